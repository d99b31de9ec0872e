"""Hugging Face weights <-> this project's checkpoints.

Import, to a checkpoint that `load_parameters_path` starts a run from:
  python -m MaxText.convert_hf_checkpoint configs/base.yml model_name=qwen3-0.6b \\
    hf_path=DIR output_path=DIR [key=value ...]
Export, a checkpoint (a step directory of any run) to a Hugging Face model directory:
  python -m MaxText.convert_hf_checkpoint configs/base.yml model_name=qwen3-0.6b \\
    load_parameters_path=RUN/checkpoints/STEP output_path=DIR

hf_path is a Hugging Face model directory (config.json and *.safetensors, as
`save_pretrained` or `huggingface-cli download` leave it) of a LlamaForCausalLM (Llama 2,
3, 3.1, 3.2), Qwen3ForCausalLM or Gemma2ForCausalLM. Its shape must be the config's
(vocabulary, widths, heads, layers, tied head, RoPE base and scaling, soft caps, query scale,
sliding window, family): a mismatch is one line naming the key, exit 2, nothing written.
Then: python -m MaxText.train ... load_parameters_path=OUTPUT_PATH (same model keys).
"""

import functools
import glob
import json
import math
import os
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import app
from safetensors.numpy import load_file, save_file

from MaxText import checkpointing, metrics, pyconfig

# decoder_block -> (Hugging Face architecture, model_type, name of its activation key, activation)
FAMILIES = {"llama2": ("LlamaForCausalLM", "llama", "hidden_act", "silu"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3", "hidden_act", "silu"),
            "gemma2": ("Gemma2ForCausalLM", "gemma2", "hidden_activation", "gelu_pytorch_tanh")}
ARCHITECTURES = {architecture: block for block, (architecture, *_) in FAMILIES.items()}


def layer_types(config) -> list:
  """Hugging Face's per-layer attention kinds for this config (sliding on even layers)."""
  return ["sliding_attention" if config.sliding_window_size and i % 2 == 0 else "full_attention"
          for i in range(config.base_num_decoder_layers)]


def _expected(config) -> dict:
  """config.json's values for this config, by the config key each one checks."""
  return {"decoder_block": config.decoder_block, "vocab_size": config.vocab_size,
          "base_emb_dim": config.base_emb_dim, "base_mlp_dim": config.base_mlp_dim,
          "base_num_query_heads": config.base_num_query_heads, "base_num_kv_heads": config.base_num_kv_heads,
          "base_num_decoder_layers": config.base_num_decoder_layers, "head_dim": config.head_dim,
          "logits_via_embedding": config.logits_via_embedding, "rope_max_timescale": float(config.rope_max_timescale),
          "normalization_layer_epsilon": config.normalization_layer_epsilon, "rope_type": config.rope_type,
          "attn_logits_soft_cap": config.attn_logits_soft_cap, "final_logits_soft_cap": config.final_logits_soft_cap,
          "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
          "sliding_window_size": config.sliding_window_size,
          **({"rope_scaling_factor": config.rope_scaling_factor, "rope_low_freq_factor": config.rope_low_freq_factor,
              "rope_high_freq_factor": config.rope_high_freq_factor,
              "rope_original_max_position": config.rope_original_max_position}
             if config.rope_type == "llama3.1" else {})}


def _found(hf: dict) -> dict:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  kinds = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
  window = 0
  if "sliding_attention" in kinds:
    alternating = [("full_attention", "sliding_attention")[i % 2 == 0] for i in range(len(kinds))]
    window = (hf["sliding_window"] if kinds == alternating
              else f"layer_types {kinds} (supported: sliding on even layers only)")
  return {"decoder_block": ARCHITECTURES.get((hf.get("architectures") or ["?"])[0], hf.get("architectures")),
          "vocab_size": hf["vocab_size"], "base_emb_dim": hf["hidden_size"], "base_mlp_dim": hf["intermediate_size"],
          "base_num_query_heads": hf["num_attention_heads"],
          "base_num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
          "base_num_decoder_layers": hf["num_hidden_layers"],
          "head_dim": head_dim,
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
          "rope_max_timescale": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
          "normalization_layer_epsilon": hf["rms_norm_eps"],
          "rope_type": {"default": "default", "llama3": "llama3.1"}.get(rope_type, f"{rope_type} (not supported)"),
          "rope_scaling_factor": rope.get("factor"), "rope_low_freq_factor": rope.get("low_freq_factor"),
          "rope_high_freq_factor": rope.get("high_freq_factor"),
          "rope_original_max_position": rope.get("original_max_position_embeddings"),
          "attn_logits_soft_cap": float(hf.get("attn_logit_softcapping") or 0),
          "final_logits_soft_cap": float(hf.get("final_logit_softcapping") or 0),
          "query_pre_attn_scalar": hf.get("query_pre_attn_scalar") or head_dim, "sliding_window_size": window}


def check_shape(config, hf: dict, hf_path: str) -> None:
  found = _found(hf)
  for key, want in _expected(config).items():
    if found[key] != want:
      raise pyconfig.ConfigError(f"{key}={want!r}: {hf_path}/config.json has {found[key]!r} (set {key}, or pick "
                                 "the model_name of that model)")


def _layout(config):
  """(path in this project's parameter tree, Hugging Face name, per layer, this project's shape
  (of one layer), input axes of a linear weight or 0 for a tensor copied as it is). Hugging
  Face keeps linear weights [out, in]; here they are [in..., out...] kernels."""
  dim, heads, kv_heads, head_dim = (config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads,
                                    config.head_dim)
  attention, layer = ("decoder", "layers", "self_attention"), "model.layers.{i}."
  entries = [
      (("token_embedder", "embedding"), "model.embed_tokens.weight", False, (config.vocab_size, dim), 0),
      (("decoder", "decoder_norm", "scale"), "model.norm.weight", False, (dim,), 0),
      ((*attention, "query", "kernel"), layer + "self_attn.q_proj.weight", True, (dim, heads, head_dim), 1),
      ((*attention, "key", "kernel"), layer + "self_attn.k_proj.weight", True, (dim, kv_heads, head_dim), 1),
      ((*attention, "value", "kernel"), layer + "self_attn.v_proj.weight", True, (dim, kv_heads, head_dim), 1),
      ((*attention, "out", "kernel"), layer + "self_attn.o_proj.weight", True, (heads, head_dim, dim), 2),
      (("decoder", "layers", "mlp", "wi_0", "kernel"), layer + "mlp.gate_proj.weight", True, (dim, config.base_mlp_dim), 1),
      (("decoder", "layers", "mlp", "wi_1", "kernel"), layer + "mlp.up_proj.weight", True, (dim, config.base_mlp_dim), 1),
      (("decoder", "layers", "mlp", "wo", "kernel"), layer + "mlp.down_proj.weight", True, (config.base_mlp_dim, dim), 1),
      (("decoder", "layers", "pre_self_attention_norm", "scale"), layer + "input_layernorm.weight", True, (dim,), 0),
      (("decoder", "layers", "post_self_attention_norm", "scale"), layer + "post_attention_layernorm.weight", True,
       (dim,), 0),
  ]
  if config.sandwich_norms:
    entries += [(("decoder", "layers", "pre_ffw_norm", "scale"), layer + "pre_feedforward_layernorm.weight", True,
                 (dim,), 0),
                (("decoder", "layers", "post_ffw_norm", "scale"), layer + "post_feedforward_layernorm.weight", True,
                 (dim,), 0)]
  if config.qk_norm:
    entries += [((*attention, "query_norm", "scale"), layer + "self_attn.q_norm.weight", True, (head_dim,), 0),
                ((*attention, "key_norm", "scale"), layer + "self_attn.k_norm.weight", True, (head_dim,), 0)]
  if not config.logits_via_embedding:
    entries.append((("logits_kernel",), "lm_head.weight", False, (dim, config.vocab_size), 1))
  return entries


def to_params(config, tensors: dict) -> dict:
  """Hugging Face tensors -> this project's parameter tree (layers stacked on a leading axis)."""
  params = {}
  for path, name, per_layer, shape, in_axes in _layout(config):
    convert = (lambda w: w.T.reshape(shape)) if in_axes else (lambda w: w)  # noqa: B023 (used at once)
    value = (np.stack([convert(tensors[name.format(i=i)]) for i in range(config.base_num_decoder_layers)])
             if per_layer else convert(tensors[name]))
    node = params
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = np.ascontiguousarray(value, dtype=jnp.dtype(config.weight_dtype))
  return params


def from_params(config, params) -> dict:
  """This project's parameter tree -> Hugging Face tensors, the inverse of to_params."""
  tensors = {}
  for path, name, per_layer, shape, in_axes in _layout(config):
    value = np.asarray(functools.reduce(lambda node, key: node[key], path, params))
    convert = (lambda w: w.reshape(math.prod(shape[:in_axes]), -1).T) if in_axes else (lambda w: w)  # noqa: B023
    if per_layer:
      tensors.update({name.format(i=i): np.ascontiguousarray(convert(value[i])) for i in range(len(value))})
    else:
      tensors[name] = np.ascontiguousarray(convert(value))
  return tensors


def hf_config(config) -> dict:
  """config.json for Hugging Face transformers, describing this config's model."""
  rope = {"rope_type": "default", "rope_theta": float(config.rope_max_timescale)}
  if config.rope_type == "llama3.1":
    rope.update(rope_type="llama3", factor=config.rope_scaling_factor, low_freq_factor=config.rope_low_freq_factor,
                high_freq_factor=config.rope_high_freq_factor,
                original_max_position_embeddings=config.rope_original_max_position)
  architecture, model_type, activation_key, activation = FAMILIES[config.decoder_block]
  return {"architectures": [architecture], "model_type": model_type,
          "vocab_size": config.vocab_size, "hidden_size": config.base_emb_dim,
          "intermediate_size": config.base_mlp_dim, "num_hidden_layers": config.base_num_decoder_layers,
          "num_attention_heads": config.base_num_query_heads, "num_key_value_heads": config.base_num_kv_heads,
          "head_dim": config.head_dim, activation_key: activation, "rms_norm_eps": config.normalization_layer_epsilon,
          "max_position_embeddings": config.max_target_length, "tie_word_embeddings": config.logits_via_embedding,
          "rope_theta": float(config.rope_max_timescale), "rope_scaling": rope if config.rope_type != "default" else None,
          "rope_parameters": rope, "attention_bias": False, "torch_dtype": config.weight_dtype,
          "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
          "attn_logit_softcapping": config.attn_logits_soft_cap or None,
          "final_logit_softcapping": config.final_logits_soft_cap or None,
          "sliding_window": config.sliding_window_size or None, "layer_types": layer_types(config)}


def read(hf_path: str) -> tuple[dict, dict]:
  """(config.json, every tensor of the *.safetensors files) of a Hugging Face model directory."""
  files = sorted(glob.glob(os.path.join(hf_path, "*.safetensors")))
  if not os.path.isfile(os.path.join(hf_path, "config.json")) or not files:
    raise pyconfig.ConfigError(f"hf_path={hf_path!r}: expected a Hugging Face model directory "
                               "(config.json and *.safetensors)")
  with open(os.path.join(hf_path, "config.json")) as f:
    hf = json.load(f)
  tensors = {}
  for path in files:
    tensors.update(load_file(path))
  return hf, tensors


def _tool_args(argv) -> tuple[list, dict]:
  """Splits hf_path= and output_path= (this tool's) from the config's key=value arguments."""
  ours = {a.partition("=")[0]: a.partition("=")[2] for a in argv if a.partition("=")[0] in ("hf_path", "output_path")}
  if not ours.get("output_path"):
    raise pyconfig.ConfigError("output_path=...: required")
  if os.path.exists(ours["output_path"]):
    raise pyconfig.ConfigError(f"output_path={ours['output_path']!r}: exists; give a new directory")
  return [a for a in argv if a.partition("=")[0] not in ours], ours


def import_hf(config, hf_path: str, output_path: str) -> None:
  hf, tensors = read(hf_path)
  check_shape(config, hf, hf_path)
  params = to_params(config, tensors)
  ocp.PyTreeCheckpointer().save(os.path.abspath(output_path), {"params": params})
  print(f"wrote {sum(w.size for w in jax.tree.leaves(params)):,} parameters to {output_path}; train with "
        f"load_parameters_path={output_path}", file=sys.stderr)


def export_hf(config, output_path: str) -> None:
  """Written into a temporary directory renamed when complete: never half a model."""
  tensors = from_params(config, jax.device_get(checkpointing.load_model_parameters(config, config.load_parameters_path)))
  partial = f"{output_path}.partial"
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(partial)
  save_file(tensors, os.path.join(partial, "model.safetensors"))
  with open(os.path.join(partial, "config.json"), "w") as f:
    json.dump(hf_config(config), f, indent=2)
  os.replace(partial, output_path)
  print(f"wrote {len(tensors)} tensors to {output_path} (Hugging Face {hf_config(config)['architectures'][0]})",
        file=sys.stderr)


def main(argv):
  metrics.quiet_library_logs()
  with pyconfig.errors_to_exit_codes():
    config_args, paths = _tool_args(argv[1:])
    config = pyconfig.initialize(config_args)
    if paths.get("hf_path"):
      import_hf(config, paths["hf_path"], paths["output_path"])
    elif config.load_parameters_path:
      export_hf(config, paths["output_path"])
    else:
      raise pyconfig.ConfigError("hf_path=...: required to import (or load_parameters_path=... to export a "
                                 "checkpoint to Hugging Face)")


if __name__ == "__main__":
  app.run(main)
