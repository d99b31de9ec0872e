"""The 2026 families on 8 simulated devices give one device's loss and gradients: OLMo 3 (norms
after attention and the MLP, q/k norms over the whole projections sharded by heads, three
sliding layers to one global, YaRN on the global layer) under fsdp x tensor x context. Their
logits against transformers': tests/test_hf_checkpoint.py."""

import pytest
from conftest import assert_mesh_gradients_equal_one_device, tiny_config

from MaxText import errors

OLMO3 = ("decoder_block=olmo3", "base_num_decoder_layers=4", "sliding_window_size=6", "rope_type=yarn",
         "rope_scaling_factor=4", "rope_original_max_position=8", "local_rope_max_timescale=10000")


def test_olmo3_on_fsdp_tensor_and_context_gives_one_devices_loss_and_gradients():
  assert_mesh_gradients_equal_one_device(
      {"fsdp2_tensor2_context2": ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_context_parallelism=2")},
      model=OLMO3)


def test_olmo3_refuses_attention_in_slices_of_heads():
  """Its q/k norms span every head, so no slice of heads stands alone."""
  with pytest.raises(errors.ConfigError, match="attention_head_chunks=2: must be 1 for decoder_block=olmo3"):
    tiny_config(*OLMO3, "attention_head_chunks=2", num_devices=1)
