"""The sliced attention (attention_head_chunks): the unsliced attention's loss and gradients under
remat policies, both stack modes, Qwen3's qk norm, Gemma 2's window and soft cap, and sharded
meshes (tensor-sharded heads, context parallelism with both strategies), with less temp memory."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import ROOT, SHARDED, assert_trees_close, fixed_batch, loss_gradients, tiny_config, trainer_and_state
from test_mlp_chunks import compiled_loss_and_grads

RTOL = 1e-6
MODEL = ("max_target_length=32", "per_device_batch_size=2")
# TINY has 4 query and 2 key/value heads: 2 slices of one key/value head and its 2 query heads.
VARIANTS = {
    "full": ("remat_policy=full",),
    "minimal, loop": ("remat_policy=minimal", "scan_layers=false"),
    "none": ("remat_policy=none",),
    "save_qkv_proj, chunked, with mlp_chunks": ("remat_policy=save_qkv_proj", "attention=chunked",
                                                "attention_chunk_size=8", "mlp_chunks=2"),
    "qwen3 (qk norm)": ("decoder_block=qwen3",),
    "gemma2, save_out_proj, interval 2": ("decoder_block=gemma2", "remat_policy=save_out_proj",
                                          "remat_layer_interval=2", "sliding_window_size=8"),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_slices_give_the_unsliced_loss_and_gradients(variant):
  reference = tiny_config(*MODEL, *VARIANTS[variant])
  params = jax.device_get(trainer_and_state(reference)[1].params)
  batch = fixed_batch(reference)
  _, want_loss, want_grads = compiled_loss_and_grads(reference, params, batch)
  sliced = tiny_config(*MODEL, *VARIANTS[variant], "attention_head_chunks=2")
  _, loss, grads = compiled_loss_and_grads(sliced, params, batch)
  np.testing.assert_allclose(loss, want_loss, rtol=RTOL, err_msg=variant)
  assert_trees_close(grads, want_grads, rtol=RTOL, what=variant)


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


MESH_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import SHARDED, loss_gradients, tiny_config
for name, mesh in {meshes!r}.items():
  grads = loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=1", *mesh, "attention_head_chunks=2"))
  np.savez(f"{{name}}.npz", **grads)
"""
# SHARDED has 8 query and 4 key/value heads; under tensor 2 each shard's 2 key/value heads make
# one run each slice takes from, so no head moves between devices.
MESHES = {"fsdp2_context4_ring": ("ici_fsdp_parallelism=2", "ici_context_parallelism=4",
                                  "context_parallel_strategy=ring"),
          "tensor2_fsdp2_context2_all_gather": ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=2",
                                                "ici_context_parallelism=2", "context_parallel_strategy=all_gather"),
          "tensor2_fsdp4": ("ici_tensor_parallelism=2", "ici_fsdp_parallelism=4")}


def test_slices_under_sharded_meshes_give_one_devices_gradients(tmp_path):
  """8 simulated devices, 2 slices of the attention, against one device without slices."""
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "8"}
  script = MESH_SCRIPT.format(tests=str(ROOT / "tests"), meshes=MESHES)
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
  assert result.returncode == 0, result.stderr[-4000:]
  want = loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=8"))
  for name in MESHES:
    got = np.load(tmp_path / f"{name}.npz")
    assert sorted(got.files) == sorted(want)
    assert_trees_close({k: got[k] for k in want}, want, rtol=1e-5, what=name)
