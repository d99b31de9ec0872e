"""The sliced attention (attention_head_chunks): the unsliced attention's loss and gradients under
remat policies, both stack modes, Qwen3's qk norm, Gemma 2's window and soft cap, Gemma 3's, and sharded
meshes (tensor-sharded heads, context parallelism with both strategies), with less temp memory."""

import jax
import pytest
from conftest import assert_mesh_gradients_equal_one_device, fixed_batch, on_devices, tiny_config, trainer_and_state
from test_mlp_chunks import VARIANTS as MLP_VARIANTS
from test_mlp_chunks import assert_setting_changes_nothing, compiled_loss_and_grads

from MaxText import costs, sharding, train_step

# TINY has 4 query and 2 key/value heads: 2 slices of one key/value head and its 2 query heads.
# The MLP tests' variants, Gemma 2 with a window shorter than the rows, and three more.
VARIANTS = {
    **MLP_VARIANTS,
    "gemma2, save_out_proj, interval 2": ("decoder_block=gemma2", "remat_policy=save_out_proj",
                                          "remat_layer_interval=2", "sliding_window_size=8"),
    "save_qkv_proj, chunked, with mlp_chunks": ("remat_policy=save_qkv_proj", "attention=chunked",
                                                "attention_chunk_size=8", "mlp_chunks=2"),
    "qwen3 (qk norm)": ("decoder_block=qwen3",),
    # Its q/k norms scale by 1 + w; the last of 6 layers is global, the others local with their own RoPE base.
    "gemma3": ("decoder_block=gemma3", "base_num_decoder_layers=6", "sliding_window_size=8",
               "local_rope_max_timescale=100", "rope_linear_scaling_factor=8"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slices_give_the_unsliced_loss_and_gradients(variant):
  assert_setting_changes_nothing(VARIANTS[variant], "attention_head_chunks=2", variant)


def test_slices_hold_less_temp_memory_at_a_longer_length():
  """8 key/value heads at 512 tokens, attention chunked: 8 slices compile to less temp memory
  than every head at once."""
  long = ("max_target_length=512", "per_device_batch_size=2", "base_num_query_heads=16", "base_num_kv_heads=8",
          "head_dim=16", "attention=chunked", "attention_chunk_size=128", "remat_policy=full")
  reference = tiny_config(*long)
  params = jax.device_get(trainer_and_state(reference)[1].params)
  batch = fixed_batch(reference)
  whole = compiled_loss_and_grads(reference, params, batch)[0]
  sliced = compiled_loss_and_grads(tiny_config(*long, "attention_head_chunks=8"), params, batch)[0]
  # One chunk's float32 scores, [2, 16 heads, 128, 512], are 8 MiB; a slice holds an eighth of them.
  assert sliced < whole / 2, (sliced, whole)


# SHARDED has 8 query and 4 key/value heads; under tensor 2 each shard's 2 key/value heads make
# one run each slice takes from, so no head moves between devices.
MESHES = {"fsdp2_context4_ring": ("ici_fsdp_parallelism=2", "ici_context_parallelism=4",
                                  "context_parallel_strategy=ring"),
          "tensor2_fsdp2_context2_all_gather": ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=2",
                                                "ici_context_parallelism=2", "context_parallel_strategy=all_gather"),
          "tensor2_fsdp4": ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4")}


@pytest.mark.slow
def test_slices_under_sharded_meshes_give_one_devices_gradients():
  """8 simulated devices, 2 slices of the attention, against one device without slices."""
  assert_mesh_gradients_equal_one_device(MESHES, "attention_head_chunks=2")


def test_a_slice_keeps_its_kernels_residuals_so_attention_runs_forward_twice_not_three_times():
  """Under remat_policy=full a layer's forward runs again in its backward, and each slice's own
  checkpoint would run it a third time; the slice keeps its attention's context and logsumexp
  instead (remat.KERNEL_RESIDUALS), so its backward recomputes the q, k and v projections only:
  the traced FLOPs of 2 slices exceed the unsliced step's by exactly those projections' forward.
  Context 2, whose attention blocks are XLA dots the count sees."""
  def traced(*more):
    config = tiny_config("ici_context_parallelism=2", "attention=chunked", "attention_chunk_size=8",
                         "remat_policy=full", *more)
    jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
    return costs.matmul_flops(jaxpr), config

  with on_devices(8):
    whole, config = traced()
    sliced, _ = traced("attention_head_chunks=2")
  tokens = config.global_batch_size_to_train_on * config.max_target_length
  qkv_forward = (2 * tokens * config.base_emb_dim * (config.base_num_query_heads + 2 * config.base_num_kv_heads)
                 * config.head_dim * config.base_num_decoder_layers)
  assert sliced - whole == qkv_forward
