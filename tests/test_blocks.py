"""The layer stack as a repeating block of layer kinds (interleave_moe_layer_step: every other
layer a mixture of experts, the others dense): the stored block against a Python loop of its
layers under every memory setting, the cost model and the traced step counting dense and routed
layers where they are, bad blocks as one-line config errors. The block on 8 devices (expert x fsdp,
pipeline stages of whole blocks) against one: tests/test_pipeline.py; transformers' Qwen3-MoE with
decoder_sparse_step: tests/test_hf_checkpoint.py."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_trees_close,
  on_devices,
  tiny_config,
)

from MaxText import costs, errors, sharding, train_step
from MaxText.layers import decoders
from MaxText.layers.normalizations import rms_norm_with

MOE = ("decoder_block=qwen3_moe", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
       "load_balance_loss_weight=0.1", "router_z_loss_weight=0.01")
# Layers 1 and 3 routed, 0 and 2 dense.
INTERLEAVED = (*MOE, "base_num_decoder_layers=4", "interleave_moe_layer_step=2")
RTOL = 1e-5


def outputs_loss_grads(fn, params, x):
  target = jax.random.normal(jax.random.key(7), x.shape)

  def loss(p, x):
    out = fn(p, x)
    return jnp.sum(jnp.square(out - target)), out

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)


@pytest.fixture(scope="module")
def stored():
  """(x, positions, segment ids, the decoder's stored parameters) of INTERLEAVED, two documents a row."""
  cfg = tiny_config(*INTERLEAVED, "remat_policy=none", num_devices=1)
  x = jax.random.normal(jax.random.key(0), (2, cfg.max_target_length, cfg.base_emb_dim))
  positions = jnp.broadcast_to(jnp.arange(cfg.max_target_length) % 10, x.shape[:2])
  segments = jnp.broadcast_to(1 + (jnp.arange(cfg.max_target_length) >= 10), x.shape[:2]).astype(jnp.int32)
  decoder = decoders.Decoder(cfg)
  params = jax.device_get(nn.meta.unbox(jax.jit(decoder.init)(jax.random.key(1), x, positions, segments)["params"]))
  return x, positions, segments, params


# Unscanned, interval 2: the block against transformers' Qwen3-MoE in tests/test_hf_checkpoint.py.
@pytest.mark.parametrize("settings", [(), ("remat_layer_interval=3", "remat_policy=full")], ids=" ".join)
def test_a_block_of_two_kinds_equals_a_python_loop_of_its_layers(stored, settings):
  """Stored as layer_0 (dense) and layer_1 (routed), each [2, ...]; scanned a block a step, in
  steps of whole blocks around every third layer's checkpoint (6 layers a step: none scanned, 4
  left over): the loop of DecoderLayers over the stored layers, outputs and gradients."""
  x, positions, segments, params = stored
  cfg = tiny_config(*INTERLEAVED, *settings, num_devices=1)
  layers = params["layers"]
  assert "mlp" in layers["layer_0"] and "moe_block" in layers["layer_1"] and "mlp" not in layers["layer_1"]
  assert jax.tree.leaves(layers["layer_0"])[0].shape[0] == 2

  def loop(p, x):
    for i in range(cfg.base_num_decoder_layers):
      layer = jax.tree.map(lambda w, i=i: w[i // 2], p["layers"][f"layer_{i % 2}"])
      x = decoders.DecoderLayer(cfg, i % 2 == 1).apply({"params": layer}, x, positions, segments, i)
    return rms_norm_with(cfg, p["decoder_norm"]["scale"], x)

  decoder = decoders.Decoder(cfg)
  got = outputs_loss_grads(lambda p, x: decoder.apply({"params": p}, x, positions, segments)[0], params, x)
  assert_trees_close(got, outputs_loss_grads(loop, params, x), RTOL, " ".join(settings))


def test_the_model_and_the_traced_step_count_dense_and_routed_layers_where_they_are():
  """Half the layers routed: the model FLOPs and the traced step's matmul FLOPs are the means of
  the all-dense and the all-routed models' (their attention, embedding and head the same)."""
  def flops(*overrides):
    config = tiny_config(*MOE, "base_num_decoder_layers=4", "remat_policy=none", *overrides, num_devices=1)
    traced = costs.matmul_flops(train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)),
                                                            config).jaxpr)
    return np.array([costs.training_flops_per_step(config), traced])

  dense, routed = flops("decoder_block=qwen3"), flops()
  assert np.all(dense != routed)
  np.testing.assert_allclose(flops("interleave_moe_layer_step=2"), (dense + routed) / 2, rtol=1e-12)


@pytest.mark.parametrize("overrides, message", [
    (("interleave_moe_layer_step=3",), "interleave_moe_layer_step=3: must divide base_num_decoder_layers=4"),
    (("interleave_moe_layer_step=2", "decoder_block=qwen3"), "interleave_moe_layer_step=2: .* in a mixture of experts"),
    (("interleave_moe_layer_step=2", "first_num_dense_layers=2"), "interleave_moe_layer_step=2: .* without "
                                                                  "first_num_dense_layers"),
    (("interleave_moe_layer_step=0",), "interleave_moe_layer_step=0: must be >= 1"),
])
def test_bad_blocks_are_one_line_naming_the_key(overrides, message):
  with pytest.raises(errors.ConfigError, match=message):
    tiny_config(*MOE, "base_num_decoder_layers=4", *overrides, num_devices=1)


def test_a_pipeline_stage_holds_whole_blocks():
  with on_devices(8), pytest.raises(errors.ConfigError, match="interleave_moe_layer_step=2: must divide each "
                                                              "pipeline stage's 1 layers"):
    tiny_config(*INTERLEAVED, "ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2")
