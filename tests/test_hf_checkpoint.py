"""Hugging Face checkpoints: converted weights give transformers' own logits (golden files
written by tests/assets/hf/make_golden.py from random LlamaForCausalLM, Qwen3ForCausalLM and
Gemma2ForCausalLM)."""

import numpy as np
import pytest

from MaxText import convert_hf_checkpoint
from MaxText.layers.models import Transformer
from conftest import ROOT, TINY, run_cli, tiny_config

ASSETS = ROOT / "tests" / "assets" / "hf"
SHAPE = ("vocab_size=96", "base_emb_dim=32", "base_mlp_dim=64", "base_num_decoder_layers=3",
         "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "rope_max_timescale=10000",
         "normalization_layer_epsilon=1e-6", "max_target_length=24")
LLAMA31_ROPE = ("rope_type=llama3.1", "rope_scaling_factor=8", "rope_low_freq_factor=1", "rope_high_freq_factor=4",
                "rope_original_max_position=16")
FAMILIES = {"llama": ("decoder_block=llama2", "logits_via_embedding=false"),
            "qwen3": ("decoder_block=qwen3", "logits_via_embedding=true"),
            "llama3.1": ("decoder_block=llama2", "logits_via_embedding=true", *LLAMA31_ROPE),
            "gemma2": ("decoder_block=gemma2", "logits_via_embedding=true", "sliding_window_size=8",
                       "query_pre_attn_scalar=24", "attn_logits_soft_cap=2", "final_logits_soft_cap=3")}


def logits_and_golden(family, config):
  _, tensors = convert_hf_checkpoint.read(str(ASSETS / family))
  golden = np.load(ASSETS / family / "golden.npz")
  tokens = golden["tokens"]
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  logits = Transformer(config).apply({"params": convert_hf_checkpoint.to_params(config, tensors)},
                                     tokens, positions, np.ones_like(tokens))
  return np.asarray(logits), golden["logits"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", [(), ("scan_layers=false", "remat_layer_interval=2")], ids=["scan", "loop"])
def test_converted_weights_give_the_hugging_face_logits(family, settings):
  config = tiny_config(*SHAPE, *FAMILIES[family], *settings)
  hf, _ = convert_hf_checkpoint.read(str(ASSETS / family))
  convert_hf_checkpoint.check_shape(config, hf, str(ASSETS / family))
  logits, golden = logits_and_golden(family, config)
  scale = np.abs(golden).max()
  np.testing.assert_allclose(logits / scale, golden / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, without", [
    ("qwen3", "decoder_block=llama2"), ("llama3.1", "rope_type=default"), ("gemma2", "decoder_block=llama2"),
    ("gemma2", "sliding_window_size=0"), ("gemma2", "query_pre_attn_scalar=0"), ("gemma2", "attn_logits_soft_cap=0"),
    ("gemma2", "final_logits_soft_cap=0")])
def test_without_the_family_feature_the_logits_are_not_matched(family, without):
  """Qwen3's q/k norms, Llama 3.1's RoPE rescaling and each of Gemma 2's features matter: the
  same weights without one miss transformers' logits by over 100 times what the parity test
  allows."""
  logits, golden = logits_and_golden(family, tiny_config(*SHAPE, *FAMILIES[family], without))
  assert np.abs(logits - golden).max() > 1e-3 * np.abs(golden).max()


@pytest.mark.parametrize("family", ["qwen3", "llama3.1", "gemma2"])
def test_import_then_export_gives_back_the_hugging_face_model_and_a_run_starts_from_it(tmp_path, family):
  """Hugging Face -> checkpoint -> Hugging Face: the same tensors bit for bit, a config.json
  that imports again, and the checkpoint starts a training run."""
  args = ("dataset_type=synthetic", *SHAPE, *FAMILIES[family])
  converted, exported = tmp_path / "converted", tmp_path / "exported"
  result = run_cli("convert_hf_checkpoint", *args, f"hf_path={ASSETS / family}", f"output_path={converted}")
  assert result.returncode == 0, result.stderr[-3000:]
  result = run_cli("convert_hf_checkpoint", *args, f"load_parameters_path={converted}", f"output_path={exported}")
  assert result.returncode == 0, result.stderr[-3000:]
  _, original = convert_hf_checkpoint.read(str(ASSETS / family))
  hf, tensors = convert_hf_checkpoint.read(str(exported))
  assert sorted(tensors) == sorted(original)
  assert all(np.array_equal(tensors[name], original[name]) for name in original)
  convert_hf_checkpoint.check_shape(tiny_config(*SHAPE, *FAMILIES[family]), hf, str(exported))
  result = run_cli("train", *TINY, *args, "steps=1", f"base_output_directory={tmp_path}",
                   f"load_parameters_path={converted}")
  assert result.returncode == 0 and f"parameters loaded from {converted}" in result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("args, message", [
    (("decoder_block=llama2",), "decoder_block='llama2': "),
    (("base_num_kv_heads=4",), "base_num_kv_heads=4: "),
    (("logits_via_embedding=false",), "logits_via_embedding=False: "),
])
def test_a_shape_mismatch_is_one_line_and_writes_nothing(tmp_path, args, message):
  output = tmp_path / "converted"
  result = run_cli("convert_hf_checkpoint", "dataset_type=synthetic", *SHAPE, *FAMILIES["qwen3"], *args, f"hf_path={ASSETS / 'qwen3'}",
                   f"output_path={output}")
  lines = result.stderr.strip().splitlines()
  assert result.returncode == 2 and len(lines) == 1 and message in lines[0], result.stderr[-2000:]
  assert not output.exists()
