"""The 2026 families on 8 simulated devices give one device's loss and gradients: OLMo 3 (norms
after attention and the MLP, q/k norms over the whole projections sharded by heads, three
sliding layers to one global, YaRN on the global layer) under fsdp x tensor x context, Llama 4
(chunks, a NoPE layer with temperature tuning, unit-RMS queries and keys, top-1 experts weighted
on their input beside dense layers) under fsdp x tensor x expert (its pipeline stages:
tests/test_pipeline.py). Their logits against transformers': tests/test_hf_checkpoint.py."""

import pytest
from conftest import assert_mesh_gradients_equal_one_device, tiny_config

from MaxText import errors

LLAMA4 = ("decoder_block=llama4", "base_num_decoder_layers=4", "interleave_moe_layer_step=2", "num_experts=4",
          "num_experts_per_tok=1", "base_moe_mlp_dim=24", "shared_experts=1", "routed_score_func=sigmoid",
          "norm_topk_prob=false", "nope_layer_interval=4", "chunk_attn_window_size=4", "temperature_tuning=true",
          "temperature_tuning_floor=2", "use_qk_norm=true")
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


def test_llama4_refuses_more_than_one_expert_per_token():
  """Its router weights the one expert's input: two experts' inputs would each need a weight."""
  with pytest.raises(errors.ConfigError, match="num_experts_per_tok=2: must be 1 for decoder_block=llama4"):
    tiny_config(*LLAMA4, "num_experts_per_tok=2", num_devices=1)


def test_olmo3_refuses_attention_in_slices_of_heads():
  """Its q/k norms span every head, so no slice of heads stands alone."""
  with pytest.raises(errors.ConfigError, match="attention_head_chunks=2: must be 1 for decoder_block=olmo3"):
    tiny_config(*OLMO3, "attention_head_chunks=2", num_devices=1)
