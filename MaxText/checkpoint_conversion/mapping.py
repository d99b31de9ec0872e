"""Hugging Face model directories <-> this project's parameters: the one mapping table both
converters read (to_maxtext.py, to_huggingface.py), config.json both ways, and reading a
directory's safetensors one tensor at a time.

Supported: LlamaForCausalLM (Llama 2, 3, 3.1, 3.2), Qwen3ForCausalLM, Gemma2ForCausalLM,
Gemma3ForCausalLM (Gemma 3's text decoder), Olmo3ForCausalLM, and the mixtures of experts
Qwen3MoeForCausalLM (every N-th layer routed too), MixtralForCausalLM, DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM, Llama4ForCausalLM (Llama 4's text model), GptOssForCausalLM and
Qwen3NextForCausalLM (Gated DeltaNet layers beside attention); imported only, the language models
of Gemma3ForConditionalGeneration (Gemma 3 4B, 12B, 27B as published) and
Llama4ForConditionalGeneration.
"""

import glob
import itertools
import json
import math
import os
import re
from typing import NamedTuple

import ml_dtypes
import numpy as np
from safetensors import safe_open

from MaxText import config_schema, errors
from MaxText.families import FAMILIES
from MaxText.layers import blocks
from MaxText.layers.embeddings import yarn_mscale

# Put before the user's keys: the converters read no data, so the text dataset's checks (a
# tokenizer that fits vocab_size) must not stop them.
NO_DATA = "dataset_type=synthetic"
# Tensors some Hugging Face checkpoints carry that the model recomputes or ties: not weights.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# A multimodal checkpoint's language model, under the Hub's names or transformers 5's, -> the names
# its causal-LM class gives it; the other towers' tensors (vision, projector) are not imported.
LANGUAGE_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                           "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}


def tool_argv(argv: list) -> list:
  """A converter's [config.yml, key=value ...] with NO_DATA before the user's keys."""
  return [*argv[:1], NO_DATA, *argv[1:]] if argv else argv


def pattern(num_layers: int, period: int) -> list:
  """Hugging Face's per-layer attention kinds for a window on all but the last of every `period` layers."""
  return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]


def layer_types(config) -> list:
  """Hugging Face's per-layer attention kinds for this config."""
  if config.gated_delta_net:
    return ["full_attention" if blocks.layer_kind(config, i).mixer == "attention" else "linear_attention"
            for i in range(config.base_num_decoder_layers)]
  if config.chunk_attn_window_size:
    return ["full_attention" if nope else "chunked_attention" for nope in _nope_layers(config)]
  if not config.sliding_window_size:
    return ["full_attention"] * config.base_num_decoder_layers
  return pattern(config.base_num_decoder_layers, config.sliding_window_pattern)


# The RoPE rescalings' keys, which config.json holds only for the rope_type that uses them: both
# Llama 3.1's and YaRN's, Llama 3.1's, YaRN's.
_RESCALED_ROPE_KEYS = ("rope_scaling_factor", "rope_original_max_position")
_LLAMA31_ROPE_KEYS = ("rope_low_freq_factor", "rope_high_freq_factor")
_YARN_ROPE_KEYS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# What transformers' YaRN takes where config.json is silent (no mscale: cos and sin scaled by mscale(1)).
_YARN_DEFAULTS = dict(zip(_YARN_ROPE_KEYS, (32.0, 1.0, 0.0, 0.0)))
# Llama 4's attention: off in the config.json of a class without it (Family.hf_llama4_attention).
_LLAMA4_ATTENTION = {"nope_layer_interval": 0, "chunk_attn_window_size": 0, "temperature_tuning": False,
                     "use_qk_norm": False}
_TEMPERATURE_KEYS = ("temperature_tuning_scale", "temperature_tuning_floor")
# Latent attention's widths (attention_type=mla).
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Gated DeltaNet's keys and config.json's (Qwen3-Next's) for them.
_GDN_KEYS = {"gdn_conv_kernel_dim": "linear_conv_kernel_dim", "gdn_key_head_dim": "linear_key_head_dim",
             "gdn_value_head_dim": "linear_value_head_dim", "gdn_num_key_heads": "linear_num_key_heads",
             "gdn_num_value_heads": "linear_num_value_heads"}


def _expected(config) -> dict:
  """config.json's values for this config: every key that affects the model but those it
  does not use, as model_keys reads them."""
  # A mixture of experts without dense layers has no dense MLP: base_mlp_dim is unused
  # (Mixtral's intermediate_size is its experts' width).
  if config.moe:
    unused = set() if config.first_num_dense_layers or config.interleave_moe_layer_step > 1 else {"base_mlp_dim"}
  else:
    unused = set(config_schema.fields("model", [config_schema.MoE]))
  if config.rope_type != "llama3.1":
    unused.update(_LLAMA31_ROPE_KEYS)
  if config.rope_type not in ("llama3.1", "yarn"):
    unused.update(_RESCALED_ROPE_KEYS)
  if config.rope_type != "yarn":
    unused.update((*_YARN_ROPE_KEYS, "rope_truncate"))
  if not config.temperature_tuning:
    unused.update(_TEMPERATURE_KEYS)
  # Latent attention's scores are scaled by its query and key width; head_dim it does not use.
  mla = config.attention_type == "mla"
  unused.update(("head_dim",) if mla else _MLA_KEYS)
  if not config.gated_delta_net:
    unused.update((*_GDN_KEYS, "inhomogeneous_layer_cycle_interval"))
  # config.json's num_nextn_predict_layers says how many prediction layers a checkpoint holds, not
  # how many to train: mtp_num_layers is the user's (check_tensors finds the layers it needs).
  unused.add("mtp_num_layers")
  return {**{key: getattr(config, key) for key in config_schema.fields("model") if key not in unused},
          "rope_max_timescale": float(config.rope_max_timescale),
          "local_rope_max_timescale": float(config.local_rope_max_timescale),
          "rope_linear_scaling_factor": float(config.rope_linear_scaling_factor),
          "query_pre_attn_scalar": query_scalar(config)}


def query_scalar(config) -> int:
  """What the scores are scaled by the inverse square root of: query_pre_attn_scalar, or the
  query width, which latent attention's is its own (not head_dim)."""
  mla = config.qk_nope_head_dim + config.qk_rope_head_dim if config.attention_type == "mla" else None
  return config.query_pre_attn_scalar or mla or config.head_dim


def _multimodal_family(hf: dict):
  """The family whose language model config.json's multimodal architecture holds, or None."""
  architecture = (hf.get("architectures") or [""])[0]
  return next((f for f in FAMILIES.values() if architecture and f.hf_multimodal_architecture == architecture), None)


def language_model(hf: dict) -> dict:
  """A multimodal config.json as its language model's causal-LM config.json: its text_config
  over transformers' defaults for what that leaves out; any other config.json as it is."""
  family = _multimodal_family(hf)
  if family is None:
    return hf
  tied = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf else {}
  return {**dict(family.hf_text_config_defaults), **tied, **(hf.get("text_config") or {}),
          "architectures": [family.hf_architecture]}


def model_keys(hf: dict, hf_path: str) -> dict:
  """The config keys config.json sets (None where it sets none); an architecture this project
  lacks, or a config.json without a size, is a config error."""
  hf = language_model(hf)
  architecture = (hf.get("architectures") or ["(none)"])[0]
  blocks = {family.hf_architecture: block for block, family in FAMILIES.items()}
  if architecture not in blocks:
    multimodal = [f.hf_multimodal_architecture for f in FAMILIES.values() if f.hf_multimodal_architecture]
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: architecture {architecture} is not supported "
                             f"(supported: {', '.join([*blocks, *multimodal])})")
  try:
    return _model_keys(hf, blocks[architecture])
  except KeyError as e:
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: config.json has no {e.args[0]}") from None
  except errors.ConfigError as e:
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: {e}") from None


def _model_keys(hf: dict, block: str) -> dict:
  family, layers = FAMILIES[block], hf["num_hidden_layers"]
  # transformers 5 keys Gemma 3's RoPE by layer type; version 4 (and the Hub's files) write the
  # global layers' in rope_scaling and the local base as rope_local_base_freq. Its local layers'
  # RoPE is plain.
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope, local = rope.get("full_attention", rope), rope.get("sliding_attention", {})
  global_base = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
  local_base = (local.get("rope_theta", hf.get("rope_local_base_freq")) or family.hf_local_rope_base or global_base
                if family.hf_rope_by_layer_type else None)
  if local.get("rope_type", "default") != "default":
    local_base = f"sliding layers' rope_type {local['rope_type']} (not supported)"
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  limit = float(hf.get(family.hf_activation_limit_key, 0.0)) if family.hf_activation_limit_key else 0.0
  # transformers' YaRN scales cos and sin by attention_factor, by default the one mscale() gives.
  factor = rope.get("attention_factor")
  if rope_type == "yarn" and factor is not None and not math.isclose(factor, yarn_mscale(rope.get("factor", 1.0)),
                                                                      rel_tol=1e-9):
    rope_type = f"yarn with attention_factor {factor} (not supported)"
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  expected = pattern(layers, family.sliding_window_pattern)
  by_default = family.hf_sliding_by_default and hf.get("sliding_window")
  kinds = hf.get("layer_types") or (pattern(layers, hf.get("sliding_window_pattern", family.sliding_window_pattern))
                                    if by_default else ["full_attention"] * layers)
  if "sliding_attention" in kinds and kinds != expected:
    raise errors.ConfigError(f"config.json's layer_types {kinds} are not {block}'s (supported: the last of every "
                             f"{family.sliding_window_pattern} layers global, the others sliding)")
  window = hf["sliding_window"] if "sliding_attention" in kinds else 0
  linear = rope_type == "linear"
  return {"decoder_block": block,
          "vocab_size": hf["vocab_size"], "base_emb_dim": hf["hidden_size"],
          "base_mlp_dim": hf[family.hf_dense_width_key],
          "base_num_query_heads": hf["num_attention_heads"],
          "base_num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
          "base_num_decoder_layers": hf["num_hidden_layers"],
          "head_dim": head_dim,
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", family.hf_tied_by_default)),
          "rope_max_timescale": global_base,
          "normalization_layer_epsilon": hf["rms_norm_eps"],
          "local_rope_max_timescale": local_base or 0,
          "rope_type": {"default": "default", "llama3": "llama3.1", "yarn": "yarn"}.get(
              rope_type, "default" if linear else f"{rope_type} (not supported)"),
          "rope_linear_scaling_factor": rope["factor"] if linear else 1.0,
          "rope_scaling_factor": rope.get("factor"), "rope_low_freq_factor": rope.get("low_freq_factor"),
          "rope_high_freq_factor": rope.get("high_freq_factor"),
          "rope_original_max_position": rope.get("original_max_position_embeddings"),
          **{key: default if rope_type == "yarn" and rope.get(key) is None else rope.get(key)
             for key, default in _YARN_DEFAULTS.items()},
          "rope_truncate": bool(rope.get("truncate", True)),
          "attention_bias": bool(hf.get("attention_bias")) if family.hf_attention_bias else False,
          "attention_sink": family.hf_sinks, "mlp_activations_limit": limit,
          "attn_logits_soft_cap": float(hf.get("attn_logit_softcapping") or 0),
          "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0),
          "query_pre_attn_scalar": hf.get("query_pre_attn_scalar") or head_dim, "sliding_window_size": window,
          "partial_rotary_factor": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
          **_llama4_keys(hf, family, layers), **_mla_keys(hf, family), **_moe_keys(hf, family),
          **_gdn_keys(hf, family, layers)}


def _nope_layers(config) -> list:
  """Whether each layer has no RoPE (nope_layer_interval)."""
  interval = config.nope_layer_interval
  return [bool(interval) and (i + 1) % interval == 0 for i in range(config.base_num_decoder_layers)]


def _llama4_keys(hf: dict, family, layers: int) -> dict:
  """Llama 4's attention keys, with its class's defaults where config.json is silent; off for the
  other families. Its NoPE layers must be the last of every N, its chunked layers the others."""
  if not family.hf_llama4_attention:
    return _LLAMA4_ATTENTION
  uses_rope = hf.get("no_rope_layers") or [int((i + 1) % hf.get("no_rope_layer_interval", 4) != 0)
                                            for i in range(layers)]
  interval = next((i + 1 for i, rope in enumerate(uses_rope) if not rope), 0)
  if list(uses_rope) != [int(not interval or (i + 1) % interval != 0) for i in range(layers)]:
    interval = f"no_rope_layers {uses_rope} (not supported: only the last of every N layers without RoPE)"
  chunk = hf.get("attention_chunk_size", 8192) or 0
  kinds = ["chunked_attention" if rope and chunk else "full_attention" for rope in uses_rope]
  if hf.get("layer_types") and list(hf["layer_types"]) != kinds:
    chunk = f"layer_types {hf['layer_types']} (not supported: chunks on the RoPE layers, {kinds})"
  return {"nope_layer_interval": interval, "chunk_attn_window_size": chunk,
          "temperature_tuning": bool(hf.get("attn_temperature_tuning", True)) and bool(interval),
          "temperature_tuning_scale": hf.get("attn_scale", 0.1),
          "temperature_tuning_floor": hf.get("floor_scale", 8192),
          "use_qk_norm": bool(hf.get("use_qk_norm", True))}


def _gdn_keys(hf: dict, family, layers: int) -> dict:
  """Gated DeltaNet's keys ({} for a family without it): its widths, and its layer pattern, the
  last of every N layers full attention (config.json's layer_types, or full_attention_interval)."""
  if not family.gated_delta_net:
    return {}
  kinds = hf.get("layer_types") or ["linear_attention" if (i + 1) % hf.get("full_attention_interval", 4) else
                                    "full_attention" for i in range(layers)]
  interval = next((i + 1 for i, kind in enumerate(kinds) if kind == "full_attention"), layers)
  if list(kinds) != ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]:
    interval = f"layer_types {kinds} (not supported: only the last of every N layers full attention)"
  return {"inhomogeneous_layer_cycle_interval": interval, **{key: hf[name] for key, name in _GDN_KEYS.items()}}


def _mla_keys(hf: dict, family) -> dict:
  """Latent attention's keys ({} for the other families): its scores are scaled by its query
  and key width (query_pre_attn_scalar), not by head_dim, which transformers sets to the RoPE
  width."""
  if family.hf_attention_type != "mla":
    return {"attention_type": family.hf_attention_type}
  nope, rope = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
  return {"attention_type": "mla", "head_dim": hf.get("head_dim") or rope,
          "q_lora_rank": hf.get("q_lora_rank") or 0, "kv_lora_rank": hf["kv_lora_rank"],
          "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": hf["v_head_dim"],
          "query_pre_attn_scalar": hf.get("query_pre_attn_scalar") or nope + rope}


def _moe_keys(hf: dict, family) -> dict:
  """The mixture-of-experts keys of a mixture's config.json ({} for a dense family). A mixture
  with dense layers listed one by one (Qwen3-MoE's mlp_only_layers) is not supported; every N-th
  layer routed (the family's hf_moe_step_key) is."""
  if not family.moe:
    return {}
  # The Hub's Qwen3-MoE files say num_experts; transformers 5 writes num_local_experts for both.
  experts = hf["num_local_experts"] if "num_local_experts" in hf else hf[family.hf_num_experts_key]
  norm_topk_prob, said = family.hf_norm_topk_prob, hf.get("norm_topk_prob")
  if norm_topk_prob is None:
    norm_topk_prob = bool(said)
  elif said is not None and bool(said) != norm_topk_prob:
    norm_topk_prob = f"{said} ({family.hf_architecture} ignores it: not supported)"
  step = (hf.get(family.hf_moe_step_key) or 1) if family.hf_moe_step_key else 1
  # Softmax, no bias, groups, scaling or shared experts (Qwen3-MoE's and Mixtral's routing) unless
  # the family's class (hf_routing, over config.json) or DeepSeek's keys say otherwise; one group
  # is none, and so are the groups of a class whose topk_method (the one converted) routes without them.
  groups = 1 if family.hf_topk_method else hf.get("n_group") or 1
  routing = {"routed_score_func": "softmax", "routed_bias": False,
             "n_routing_groups": groups if groups > 1 else -1,
             "topk_routing_group": hf["topk_group"] if groups > 1 else -1,
             "routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0)),
             "shared_experts": _shared_experts(hf, family),
             "first_num_dense_layers": hf.get("first_k_dense_replace", 0), **dict(family.hf_routing)}
  method = hf.get("topk_method") or family.hf_topk_method
  if family.hf_topk_method and method != family.hf_topk_method:
    routing["n_routing_groups"] = (f"topk_method {method} of {family.hf_architecture} (not supported: "
                                   f"{family.hf_topk_method} is)")
  return {**routing, "num_experts": experts, "num_experts_per_tok": hf["num_experts_per_tok"],
          "mlp_bias": bool(family.hf_expert_biases),
          "base_moe_mlp_dim": hf[family.hf_expert_width_key], "norm_topk_prob": norm_topk_prob,
          "interleave_moe_layer_step": step,
          **({"decoder_block": f"{family.hf_architecture} with dense layers (mlp_only_layers "
                               f"{hf.get('mlp_only_layers')}: not supported)"} if hf.get("mlp_only_layers") else {})}


def _shared_experts(hf: dict, family):
  """The shared experts config.json says: counted, or their width over one expert's."""
  if not family.hf_shared_expert_width_key:
    return hf.get("n_shared_experts") or 0
  width, expert = hf[family.hf_shared_expert_width_key], hf[family.hf_expert_width_key]
  if width % expert:
    return f"{family.hf_shared_expert_width_key} {width} (not supported: a multiple of {expert})"
  return width // expert


def check_shape(config, hf: dict, hf_path: str) -> None:
  found = model_keys(hf, hf_path)
  for key, want in _expected(config).items():
    if found[key] != want:
      fix = (f"set {key} as it does, or leave model_name out to take every model key from it"
             if config.model_name != "default" else f"leave {key} out: config.json sets every model key")
      raise errors.ConfigError(f"{key}={want!r}: {hf_path}/config.json has {found[key]!r} ({fix})")


class Entry(NamedTuple):
  """One parameter of this project and its Hugging Face tensors. Hugging Face keeps linear weights
  [out, in]; here they are [in..., out...] kernels, except the MLP's and the experts' wo, which
  are [out, in] as there (layers/linears.DenseGeneral's in_last); per-layer weights (names with
  {i}) are stacked on a leading layer axis, and experts' weights (names with {e} too) on an
  expert axis after it."""

  path: tuple  # in this project's parameter tree
  name: str  # Hugging Face's, with {i} for the layer and {e} for the expert
  stack: tuple  # the stacked dimensions
  shape: tuple  # this project's shape of one of the stacked tensors
  in_axes: int  # input axes of a linear weight, 0 for a tensor copied as it is
  first: int = 0  # the model's index of the stack's first layer: {i} counts from it
  stride: int = 1  # model layers between consecutive stacked layers (a block's position in a block of K: K)
  # Trailing features of the last axis that Hugging Face keeps in interleaved RoPE pairs (2j, 2j+1)
  # and this project in halves (j, j + n/2): DeepSeek's MLA queries and shared RoPE key, each head
  # of Llama 4's queries and keys.
  interleaved: int = 0
  # A Hugging Face copy of a parameter another entry holds (DeepSeek's multi-token prediction
  # layers keep the embedding and the head again): written on export, required but not read on import.
  copy: bool = False
  # (k, n): Hugging Face keeps a layer's experts in one tensor [experts, in, out], each expert's
  # [out, in] transposed, and this parameter is the k-th of n equal runs of its out features
  # (Llama 4's gate_up_proj: the gate's, then the up projection's); (): a tensor per expert.
  part: tuple = ()
  # With part, the n parameters' features alternate instead (feature j of part k at j * n + k:
  # GPT-OSS's gate_up_proj).
  strided: bool = False
  # Hugging Face keeps the (unstacked) tensor flat, one axis (attention biases [heads * head_dim]).
  flat: bool = False
  # Hugging Face's shape, where it has unit axes the layout's lacks (Gated DeltaNet's conv1d
  # [channels, 1, width]).
  hf_dims: tuple = ()


def layout(config) -> list:
  """Every parameter's Entry: the embedding, each layer stack's (blocks.stacks), the head."""
  dim = config.base_emb_dim
  entries = [Entry(("token_embedder", "embedding"), "model.embed_tokens.weight", (), (config.vocab_size, dim), 0),
             Entry(("decoder", "decoder_norm", "scale"), "model.norm.weight", (), (dim,), 0)]
  for stack in blocks.stacks(config):
    period = len(stack.block)
    for j, kind in enumerate(stack.block):
      path = ("decoder", stack.name, *((f"layer_{j}",) if period > 1 else ()))
      entries += _layer_entries(config, path, "model.layers.{i}.", (stack.depth // period,), stack.first + j, kind,
                                period)
  if not config.logits_via_embedding:
    entries.append(Entry(("logits_kernel",), "lm_head.weight", (), (dim, config.vocab_size), 1))
  for k in range(1, config.mtp_num_layers + 1):
    entries += _mtp_entries(config, k)
  return entries


def _mtp_entries(config, k: int) -> list:
  """Multi-token prediction's layer k, where DeepSeek's checkpoints keep it: as their layer
  base_num_decoder_layers + k - 1, whose eh_proj reads [enorm(embedding) ; hnorm(hidden)] as
  the projection does, with copies of the embedding and the head."""
  dim, vocab = config.base_emb_dim, config.vocab_size
  path, prefix = ("mtp", f"layer_{k}"), f"model.layers.{config.base_num_decoder_layers + k - 1}."
  head = (Entry(("token_embedder", "embedding"), prefix + "shared_head.head.weight", (), (vocab, dim), 0, copy=True)
          if config.logits_via_embedding else
          Entry(("logits_kernel",), prefix + "shared_head.head.weight", (), (dim, vocab), 1, copy=True))
  return [Entry((*path, "embedding_norm", "scale"), prefix + "enorm.weight", (), (dim,), 0),
          Entry((*path, "hidden_state_norm", "scale"), prefix + "hnorm.weight", (), (dim,), 0),
          Entry((*path, "projection"), prefix + "eh_proj.weight", (), (2 * dim, dim), 1),
          Entry((*path, "shared_head_norm", "scale"), prefix + "shared_head.norm.weight", (), (dim,), 0),
          Entry(("token_embedder", "embedding"), prefix + "embed_tokens.weight", (), (vocab, dim), 0, copy=True),
          head, *_layer_entries(config, (*path, "transformer_layer"), prefix, (), 0,
                                blocks.layer_kind(config, config.base_num_decoder_layers + k - 1))]


def _layer_entries(config, prefix: tuple, hf_prefix: str, layers: tuple, first: int, kind, stride: int = 1) -> list:
  """A decoder layer's parameters under `prefix`, a layer of `kind` (blocks.LayerKind): a stack's,
  each [depth, ...] (layers (depth,), Hugging Face's layers first, first + stride, ...), or one
  layer's (layers (), its index in hf_prefix)."""
  dim, head_dim, family = config.base_emb_dim, config.head_dim, FAMILIES[config.decoder_block]

  def entry(path, name, shape, in_axes, stacked=layers, **options):
    return Entry((*prefix, *path), hf_prefix + name, stacked, shape, in_axes, first=first, stride=stride, **options)

  pre_norm = [] if config.post_norms else [entry(("pre_self_attention_norm", "scale"), "input_layernorm.weight",
                                                 (dim,), 0)]
  sinks = [entry(("self_attention", "sinks"), "self_attn.sinks", (config.base_num_query_heads,), 0)]
  attending = kind.mixer == "attention"
  mixer = ([*_attention_entries(config, entry), *(sinks if config.attention_sink else [])] if attending else
           _gdn_entries(config, entry))
  entries = [*mixer, *pre_norm,
             entry(("post_self_attention_norm", "scale"), "post_attention_layernorm.weight", (dim,), 0)]
  if kind.moe:
    (router, gate, up, down), hidden = family.hf_expert_names, config.base_moe_mlp_dim
    experts = layers + (config.num_experts,)
    part = lambda k, n: ({"part": (k, n), "strided": family.hf_fused_experts == "interleaved"}
                         if family.hf_fused_experts else {})
    entries += [entry(("moe_block", "gate", "kernel"), router, (dim, config.num_experts), 1),
                entry(("moe_block", "wi_0"), gate, (dim, hidden), 1, experts, **part(0, 2)),
                entry(("moe_block", "wi_1"), up, (dim, hidden), 1, experts, **part(1, 2)),
                entry(("moe_block", "wo"), down, (dim, hidden), 0, experts, **part(0, 1))]
    if config.mlp_bias:
      router_bias, gate_up_bias, down_bias = family.hf_expert_biases
      entries += [entry(("moe_block", "gate", "logit_bias"), router_bias, (config.num_experts,), 0),
                  entry(("moe_block", "wi_0_bias"), gate_up_bias, (hidden,), 0, experts, **part(0, 2)),
                  entry(("moe_block", "wi_1_bias"), gate_up_bias, (hidden,), 0, experts, **part(1, 2)),
                  entry(("moe_block", "wo_bias"), down_bias, (dim,), 0, experts, **part(0, 1))]
    if config.routed_bias:
      entries.append(entry(("moe_block", "gate", "bias"), family.hf_router_bias, (config.num_experts,), 0))
    if config.shared_experts:
      entries += _mlp_entries(entry, ("moe_block", "shared_experts"), family.hf_shared_experts, dim,
                              config.shared_experts * hidden)
    if config.shared_experts and config.shared_expert_gate:
      entries.append(entry(("moe_block", "shared_expert_gate", "kernel"), "mlp.shared_expert_gate.weight", (dim, 1), 1))
  else:
    entries += _mlp_entries(entry, ("mlp",), family.hf_mlp_prefix, dim, config.base_mlp_dim)
  if config.sandwich_norms:
    entries.append(entry(("pre_ffw_norm", "scale"), "pre_feedforward_layernorm.weight", (dim,), 0))
  if config.sandwich_norms or config.post_norms:
    entries.append(entry(("post_ffw_norm", "scale"), "post_feedforward_layernorm.weight", (dim,), 0))
  if config.qk_norm and attending:
    heads = (config.base_num_query_heads, config.base_num_kv_heads) if config.qk_norm_over_heads else (1, 1)
    entries += [entry(("self_attention", "query_norm", "scale"), "self_attn.q_norm.weight", (heads[0] * head_dim,), 0),
                entry(("self_attention", "key_norm", "scale"), "self_attn.k_norm.weight", (heads[1] * head_dim,), 0)]
  return entries


def _mlp_entries(entry, path: tuple, prefix: str, dim: int, width: int) -> list:
  """A SwiGLU MLP's (linears.MlpBlock) three kernels, Hugging Face's gate, up and down projections."""
  return [entry((*path, "wi_0", "kernel"), prefix + "gate_proj.weight", (dim, width), 1),
          entry((*path, "wi_1", "kernel"), prefix + "up_proj.weight", (dim, width), 1),
          entry((*path, "wo", "kernel"), prefix + "down_proj.weight", (dim, width), 0)]


def _gdn_entries(config, entry) -> list:
  """A Gated DeltaNet layer's parameters (layers/gated_delta_net.py), in Hugging Face's layouts."""
  dim, kh, vh, dk, dv = (config.base_emb_dim, config.gdn_num_key_heads, config.gdn_num_value_heads,
                         config.gdn_key_head_dim, config.gdn_value_head_dim)
  groups, channels, width = vh // kh, 2 * kh * dk + vh * dv, config.gdn_conv_kernel_dim
  layer = lambda *path: ("linear_attention", *path)
  return [entry(layer("in_proj_qkvz", "kernel"), "linear_attn.in_proj_qkvz.weight",
                (dim, kh, 2 * dk + 2 * groups * dv), 1),
          entry(layer("in_proj_ba", "kernel"), "linear_attn.in_proj_ba.weight", (dim, kh, 2 * groups), 1),
          entry(layer("conv1d"), "linear_attn.conv1d.weight", (width, channels), 1, hf_dims=(channels, 1, width)),
          entry(layer("A_log"), "linear_attn.A_log", (vh,), 0),
          entry(layer("dt_bias"), "linear_attn.dt_bias", (vh,), 0),
          entry(layer("norm", "scale"), "linear_attn.norm.weight", (dv,), 0),
          entry(layer("out_proj", "kernel"), "linear_attn.out_proj.weight", (vh, dv, dim), 2)]


def _attention_entries(config, entry) -> list:
  """The attention's projections: q, k, v and out (attention_type=global) or MLA's (DeepSeek's
  names), whose queries' and shared key's RoPE features Hugging Face keeps interleaved."""
  dim, heads, kv_heads, head_dim = (config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads,
                                    config.head_dim)
  attention = lambda *path: ("self_attention", *path)
  if config.attention_type == "global":
    pairs = head_dim if FAMILIES[config.decoder_block].hf_rope_interleaved else 0
    biases = [entry(attention(name, "bias"), f"self_attn.{hf}_proj.bias", (n, head_dim), 0, interleaved=rope,
                    flat=True) for name, hf, n, rope in (("query", "q", heads, pairs), ("key", "k", kv_heads, pairs),
                                                         ("value", "v", kv_heads, 0))]
    # With the output gate, each head's queries then its gates (Qwen3-Next's q_proj).
    query_width = head_dim * (2 if config.attention_output_gate else 1)
    return [entry(attention("query", "kernel"), "self_attn.q_proj.weight", (dim, heads, query_width), 1,
                  interleaved=pairs),
            entry(attention("key", "kernel"), "self_attn.k_proj.weight", (dim, kv_heads, head_dim), 1,
                  interleaved=pairs),
            entry(attention("value", "kernel"), "self_attn.v_proj.weight", (dim, kv_heads, head_dim), 1),
            entry(attention("out", "kernel"), "self_attn.o_proj.weight", (heads, head_dim, dim), 2),
            *((*biases, entry(attention("out", "bias"), "self_attn.o_proj.bias", (dim,), 0))
              if config.attention_bias else ())]
  rope, latent, rank = config.qk_rope_head_dim, config.kv_lora_rank, config.q_lora_rank
  qk = config.qk_nope_head_dim + rope
  query = ([entry(attention("wq_a", "kernel"), "self_attn.q_a_proj.weight", (dim, rank), 1),
            entry(attention("q_norm", "scale"), "self_attn.q_a_layernorm.weight", (rank,), 0),
            entry(attention("wq_b", "kernel"), "self_attn.q_b_proj.weight", (rank, heads, qk), 1, interleaved=rope)]
           if rank else
           [entry(attention("query", "kernel"), "self_attn.q_proj.weight", (dim, heads, qk), 1, interleaved=rope)])
  return [*query,
          entry(attention("wkv_a", "kernel"), "self_attn.kv_a_proj_with_mqa.weight", (dim, latent + rope), 1,
                interleaved=rope),
          entry(attention("kv_norm", "scale"), "self_attn.kv_a_layernorm.weight", (latent,), 0),
          entry(attention("wkv_b", "kernel"), "self_attn.kv_b_proj.weight",
                (latent, heads, config.qk_nope_head_dim + config.v_head_dim), 1),
          entry(attention("out", "kernel"), "self_attn.o_proj.weight", (heads, config.v_head_dim, dim), 2)]


def hf_names(config, entry) -> list:
  """The entry's Hugging Face names in the order of its stacked dimensions (layer-major; a
  name without {i} is one layer's, its stacked dimension the experts')."""
  layered = "{i}" in entry.name
  return [entry.name.format(**dict(zip("ie" if layered else "e",
                                       (index[0] * entry.stride + entry.first, *index[1:]) if layered else index)))
          for index in itertools.product(*map(range, entry.stack))]


def hf_shape(entry) -> tuple:
  """The shape of one of the entry's Hugging Face tensors: all experts' where they share one."""
  if entry.hf_dims:
    return entry.hf_dims
  shape, in_axes = entry.shape, entry.in_axes
  hf = (math.prod(shape[in_axes:]), math.prod(shape[:in_axes])) if in_axes else shape
  if entry.flat:
    return (math.prod(shape),)
  if entry.part:  # each expert's [out, in] (or [out]) transposed, its out features n times
    *rest, out = hf[::-1]
    return (entry.stack[-1], *rest, out * entry.part[1])
  return hf


def _expert_part(entry, read, name: str, index: tuple) -> np.ndarray:
  """Stacked element `index` (layer, expert) of a part entry, as Hugging Face's tensor of that
  expert alone would hold it ([out, in]), read from the layer's tensor of all experts."""
  (k, n), shape = entry.part, hf_shape(entry)
  if entry.strided:
    return read(name, (index[-1],))[..., k::n].T
  out = shape[-1] // n
  return read(name, (index[-1], *[slice(None)] * (len(shape) - 2), slice(k * out, (k + 1) * out))).T


def tensor_groups(config) -> list:
  """The layout's entries, those that are parts of the same Hugging Face tensors together (in
  part order), each other entry alone: what to_hf_tensors' results are joined over."""
  groups = {}
  for entry in layout(config):
    groups.setdefault((entry.name, entry.first, entry.stride) if entry.part else (entry.path, entry.name),
                      []).append(entry)
  return [sorted(group, key=lambda e: e.part) for group in groups.values()]


def joined(group: list, tensors: list) -> dict:
  """One layer's Hugging Face tensors from its group's to_hf_tensors results: the parts of a
  tensor joined along its last axis, one after the other or alternating (strided)."""
  if len(group) == 1:
    return tensors[0]
  if group[0].strided:
    join = lambda parts: np.stack(parts, axis=-1).reshape(*parts[0].shape[:-1], -1)
  else:
    join = lambda parts: np.concatenate(parts, axis=-1)
  return {name: np.ascontiguousarray(join([part[name] for part in tensors])) for name in tensors[0]}


def _layer(config, entry, layer) -> tuple:
  """(stacked dimensions, Hugging Face names) of the entry, or of its slice [layer]."""
  stack, names = entry.stack, hf_names(config, entry)
  if layer is None:
    return stack, names
  per_layer = len(names) // stack[0]
  return stack[1:], names[layer * per_layer:(layer + 1) * per_layer]


def _halves(n: int) -> np.ndarray:
  """Interleaved pair order -> halves: features (0, 2, 4, ..., 1, 3, 5, ...) of n."""
  return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def _reorder(entry, w, order) -> np.ndarray:
  """w with the entry's interleaved trailing features taken in `order`."""
  if not entry.interleaved:
    return w
  n = entry.interleaved
  return np.concatenate([w[..., :-n], w[..., -n:][..., order]], axis=-1)


def _from_hf(entry, tensor) -> np.ndarray:
  return _reorder(entry, tensor.T.reshape(entry.shape) if entry.in_axes else tensor.reshape(entry.shape),
                  _halves(entry.interleaved))


def to_param(config, entry, read, dtype, layer=None) -> np.ndarray:
  """One parameter of this project (layers, experts stacked), or its slice [layer], from its
  Hugging Face tensors, read one at a time with read(name), or read(name, region) for one expert's
  part of a tensor the experts share (a tuple of indices); dtype None keeps theirs."""
  stack, names = _layer(config, entry, layer)
  if not stack:  # one tensor: no copy of it, unless to another dtype
    tensor = read(names[0])
    return _from_hf(entry, tensor).astype(dtype or tensor.dtype, copy=False)
  out = None
  for index, name in zip(itertools.product(*map(range, stack)), names):
    tensor = _expert_part(entry, read, name, index) if entry.part else read(name)
    if out is None:
      out = np.empty(stack + entry.shape, dtype or tensor.dtype)
    out[index] = _from_hf(entry, tensor)
  return out


def to_hf_tensors(config, entry, param, layer=None) -> dict:
  """The inverse of to_param: {Hugging Face name: tensor} of one parameter or of its slice [layer]."""
  shape, in_axes = entry.shape, entry.in_axes
  convert = (lambda w: w.reshape(math.prod(shape[:in_axes]), -1).T) if in_axes else (lambda w: w)
  if entry.flat:
    convert = lambda w: w.reshape(-1)
  values = param.reshape(-1, *shape)
  inverse = np.argsort(_halves(entry.interleaved))
  names = _layer(config, entry, layer)[1]
  if entry.part:  # one tensor of all the layer's experts, [experts, in, out] (joined: the whole)
    return {names[0]: np.ascontiguousarray(np.stack([convert(value).T for value in values]))}
  if entry.hf_dims:
    convert = lambda w, convert=convert: convert(w).reshape(entry.hf_dims)
  return {name: np.ascontiguousarray(convert(_reorder(entry, value, inverse))) for name, value in zip(names, values)}


def hf_config(config, dtype: str) -> dict:
  """config.json for Hugging Face transformers, describing this config's model."""
  rope = {"rope_type": "default", "rope_theta": float(config.rope_max_timescale)}
  if config.rope_type == "llama3.1":
    rope.update(rope_type="llama3", factor=config.rope_scaling_factor, low_freq_factor=config.rope_low_freq_factor,
                high_freq_factor=config.rope_high_freq_factor,
                original_max_position_embeddings=config.rope_original_max_position)
  if config.rope_type == "yarn":
    rope.update(rope_type="yarn", factor=config.rope_scaling_factor,
                original_max_position_embeddings=config.rope_original_max_position, truncate=config.rope_truncate,
                **{key: getattr(config, key) or None for key in _YARN_ROPE_KEYS})
  if config.rope_linear_scaling_factor != 1:
    rope.update(rope_type="linear", factor=config.rope_linear_scaling_factor)
  if config.partial_rotary_factor != 1:
    rope.update(partial_rotary_factor=config.partial_rotary_factor)
  family = FAMILIES[config.decoder_block]
  local_base = float(config.local_rope_max_timescale or config.rope_max_timescale)
  local = {"rope_type": "default", "rope_theta": local_base} if config.local_rope_max_timescale else rope
  by_type = {"full_attention": rope, "sliding_attention": local}
  # Mixtral's intermediate_size is its experts' width.
  widths = {family.hf_dense_width_key: config.base_mlp_dim,
            **({family.hf_expert_width_key: config.base_moe_mlp_dim} if config.moe else {})}
  return {"architectures": [family.hf_architecture], "model_type": family.hf_model_type,
          "vocab_size": config.vocab_size, "hidden_size": config.base_emb_dim, **widths,
          "num_hidden_layers": config.base_num_decoder_layers,
          "num_attention_heads": config.base_num_query_heads, "num_key_value_heads": config.base_num_kv_heads,
          "head_dim": config.head_dim, family.hf_activation_key: family.hf_activation,
          "rms_norm_eps": config.normalization_layer_epsilon, "max_position_embeddings": config.max_target_length,
          "tie_word_embeddings": config.logits_via_embedding, "rope_theta": float(config.rope_max_timescale),
          "rope_scaling": rope if rope["rope_type"] != "default" else None,
          "rope_parameters": by_type if family.hf_rope_by_layer_type else rope,
          **({"rope_local_base_freq": local_base} if family.hf_rope_by_layer_type else {}),
          # dtype for transformers 5, torch_dtype for 4
          "attention_bias": config.attention_bias, "torch_dtype": dtype, "dtype": dtype,
          **({family.hf_activation_limit_key: config.mlp_activations_limit} if family.hf_activation_limit_key else {}),
          "query_pre_attn_scalar": query_scalar(config),
          "attn_logit_softcapping": config.attn_logits_soft_cap or None,
          "final_logit_softcapping": config.final_logits_soft_cap or None,
          "sliding_window": config.sliding_window_size or None, "layer_types": layer_types(config),
          "sliding_window_pattern": config.sliding_window_pattern,
          **(_mla_config(config) if config.attention_type == "mla" else {}),
          **(_llama4_config(config) if family.hf_llama4_attention else {}),
          **({name: getattr(config, key) for key, name in _GDN_KEYS.items()} if config.gated_delta_net else {}),
          **(_moe_config(config) if config.moe else {})}


def _llama4_config(config) -> dict:
  """config.json's Llama 4 attention keys, the NoPE layers listed (its no_rope_layers: 0 for none)."""
  return {"no_rope_layers": [int(not nope) for nope in _nope_layers(config)],
          "attention_chunk_size": config.chunk_attn_window_size or None,
          "attn_temperature_tuning": config.temperature_tuning, "attn_scale": config.temperature_tuning_scale,
          "floor_scale": config.temperature_tuning_floor, "use_qk_norm": config.use_qk_norm}


def _mla_config(config) -> dict:
  """config.json's latent-attention keys; transformers' head_dim is the RoPE width."""
  return {"q_lora_rank": config.q_lora_rank or None, "kv_lora_rank": config.kv_lora_rank,
          "qk_nope_head_dim": config.qk_nope_head_dim, "qk_rope_head_dim": config.qk_rope_head_dim,
          "v_head_dim": config.v_head_dim, "head_dim": config.qk_rope_head_dim, "rope_interleave": True}


def _moe_config(config) -> dict:
  """config.json's mixture-of-experts keys, Qwen3-MoE's and Mixtral's (every layer routed) and
  DeepSeek's (its routing)."""
  family = FAMILIES[config.decoder_block]
  deepseek = {"n_shared_experts": config.shared_experts, "first_k_dense_replace": config.first_num_dense_layers,
              "num_nextn_predict_layers": config.mtp_num_layers,
              "n_group": max(config.n_routing_groups, 1), "topk_group": max(config.topk_routing_group, 1),
              "routed_scaling_factor": config.routed_scaling_factor,
              **({"topk_method": family.hf_topk_method} if family.hf_topk_method else {})}
  return {family.hf_num_experts_key: config.num_experts, "num_experts_per_tok": config.num_experts_per_tok,
          "moe_intermediate_size": config.base_moe_mlp_dim, "norm_topk_prob": config.norm_topk_prob,
          "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": config.load_balance_loss_weight,
          **({family.hf_moe_step_key: config.interleave_moe_layer_step} if family.hf_moe_step_key else {}),
          **({family.hf_shared_expert_width_key: config.shared_experts * config.base_moe_mlp_dim}
             if family.hf_shared_expert_width_key else deepseek if family.hf_shared_experts else {})}


def check_exportable(config) -> None:
  """A config Hugging Face's class for its family cannot express is refused before anything is written."""
  family = FAMILIES[config.decoder_block]
  if config.mtp_num_layers and not family.hf_layers_after_last:
    raise errors.ConfigError(f"mtp_num_layers={config.mtp_num_layers}: {family.hf_architecture} has no multi-token "
                             "prediction layers")
  if config.attention_type != family.hf_attention_type:
    raise errors.ConfigError(f"attention_type={config.attention_type!r}: {family.hf_architecture} has "
                             f"{family.hf_attention_type!r} attention")
  if config.moe:
    # The class's routing: its score function and bias, and scaling, shared experts and dense
    # first layers only where it has shared experts (DeepSeek's), groups only where its
    # topk_method is not read (DeepSeek-V3's).
    routing = {"routed_score_func": "softmax", "routed_bias": False, **dict(family.hf_routing)}
    if not family.hf_shared_experts or family.hf_topk_method:
      routing.update(n_routing_groups=config.n_routing_groups if config.n_routing_groups <= 0 else -1,
                     topk_routing_group=config.topk_routing_group if config.topk_routing_group <= 0 else -1)
    if not family.hf_shared_experts:
      routing.update(routed_scaling_factor=1.0, shared_experts=0, first_num_dense_layers=0)
    if not family.hf_moe_step_key:
      routing.update(interleave_moe_layer_step=1)
    for key, want in routing.items():
      if getattr(config, key) != want:
        raise errors.ConfigError(f"{key}={getattr(config, key)!r}: {family.hf_architecture} routes with {key}={want!r}")
  for key, off in _LLAMA4_ATTENTION.items():
    if getattr(config, key) != off and not family.hf_llama4_attention:
      raise errors.ConfigError(f"{key}={getattr(config, key)!r}: {family.hf_architecture} has no such attention")
  has = {"attention_bias": family.hf_attention_bias, "attention_sink": family.hf_sinks}
  for key, takes in has.items():
    if getattr(config, key) and not takes:
      raise errors.ConfigError(f"{key}=True: {family.hf_architecture} has no such attention")
  if config.attention_sink != family.hf_sinks:
    raise errors.ConfigError(f"attention_sink={config.attention_sink}: {family.hf_architecture} always has sinks")
  if config.moe and config.mlp_bias != bool(family.hf_expert_biases):
    raise errors.ConfigError(f"mlp_bias={config.mlp_bias}: {family.hf_architecture}'s experts "
                             f"{'always have' if family.hf_expert_biases else 'have no'} biases")
  if (config.mlp_activations_limit > 0) != bool(family.hf_activation_limit_key):
    clamps = "always clamps" if family.hf_activation_limit_key else "has no clamp on"
    raise errors.ConfigError(f"mlp_activations_limit={config.mlp_activations_limit}: {family.hf_architecture} "
                             f"{clamps} its gated unit")
  if config.partial_rotary_factor != 1 and not family.hf_partial_rotary:
    raise errors.ConfigError(f"partial_rotary_factor={config.partial_rotary_factor}: {family.hf_architecture} "
                             "rotates every feature of a head")
  if family.hf_shared_expert_width_key and not config.shared_experts:
    raise errors.ConfigError(f"shared_experts=0: {family.hf_architecture} always has a shared expert")
  if config.rope_linear_scaling_factor != 1 and config.rope_type != "default":
    raise errors.ConfigError(f"rope_linear_scaling_factor={config.rope_linear_scaling_factor}: config.json holds "
                             f"one RoPE scaling, and rope_type={config.rope_type!r} is another")
  if config.sliding_window_size and config.local_rope_max_timescale and not family.hf_rope_by_layer_type:
    raise errors.ConfigError(f"local_rope_max_timescale={config.local_rope_max_timescale}: {family.hf_architecture} "
                             "gives its sliding and global layers one RoPE; export with local_rope_max_timescale=0 "
                             "or as a family with a RoPE per layer type (gemma3)")
  if family.hf_norm_topk_prob not in (None, config.norm_topk_prob):
    raise errors.ConfigError(f"norm_topk_prob={config.norm_topk_prob}: {family.hf_architecture} fixes it at "
                             f"{family.hf_norm_topk_prob}; export with norm_topk_prob={family.hf_norm_topk_prob} "
                             "or as a family whose config.json says it")


def read_config(hf_path: str) -> dict:
  path = os.path.join(hf_path, "config.json")
  if not os.path.isfile(path):
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: no config.json (expected a Hugging Face model "
                             "directory: config.json and *.safetensors)")
  try:
    with open(path) as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: config.json is not valid JSON ({e})") from None
  if not isinstance(config, dict):
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: config.json holds a {type(config).__name__}, not the "
                             "model's settings")
  return config


def tensor_index(hf_path: str) -> dict:
  """{name: (file, shape, dtype, name in the file)} of a Hugging Face model directory's tensors,
  sharded (model.safetensors.index.json) or not, from the files' headers; of a multimodal
  model's, its language model's alone, named as its causal-LM class names them."""
  index = os.path.join(hf_path, "model.safetensors.index.json")
  if os.path.isfile(index):
    try:
      with open(index) as f:
        files = sorted({os.path.join(hf_path, file) for file in json.load(f)["weight_map"].values()})
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: model.safetensors.index.json has no weight_map of "
                               f"tensor names to files ({type(e).__name__}: {errors.first_line(e)})") from None
    missing = [os.path.basename(file) for file in files if not os.path.isfile(file)]
    if missing:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: incomplete, model.safetensors.index.json lists "
                               f"{missing[0]}, which is not there ({len(missing)} of {len(files)} files missing)")
  else:
    files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
  if not files:
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: no *.safetensors files (expected a Hugging Face "
                             "model directory: config.json and *.safetensors)")
  tensors = {}
  for file in files:
    try:
      with safe_open(file, framework="numpy") as handle:
        for name in handle.keys():
          header = handle.get_slice(name)
          tensors[name] = (file, tuple(header.get_shape()), header.get_dtype(), name)
    except Exception as e:  # safetensors raises its own error types for truncated or foreign files
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: {os.path.basename(file)} is not a readable "
                               f"safetensors file ({errors.first_line(e)})") from None
  if _multimodal_family(read_config(hf_path)):
    tensors = {causal + name[len(prefix):]: value for name, value in tensors.items()
               for prefix, causal in LANGUAGE_MODEL_PREFIXES.items() if name.startswith(prefix)}
  return _mxfp4_pairs(tensors, hf_path)


# An MXFP4 tensor (GPT-OSS's published experts): NAME_blocks [..., out, G, 16] bytes, each two
# 4-bit values (E2M1: FP4_VALUES[nibble], the low nibble first), and NAME_scales [..., out, G] bytes,
# each block of 32 values' power of two plus 127; transformers dequantizes it to NAME [..., G * 32, out].
MXFP4 = "MXFP4"
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def _mxfp4_pairs(tensors: dict, hf_path: str) -> dict:
  """The index with each MXFP4 pair as the one tensor it dequantizes to, its entry (None, its
  shape, MXFP4, (the blocks' entry, the scales' entry)); a pair whose halves do not match is a
  config error naming the tensor."""
  for packed in [name for name in tensors if name.endswith("_blocks")]:
    name = packed[:-len("_blocks")]
    scales = name + "_scales"
    if scales not in tensors:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {packed} (MXFP4) has no {scales}")
    (_, block_shape, block_type, _), (_, scale_shape, scale_type, _) = tensors[packed], tensors[scales]
    if block_type != "U8" or scale_type != "U8" or len(block_shape) < 3 or block_shape[-1] != 16:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensors {packed} and {scales} are {block_type} "
                               f"{block_shape} and {scale_type} {scale_shape}, not MXFP4 (bytes [..., G, 16] and "
                               "[..., G])")
    if block_shape[:-1] != scale_shape:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {scales} has shape {scale_shape}, not its "
                               f"blocks' {block_shape[:-1]} ({packed}, MXFP4)")
    *prefix, out, groups, _ = block_shape
    tensors[name] = (None, (*prefix, groups * 32, out), MXFP4, (tensors.pop(packed), tensors.pop(scales)))
  return tensors


def dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 blocks [..., out, G, 16] and scales [..., out, G] -> bfloat16 [..., G * 32, out], as
  transformers' convert_moe_packed_tensors."""
  values = np.stack([FP4_VALUES[blocks & 15], FP4_VALUES[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
  values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
  return np.swapaxes(values.reshape(*blocks.shape[:-2], -1), -1, -2).astype(ml_dtypes.bfloat16)


DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,  # safetensors' names
          MXFP4: ml_dtypes.bfloat16}  # dequantized as transformers does


def tensor_dtype(tensors: dict, name: str) -> np.dtype:
  return np.dtype(DTYPES[tensors[name][2]])


def _read(entry: tuple, region: tuple | None) -> np.ndarray:
  with safe_open(entry[0], framework="numpy") as handle:
    return handle.get_tensor(entry[3]) if region is None else handle.get_slice(entry[3])[region]


def read_tensor(tensors: dict, name: str, region: tuple | None = None) -> np.ndarray:
  """One tensor, or its `region` (a tuple of indices) alone, copied out of its file, which is
  closed again: the file's pages read so far do not stay mapped, so memory holds what is being
  converted, not the whole model. An MXFP4 tensor's region is dequantized from the blocks and
  scales of its first index (an expert's) alone."""
  if tensors[name][2] != MXFP4:
    return _read(tensors[name], region)
  blocks, scales = tensors[name][3]
  first = None if region is None else region[:1]
  whole = dequantized(_read(blocks, first), _read(scales, first))
  return whole if region is None else whole[(Ellipsis,) if len(region) == 1 else (Ellipsis, *region[1:])]


def _after_last_layer(config, name: str) -> bool:
  """A tensor of a layer after the last where the family's checkpoints keep their multi-token
  prediction block there (DeepSeek's), past the mtp_num_layers this config trains: not imported."""
  layer = re.match(r"model\.layers\.(\d+)\.", name)
  return FAMILIES[config.decoder_block].hf_layers_after_last and bool(layer) and int(layer[1]) >= (
      config.base_num_decoder_layers + config.mtp_num_layers)


def check_tensors(config, tensors: dict, hf_path: str) -> None:
  """Every tensor the config's model needs is there with its shape, and nothing else is."""
  wanted = {}
  for entry in layout(config):
    wanted.update(dict.fromkeys(hf_names(config, entry), hf_shape(entry)))
  for name, shape in wanted.items():
    if name not in tensors:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {name} is missing")
    found = tensors[name][1]
    if found != tuple(shape):
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {name} has shape {found}, expected {shape}")
    if tensors[name][2] not in DTYPES:
      raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {name} is {tensors[name][2]}, expected one of "
                               f"{', '.join(DTYPES)}")
  tied_head = {"lm_head.weight"} if config.logits_via_embedding else set()
  extra = [n for n in tensors if n not in wanted and n not in tied_head and not n.endswith(IGNORED_SUFFIXES)
           and not _after_last_layer(config, n)]
  if extra:
    architecture = FAMILIES[config.decoder_block].hf_architecture
    raise errors.ConfigError(f"hf_model_path={hf_path!r}: tensor {extra[0]} is not part of a {architecture} of this "
                             f"shape ({len(extra)} such tensors)")
