"""Hugging Face weights -> a checkpoint that `load_parameters_path` starts a run from:

  python -m MaxText.convert_hf_checkpoint configs/base.yml model_name=qwen3-0.6b \\
    hf_path=DIR output_path=DIR [key=value ...]

hf_path is a Hugging Face model directory (config.json and *.safetensors, as
`save_pretrained` or `huggingface-cli download` leave it) of a LlamaForCausalLM (Llama 2,
3, 3.1, 3.2) or Qwen3ForCausalLM. Its shape must be the config's (vocabulary, widths, heads,
layers, tied head, RoPE base and scaling, family): a mismatch is one line naming the key,
exit 2, nothing written.
Then: python -m MaxText.train ... load_parameters_path=OUTPUT_PATH (same model keys).
"""

import glob
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import app
from safetensors.numpy import load_file

from MaxText import metrics, pyconfig

# Hugging Face architecture -> decoder_block
ARCHITECTURES = {"LlamaForCausalLM": "llama2", "Qwen3ForCausalLM": "qwen3"}


def _expected(config) -> dict:
  """config.json's values for this config, by the config key each one checks."""
  return {"decoder_block": config.decoder_block, "vocab_size": config.vocab_size,
          "base_emb_dim": config.base_emb_dim, "base_mlp_dim": config.base_mlp_dim,
          "base_num_query_heads": config.base_num_query_heads, "base_num_kv_heads": config.base_num_kv_heads,
          "base_num_decoder_layers": config.base_num_decoder_layers, "head_dim": config.head_dim,
          "logits_via_embedding": config.logits_via_embedding, "rope_max_timescale": float(config.rope_max_timescale),
          "normalization_layer_epsilon": config.normalization_layer_epsilon, "rope_type": config.rope_type,
          **({"rope_scaling_factor": config.rope_scaling_factor, "rope_low_freq_factor": config.rope_low_freq_factor,
              "rope_high_freq_factor": config.rope_high_freq_factor,
              "rope_original_max_position": config.rope_original_max_position}
             if config.rope_type == "llama3.1" else {})}


def _found(hf: dict) -> dict:
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  return {"decoder_block": ARCHITECTURES.get((hf.get("architectures") or ["?"])[0], hf.get("architectures")),
          "vocab_size": hf["vocab_size"], "base_emb_dim": hf["hidden_size"], "base_mlp_dim": hf["intermediate_size"],
          "base_num_query_heads": hf["num_attention_heads"],
          "base_num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
          "base_num_decoder_layers": hf["num_hidden_layers"],
          "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
          "logits_via_embedding": bool(hf.get("tie_word_embeddings", False)),
          "rope_max_timescale": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
          "normalization_layer_epsilon": hf["rms_norm_eps"],
          "rope_type": {"default": "default", "llama3": "llama3.1"}.get(rope_type, f"{rope_type} (not supported)"),
          "rope_scaling_factor": rope.get("factor"), "rope_low_freq_factor": rope.get("low_freq_factor"),
          "rope_high_freq_factor": rope.get("high_freq_factor"),
          "rope_original_max_position": rope.get("original_max_position_embeddings")}


def check_shape(config, hf: dict, hf_path: str) -> None:
  found = _found(hf)
  for key, want in _expected(config).items():
    if found[key] != want:
      raise pyconfig.ConfigError(f"{key}={want!r}: {hf_path}/config.json has {found[key]!r} (set {key}, or pick "
                                 "the model_name of that model)")


def to_params(config, tensors: dict) -> dict:
  """Hugging Face tensors ([out, in] linear weights, one set per layer) -> this project's
  parameter tree ([in, ...out] kernels, layers stacked on a leading axis)."""
  heads, kv_heads, head_dim, dim = (config.base_num_query_heads, config.base_num_kv_heads, config.head_dim,
                                    config.base_emb_dim)

  def layers(name, convert=lambda w: w):
    return np.stack([convert(tensors[f"model.layers.{i}.{name}"]) for i in range(config.base_num_decoder_layers)])

  attention = {
      "query": {"kernel": layers("self_attn.q_proj.weight", lambda w: w.T.reshape(dim, heads, head_dim))},
      "key": {"kernel": layers("self_attn.k_proj.weight", lambda w: w.T.reshape(dim, kv_heads, head_dim))},
      "value": {"kernel": layers("self_attn.v_proj.weight", lambda w: w.T.reshape(dim, kv_heads, head_dim))},
      "out": {"kernel": layers("self_attn.o_proj.weight", lambda w: w.T.reshape(heads, head_dim, dim))},
  }
  if config.qk_norm:
    attention["query_norm"] = {"scale": layers("self_attn.q_norm.weight")}
    attention["key_norm"] = {"scale": layers("self_attn.k_norm.weight")}
  params = {
      "token_embedder": {"embedding": tensors["model.embed_tokens.weight"]},
      "decoder": {
          "layers": {
              "self_attention": attention,
              "mlp": {"wi_0": {"kernel": layers("mlp.gate_proj.weight", np.transpose)},
                      "wi_1": {"kernel": layers("mlp.up_proj.weight", np.transpose)},
                      "wo": {"kernel": layers("mlp.down_proj.weight", np.transpose)}},
              "pre_self_attention_norm": {"scale": layers("input_layernorm.weight")},
              "post_self_attention_norm": {"scale": layers("post_attention_layernorm.weight")},
          },
          "decoder_norm": {"scale": tensors["model.norm.weight"]},
      },
  }
  if not config.logits_via_embedding:
    params["logits_kernel"] = tensors["lm_head.weight"].T
  return jax.tree.map(lambda w: np.ascontiguousarray(w, dtype=jnp.dtype(config.weight_dtype)), params)


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
  for key in ("hf_path", "output_path"):
    if not ours.get(key):
      raise pyconfig.ConfigError(f"{key}=...: required")
  if os.path.exists(ours["output_path"]):
    raise pyconfig.ConfigError(f"output_path={ours['output_path']!r}: exists; give a new directory")
  return [a for a in argv if a.partition("=")[0] not in ours], ours


def main(argv):
  metrics.quiet_library_logs()
  with pyconfig.errors_to_exit_codes():
    config_args, paths = _tool_args(argv[1:])
    config = pyconfig.initialize(config_args)
    hf, tensors = read(paths["hf_path"])
    check_shape(config, hf, paths["hf_path"])
    params = to_params(config, tensors)
  ocp.PyTreeCheckpointer().save(os.path.abspath(paths["output_path"]), {"params": params})
  count = sum(w.size for w in jax.tree.leaves(params))
  print(f"wrote {count:,} parameters to {paths['output_path']}; train with load_parameters_path={paths['output_path']}",
        file=sys.stderr)


if __name__ == "__main__":
  app.run(main)
