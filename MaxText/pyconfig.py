"""Configuration: configs/base.yml, then configs/models/<model_name>.yml, then the model keys
saved with load_parameters_path's checkpoint, then key=value.

base.yml is the schema: every key, its default and its type. Overrides are parsed to the
type of the default, checked, and the derived values are computed once. The result is a
read-only `Config`; any bad input raises `ConfigError`, whose message is one line naming
the key and what is allowed. runtime.run turns it into exit code 2.
"""

import math
import os
from types import MappingProxyType
from typing import Any, Sequence

import yaml
from absl import logging

from MaxText import accelerators, checkpointing, losses, remat, sharding
from MaxText.errors import ConfigError, first_line
from MaxText.families import FAMILIES
from MaxText.input_pipeline.input_pipeline import DATASET_TYPES
from MaxText.layers.attentions import ATTENTIONS, FLASH_KERNELS
from MaxText.layers.context_parallel import SHARD_KERNELS, STRATEGIES

DTYPES = ("float32", "bfloat16", "float16")
# The keys that fix the parameters' shapes and meaning. Saved with a checkpoint (the converters'
# model.yml, a run's config.yml), they come with load_parameters_path: see saved_model_keys.
MODEL_KEYS = ("decoder_block", "vocab_size", "base_emb_dim", "base_mlp_dim", "base_num_query_heads",
              "base_num_kv_heads", "base_num_decoder_layers", "head_dim", "logits_via_embedding",
              "rope_max_timescale", "rope_type", "rope_scaling_factor", "rope_low_freq_factor",
              "rope_high_freq_factor", "rope_original_max_position", "normalization_layer_epsilon",
              "attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar", "sliding_window_size",
              "num_experts", "num_experts_per_tok", "base_moe_mlp_dim", "norm_topk_prob")
MODEL_KEYS_FILE = "model.yml"
# Keys that are gone, -> what replaces them: the one sequence-sharding axis is `context`.
RENAMED_KEYS = {"ici_sequence_parallelism": "ici_context_parallelism",
                "dcn_sequence_parallelism": "dcn_context_parallelism"}
class Config:
  """Read-only attribute access to the resolved keys."""

  __slots__ = ("_values",)

  def __init__(self, values: dict):
    object.__setattr__(self, "_values", MappingProxyType(dict(values)))

  def __getattr__(self, key):
    try:
      return self._values[key]
    except KeyError:
      raise AttributeError(f"config has no key {key!r}") from None

  def __setattr__(self, key, value):
    raise AttributeError(f"config is read-only (tried to set {key!r})")

  def to_dict(self) -> dict:
    return dict(self._values)

  def __reduce__(self):  # to the planner's worker processes
    return Config, (dict(self._values),)


# The shipped schema: every key and its type. Any config file's values are checked against it.
SCHEMA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
_INT_LIMIT = 2**31 - 1  # JAX's default integers are 32-bit: a larger step, size or seed overflows on device


def load_yaml(path: str) -> dict:
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  try:
    with open(path) as f:
      values = yaml.safe_load(f) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {path!r} is not valid YAML: {first_line(e)}") from None
  if not isinstance(values, dict):
    raise ConfigError(f"config file {path!r} must be a mapping of key: value")
  return values


def type_name(default) -> str:
  return {bool: "a bool (true/false)", int: "an integer", float: "a number", str: "a string",
          list: "a list"}[type(default)]


def _coerce(key: str, value: Any, default: Any) -> Any:
  """`value` (from YAML or a command-line string) as the type of `default`."""
  kind = type(default)
  if isinstance(value, str) and kind is not str:
    try:
      if kind is bool:
        if value.lower() not in ("true", "false"):
          raise ValueError
        value = value.lower() == "true"
      elif kind in (int, float):
        value = kind(value)  # Python's parser: YAML 1.1 would read "1e-3" as a string.
      else:
        value = yaml.safe_load(value)
    except (ValueError, yaml.YAMLError):
      raise ConfigError(f"{key}={value}: must be {type_name(default)}") from None
  ok = (
      (kind is bool and isinstance(value, bool))
      or (kind is int and isinstance(value, int) and not isinstance(value, bool))
      or (kind is float and isinstance(value, (int, float)) and not isinstance(value, bool))
      or (kind is str and isinstance(value, str))
      or (kind is list and isinstance(value, list))
  )
  if not ok:
    raise ConfigError(f"{key}={value!r}: must be {type_name(default)}")
  if kind is int and abs(value) > _INT_LIMIT:
    raise ConfigError(f"{key}={value}: must be at most {_INT_LIMIT} in magnitude")
  if kind is float and not math.isfinite(value):
    raise ConfigError(f"{key}={value}: must be a finite number")
  return float(value) if kind is float else value


def _load_config(path: str, depth: int = 0) -> dict:
  """The keys of config file `path`, each checked against the schema's type: over those of the
  file its `base_config` names (relative to it), as in MaxText, or else all of them itself."""
  values = load_yaml(path)
  base = values.pop("base_config", None)
  if base is None:
    schema = values if os.path.abspath(path) == SCHEMA else load_yaml(SCHEMA)
    missing = [key for key in schema if key not in values]
    if missing:
      raise ConfigError(f"config file {path!r} lacks {len(missing)} of the keys of {SCHEMA} (first: {missing[0]!r}); "
                        "give configs/base.yml first, or start the file with `base_config: base.yml` (its path "
                        "relative to the file) to take the keys it does not set from there")
    resolved = dict(schema)
  else:
    if not isinstance(base, str) or depth >= 8:
      raise ConfigError(f"config file {path!r}: base_config={base!r} must name a config file (at most 8 deep)")
    resolved = _load_config(os.path.join(os.path.dirname(os.path.abspath(path)), base), depth + 1)
  _merge(resolved, values, path)
  return resolved


def _unknown(key: str, source: str) -> ConfigError:
  if key in RENAMED_KEYS:
    return ConfigError(f"{key}: the sequence is now split by the context axis; use {RENAMED_KEYS[key]} "
                       "(docs/attention.md)")
  return ConfigError(f"unknown key {key!r} in {source} (every key is listed in configs/base.yml)")


def _merge(values: dict, overrides: dict, source: str) -> None:
  for key, value in overrides.items():
    if key not in values:
      raise _unknown(key, source)
    values[key] = _coerce(key, value, values[key])


def _require(ok: bool, key: str, message: str, values: dict) -> None:
  if not ok:
    raise ConfigError(f"{key}={values[key]!r}: {message}")


def _one_of(v: dict, key: str, choices) -> None:
  _require(v[key] in choices, key, f"must be one of {', '.join(choices)}", v)


def _validate(v: dict) -> None:
  """Range checks that need no devices, topic by topic."""
  _validate_model(v)
  _validate_optimizer(v)
  _validate_data(v)
  _validate_paths(v)
  _validate_mesh(v)
  _validate_remat(v)
  _validate_vocab_tiling(v)
  _validate_plan(v)


def _validate_model(v: dict) -> None:
  for key in ("steps", "log_period", "max_target_length", "vocab_size", "base_emb_dim",
              "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
              "base_num_decoder_layers", "gradient_accumulation_steps"):
    _require(v[key] >= 1, key, "must be >= 1", v)
  _require(v["per_device_batch_size"] > 0, "per_device_batch_size", "must be > 0", v)
  _require(v["base_num_query_heads"] % v["base_num_kv_heads"] == 0, "base_num_kv_heads",
           f"must divide base_num_query_heads={v['base_num_query_heads']}", v)
  _require(v["head_dim"] >= 0, "head_dim", "must be >= 0 (0: base_emb_dim // base_num_query_heads)", v)
  if v["head_dim"] == 0:
    _require(v["base_emb_dim"] % v["base_num_query_heads"] == 0, "base_emb_dim",
             f"must be divisible by base_num_query_heads={v['base_num_query_heads']} when head_dim=0", v)
  head_dim = v["head_dim"] or v["base_emb_dim"] // v["base_num_query_heads"]
  if head_dim % 2:
    raise ConfigError(f"head_dim={head_dim}: must be even (RoPE rotates pairs of features)")
  for key in ("dtype", "weight_dtype"):
    _one_of(v, key, DTYPES)
  _one_of(v, "convert_dtype", ("", *DTYPES))
  _one_of(v, "decoder_block", tuple(FAMILIES))
  _one_of(v, "attention", tuple(ATTENTIONS))
  if v["attention"] == "flash":  # the kernels' blocks: min(512, length) on TPU, 128 on GPU
    length = v["max_target_length"]
    _require(length % 128 == 0 and (length <= 512 or length % 512 == 0), "max_target_length",
             "must be a multiple of 128, and of 512 above 512, for attention=flash", v)
  if v["attention"] == "chunked":
    _require(v["attention_chunk_size"] >= 1 and v["max_target_length"] % v["attention_chunk_size"] == 0,
             "attention_chunk_size", f"must divide max_target_length={v['max_target_length']}", v)
  _require(v["mlp_chunks"] >= 1, "mlp_chunks", "must be >= 1 (1: the MLP over the whole sequence)", v)
  _require(v["attention_head_chunks"] >= 1, "attention_head_chunks", "must be >= 1 (1: every head at once)", v)
  _require(v["rope_max_timescale"] > 0, "rope_max_timescale", "must be > 0", v)
  _one_of(v, "rope_type", ("default", "llama3.1"))
  for key in ("final_logits_soft_cap", "attn_logits_soft_cap"):
    _require(v[key] >= 0, key, "must be >= 0 (0: no cap)", v)
  _require(v["query_pre_attn_scalar"] >= 0, "query_pre_attn_scalar", "must be >= 0 (0: head_dim)", v)
  _require(v["sliding_window_size"] >= 0, "sliding_window_size", "must be >= 0 (0: every layer attends globally)", v)
  _require(v["rope_high_freq_factor"] > v["rope_low_freq_factor"] > 0, "rope_high_freq_factor",
           f"must be > rope_low_freq_factor={v['rope_low_freq_factor']} > 0", v)
  _require(v["rope_scaling_factor"] > 0 and v["rope_original_max_position"] > 0, "rope_scaling_factor",
           "and rope_original_max_position must be > 0", v)
  _require(v["normalization_layer_epsilon"] > 0, "normalization_layer_epsilon", "must be > 0", v)
  _validate_moe(v)
  _require(v["max_decode_length"] >= 1, "max_decode_length", "must be >= 1", v)
  _one_of(v, "decode_sampling_strategy", ("greedy", "weighted"))
  _require(v["decode_sampling_temperature"] > 0, "decode_sampling_temperature", "must be > 0", v)


def _validate_moe(v: dict) -> None:
  # mlp_chunks slices a dense MLP's hidden units; slicing the experts' the same way, each slice
  # gathered inside the MoE's shard_map, saved nothing measurable (docs/moe.md).
  _require(v["mlp_chunks"] == 1 or not FAMILIES[v["decoder_block"]].moe, "mlp_chunks",
           f"must be 1 for a mixture of experts (decoder_block={v['decoder_block']})", v)
  for key in ("num_experts", "base_moe_mlp_dim"):
    _require(v[key] >= 1, key, "must be >= 1", v)
  _require(1 <= v["num_experts_per_tok"] <= v["num_experts"], "num_experts_per_tok",
           f"must be in [1, num_experts={v['num_experts']}]", v)
  _require(v["capacity_factor"] >= 0 or v["capacity_factor"] == -1, "capacity_factor",
           "must be > 0 (tokens past capacity dropped), or -1 or 0 (dropless)", v)
  for key in ("load_balance_loss_weight", "router_z_loss_weight"):
    _require(v[key] >= 0, key, "must be >= 0", v)
  _one_of(v, "expert_exchange", ("auto", "all_gather", "all_to_all"))
  _require(v["expert_exchange"] != "all_to_all" or v["capacity_factor"] <= 0, "expert_exchange",
           f"all_to_all needs dropless routing (capacity_factor -1 or 0, not {v['capacity_factor']})", v)


def _validate_optimizer(v: dict) -> None:
  _require(v["learning_rate"] >= 0, "learning_rate", "must be >= 0", v)
  _require(0 <= v["warmup_steps_fraction"] < 1, "warmup_steps_fraction", "must be in [0, 1)", v)
  _require(v["learning_rate_schedule_steps"] == -1 or v["learning_rate_schedule_steps"] >= v["steps"],
           "learning_rate_schedule_steps", f"must be >= steps={v['steps']}, or -1 for `steps`", v)
  _require(v["max_nonfinite_steps"] >= 1, "max_nonfinite_steps", "must be >= 1", v)
  _require(0 <= v["cosine_learning_rate_final_fraction"] <= 1, "cosine_learning_rate_final_fraction",
           "must be in [0, 1]", v)
  for key in ("adam_b1", "adam_b2"):
    _require(0 <= v[key] < 1, key, "must be in [0, 1)", v)
  _require(v["adam_eps"] > 0, "adam_eps", "must be > 0", v)
  for key in ("adam_weight_decay", "gradient_clipping_threshold", "z_loss_multiplier"):
    _require(v[key] >= 0, key, "must be >= 0", v)


def _validate_data(v: dict) -> None:
  _one_of(v, "dataset_type", tuple(DATASET_TYPES))
  _one_of(v, "grain_file_type", ("arrayrecord", "parquet"))
  for key in ("num_train_shards", "num_eval_shards", "grain_per_worker_buffer_size"):
    _require(v[key] >= 1, key, "must be >= 1", v)
  for key in ("prepare_workers", "grain_worker_count"):
    _require(v[key] >= 0, key, "must be >= 0", v)
  _one_of(v, "tokenizer_type", ("bpe", "byte"))
  if v["dataset_type"] == "text" and not v["tokenizer_path"]:
    _require(v["vocab_size"] >= 257, "vocab_size",
             f"must be >= 257 (256 bytes + end-of-document) for tokenizer_type={v['tokenizer_type']}", v)
  _require(v["eval_interval"] >= 0, "eval_interval", "must be >= 0 (0 disables evaluation)", v)
  _require(v["eval_steps"] >= 1, "eval_steps", "must be >= 1 (eval_interval=0 disables evaluation)", v)


def _validate_paths(v: dict) -> None:
  for key in ("checkpoint_period", "max_to_keep"):
    _require(v[key] >= 1, key, "must be >= 1", v)
  _require(bool(v["base_output_directory"]) and "\n" not in v["base_output_directory"], "base_output_directory",
           "must be a non-empty path", v)
  for key in ("base_output_directory", "dataset_cache_dir", "metrics_file", "memory_stats_file", "dataset_path",
              "tokenizer_path", "load_parameters_path", "output_path", "grain_train_files", "grain_eval_files",
              "hf_model_path", "hf_output_path"):
    _require("://" not in v[key], key, "must be a local path (URLs such as gs:// are not supported; mount a "
             "bucket with GCS FUSE and give its local path)", v)
  # A run owns base_output_directory/run_name; a path here could reach another run's directory.
  _require(v["run_name"] not in ("", ".", "..") and not any(c in v["run_name"] for c in "/\\\n"), "run_name",
           "must be a plain directory name (no '/', '\\', '.' or '..')", v)


def _validate_mesh(v: dict) -> None:
  v["logical_axis_rules"] = _axis_rules(v["logical_axis_rules"])
  if v["compile_topology"]:
    try:
      accelerators.parse_slice(v["compile_topology"])
    except ValueError as e:
      raise ConfigError(str(e)) from None
  _require(v["compile_topology_num_slices"] >= 1, "compile_topology_num_slices", "must be >= 1", v)
  _require(v["jax_num_processes"] >= 0, "jax_num_processes", "must be >= 0 (0: from the environment)", v)
  _require(v["jax_process_id"] >= -1, "jax_process_id", "must be >= 0, or -1 for the environment", v)
  _one_of(v, "context_parallel_strategy", tuple(STRATEGIES))


def _axis_rules(rules: list) -> list:
  """The rules checked, each as [name, list of mesh axes]: a rule may give one axis, or null for none."""
  normalised = []
  for rule in rules:
    ok = isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)
    if ok:
      axes = rule[1] if isinstance(rule[1], list) else [] if rule[1] is None else [rule[1]]
      ok = all(a in sharding.MESH_AXES for a in axes) and len(set(axes)) == len(axes)
    if not ok:
      raise ConfigError(f"logical_axis_rules: bad rule {rule!r}; each rule is "
                        f"[logical_name, [distinct mesh axes from {', '.join(sharding.MESH_AXES)}]]")
    normalised.append([rule[0], axes])
  return normalised


def _validate_remat(v: dict) -> None:
  _one_of(v, "remat_policy", remat.POLICY_NAMES)
  _require(1 <= v["remat_layer_interval"] <= v["base_num_decoder_layers"], "remat_layer_interval",
           f"must be in [1, base_num_decoder_layers={v['base_num_decoder_layers']}]", v)
  for name in remat.TENSOR_NAMES:
    _one_of(v, name, remat.ACTIONS)


def _validate_vocab_tiling(v: dict) -> None:
  _require(v["num_vocab_tiling"] >= 1, "num_vocab_tiling", "must be >= 1 (1: no tiling)", v)
  _one_of(v, "vocab_tiling_mode", losses.MODES)
  tokens = v["per_device_batch_size"] * v["max_target_length"]
  _require(v["num_vocab_tiling"] <= tokens, "num_vocab_tiling",
           f"each tile must hold at least one token per device; at most "
           f"per_device_batch_size * max_target_length = {tokens:g}", v)


def _validate_plan(v: dict) -> None:
  _require(v["hbm_budget_gib"] >= 0, "hbm_budget_gib", "must be >= 0 (0: the chip's HBM minus 10%)", v)
  _require(v["plan_workers"] >= 0, "plan_workers", "must be >= 0 (0: the CPU cores)", v)
  ladders = {"plan_num_vocab_tiling": int, "plan_remat_layer_intervals": int, "plan_gradient_accumulation_steps": int,
             "plan_per_device_batch_sizes": (int, float), "plan_mlp_chunks": int,
             "plan_attention_head_chunks": int, "plan_max_target_lengths": int}
  for key, kind in ladders.items():
    ok = all(isinstance(x, kind) and not isinstance(x, bool) and x > 0 for x in v[key])
    _require(bool(v[key]) and ok and list(v[key]) == sorted(set(v[key])), key,
             "must be a non-empty ascending list of distinct positive numbers", v)
  _require(all(p in remat.SEARCHABLE_POLICIES for p in v["plan_remat_policies"]), "plan_remat_policies",
           f"must list names from {', '.join(remat.SEARCHABLE_POLICIES)} ([]: all of them)", v)
  _require(all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v["plan_context_parallelism"])
           and list(v["plan_context_parallelism"]) == sorted(set(v["plan_context_parallelism"])),
           "plan_context_parallelism", "must be an ascending list of distinct positive numbers ([]: as configured)", v)
  _require(all(s in STRATEGIES for s in v["plan_context_parallel_strategies"]), "plan_context_parallel_strategies",
           f"must list names from {', '.join(STRATEGIES)} ([]: as configured)", v)


def _derive(v: dict, num_devices: int, num_granules: int) -> None:
  """Adds the values every module would otherwise recompute."""
  v["num_devices"] = num_devices
  v["mesh_shape"], v["dcn_mesh_shape"] = sharding.mesh_shapes(v, num_devices, num_granules)
  micro = v["per_device_batch_size"] * num_devices
  if micro != int(micro):
    raise ConfigError(f"per_device_batch_size={v['per_device_batch_size']}: times the {num_devices} "
                      "devices must be a whole number of sequences")
  v["micro_batch_size"] = int(micro)
  v["global_batch_size_to_train_on"] = int(micro) * v["gradient_accumulation_steps"]
  v["head_dim"] = v["head_dim"] or v["base_emb_dim"] // v["base_num_query_heads"]
  v.update(FAMILIES[v["decoder_block"]].switches())
  sharding.check_divisible(v)
  _check_context(v)
  units = v["base_mlp_dim"] // sharding.logical_shards(v, "mlp")
  _require(units % v["mlp_chunks"] == 0, "mlp_chunks",
           f"must divide the {units} hidden units per tensor shard (base_mlp_dim / the shards of mlp)", v)
  kv_shards = sharding.logical_shards(v, "kv_heads")
  _require((v["base_num_kv_heads"] // kv_shards) % v["attention_head_chunks"] == 0,
           "attention_head_chunks", f"must divide the {v['base_num_kv_heads'] // kv_shards} key/value heads per tensor "
           "shard (base_num_kv_heads / the shards of kv_heads)", v)
  _require(v["attention_head_chunks"] == 1 or sharding.logical_shards(v, "q_heads") == kv_shards,
           "attention_head_chunks", "needs the query heads sharded as the key/value heads (logical_axis_rules)", v)
  if v["learning_rate_schedule_steps"] == -1:
    v["learning_rate_schedule_steps"] = v["steps"]
  v["run_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
  v["dataset_cache_dir"] = v["dataset_cache_dir"] or os.path.join(v["base_output_directory"], "cache")


def _check_context(v: dict) -> None:
  """What context parallelism needs of the length and the attention, once the mesh is known."""
  axis = sharding.MESH_AXES.index("context")
  shards = v["mesh_shape"][axis] * v["dcn_mesh_shape"][axis]
  if shards == 1:
    return
  length = v["max_target_length"]
  if v["context_parallel_load_balance"]:
    _require(length % (2 * shards) == 0, "max_target_length", f"must be divisible by 2 x context parallelism "
             f"= {2 * shards} with context_parallel_load_balance=true", v)
  _require(v["attention"] in SHARD_KERNELS, "attention", f"with context parallelism ({shards} shards) must be one of "
           f"{', '.join(SHARD_KERNELS)}, whose kernel runs per context shard", v)
  if v["attention"] == "chunked":
    chunk = v["attention_chunk_size"]
    _require(chunk >= length // shards or (length // shards) % chunk == 0, "attention_chunk_size",
             f"must divide the {length // shards} tokens of each context shard", v)


def saved_model_keys(checkpoint: str) -> tuple[dict, str] | None:
  """(model keys, file) saved with a checkpoint step directory: the converters' model.yml in
  it, or else the config.yml of the run it belongs to (run_dir/checkpoints/step)."""
  if not checkpoint:
    return None
  for path in (os.path.join(checkpoint, MODEL_KEYS_FILE), os.path.join(checkpoint, "..", "..", "config.yml")):
    if os.path.isfile(path):
      values = load_yaml(path)
      return {key: values[key] for key in MODEL_KEYS if key in values}, os.path.normpath(path)
  return None


def _freeze(value):
  if isinstance(value, list):
    return tuple(_freeze(x) for x in value)
  return value


def _thaw(value):
  if isinstance(value, tuple):
    return [_thaw(x) for x in value]
  return value


def initialize(argv: Sequence[str], num_devices: int | None = None,
               memory_kinds: Sequence[str] | None = None, num_granules: int | None = None) -> Config:
  """argv = [config.yml, key=value, ...].

  `num_devices`, `memory_kinds` (of one device) and `num_granules` (slices or processes)
  default to those of `sharding.run_devices(...)`: compile_topology's, or else what JAX sees, after
  jax.distributed is initialised if this is a multi-process run.
  """
  if not argv:
    raise ConfigError("usage: <config.yml> [key=value ...]")
  config_path, *args = argv
  values = _load_config(config_path)
  overrides = {}
  for arg in args:
    key, sep, raw = arg.partition("=")
    if not sep or not key:
      raise ConfigError(f"argument {arg!r}: expected key=value")
    if key not in values:
      raise _unknown(key, config_path)
    overrides[key] = raw
  model_name = _coerce("model_name", overrides.get("model_name", values["model_name"]), "")
  if model_name != "default":
    model_path = os.path.join(os.path.dirname(os.path.abspath(config_path)), "models", f"{model_name}.yml")
    if not os.path.isfile(model_path):
      raise ConfigError(f"model_name={model_name!r}: no file {model_path}")
    _merge(values, load_yaml(model_path), model_path)
  saved = saved_model_keys(_coerce("load_parameters_path", overrides.get("load_parameters_path",
                                                                          values["load_parameters_path"]), ""))
  if saved:
    _merge(values, *saved)
  _merge(values, overrides, "the command line")
  _validate(values)
  if values["load_parameters_path"]:  # every reader of it: train, decode, to_huggingface
    checkpointing.check_verified(values["load_parameters_path"], values["trust_unverified_checkpoints"])
  if num_devices is None and not values["compile_topology"]:
    sharding.initialize_distributed(values)
  return _for_devices(values, num_devices, memory_kinds, num_granules)


def replace(config: Config, settings: dict) -> Config:
  """config with `settings` (base.yml keys: the planner's choice) changed, then checked and
  derived again exactly as initialize would, for the devices config was resolved for."""
  values = {k: _thaw(x) for k, x in config.to_dict().items()}
  _merge(values, settings, "the settings")
  _validate(values)
  return _for_devices(values, config.num_devices, None, None)


def _for_devices(values: dict, num_devices: int | None, memory_kinds: Sequence[str] | None,
                 num_granules: int | None) -> Config:
  """The checks and derived values that need the run's devices (see initialize)."""
  run_devices = sharding.run_devices(values["compile_topology"], values["compile_topology_num_slices"])
  num_devices = num_devices or len(run_devices)
  memory_kinds = memory_kinds or [m.kind for m in run_devices[0].addressable_memories()]
  values["platform"] = run_devices[0].platform
  if values["attention"] == "flash" and values["platform"] not in FLASH_KERNELS:
    raise ConfigError(f"attention='flash': its kernels run on {' and '.join(sorted(FLASH_KERNELS))}, not on "
                      f"{values['platform']}; use attention=chunked (or dot_product)")
  if values["attention"] == "flash" and values["platform"] == "gpu":
    for key in ("attn_logits_soft_cap", "sliding_window_size"):
      _require(not values[key], key, "must be 0 for attention=flash on GPU (the Triton kernel has neither "
               "soft cap nor window); use attention=chunked", values)
  policy = values["remat_policy"]
  if policy != "none" and remat.saved_names(policy, values)[1]:
    if "pinned_host" not in memory_kinds:
      raise ConfigError(f"remat_policy={policy!r}: offloads to host memory, which this backend lacks "
                        f"(it has {', '.join(memory_kinds)})")
    if values["platform"] == "cpu":
      logging.warning("remat_policy=%s: on CPU, host and device memory are one; offloading changes nothing", policy)
  _derive(values, num_devices, num_granules or sharding.granules(run_devices))
  return Config({k: _freeze(x) for k, x in values.items()})

