"""The 2026 families on 8 simulated devices give one device's loss and gradients: OLMo 3 (norms
after attention and the MLP, q/k norms over the whole projections sharded by heads, three
sliding layers to one global, YaRN on the global layer) under fsdp x tensor x context, Llama 4
(chunks, a NoPE layer with temperature tuning, unit-RMS queries and keys, top-1 experts weighted
on their input beside dense layers) under fsdp x tensor x expert, GPT-OSS (sinks, biased
attention and experts, the clamped gated unit, sliding layers) under fsdp x tensor x expert from
parameters whose biases and sinks are far from their zero start (their pipeline stages:
tests/test_pipeline.py). Their logits against transformers': tests/test_hf_checkpoint.py."""

import jax
import numpy as np
import pytest
from conftest import (
  SHARDED,
  assert_mesh_gradients_equal_one_device,
  assert_trees_close,
  loss_gradients,
  on_devices,
  tiny_config,
  trainer_and_state,
)

from MaxText import errors

LLAMA4 = ("decoder_block=llama4", "base_num_decoder_layers=4", "interleave_moe_layer_step=2", "num_experts=4",
          "num_experts_per_tok=1", "base_moe_mlp_dim=24", "shared_experts=1", "routed_score_func=sigmoid",
          "norm_topk_prob=false", "nope_layer_interval=4", "chunk_attn_window_size=4", "temperature_tuning=true",
          "temperature_tuning_floor=2", "use_qk_norm=true")
GPT_OSS = ("decoder_block=gpt_oss", "base_num_decoder_layers=2", "num_experts=4", "num_experts_per_tok=2",
           "base_moe_mlp_dim=32", "sliding_window_size=6", "attention_bias=true", "attention_sink=true",
           "mlp_bias=true", "mlp_activations_limit=1.5")
OLMO3 = ("decoder_block=olmo3", "base_num_decoder_layers=4", "sliding_window_size=6", "rope_type=yarn",
         "rope_scaling_factor=4", "rope_original_max_position=8", "local_rope_max_timescale=10000")


def test_olmo3_on_fsdp_tensor_and_context_gives_one_devices_loss_and_gradients():
  assert_mesh_gradients_equal_one_device(
      {"fsdp2_tensor2_context2": ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_context_parallelism=2")},
      model=OLMO3)


def test_llama4_on_fsdp_tensor_and_expert_gives_one_devices_loss_and_gradients():
  assert_mesh_gradients_equal_one_device(
      {"fsdp2_tensor2_expert2": ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")},
      model=LLAMA4)


def test_gpt_oss_on_fsdp_tensor_and_expert_gives_one_devices_loss_and_gradients():
  """From one device's initial parameters with every bias and sink drawn at random (zero, as
  initialised, a bias added once per tensor shard would go unseen); on the mesh the experts and
  the attention run in slices (mlp_chunks, attention_head_chunks), their biases and sinks sliced
  with them."""
  config = tiny_config(*SHARDED, *GPT_OSS, "per_device_batch_size=8")
  params = jax.device_get(trainer_and_state(config)[1].params)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: rng.normal(0, 0.5, p.shape).astype(p.dtype)
      if jax.tree_util.keystr(path).endswith(("bias']", "sinks']")) else p, params)
  want = loss_gradients(config, params=params)
  with on_devices(8):
    got = loss_gradients(tiny_config(*SHARDED, *GPT_OSS, "per_device_batch_size=1", "ici_fsdp_parallelism=2",
                                     "ici_tensor_parallelism=2", "ici_expert_parallelism=2", "mlp_chunks=2",
                                     "attention_head_chunks=2"), params=params)
  assert_trees_close(got, want, rtol=1e-5)


def test_llama4_refuses_more_than_one_expert_per_token():
  """Its router weights the one expert's input: two experts' inputs would each need a weight."""
  with pytest.raises(errors.ConfigError, match="num_experts_per_tok=2: must be 1 for decoder_block=llama4"):
    tiny_config(*LLAMA4, "num_experts_per_tok=2", num_devices=1)


def test_olmo3_refuses_attention_in_slices_of_heads():
  """Its q/k norms span every head, so no slice of heads stands alone."""
  with pytest.raises(errors.ConfigError, match="attention_head_chunks=2: must be 1 for decoder_block=olmo3"):
    tiny_config(*OLMO3, "attention_head_chunks=2", num_devices=1)
