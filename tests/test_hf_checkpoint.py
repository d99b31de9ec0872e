"""Hugging Face checkpoints: converted weights give transformers' own logits and greedy tokens
(golden files written by tests/assets/hf/make_golden.py from random LlamaForCausalLM,
Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3MoeForCausalLM, Qwen3NextForCausalLM,
MixtralForCausalLM, DeepseekV2ForCausalLM and DeepseekV3ForCausalLM), both converters
round-trip bit for bit, and runs continue from the imported weights with the model directory's tokenizer."""

import dataclasses
import json
import re
import shutil
import subprocess

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import BASE_YML, ROOT, TINY, run_cli, run_command, tiny_config
from etils import epath
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from MaxText import checkpointing, decode, errors, families, pyconfig
from MaxText.checkpoint_conversion import mapping, to_huggingface, to_maxtext
from MaxText.layers import blocks
from MaxText.layers.models import Transformer

ASSETS = ROOT / "tests" / "assets" / "hf"
SHAPE = ("vocab_size=96", "base_emb_dim=32", "base_mlp_dim=64", "base_num_decoder_layers=3",
         "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "rope_max_timescale=10000",
         "normalization_layer_epsilon=1e-6", "max_target_length=24")
LLAMA31_ROPE = ("rope_type=llama3.1", "rope_scaling_factor=8", "rope_low_freq_factor=1", "rope_high_freq_factor=4",
                "rope_original_max_position=16")
MOE = ("num_experts=4", "num_experts_per_tok=2")
FAMILIES = {"llama": ("decoder_block=llama2", "logits_via_embedding=false"),
            "qwen3": ("decoder_block=qwen3", "logits_via_embedding=true"),
            "llama3.1": ("decoder_block=llama2", "logits_via_embedding=true", *LLAMA31_ROPE),
            "gemma2": ("decoder_block=gemma2", "logits_via_embedding=true", "sliding_window_size=8",
                       "query_pre_attn_scalar=24", "attn_logits_soft_cap=2", "final_logits_soft_cap=3"),
            "gemma3": ("decoder_block=gemma3", "logits_via_embedding=true", "base_num_decoder_layers=7",
                       "sliding_window_size=4", "query_pre_attn_scalar=24", "rope_max_timescale=1000000",
                       "local_rope_max_timescale=10000", "rope_linear_scaling_factor=8"),
            "olmo3": ("decoder_block=olmo3", "logits_via_embedding=false", "base_num_decoder_layers=5",
                      "sliding_window_size=4", "rope_type=yarn", "rope_scaling_factor=4",
                      "rope_original_max_position=16", "beta_fast=32", "beta_slow=1", "local_rope_max_timescale=10000"),
            "qwen3_moe": ("decoder_block=qwen3_moe", "logits_via_embedding=false", *MOE, "base_moe_mlp_dim=24",
                          "norm_topk_prob=true"),
            "qwen3_moe_interleaved": ("decoder_block=qwen3_moe", "logits_via_embedding=false", *MOE,
                                      "base_moe_mlp_dim=24", "norm_topk_prob=true", "base_num_decoder_layers=4",
                                      "interleave_moe_layer_step=2"),
            "qwen3_moe_tied": ("decoder_block=qwen3_moe", "logits_via_embedding=true", *MOE, "base_moe_mlp_dim=24",
                               "norm_topk_prob=false"),
            "qwen3_next": ("decoder_block=qwen3_next", "logits_via_embedding=false", "base_num_decoder_layers=4",
                           "inhomogeneous_layer_cycle_interval=4", "partial_rotary_factor=0.25",
                           "gdn_num_key_heads=2", "gdn_num_value_heads=4", "gdn_key_head_dim=8",
                           "gdn_value_head_dim=8", "gdn_conv_kernel_dim=4", *MOE,
                           "base_moe_mlp_dim=24", "shared_experts=1", "norm_topk_prob=true"),
            "deepseek3": ("decoder_block=deepseek", "logits_via_embedding=false", "base_num_decoder_layers=4",
                          "base_num_kv_heads=4", "attention_type=mla", "q_lora_rank=12", "kv_lora_rank=16",
                          "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=6", "rope_type=yarn",
                          "rope_scaling_factor=4", "rope_original_max_position=16", "beta_fast=32", "beta_slow=1",
                          "mscale=1", "mscale_all_dim=1", "num_experts=8", "num_experts_per_tok=2",
                          "base_moe_mlp_dim=24", "first_num_dense_layers=1", "shared_experts=1", "n_routing_groups=4",
                          "topk_routing_group=2", "routed_scaling_factor=2.5", "norm_topk_prob=true",
                          "routed_score_func=sigmoid", "routed_bias=true"),
            "deepseek2": ("decoder_block=deepseek2", "logits_via_embedding=false", "base_num_kv_heads=4",
                          "attention_type=mla", "q_lora_rank=0", "kv_lora_rank=16", "qk_nope_head_dim=8",
                          "qk_rope_head_dim=8", "v_head_dim=6", "rope_type=yarn", "rope_scaling_factor=4",
                          "rope_original_max_position=16", "beta_fast=32", "beta_slow=1", "mscale=1",
                          "mscale_all_dim=0.707", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
                          "first_num_dense_layers=1", "shared_experts=2", "routed_scaling_factor=2.5",
                          "norm_topk_prob=false"),
            "llama4": ("decoder_block=llama4", "logits_via_embedding=false", "base_num_decoder_layers=4",
                       "num_experts=4", "num_experts_per_tok=1", "base_moe_mlp_dim=24", "norm_topk_prob=false",
                       "interleave_moe_layer_step=2", "shared_experts=1", "routed_score_func=sigmoid",
                       "nope_layer_interval=4", "chunk_attn_window_size=8", "temperature_tuning=true",
                       "temperature_tuning_floor=4", "temperature_tuning_scale=0.5", "use_qk_norm=true",
                       "rope_type=llama3.1", "rope_scaling_factor=16", "rope_low_freq_factor=1",
                       "rope_high_freq_factor=1", "rope_original_max_position=16"),
            "gpt_oss": ("decoder_block=gpt_oss", "logits_via_embedding=false", "base_num_decoder_layers=4", *MOE,
                        "base_moe_mlp_dim=64", "norm_topk_prob=true", "sliding_window_size=4", "attention_bias=true",
                        "attention_sink=true", "mlp_bias=true", "mlp_activations_limit=1.5", "rope_type=yarn",
                        "rope_scaling_factor=4", "rope_original_max_position=64", "beta_fast=32", "beta_slow=1",
                        "rope_truncate=false"),
            "mixtral": ("decoder_block=mixtral", "logits_via_embedding=false", *MOE, "base_moe_mlp_dim=64"),
            "mixtral_tied": ("decoder_block=mixtral", "logits_via_embedding=true", *MOE, "base_moe_mlp_dim=64")}
# TINY's run keys without its model keys: runs from a converted checkpoint take those saved with it.
RUN = tuple(a for a in TINY if a.partition("=")[0] not in pyconfig.MODEL_KEYS) + ("max_target_length=24",)
EOD = "<|endoftext|>"


def imported_params(config, hf_path):
  tensors, params = mapping.tensor_index(str(hf_path)), {}
  for entry in mapping.layout(config):
    node = params
    for key in entry[0][:-1]:
      node = node.setdefault(key, {})
    node[entry[0][-1]] = mapping.to_param(config, entry, lambda *name: mapping.read_tensor(tensors, *name), None)
  return params


def logits_and_golden(family, config, hf_path=None):
  golden = np.load(ASSETS / family / "golden.npz")
  tokens = golden["tokens"]
  positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
  logits = Transformer(config).apply({"params": imported_params(config, hf_path or ASSETS / family)},
                                     tokens, positions, np.ones_like(tokens))
  return np.asarray(logits), golden["logits"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("settings", [(), ("scan_layers=false", "remat_layer_interval=2")], ids=["scan", "loop"])
def test_converted_weights_give_the_hugging_face_logits(family, settings):
  config = tiny_config(*SHAPE, *FAMILIES[family], *settings)
  mapping.check_shape(config, mapping.read_config(str(ASSETS / family)), str(ASSETS / family))
  logits, golden = logits_and_golden(family, config)
  scale = np.abs(golden).max()
  np.testing.assert_allclose(logits / scale, golden / scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, without", [
    ("qwen3", "decoder_block=llama2"), ("llama3.1", "rope_type=default"), ("gemma2", "decoder_block=llama2"),
    ("gemma2", "sliding_window_size=0"), ("gemma2", "query_pre_attn_scalar=0"), ("gemma2", "attn_logits_soft_cap=0"),
    ("gemma2", "final_logits_soft_cap=0"), ("gemma3", "decoder_block=gemma2"), ("gemma3", "sliding_window_size=0"),
    ("gemma3", "local_rope_max_timescale=0"), ("gemma3", "rope_linear_scaling_factor=1"),
    ("qwen3_moe", "norm_topk_prob=false"),
    ("qwen3_moe_tied", "norm_topk_prob=true"), ("mixtral", "num_experts_per_tok=1"),
    ("deepseek3", "routed_bias=false"), ("deepseek3", "shared_experts=0"), ("deepseek3", "routed_scaling_factor=1"),
    ("deepseek3", "rope_type=default"), ("deepseek2", "norm_topk_prob=true"), ("deepseek2", "mscale_all_dim=1"),
    ("olmo3", "sliding_window_size=0"), ("olmo3", "local_rope_max_timescale=0"), ("olmo3", "rope_type=default"),
    ("llama4", "use_qk_norm=false"), ("llama4", "chunk_attn_window_size=0"), ("llama4", "temperature_tuning=false"),
    ("llama4", "routed_score_func=softmax"), ("llama4", "rope_type=default"),
    ("gpt_oss", "attention_sink=false"), ("gpt_oss", "attention_bias=false"), ("gpt_oss", "mlp_bias=false"),
    ("gpt_oss", "mlp_activations_limit=0"), ("gpt_oss", "rope_truncate=true"), ("gpt_oss", "sliding_window_size=0"),
    ("qwen3_next", "partial_rotary_factor=1")])
def test_without_the_family_feature_the_logits_are_not_matched(family, without):
  """Qwen3's q/k norms, Llama 3.1's RoPE rescaling, each of Gemma 2's and Gemma 3's features (its
  q/k norms and five-to-one pattern are what it adds to gemma2), the experts' routing and
  DeepSeek-V3's correction bias, shared expert, routed scaling and YaRN, and DeepSeek-V2's
  top-k weights not renormalised and YaRN's score factor (mscale_all_dim), OLMo 3's window,
  its sliding layers' plain RoPE and its global layers' YaRN, Llama 4's unit-RMS queries and
  keys, chunks, temperature tuning, sigmoid router and rescaled RoPE, and GPT-OSS's sinks,
  attention biases, router and expert biases, clamped gated unit, YaRN bounds left unrounded and
  window, and Qwen3-Next's partial RoPE matter: the
  same weights without one miss transformers' logits by over 100 times what the parity test
  allows."""
  logits, golden = logits_and_golden(family, tiny_config(*SHAPE, *FAMILIES[family], without))
  assert np.abs(logits - golden).max() > 1e-3 * np.abs(golden).max()


def test_llama4s_router_weights_its_experts_input_not_their_output(monkeypatch):
  """The same Llama 4 weights with the router's weight on the experts' output miss transformers'
  logits as above: the input weighting is what matches them."""
  monkeypatch.setitem(families.FAMILIES, "llama4",
                      dataclasses.replace(families.FAMILIES["llama4"], routed_input_scaling=False))
  logits, golden = logits_and_golden("llama4", tiny_config(*SHAPE, *FAMILIES["llama4"]))
  assert np.abs(logits - golden).max() > 1e-3 * np.abs(golden).max()


def hf_dir_with_tokenizer(tmp_path, family, vocab_size=96):
  """A copy of the family's asset with a tokenizer.json: word k is token k ("w0" ... ), the
  last id the end-of-document token; and a corpus of ten documents in those words."""
  hf = tmp_path / f"hf-{family}"
  shutil.copytree(ASSETS / family, hf)
  vocab = {f"w{k}": k for k in range(vocab_size - 1)} | {EOD: vocab_size - 1}
  tokenizer = Tokenizer(models.WordLevel(vocab))
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(hf / "tokenizer.json"))
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  for doc in range(10):
    (corpus / f"{doc}.txt").write_text(" ".join(f"w{k}" for k in rng.integers(0, vocab_size - 1, 120)))
  return hf, tokenizer, corpus


def words(ids):
  return " ".join(f"w{k}" for k in ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_of_an_imported_model_gives_the_hugging_face_tokens(tmp_path, family):
  """to_maxtext (every model key from config.json), then decode with the model directory as
  tokenizer_path: transformers' generate(do_sample=False) continuation. (The tied tiny models
  echo their last prompt token, as random tied models do; Llama's and Gemma 2's do not.)"""
  hf, tokenizer, corpus = hf_dir_with_tokenizer(tmp_path, family)
  golden = np.load(hf / "golden.npz")
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={tmp_path}", "run_name=imported"]))
  config = pyconfig.initialize([BASE_YML, *RUN, "dataset_type=text", f"dataset_path={corpus}",
                                f"tokenizer_path={hf}", f"load_parameters_path={converted}",
                                f"prompt={words(golden['greedy_prompt'])}",
                                f"max_decode_length={len(golden['greedy'])}",
                                "decode_sampling_strategy=greedy"])
  assert decode.generate(config) == words(golden["greedy_prompt"]) + tokenizer.decode(golden["greedy"].tolist())


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe"])
def test_import_export_round_trip_and_continued_pretraining(tmp_path, family):
  """The command lines of docs/guides/huggingface.md, for a dense and a routed family: Hugging
  Face -> checkpoint -> Hugging Face gives the same tensors bit for bit with no model key given
  (config.json's are saved with the checkpoint and read back), and a tiled training run continues
  from the checkpoint on the model directory's tokenizer. Every family's tensors round-trip in
  process: test_both_converters_hold_one_layer_of_a_stacked_parameter_at_a_time."""
  hf, _, corpus = hf_dir_with_tokenizer(tmp_path, family)
  result = run_cli("checkpoint_conversion.to_maxtext", f"hf_model_path={hf}", f"base_output_directory={tmp_path}",
                   "run_name=imported")
  assert result.returncode == 0, result.stderr[-3000:]
  converted, exported = tmp_path / "imported" / "checkpoints" / "0", tmp_path / "exported"
  result = run_cli("checkpoint_conversion.to_huggingface", f"load_parameters_path={converted}",
                   f"hf_output_path={exported}")
  assert result.returncode == 0, result.stderr[-3000:]
  original, tensors = load_file(hf / "model.safetensors"), load_file(exported / "model.safetensors")
  assert sorted(tensors) == sorted(original)
  assert all(np.array_equal(tensors[name], original[name]) for name in original)
  config = tiny_config(*SHAPE, *FAMILIES[family])
  mapping.check_shape(config, mapping.read_config(str(exported)), str(exported))
  result = run_cli("train", *RUN, "steps=2", "dataset_type=text", f"dataset_path={corpus}", f"tokenizer_path={hf}",
                   "num_vocab_tiling=8", f"base_output_directory={tmp_path}", "run_name=continued",
                   f"load_parameters_path={converted}")
  assert result.returncode == 0 and f"parameters loaded from {converted}" in result.stderr, result.stderr[-3000:]


def test_export_shards_above_the_shard_size_and_the_shards_import_again(tmp_path):
  """Shards as save_pretrained writes them (files of at most the shard size, an index naming
  each tensor's file and the total size), read back by to_maxtext to the same parameters."""
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={ASSETS / 'llama'}", f"base_output_directory={tmp_path}", "run_name=a"]))
  exported = tmp_path / "sharded"
  config = pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                f"hf_output_path={exported}"])
  original = load_file(ASSETS / "llama" / "model.safetensors")
  shard_bytes = max(t.nbytes for t in original.values())
  files = to_huggingface.convert(config, max_shard_bytes=shard_bytes)
  index = json.loads((exported / "model.safetensors.index.json").read_text())
  assert len(files) > 1 and sorted(set(index["weight_map"].values())) == files
  assert index["metadata"]["total_size"] == sum(t.nbytes for t in original.values())
  for file in files:
    shard = load_file(exported / file)
    assert sum(t.nbytes for t in shard.values()) <= shard_bytes
    assert all(index["weight_map"][name] == file and np.array_equal(t, original[name]) for name, t in shard.items())
  assert sorted(index["weight_map"]) == sorted(original)
  again = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={exported}", f"base_output_directory={tmp_path}", "run_name=b"]))
  assert jax.tree.all(jax.tree.map(np.array_equal, restore(again), restore(converted)))


@pytest.mark.parametrize("family", [f for f in FAMILIES if not f.startswith("deepseek")])
def test_both_converters_hold_one_layer_of_a_stacked_parameter_at_a_time(tmp_path, family, monkeypatch):
  """For every family (DeepSeek's: test_deepseek_converts_both_ways_bit_for_bit):
  to_maxtext builds, and to_huggingface reads, every stacked parameter a layer at a time (a
  stacked expert projection can exceed a host's memory); the checkpoint stores one layer per
  chunk (and expert), and a run's restore of it and the export are the parameters of the
  whole-array path, the exported tensors the imported ones bit for bit."""
  built, exported = [], []
  to_param, to_hf_tensors = mapping.to_param, mapping.to_hf_tensors

  def building(config, entry, *args):
    param = to_param(config, entry, *args)
    built.append((entry, param.shape))
    return param

  def exporting(config, entry, param, layer):
    exported.append((entry, param.shape))
    return to_hf_tensors(config, entry, param, layer)

  monkeypatch.setattr(mapping, "to_param", building)
  monkeypatch.setattr(mapping, "to_hf_tensors", exporting)
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={ASSETS / family}", f"base_output_directory={tmp_path}", "run_name=a"]))
  config = pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                f"hf_output_path={tmp_path / 'hf'}"])
  to_huggingface.convert(config)
  for calls in built, exported:
    stacked = [(entry, shape) for entry, shape in calls if entry[2]]
    # Once for each stacked layer of each stacked parameter.
    assert len(stacked) == sum(entry[2][0] for entry in {entry for entry, _ in stacked}) > 0
    assert all(shape == entry[2][1:] + entry[3] for entry, shape in stacked)
    assert all(shape == entry[3] for entry, shape in calls if not entry[2])
  metadata = ocp.PyTreeCheckpointHandler().metadata(epath.Path(f"{converted}/state")).tree["params"]
  stacked = jax.tree_util.tree_leaves_with_path({k: v for k, v in metadata["decoder"].items() if k != "decoder_norm"})
  assert stacked and all(leaf.storage.chunk_shape[0] == 1 for _, leaf in stacked)
  experts = [leaf for path, leaf in stacked if jax.tree_util.keystr(path).endswith(("['wi_0']", "['wo']"))
             and "moe_block" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path)]
  moe_positions = sum(kind.moe for stack in blocks.stacks(config) for kind in stack.block)
  assert len(experts) == 2 * moe_positions and all(leaf.storage.chunk_shape[:2] == (1, 1) for leaf in experts)
  assert jax.tree.all(jax.tree.map(np.array_equal, restore(converted), imported_params(config, ASSETS / family)))
  original, tensors = load_file(ASSETS / family / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
  assert sorted(tensors) == sorted(original) and all(np.array_equal(tensors[n], original[n]) for n in original)


@pytest.mark.parametrize("family, after_last", [("deepseek3", "model.layers.4.enorm.weight"), ("deepseek2", None)])
def test_deepseek_converts_both_ways_bit_for_bit(tmp_path, family, after_last):
  """DeepSeek-V3's and V2's two layer stacks (the dense first layer, then the experts', each
  counting Hugging Face's layers from where it starts), their RoPE features kept interleaved
  there, V3's correction bias and V2's queries without a low rank: imported and exported again,
  the same tensors bit for bit and a config.json of the same model; V3's multi-token prediction
  block after the last layer is not imported."""
  hf = tmp_path / "hf"
  shutil.copytree(ASSETS / family, hf)
  tensors = load_file(hf / "model.safetensors")
  if after_last:
    save_file({**tensors, after_last: np.ones(32, np.float32)}, hf / "model.safetensors")
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={tmp_path}", "run_name=a"]))
  config = pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                f"hf_output_path={tmp_path / 'exported'}"])
  assert set(restore(converted)["decoder"]) == {"dense_layers", "moe_layers", "decoder_norm"}
  to_huggingface.convert(config)
  exported = load_file(tmp_path / "exported" / "model.safetensors")
  assert sorted(exported) == sorted(tensors) and all(np.array_equal(exported[n], tensors[n]) for n in tensors)
  mapping.check_shape(tiny_config(*SHAPE, *FAMILIES[family]),
                      mapping.read_config(str(tmp_path / "exported")), "exported")


def restore(checkpoint):
  return ocp.PyTreeCheckpointer().restore(f"{checkpoint}/state")["params"]


@pytest.mark.parametrize("convert_dtype, stored", [("", "bfloat16"), ("float32", "float32")])
def test_bf16_weights_stay_bf16_unless_convert_dtype_asks(tmp_path, convert_dtype, stored):
  hf = tmp_path / "bf16"
  shutil.copytree(ASSETS / "qwen3", hf)
  original = {name: t.astype(ml_dtypes.bfloat16) for name, t in load_file(hf / "model.safetensors").items()}
  save_file(original, hf / "model.safetensors")
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={tmp_path}", "run_name=a",
       f"convert_dtype={convert_dtype}"]))
  assert {str(x.dtype) for x in jax.tree.leaves(restore(converted))} == {stored}
  exported = tmp_path / "exported"
  to_huggingface.convert(pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                              f"hf_output_path={exported}"]))
  tensors = load_file(exported / "model.safetensors")
  assert all(str(tensors[name].dtype) == stored and np.array_equal(tensors[name].astype(np.float32),
                                                              original[name].astype(np.float32))
             for name in original)
  assert json.loads((exported / "config.json").read_text())["torch_dtype"] == stored


@pytest.mark.parametrize("model_name", ["llama3.2-1b", "qwen3-0.6b", "gemma2-2b", "gemma3-1b", "gemma3-4b",
                                        "gemma3-27b", "deepseek3-671b", "deepseek2-16b", "olmo3-7b", "olmo3-32b",
                                        "kimi-k2-1t", "llama4-17b-16e", "llama4-17b-128e", "gpt-oss-20b",
                                        "gpt-oss-120b", "qwen3-next-80b-a3b"])
def test_a_published_config_json_gives_the_model_file_keys(tmp_path, model_name):
  """config.json as the Hub publishes it (transcribed in tests/assets/hf/published_configs.json;
  Gemma 2's names neither a tied head nor layer_types, which transformers takes as tied and
  sliding on even layers; OLMo 3's keys its YaRN by neither layer type, which transformers gives
  the global layers alone; Gemma 3 4B's and 27B's are Gemma3ForConditionalGeneration, whose
  text_config names only what differs from transformers' defaults; Llama 4's are
  Llama4ForConditionalGeneration, listing no_rope_layers empty for the default, one in four): with model_name it agrees
  with configs/models/NAME.yml, and without it to_maxtext resolves the same model keys."""
  (tmp_path / "config.json").write_text(json.dumps(
      json.loads((ASSETS / "published_configs.json").read_text())[model_name]))
  named = to_maxtext.resolve_config([BASE_YML, f"hf_model_path={tmp_path}", f"model_name={model_name}"])
  resolved = to_maxtext.resolve_config([BASE_YML, f"hf_model_path={tmp_path}"])
  keys = lambda config: {key: getattr(config, key) for key in pyconfig.MODEL_KEYS} | {
      "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim}
  assert keys(resolved) == keys(named)


@pytest.mark.parametrize("form", ["rope_parameters without sliding_attention", "transformers 4"])
def test_a_gemma3_config_json_silent_on_the_sliding_base_takes_transformers_default(tmp_path, form):
  """Gemma 3's config.json naming no RoPE base for its sliding layers (transformers 5's
  rope_parameters keyed by full_attention alone, or version 4's rope_scaling and rope_theta without
  rope_local_base_freq) imports with transformers' default, 10,000: its logits are transformers'."""
  hf = tmp_path / "gemma3"
  shutil.copytree(ASSETS / "gemma3", hf)
  full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
  edit_config(hf, **({"rope_parameters": {"full_attention": full}} if form.startswith("rope_parameters") else
                     {"rope_parameters": None, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
                      "rope_theta": 1000000.0}))
  config = to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"])
  assert config.local_rope_max_timescale == 10000
  logits, golden = logits_and_golden("gemma3", config, hf)
  scale = np.abs(golden).max()
  np.testing.assert_allclose(logits / scale, golden / scale, rtol=0, atol=1e-5)


def test_layer_types_unlike_the_familys_pattern_are_one_line_naming_them(tmp_path):
  """Gemma 3 with a global layer where its pattern has a sliding one: the line names config.json's
  layer_types, not a key it was put in."""
  hf = tmp_path / "gemma3"
  shutil.copytree(ASSETS / "gemma3", hf)
  kinds = json.loads((hf / "config.json").read_text())["layer_types"]
  edit_config(hf, layer_types=["full_attention"] + kinds[1:])
  with pytest.raises(errors.ConfigError, match=re.escape(f"hf_model_path={str(hf)!r}: config.json's layer_types "
                                                         "['full_attention', 'sliding_attention'")) as e:
    to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"])
  assert "gemma3's (supported: the last of every 6 layers global" in str(e.value) and "\n" not in str(e.value)


def edit_config(hf, **changes):
  config = json.loads((hf / "config.json").read_text())
  (hf / "config.json").write_text(json.dumps({**config, **changes}))


def drop_tensor(hf, name):
  tensors = load_file(hf / "model.safetensors")
  del tensors[name]
  save_file(tensors, hf / "model.safetensors")


def reshape_tensor(hf, name):
  tensors = load_file(hf / "model.safetensors")
  tensors[name] = tensors[name][:-1]
  save_file(tensors, hf / "model.safetensors")


def add_tensor(hf, name):
  tensors = load_file(hf / "model.safetensors")
  save_file({**tensors, name: np.zeros(32, np.float32)}, hf / "model.safetensors")


def retype_tensor(hf, name):
  tensors = load_file(hf / "model.safetensors")
  save_file({**tensors, name: tensors[name].astype(np.int32)}, hf / "model.safetensors")


def poison_tensor(hf, name):
  tensors = load_file(hf / "model.safetensors")
  tensors[name][0, 0] = np.nan
  save_file(tensors, hf / "model.safetensors")


def split_and_lose_a_shard(hf):
  tensors = load_file(hf / "model.safetensors")
  (hf / "model.safetensors").unlink()
  names = sorted(tensors)
  save_file({name: tensors[name] for name in names[:5]}, hf / "model-00001-of-00002.safetensors")
  (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
      name: f"model-0000{1 + (k >= 5)}-of-00002.safetensors" for k, name in enumerate(names)}}))


def test_a_non_finite_expert_is_one_line_naming_that_expert_alone(tmp_path):
  """The command line, a NaN in expert 2's down projection of layer 1 of a stacked expert tensor:
  one line naming that tensor (not every expert read with it), no writer thread's traceback,
  exit 2, nothing written."""
  hf = tmp_path / "hf"
  shutil.copytree(ASSETS / "qwen3_moe", hf)
  poison_tensor(hf, "model.layers.1.mlp.experts.2.down_proj.weight")
  result = run_cli("checkpoint_conversion.to_maxtext", f"hf_model_path={hf}", f"base_output_directory={tmp_path}/out",
                   "run_name=a")
  assert result.returncode == 2 and result.stderr.strip() == (
      f"config error: hf_model_path='{hf}': tensor model.layers.1.mlp.experts.2.down_proj.weight holds values that "
      "are not finite (inf or nan)"), result.stderr[-3000:]
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage, message", [
    (lambda hf: shutil.rmtree(hf), "no config.json"),
    (lambda hf: (hf / "config.json").unlink(), "no config.json"),
    (lambda hf: (hf / "model.safetensors").unlink(), "no *.safetensors files"),
    (split_and_lose_a_shard, "model-00002-of-00002.safetensors, which is not there"),
    (lambda hf: edit_config(hf, architectures=["MistralForCausalLM"]),
     "architecture MistralForCausalLM is not supported (supported: "),
    (lambda hf: drop_tensor(hf, "model.layers.1.mlp.up_proj.weight"), "tensor model.layers.1.mlp.up_proj.weight is "
     "missing"),
    (lambda hf: reshape_tensor(hf, "model.layers.2.self_attn.k_proj.weight"),
     "tensor model.layers.2.self_attn.k_proj.weight has shape (31, 32), expected (32, 32)"),
    (lambda hf: add_tensor(hf, "model.layers.0.self_attn.q_proj.bias"),
     "tensor model.layers.0.self_attn.q_proj.bias is not part of a LlamaForCausalLM of this shape"),
    (lambda hf: retype_tensor(hf, "model.layers.1.mlp.down_proj.weight"),
     "tensor model.layers.1.mlp.down_proj.weight is I32, expected one of F64, F32, F16, BF16"),
    (lambda hf: poison_tensor(hf, "model.layers.1.mlp.down_proj.weight"),
     "tensor model.layers.1.mlp.down_proj.weight holds values that are not finite"),
    (lambda hf: (hf / "model.safetensors.index.json").write_text("{not json"),
     "model.safetensors.index.json has no weight_map of tensor names to files (JSONDecodeError"),
    (lambda hf: (hf / "config.json").write_text("[1, 2]"), "config.json holds a list, not the model's settings"),
], ids=["no directory", "no config.json", "no safetensors", "a lost shard", "architecture", "missing tensor",
        "mis-shaped tensor", "extra tensor", "integer tensor", "non-finite tensor", "garbage index", "config a list"])
def test_a_bad_hugging_face_directory_names_what_is_wrong_and_writes_nothing(tmp_path, damage, message):
  hf = tmp_path / "hf"
  shutil.copytree(ASSETS / "llama", hf)
  damage(hf)
  output = tmp_path / "out"
  with pytest.raises(errors.ConfigError, match=re.escape(f"hf_model_path='{hf}': ") + ".*" + re.escape(message)):
    to_maxtext.convert(to_maxtext.resolve_config(
        [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={output}", "run_name=a"]))
  assert not output.exists()


def test_an_unsupported_architecture_is_one_line_listing_every_supported_one(tmp_path):
  hf = tmp_path / "hf"
  shutil.copytree(ASSETS / "llama", hf)
  edit_config(hf, architectures=["MistralForCausalLM"])
  with pytest.raises(errors.ConfigError) as e:
    to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"])
  supported = re.fullmatch(r".*: architecture MistralForCausalLM is not supported \(supported: (.*)\)", str(e.value))
  assert supported and set(supported[1].split(", ")) == {name for family in families.FAMILIES.values() for name in (
      family.hf_architecture, family.hf_multimodal_architecture) if name}


@pytest.mark.parametrize("args, message", [
    (("model_name=qwen3-0.6b",), "vocab_size=151936: "),
    (("model_name=qwen3-0.6b",), "(set vocab_size as it does, or leave model_name out"),
    # No model_name: the clash is the override's.
    (("base_num_kv_heads=4",), "base_num_kv_heads=4: "),
    (("base_num_kv_heads=4",), "(leave base_num_kv_heads out: config.json sets every model key)"),
    (("logits_via_embedding=false",), "logits_via_embedding=False: "),
    # Blamed on the key given, checked beside config.json's others (DeepSeek-V3's topk_group 2), not
    # beside base.yml's defaults (topk_routing_group=-1).
    (("n_routing_groups=2",), "n_routing_groups=2: "),
], ids=["model file clash", "model file fix", "override clash", "override fix", "tied head", "beside config.json"])
def test_a_model_key_config_json_contradicts_is_one_line_and_writes_nothing(tmp_path, args, message):
  output = tmp_path / "out"
  asset = "deepseek3" if "n_routing_groups=2" in args else "qwen3"
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    run_command("checkpoint_conversion.to_maxtext", f"hf_model_path={ASSETS / asset}",
                f"base_output_directory={output}", "run_name=a", *args)
  assert "\n" not in str(error.value)
  assert not output.exists()


def test_outputs_are_never_overwritten_and_a_checkpoint_of_other_keys_is_named(tmp_path):
  """A second import into the same run, an import into a training run's checkpoints, an export
  into an existing directory, and an export under model keys the checkpoint was not saved with:
  one line each, nothing written."""
  args = [BASE_YML, f"hf_model_path={ASSETS / 'llama'}", f"base_output_directory={tmp_path}", "run_name=a"]
  converted = to_maxtext.convert(to_maxtext.resolve_config(args))
  with pytest.raises(errors.ConfigError, match=re.escape(f"run_name='a': {converted} exists")):
    to_maxtext.convert(to_maxtext.resolve_config(args))
  exported = tmp_path / "exported"
  exported.mkdir()
  export = [BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}", f"hf_output_path={exported}"]
  with pytest.raises(errors.ConfigError, match=re.escape(f"hf_output_path='{exported}': exists")):
    to_huggingface.convert(pyconfig.initialize(export))
  exported.rmdir()
  with pytest.raises(errors.ConfigError, match=re.escape("parameter token_embedder/embedding has shape (96, 32), "
                                                           "the model keys give (128, 32)")):
    to_huggingface.convert(pyconfig.initialize([*export, "vocab_size=128"]))
  assert not exported.exists() and sorted(p.name for p in (tmp_path / "a" / "checkpoints").iterdir()) == ["0"]
  # An import into a training run's own checkpoints (step 300, no step 0) would add a step 0 of another model.
  (tmp_path / "b" / "checkpoints" / "300").mkdir(parents=True)
  with pytest.raises(errors.ConfigError, match=re.escape(f"run_name='b': run {tmp_path / 'b'} has checkpoints "
                                                         "(steps 300); import into a new run_name")):
    to_maxtext.convert(to_maxtext.resolve_config([*args[:-1], "run_name=b"]))
  assert [p.name for p in (tmp_path / "b" / "checkpoints").iterdir()] == ["300"]


def test_an_imported_checkpoint_has_checksums_and_a_flipped_bit_is_not_exported(tmp_path):
  from test_checkpointing import damage
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={ASSETS / 'llama'}", f"base_output_directory={tmp_path}", "run_name=a"]))
  assert (tmp_path / "a" / "checkpoints" / "0" / "checksums").is_dir()
  damage(tmp_path / "a" / "checkpoints" / "0", "flipped bit")
  exported = tmp_path / "exported"
  with pytest.raises(checkpointing.CheckpointError, match=re.escape(f"load_parameters_path='{converted}': ")):
    to_huggingface.convert(pyconfig.initialize([BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}",
                                                f"hf_output_path={exported}"]))
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]


def test_export_removes_only_its_own_dead_leftovers_and_paths_in_the_way_are_one_line(tmp_path):
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={ASSETS / 'llama'}", f"base_output_directory={tmp_path}", "run_name=a"]))
  users = tmp_path / "exported.partial"  # a name a user may well pick: never touched
  users.mkdir()
  (users / "mine.txt").write_text("keep")
  dead = subprocess.Popen(["true"])
  dead.wait()
  leftover = tmp_path / f".exported.to_huggingface-{dead.pid}.partial"  # a killed export's
  leftover.mkdir()
  export = [BASE_YML, mapping.NO_DATA, f"load_parameters_path={converted}"]
  to_huggingface.convert(pyconfig.initialize([*export, f"hf_output_path={tmp_path / 'exported'}"]))
  assert (users / "mine.txt").read_text() == "keep" and not leftover.exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "exported", "exported.partial"]
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(errors.ConfigError, match=re.escape(f"hf_output_path: cannot write '{a_file}/out'")):
    to_huggingface.convert(pyconfig.initialize([*export, f"hf_output_path={a_file}/out"]))
  with pytest.raises(errors.ConfigError, match="base_output_directory: cannot write"):
    to_maxtext.convert(to_maxtext.resolve_config([BASE_YML, f"hf_model_path={ASSETS / 'llama'}",
                                                  f"base_output_directory={a_file}", "run_name=b"]))
  assert a_file.read_text() == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_the_config_json_written_for_each_family_reads_back_as_the_same_model(family):
  """hf_config and model_keys, both read from the family's registry entry, are inverses: the
  exported config.json of every family (dense and mixtures) gives back every model key."""
  config = tiny_config(*SHAPE, *FAMILIES[family])
  written = mapping.hf_config(config, "float32")
  mapping.check_shape(config, written, "exported")
  # The registry's names are transformers' own: those of the golden files it wrote.
  golden = mapping.read_config(str(ASSETS / family))
  assert (written["architectures"], written["model_type"]) == (golden["architectures"], golden["model_type"])


def test_gemma3_config_json_in_transformers_4_keys_reads_as_the_same_model():
  """The Hub's Gemma 3 files (transformers 4) name the global RoPE rope_theta and rope_scaling,
  the local base rope_local_base_freq, and the pattern sliding_window_pattern, without
  layer_types: the golden config.json (transformers 5, RoPE keyed by layer type) so rewritten
  gives the same model keys."""
  golden = mapping.read_config(str(ASSETS / "gemma3"))
  rope = golden["rope_parameters"]
  hub = {key: value for key, value in golden.items() if key not in ("rope_parameters", "layer_types")}
  hub.update(rope_theta=rope["full_attention"]["rope_theta"],
             rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
             rope_scaling={k: v for k, v in rope["full_attention"].items() if k != "rope_theta"},
             sliding_window_pattern=golden["layer_types"].index("full_attention") + 1)
  assert mapping.model_keys(hub, "hub") == mapping.model_keys(golden, "golden")


@pytest.mark.parametrize("names", ["hub", "transformers 5"])
def test_the_language_model_of_a_multimodal_gemma3_gives_its_logits_of_text(tmp_path, names):
  """Gemma3ForConditionalGeneration's language model, imported alone with every model key from
  its config.json's text_config (the vision tower and projector left out, as is a missing
  lm_head under a tied one), gives the multimodal model's logits of text alone: under the Hub's
  tensor names (language_model.model.*) and transformers 5's (model.language_model.*)."""
  hf = ASSETS / "gemma3_multimodal"
  if names == "transformers 5":
    shutil.copytree(hf, tmp_path / "hf")
    hf = tmp_path / "hf"
    tensors = load_file(hf / "model.safetensors")
    save_file({re.sub(r"^language_model\.model\.", "model.language_model.", n): t for n, t in tensors.items()},
              hf / "model.safetensors")
  config = to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"])
  assert (config.decoder_block, config.base_num_decoder_layers, config.sliding_window_size) == ("gemma3", 7, 4)
  tensors = mapping.tensor_index(str(hf))
  mapping.check_tensors(config, tensors, str(hf))
  assert not [n for n in tensors if "vision" in n or "projector" in n]
  logits, golden = logits_and_golden("gemma3_multimodal", config, hf)
  scale = np.abs(golden).max()
  np.testing.assert_allclose(logits / scale, golden / scale, rtol=0, atol=1e-5)


def test_a_new_family_is_one_registry_entry(monkeypatch, tmp_path):
  """A family added to families.FAMILIES alone is a decoder_block the config accepts, whose
  switches the layers read, and whose weights and config.json both converters map."""
  toy = dataclasses.replace(families.FAMILIES["qwen3"], sandwich_norms=True, hf_architecture="ToyForCausalLM",
                            hf_model_type="toy")
  monkeypatch.setitem(families.FAMILIES, "toy", toy)
  config = tiny_config(*SHAPE, "decoder_block=toy", "logits_via_embedding=false")
  assert config.qk_norm and config.sandwich_norms and not config.norm_plus_one
  names = {name for entry in mapping.layout(config) for name in mapping.hf_names(config, entry)}
  assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.2.pre_feedforward_layernorm.weight"} <= names
  hf = mapping.hf_config(config, "float32")
  assert hf["architectures"] == ["ToyForCausalLM"] and mapping.model_keys(hf, "toy")["decoder_block"] == "toy"
  mapping.check_shape(config, hf, "toy")


@pytest.mark.parametrize("family, settings, message", [
    ("mixtral", ("norm_topk_prob=false",), r"^norm_topk_prob=False: MixtralForCausalLM fixes it at True"),
    ("gemma2", ("local_rope_max_timescale=100",), r"^local_rope_max_timescale=100: Gemma2ForCausalLM gives its "
                                                  "sliding and global layers one RoPE"),
    ("llama3.1", ("rope_linear_scaling_factor=2",), r"^rope_linear_scaling_factor=2.0: config.json holds one RoPE "
                                                    "scaling, and rope_type='llama3.1' is another"),
    ("qwen3_moe", ("routed_score_func=sigmoid",), r"^routed_score_func='sigmoid': Qwen3MoeForCausalLM routes with "
                                                  "routed_score_func='softmax'"),
    ("qwen3", ("attention_type=mla", "base_num_kv_heads=4"), r"^attention_type='mla': Qwen3ForCausalLM has 'global' "
                                                             "attention"),
    ("deepseek2", ("norm_topk_prob=true",), r"^norm_topk_prob=True: DeepseekV2ForCausalLM fixes it at False"),
    ("deepseek2", ("n_routing_groups=4", "topk_routing_group=2"),
     r"^n_routing_groups=4: DeepseekV2ForCausalLM routes with n_routing_groups=-1"),
    ("deepseek2", ("mtp_num_layers=1",), r"^mtp_num_layers=1: DeepseekV2ForCausalLM has no multi-token prediction"),
    ("llama", ("chunk_attn_window_size=4",), r"^chunk_attn_window_size=4: LlamaForCausalLM has no such attention"),
    ("llama", ("use_qk_norm=true",), r"^use_qk_norm=True: LlamaForCausalLM has no such attention"),
    ("llama4", ("routed_bias=true",), r"^routed_bias=True: Llama4ForCausalLM routes with routed_bias=False"),
    ("llama4", ("shared_experts=2",), r"^shared_experts=2: Llama4ForCausalLM routes with shared_experts=1")],
    ids=["mixtral unnormalised", "gemma2 local base", "llama3.1 and linear", "qwen3_moe sigmoid", "qwen3 mla",
         "deepseek2 renormalised", "deepseek2 groups", "deepseek2 mtp", "llama chunks", "llama unit-RMS q/k",
         "llama4 correction bias", "llama4 two shared experts"])
def test_an_export_the_hugging_face_class_cannot_express_is_refused(family, settings, message):
  with pytest.raises(errors.ConfigError, match=message):
    mapping.check_exportable(tiny_config(*SHAPE, *FAMILIES[family], *settings))
  mapping.check_exportable(tiny_config(*SHAPE, *FAMILIES[family]))


@pytest.mark.parametrize("damage, message", [
    (lambda hf: edit_config(hf, no_rope_layers=[1, 0, 1, 1]),
     "nope_layer_interval=no_rope_layers [1, 0, 1, 1] (not supported: only the last of every N layers without RoPE)"),
    (lambda hf: edit_config(hf, layer_types=["full_attention"] * 4),
     "chunk_attn_window_size=layer_types ['full_attention', 'full_attention', 'full_attention', 'full_attention'] "
     "(not supported: chunks on the RoPE layers"),
    (lambda hf: reshape_tensor(hf, "model.layers.3.feed_forward.experts.gate_up_proj"),
     "tensor model.layers.3.feed_forward.experts.gate_up_proj has shape (3, 32, 48), expected (4, 32, 48)")],
    ids=["NoPE layers off the pattern", "no chunks on the RoPE layers", "experts' tensor mis-shaped"])
def test_a_llama4_directory_this_project_cannot_express_is_one_line_and_writes_nothing(tmp_path, damage, message):
  hf, output = tmp_path / "hf", tmp_path / "out"
  shutil.copytree(ASSETS / "llama4", hf)
  damage(hf)
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    to_maxtext.convert(to_maxtext.resolve_config(
        [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={output}", "run_name=a"]))
  assert "\n" not in str(error.value) and not output.exists()


def test_gpt_oss_experts_in_mxfp4_import_dequantized_as_transformers_does(tmp_path):
  """GPT-OSS as published: its experts' projections in MXFP4 (4-bit values in 32-value blocks
  with a power-of-two scale each; transformers' own loading of the asset gives its golden
  logits) import, an expert at a time, to bfloat16 parameters whose logits are transformers'."""
  converted = to_maxtext.convert(to_maxtext.resolve_config(
      [BASE_YML, f"hf_model_path={ASSETS / 'gpt_oss_mxfp4'}", f"base_output_directory={tmp_path}", "run_name=a"]))
  params = restore(converted)
  assert params["decoder"]["layers"]["moe_block"]["wi_0"].dtype == ml_dtypes.bfloat16
  config = tiny_config(*SHAPE, *FAMILIES["gpt_oss"])
  golden = np.load(ASSETS / "gpt_oss_mxfp4" / "golden.npz")
  tokens = golden["tokens"]
  logits = np.asarray(Transformer(config).apply({"params": params}, tokens,
                                                np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape),
                                                np.ones_like(tokens)))
  scale = np.abs(golden["logits"]).max()
  np.testing.assert_allclose(logits / scale, golden["logits"] / scale, rtol=0, atol=1e-5)


def damage_mxfp4(hf, name, change):
  tensors = load_file(hf / "model.safetensors")
  tensors = change(tensors, name)
  save_file(tensors, hf / "model.safetensors")


@pytest.mark.parametrize("change, message", [
    (lambda t, n: {**t, n + "_scales": t[n + "_scales"][:, :-1]},
     "tensor model.layers.2.mlp.experts.down_proj_scales has shape (4, 31, 2), not its blocks' (4, 32, 2) "
     "(model.layers.2.mlp.experts.down_proj_blocks, MXFP4)"),
    (lambda t, n: {k: v for k, v in t.items() if k != n + "_scales"},
     "tensor model.layers.2.mlp.experts.down_proj_blocks (MXFP4) has no model.layers.2.mlp.experts.down_proj_scales"),
    (lambda t, n: {**t, n + "_blocks": t[n + "_blocks"].astype(np.int32)},
     "are I32 (4, 32, 2, 16) and U8 (4, 32, 2), not MXFP4")],
    ids=["scales unlike the blocks", "blocks without scales", "blocks not bytes"])
def test_a_damaged_mxfp4_tensor_is_one_line_naming_it_and_writes_nothing(tmp_path, change, message):
  hf, output = tmp_path / "hf", tmp_path / "out"
  shutil.copytree(ASSETS / "gpt_oss_mxfp4", hf)
  damage_mxfp4(hf, "model.layers.2.mlp.experts.down_proj", change)
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    to_maxtext.convert(to_maxtext.resolve_config(
        [BASE_YML, f"hf_model_path={hf}", f"base_output_directory={output}", "run_name=a"]))
  assert "\n" not in str(error.value) and not output.exists()


@pytest.mark.parametrize("changes, message", [
    (dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     "n_routing_groups=topk_method group_limited_greedy of DeepseekV2ForCausalLM (not supported: greedy is): "),
    (dict(norm_topk_prob=True), "norm_topk_prob=True (DeepseekV2ForCausalLM ignores it: not supported): ")],
    ids=["groups by their best expert", "renormalised"])
def test_a_deepseek2_routing_unlike_this_projects_is_refused_on_import(tmp_path, changes, message):
  """transformers' DeepseekV2ForCausalLM ranks groups by their best expert (group_limited_greedy),
  where this project ranks them by their best two, and ignores norm_topk_prob: a config.json
  asking for either is one line naming it, where the greedy method's groups (V2-Lite's n_group 1,
  or any) are none."""
  hf = tmp_path / "hf"
  shutil.copytree(ASSETS / "deepseek2", hf)
  edit_config(hf, topk_method="greedy", n_group=4, topk_group=2)
  assert to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"]).n_routing_groups == -1
  edit_config(hf, **changes)
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    to_maxtext.resolve_config([BASE_YML, f"hf_model_path={hf}"])
  assert "\n" not in str(error.value)
