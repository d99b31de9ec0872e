"""The sliced MLP (mlp_chunks): the untiled MLP's loss and gradients, under remat policies,
both stack modes and a sequence-sharded mesh, with less temp memory."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (
  assert_mesh_gradients_equal_one_device,
  assert_trees_close,
  fixed_batch,
  tiny_config,
  trainer_and_state,
)

from MaxText import costs, objective, sharding, train_step
from MaxText.layers.linears import MlpBlock

# The project's bound for a memory setting. Slices sum in another order than the whole, and how
# far apart float32 sums land depends on the CPU's vector width: on an AVX-512 machine two
# sliced-attention gradients differ by 1.2e-5 of an element (2e-6 of their leaf's scale).
RTOL = 1e-5
MODEL = ("max_target_length=32", "per_device_batch_size=2")
# Scan and loop stacks, a policy that keeps the MLP's named tensors, no remat, every-other-layer
# remat, and Gemma 2's norm after the MLP.
VARIANTS = {
    "full": ("remat_policy=full",),
    "minimal, loop": ("remat_policy=minimal", "scan_layers=false"),
    "none": ("remat_policy=none",),
    "gemma2, save_out_proj, interval 2": ("decoder_block=gemma2", "remat_policy=save_out_proj",
                                          "remat_layer_interval=2"),
}


def compiled_loss_and_grads(config, params, batch):
  """(temp bytes of the compiled value_and_grad of the summed loss, loss, gradients)."""
  trainer = train_step.build(config, sharding.create_mesh(config))
  fn = jax.jit(jax.value_and_grad(lambda p, b: objective.batch_sums(trainer.model, config, p, b)[0]))
  with sharding.activate(trainer.mesh, config):
    args = (jax.device_put(params, trainer.state_sharding.params), train_step.device_batch(trainer, batch))
    compiled = fn.lower(*args).compile()
    loss, grads = compiled(*args)
  return costs.memory_stats(compiled)["temp_bytes"], float(loss), jax.device_get(grads)


def assert_setting_changes_nothing(overrides, setting, what):
  """The model of MODEL + `overrides` gives the same loss and gradients (rtol 1e-5) with the
  memory `setting` as without it, from the same parameters on the same batch."""
  reference = tiny_config(*MODEL, *overrides)
  params = jax.device_get(trainer_and_state(reference)[1].params)
  batch = fixed_batch(reference)
  _, want_loss, want_grads = compiled_loss_and_grads(reference, params, batch)
  _, loss, grads = compiled_loss_and_grads(tiny_config(*MODEL, *overrides, setting), params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=RTOL, err_msg=what)
  assert_trees_close(grads, want_grads, rtol=RTOL, what=what)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunks_give_the_untiled_loss_and_gradients(variant):
  assert_setting_changes_nothing(VARIANTS[variant], "mlp_chunks=4", variant)


def test_chunks_hold_less_temp_memory_at_a_longer_length():
  """A wide MLP at 512 tokens (attention chunked, so the MLP sets the peak): 8 chunks compile
  to less temp memory than the whole sequence at once."""
  long = ("max_target_length=512", "per_device_batch_size=2", "base_mlp_dim=1024", "attention=chunked",
          "attention_chunk_size=64", "remat_policy=full")
  reference = tiny_config(*long)
  params = jax.device_get(trainer_and_state(reference)[1].params)
  batch = fixed_batch(reference)
  whole = compiled_loss_and_grads(reference, params, batch)[0]
  chunked = compiled_loss_and_grads(tiny_config(*long, "mlp_chunks=8"), params, batch)[0]
  # One layer's [2, 512, 1024] float32 intermediate is 4 MiB; 8 chunks hold an eighth of it.
  assert chunked < whole - 2 * 2**20, (chunked, whole)


# The hidden units sharded over tensor 2 too: each slice takes its units from every tensor shard.
MESHES = {"fsdp2_context4": ("ici_fsdp_parallelism=2", "ici_context_parallelism=4"),
          "tensor2_fsdp2_context2": ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=2", "ici_context_parallelism=2")}


def test_chunks_under_sharded_meshes_give_one_devices_gradients():
  """8 simulated devices, fsdp 2 x context 4 and tensor 2 x fsdp 2 x context 2, 4 slices of
  the MLP, against one device without slices."""
  assert_mesh_gradients_equal_one_device(MESHES, "context_parallel_load_balance=false", "mlp_chunks=4")


def test_bfloat16_slices_sum_the_input_gradient_in_float32():
  """In bfloat16, 64 slices' input gradient is as close to float32's as the untiled MLP's (within
  10%): each slice adds its part in float32. Summed in bfloat16 (x closed over in bfloat16),
  the error grew 1.8x."""
  config = lambda dtype, chunks: tiny_config("base_mlp_dim=4096", f"dtype={dtype}", f"mlp_chunks={chunks}",
                                            num_devices=1)
  x = jax.random.normal(jax.random.key(0), (2, 64, config("float32", 1).base_emb_dim))
  target = jax.random.normal(jax.random.key(1), x.shape)
  params = nn.meta.unbox(MlpBlock(config("float32", 1)).init(jax.random.key(2), x)["params"])

  def input_gradient(cfg, x):
    output = lambda x: MlpBlock(cfg).apply({"params": params}, x).astype(jnp.float32)
    return np.asarray(jax.grad(lambda x: jnp.sum(output(x) * target))(x), np.float64)

  want = input_gradient(config("float32", 1), x)
  error = lambda chunks: np.linalg.norm(input_gradient(config("bfloat16", chunks), x.astype(jnp.bfloat16)) - want)
  assert error(64) < 1.1 * error(1), (error(64), error(1))
