"""Configuration: configs/base.yml, then configs/models/<model_name>.yml, then the model keys
saved with load_parameters_path's checkpoint, then key=value.

config_schema is the schema: every key, its section, type and default. Values are parsed to the
key's type and checked by their sections (`parse`, which reads config files and nothing else),
then resolved for the run's devices, with the derived values computed once (`for_devices`). The
result is a read-only `Config`; any bad input raises `ConfigError`, whose message is one line
naming the key and what is allowed. runtime.run turns it into exit code 2.
"""

import dataclasses
import math
import os
import types
import typing
from types import MappingProxyType
from typing import Any, Sequence

import yaml
from absl import logging

from MaxText import config_schema, remat, sharding
from MaxText.errors import ConfigError, first_line
from MaxText.families import FAMILIES
from MaxText.layers import blocks, masks, moe
from MaxText.layers.attentions import DEFAULT_FLASH_KERNEL, FLASH_BLOCK, FLASH_KERNELS
from MaxText.layers.context_parallel import ROW_KERNELS, kernels_for

# The keys that fix the parameters' shapes and meaning. Saved with a checkpoint (the converters'
# model.yml, a run's config.yml), they come with load_parameters_path: see saved_model_keys.
MODEL_KEYS = config_schema.fields("model")
MODEL_KEYS_FILE = "model.yml"
# The keys that take `auto`: the planner's choice, resolved by the commands that plan.
_TYPES = {f.name: f.type for s in config_schema.SECTIONS for f in dataclasses.fields(s)}
# The keys that take `auto`: the planner's choice, resolved by the commands that plan.
AUTO_KEYS = tuple(k for k, kind in _TYPES.items() if config_schema.takes_auto(kind))
# Keys that are gone, -> what replaces them: the one sequence-sharding axis is `context`.
RENAMED_KEYS = {"ici_sequence_parallelism": "ici_context_parallelism",
                "dcn_sequence_parallelism": "dcn_context_parallelism"}
MODELS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "models")
# Keys holding paths, which must be local.
_PATHS = ("base_output_directory", "dataset_cache_dir", "metrics_file", "memory_stats_file", "dataset_path",
          "tokenizer_path", "load_parameters_path", "output_path", "grain_train_files", "grain_eval_files",
          "hf_model_path", "hf_output_path")


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


def defaults() -> dict:
  """Every key's default, in base.yml's order."""
  return {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
          for s in config_schema.SECTIONS for f in dataclasses.fields(s)}


def load_yaml(path: str, loader=yaml.BaseLoader) -> dict:
  """The mapping in YAML file `path`, its scalars as text by default: a config file's values are
  then typed by the one rule that types the command line's (`scan_layers: yes` is no bool there
  either, `run_name: 2024` a name)."""
  if not os.path.isfile(path):
    raise ConfigError(f"config file {path!r} does not exist")
  try:
    with open(path) as f:
      values = yaml.load(f, loader) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {path!r} is not valid YAML: {first_line(e)}") from None
  if not isinstance(values, dict):
    raise ConfigError(f"config file {path!r} must be a mapping of key: value")
  return values


def type_name(kind) -> str:
  """A key's type in words: "an integer", "null or a number", "one of a, b", "a list of integers"."""
  options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
  words = []
  for option in options:
    if option is type(None):
      words.insert(0, "null")
    elif typing.get_origin(option) is typing.Literal:
      words.append(f"one of {', '.join(map(str, typing.get_args(option)))}")
    elif typing.get_origin(option) is typing.Annotated:
      words.append(f"one of {', '.join(name or repr(name) for name in option.__metadata__[0])}")
    elif typing.get_origin(option) is list:
      item = type_name(typing.get_args(option)[0])
      words.append(f"a list of names from {item.removeprefix('one of ')}" if item.startswith("one of ")
                   else f"a list of {item.removeprefix('a ').removeprefix('an ')}s")
    else:
      words.append({bool: "a bool (true/false)", int: "an integer", float: "a number", str: "a string",
                    list: "a list"}[option])
  return " or ".join(words)


def _as(value, kind):
  """`value` (from YAML, or a command-line string) as `kind`; ValueError if it is none of it."""
  if typing.get_origin(kind) in (typing.Union, types.UnionType):
    for option in typing.get_args(kind):
      try:
        return _as(value, option)
      except ValueError:
        pass
    raise ValueError
  if kind is type(None):
    if value is None or (isinstance(value, str) and value in ("", "null", "Null", "NULL", "none", "None", "~")):
      return None
  elif typing.get_origin(kind) is typing.Literal:
    if value in typing.get_args(kind):
      return value
  elif typing.get_origin(kind) is typing.Annotated:
    if isinstance(value, str) and value in kind.__metadata__[0]:
      return value
  elif kind is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
      return value.lower() == "true"
  elif kind in (int, float):
    if isinstance(value, str):
      value = kind(value)  # Python's parser: YAML 1.1 would read "1e-3" as a string.
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int)):
      return kind(value)
  elif kind is str:
    if isinstance(value, str):
      return value
  elif kind is list or typing.get_origin(kind) is list:
    if isinstance(value, str):
      try:
        value = yaml.safe_load(value)
      except yaml.YAMLError:
        raise ValueError from None
    if isinstance(value, list):
      item = typing.get_args(kind)
      return [_as(x, item[0]) for x in value] if item else value
  raise ValueError


def _coerce(key: str, value: Any) -> Any:
  try:
    typed = _as(value, _TYPES[key])
  except ValueError:
    raise ConfigError(f"{key}={value}: must be {type_name(_TYPES[key])}") from None
  if isinstance(typed, int) and not isinstance(typed, bool) and abs(typed) > config_schema.INT_LIMIT:
    raise ConfigError(f"{key}={value}: must be at most {config_schema.INT_LIMIT} in magnitude")
  if isinstance(typed, float) and not math.isfinite(typed):
    raise ConfigError(f"{key}={value}: must be a finite number")
  return typed


def _load_config(path: str, depth: int = 0) -> dict:
  """The keys of config file `path`, each coerced to its type: over those of the file its
  `base_config` names (relative to it), as in MaxText, or else all of them itself."""
  values = load_yaml(path)
  base = values.pop("base_config", None)
  if base is None:
    missing = [key for key in _TYPES if key not in values]
    if missing:
      raise ConfigError(f"config file {path!r} lacks {len(missing)} of the keys of configs/base.yml (first: "
                        f"{missing[0]!r}); give configs/base.yml first, or start the file with `base_config: base.yml` "
                        "(its path relative to the file) to take the keys it does not set from there")
    resolved = defaults()
  else:
    if not isinstance(base, str) or depth >= 8:
      raise ConfigError(f"config file {path!r}: base_config={base!r} must name a config file (at most 8 deep)")
    resolved = _load_config(os.path.join(os.path.dirname(os.path.abspath(path)), base), depth + 1)
  _merge(resolved, values, path)
  return resolved


def _unknown(key: str, source: str) -> ConfigError:
  if key in RENAMED_KEYS:
    return ConfigError(f"{key}: the sequence is now split by the context axis; use {RENAMED_KEYS[key]} "
                       "(docs/guides/long_context.md)")
  return ConfigError(f"unknown key {key!r} in {source} (every key is listed in configs/base.yml)")


def _merge(values: dict, overrides: dict, source: str) -> None:
  for key, value in overrides.items():
    if key not in _TYPES:
      raise _unknown(key, source)
    values[key] = _coerce(key, value)


def _require(ok: bool, key: str, message: str, values: dict) -> None:
  if not ok:
    raise ConfigError(f"{key}={values[key]!r}: {message}")


def _validate(v: dict) -> None:
  """Each section's checks of its own keys, then those that span sections; none needs devices."""
  v["logical_axis_rules"] = config_schema.Mesh.axis_rules(v["logical_axis_rules"])
  for section in config_schema.SECTIONS:
    instance = section(**{f.name: v[f.name] for f in dataclasses.fields(section)})
    if hasattr(instance, "check"):
      instance.check()
  for key in _PATHS:
    _require("://" not in v[key], key, "must be a local path (URLs such as gs:// are not supported; mount a "
             "bucket with GCS FUSE and give its local path)", v)
  if v["attention"] == "flash":  # the kernels' blocks: min(512, length) on TPU, 128 on GPU
    length = v["max_target_length"]
    _require(length % 128 == 0 and (length <= 512 or length % 512 == 0), "max_target_length",
             "must be a multiple of 128, and of 512 above 512, for attention=flash", v)
  # A chunk longer than the row is the row (a model file's chunk with a short max_target_length).
  v["attention_chunk_size"] = min(v["attention_chunk_size"], v["max_target_length"])
  if v["attention"] == "chunked":
    _require(v["max_target_length"] % v["attention_chunk_size"] == 0,
             "attention_chunk_size", f"must divide max_target_length={v['max_target_length']}", v)
  if FAMILIES[v["decoder_block"]].moe and v["capacity_factor"] is not None:
    slots = moe.capacity(v["max_target_length"], v["num_experts_per_tok"], v["num_experts"], v["capacity_factor"])
    _require(slots >= 1, "capacity_factor", f"gives each expert {slots} slots per sequence of "
             f"max_target_length={v['max_target_length']} tokens: at least 1 is needed", v)
  _require(not v["first_num_dense_layers"] or FAMILIES[v["decoder_block"]].moe, "first_num_dense_layers",
           f"counts the dense layers before the experts in a mixture of experts; decoder_block="
           f"{v['decoder_block']} has no experts", v)
  _require(v["first_num_dense_layers"] < v["base_num_decoder_layers"] or not v["first_num_dense_layers"],
           "first_num_dense_layers", f"must be below base_num_decoder_layers={v['base_num_decoder_layers']}", v)
  step = v["interleave_moe_layer_step"]
  _require(step == 1 or (FAMILIES[v["decoder_block"]].moe and not v["first_num_dense_layers"]
                         and v["base_num_decoder_layers"] % step == 0), "interleave_moe_layer_step",
           f"must divide base_num_decoder_layers={v['base_num_decoder_layers']}, in a mixture of experts "
           f"(decoder_block={v['decoder_block']}) without first_num_dense_layers", v)
  _require(v["num_experts_per_tok"] == 1 or not FAMILIES[v["decoder_block"]].routed_input_scaling,
           "num_experts_per_tok", f"must be 1 for decoder_block={v['decoder_block']}, whose router weights its one "
           "expert's input", v)
  layers = v["base_num_decoder_layers"]
  _require(all(-layers <= i < layers for i in v["quantization_skip_layers"]), "quantization_skip_layers",
           f"names layers in [-{layers}, {layers}) of base_num_decoder_layers={layers}", v)
  dense_mlps = (v["first_num_dense_layers"] or v["interleave_moe_layer_step"] > 1 or v["shared_experts"]
                or not FAMILIES[v["decoder_block"]].moe)
  _require(not v["mlp_bias"] or (not dense_mlps and v["capacity_factor"] is None), "mlp_bias",
           "biases the routed experts of a dropless mixture (capacity_factor null) with no dense MLPs (no "
           "first_num_dense_layers, interleave_moe_layer_step or shared_experts)", v)
  _require(not v["use_qk_norm"] or v["attention_type"] == "global", "use_qk_norm",
           f"normalises the heads of attention_type=global, not {v['attention_type']}", v)
  _require(v["expert_exchange"] != "all_to_all" or v["capacity_factor"] is None, "expert_exchange",
           f"all_to_all needs dropless routing (capacity_factor null, not {v['capacity_factor']})", v)
  # MLA's latent keys and values are shared by all heads: no slice of heads stands alone.
  _require(v["attention_head_chunks"] == 1 or v["attention_type"] != "mla", "attention_head_chunks",
           "must be 1 for attention_type=mla", v)
  _require(v["learning_rate_schedule_steps"] is None or v["learning_rate_schedule_steps"] >= v["steps"],
           "learning_rate_schedule_steps", f"must be >= steps={v['steps']}, or null for `steps`", v)
  if v["dataset_type"] == "text" and not v["tokenizer_path"]:
    _require(v["vocab_size"] >= 257, "vocab_size",
             f"must be >= 257 (256 bytes + end-of-document) for tokenizer_type={v['tokenizer_type']}", v)
  _require(v["remat_layer_interval"] <= v["base_num_decoder_layers"], "remat_layer_interval",
           f"must be in [1, base_num_decoder_layers={v['base_num_decoder_layers']}]", v)
  tokens = v["per_device_batch_size"] * v["max_target_length"]
  _require(v["num_vocab_tiling"] <= tokens, "num_vocab_tiling",
           f"each tile must hold at least one token per device; at most "
           f"per_device_batch_size * max_target_length = {tokens:g}", v)


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
  _check_linear_attention(v)
  _derive_pipeline(v)
  moe_family = FAMILIES[v["decoder_block"]].moe
  dense_layers = v["first_num_dense_layers"] or v["interleave_moe_layer_step"] > 1 or not moe_family
  widths = (["base_mlp_dim"] if dense_layers else []) + (
      ["base_moe_mlp_dim"] if moe_family else [])  # the dense MLPs', the experts' (and shared experts')
  for name in widths:
    units = v[name] // sharding.logical_shards(v, "mlp")
    _require(units % v["mlp_chunks"] == 0, "mlp_chunks",
             f"must divide the {units} hidden units per tensor shard ({name} / the shards of mlp)", v)
  kv_shards = sharding.logical_shards(v, "kv_heads")
  _require((v["base_num_kv_heads"] // kv_shards) % v["attention_head_chunks"] == 0,
           "attention_head_chunks", f"must divide the {v['base_num_kv_heads'] // kv_shards} key/value heads per tensor "
           "shard (base_num_kv_heads / the shards of kv_heads)", v)
  _require(v["attention_head_chunks"] == 1 or not v["qk_norm_over_heads"], "attention_head_chunks",
           f"must be 1 for decoder_block={v['decoder_block']}, whose query and key norms span every head", v)
  _require(v["attention_head_chunks"] == 1 or sharding.logical_shards(v, "q_heads") == kv_shards,
           "attention_head_chunks", "needs the query heads sharded as the key/value heads (logical_axis_rules)", v)
  # libtpu fails to place splash attention's residuals, stacked over the slices, in host memory
  # (an internal error); the context-parallel blocks' residuals offload.
  offloads_context = (v["remat_policy"] in remat.POLICY_NAMES and v["remat_policy"] != "none"
                      and "attention_out" in remat.saved_names(v["remat_policy"], v)[1])
  _require(v["attention_head_chunks"] == 1 or v["attention"] != "flash" or v["platform"] != "tpu"
           or not offloads_context, "attention_head_chunks",
           f"must be 1 for attention=flash on TPU with remat_policy={v['remat_policy']}, which offloads "
           "attention_out (libtpu cannot offload splash's residuals from the slices); drop slices or offload", v)
  v["learning_rate_schedule_steps"] = v["learning_rate_schedule_steps"] or v["steps"]
  v["run_dir"] = os.path.join(v["base_output_directory"], v["run_name"])
  v["dataset_cache_dir"] = v["dataset_cache_dir"] or os.path.join(v["base_output_directory"], "cache")


def _derive_pipeline(v: dict) -> None:
  """pipeline_stages, num_pipeline_microbatches, num_pipeline_repeats and, with stages, pipeline_schedule resolved
  and what a pipeline needs of the layers and the batch."""
  axis = sharding.MESH_AXES.index("pipeline")
  stages = v["pipeline_stages"] = v["mesh_shape"][axis] * v["dcn_mesh_shape"][axis]
  # The stages split the layers after the dense first ones, which run before them.
  layers = v["base_num_decoder_layers"] - v["first_num_dense_layers"]
  if v["num_pipeline_microbatches"] == -1:
    v["num_pipeline_microbatches"] = stages
  _require(not v["pipeline_keep_residuals"] or (stages > 1 and v["pipeline_schedule"] in (None, "1f1b")),
           "pipeline_keep_residuals", "is 1F1B's: it needs pipeline stages (ici_/dcn_pipeline_parallelism) and "
           "pipeline_schedule=1f1b", v)
  if stages == 1:
    v["num_pipeline_repeats"] = 1
    return
  per_stage = v["num_layers_per_pipeline_stage"] or layers // stages
  _require(not v["num_layers_per_pipeline_stage"] or layers % (stages * per_stage) == 0,
           "num_layers_per_pipeline_stage", f"times the {stages} pipeline stages must divide the {layers} layers "
           "into whole repeats", v)
  _require(per_stage > 0, "base_num_decoder_layers", (f"less first_num_dense_layers ({layers} layers) " if
           v["first_num_dense_layers"] else "") + f"must be at least the {stages} pipeline stages", v)
  repeats = layers // (stages * per_stage)
  if v["num_pipeline_repeats"] != -1:
    _require(v["num_pipeline_repeats"] == repeats or not v["num_layers_per_pipeline_stage"], "num_pipeline_repeats",
             f"disagrees with num_layers_per_pipeline_stage={per_stage}: {layers} layers over {stages} stages make "
             f"{repeats} repeats", v)
    repeats = v["num_pipeline_repeats"]
  _require(repeats >= 1 and layers % (stages * repeats) == 0, "base_num_decoder_layers",
           (f"less first_num_dense_layers ({layers} layers) " if v["first_num_dense_layers"] else "")
           + f"must be divisible by pipeline stages x repeats = {stages} x {repeats} (ici_/dcn_pipeline_parallelism, "
           "num_pipeline_repeats or num_layers_per_pipeline_stage)", v)
  # A stage holds whole blocks of the layers' kinds.
  block = blocks.period(v)
  _require((layers // (stages * repeats)) % block == 0,
           "inhomogeneous_layer_cycle_interval" if v["gated_delta_net"] else "interleave_moe_layer_step",
           f"must divide each pipeline stage's {layers // (stages * repeats)} layers (stages hold whole blocks)", v)
  v["num_pipeline_repeats"] = repeats
  count = v["num_pipeline_microbatches"]
  _require(count % stages == 0, "num_pipeline_microbatches", f"must be a multiple of the {stages} pipeline stages", v)
  shards = sharding.logical_shards(v, "activation_batch")
  _require(v["micro_batch_size"] % (count * shards) == 0, "num_pipeline_microbatches",
           f"must split the {v['micro_batch_size']} rows per step into microbatches of whole rows per batch shard "
           f"({shards} shards of activation_batch)", v)
  if v["pipeline_schedule"] is None:
    v["pipeline_schedule"] = "1f1b" if repeats == 1 or v["pipeline_keep_residuals"] else "gpipe"


def _check_linear_attention(v: dict) -> None:
  """What Gated DeltaNet layers (layers/gated_delta_net.py) need of the layers, heads and rows."""
  if not v["gated_delta_net"]:
    return
  interval, layers = v["inhomogeneous_layer_cycle_interval"], v["base_num_decoder_layers"]
  _require(layers % interval == 0 and not v["first_num_dense_layers"], "inhomogeneous_layer_cycle_interval",
           f"must divide base_num_decoder_layers={layers} (without first_num_dense_layers)", v)
  heads = sharding.logical_shards(v, "kv_heads")
  _require(v["gdn_num_key_heads"] % heads == 0, "gdn_num_key_heads",
           f"must be divisible by the {heads} shards of kv_heads (the tensor axes)", v)
  # Each context shard holds one run of consecutive tokens, or two with load balancing.
  axis = sharding.MESH_AXES.index("context")
  shards = v["mesh_shape"][axis] * v["dcn_mesh_shape"][axis]
  pieces = shards * (2 if v["context_parallel_load_balance"] and shards > 1 else 1)
  run = v["max_target_length"] // pieces
  _require(run >= v["gdn_conv_kernel_dim"] - 1, "gdn_conv_kernel_dim",
           f"must be at most one more than the {run} consecutive tokens each context shard holds of a row "
           f"(max_target_length={v['max_target_length']} over {pieces} runs): a shard's convolution reaches into "
           "the run before its own only", v)


def _derive_flash_kernel(v: dict) -> None:
  """attention=flash: the kernel asked for (flash_kernel), else the platform's fastest, and what
  the model asks of it that it must take."""
  platform = v["platform"]
  if v["flash_kernel"] is None:
    if platform not in DEFAULT_FLASH_KERNEL:
      raise ConfigError(f"attention='flash': its kernels run on {' and '.join(sorted(DEFAULT_FLASH_KERNEL))}, not "
                        f"on {platform}; use attention=chunked (or dot_product)")
    v["flash_kernel"] = DEFAULT_FLASH_KERNEL[platform]
  kernel = FLASH_KERNELS[v["flash_kernel"]]
  _require(kernel.platform == platform, "flash_kernel", f"runs on {kernel.platform}, not on "
           f"{platform}", v)
  _require(v["flash_kernel"] != "cudnn" or v["dtype"] in ("bfloat16", "float16"), "dtype",
           "must be bfloat16 or float16 for flash_kernel=cudnn (cuDNN's fused attention takes no float32)", v)
  refusal = masks.refused(v, v["flash_kernel"], kernel.takes)
  if refusal:
    raise ConfigError(refusal)
  for name, other in FLASH_KERNELS.items():
    for key in set(other.options) - set(kernel.options):
      _require(not v[key], key, f"{name} attention's: flash_kernel={v['flash_kernel']} has no such option", v)
  length, block = v["max_target_length"], v["sa_block_kv_dkv"]
  _require(not block or (length % block == 0 and block % min(FLASH_BLOCK, length) == 0), "sa_block_kv_dkv",
           f"must be a multiple of {min(FLASH_BLOCK, length)} that divides max_target_length={length}", v)


def _check_context(v: dict) -> None:
  """What context parallelism needs of the length and the attention, once the mesh is known."""
  axis = sharding.MESH_AXES.index("context")
  shards = v["mesh_shape"][axis] * v["dcn_mesh_shape"][axis]
  if shards == 1:
    return
  # The context-parallel blocks take a window and sinks, not yet a chunk of the row.
  _require(not v["chunk_attn_window_size"], "chunk_attn_window_size", f"must be 0 with context parallelism "
           f"({shards} context shards)", v)
  length = v["max_target_length"]
  if v["context_parallel_load_balance"]:
    # The batch is reordered before the model sees it; multi-token prediction's shifts need row order.
    _require(not v["mtp_num_layers"], "mtp_num_layers", "must be 0 with context parallelism and "
             "context_parallel_load_balance=true (its shifts need the tokens in row order)", v)
    _require(length % (2 * shards) == 0, "max_target_length", f"must be divisible by 2 x context parallelism "
             f"= {2 * shards} with context_parallel_load_balance=true", v)
  strategy = v["context_parallel_strategy"]
  kernels = kernels_for(strategy, v["platform"])
  _require(v["attention"] in kernels, "attention", f"with context parallelism ({shards} shards, "
           f"context_parallel_strategy={strategy}, on {v['platform']}) must be one of {', '.join(kernels)}, "
           "whose kernel runs per context shard", v)
  if v["attention"] in ROW_KERNELS:  # the kernel's query blocks, multiples of 128 (lanes), tile a shard's runs
    run = length // shards // (2 if v["context_parallel_load_balance"] else 1)
    _require(run % 128 == 0, "max_target_length", f"must be a multiple of 128 x {length // run} with "
             f"attention={v['attention']} under context parallelism: each shard's runs of consecutive tokens "
             f"({run}) hold whole 128-token query blocks", v)
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


def parse(argv: Sequence[str]) -> tuple[dict, tuple]:
  """argv = [config.yml, key=value, ...] -> (the keys, typed and checked; the keys given as
  `auto`, which hold their defaults here). Reads config files only: the devices, jax.distributed
  and a checkpoint's checksums are the entry point's (launch.config)."""
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
  model_name = _coerce("model_name", overrides.get("model_name", values["model_name"]))
  if model_name != "default":
    # Beside the config file, as in configs/, else the project's: a user's config elsewhere
    # (starting `base_config: .../base.yml`) still names the shipped models.
    candidates = [os.path.join(os.path.dirname(os.path.abspath(config_path)), "models", f"{model_name}.yml"),
                  os.path.join(MODELS_DIR, f"{model_name}.yml")]
    model_path = next((p for p in candidates if os.path.isfile(p)), None)
    if model_path is None:
      raise ConfigError(f"model_name={model_name!r}: no file {' or '.join(dict.fromkeys(candidates))}")
    _merge(values, load_yaml(model_path), model_path)
  saved = saved_model_keys(_coerce("load_parameters_path", overrides.get("load_parameters_path",
                                                                          values["load_parameters_path"])))
  if saved:
    _merge(values, *saved)
  _merge(values, overrides, "the command line")
  auto = tuple(k for k in AUTO_KEYS if values[k] == config_schema.AUTO)
  values.update({k: defaults()[k] for k in auto})
  _validate(values)
  return values, auto


def initialize(argv: Sequence[str], num_devices: int | None = None,
               memory_kinds: Sequence[str] | None = None, num_granules: int | None = None) -> Config:
  """parse(argv), resolved for `num_devices`, `memory_kinds` (of one device) and `num_granules`
  (slices or processes): by default those of `sharding.run_devices(...)`, compile_topology's or
  else what JAX sees. `auto` is refused: the commands that plan resolve it (launch.config)."""
  values, auto = parse(argv)
  refuse_auto(auto)
  return for_devices(values, num_devices, memory_kinds, num_granules)


def refuse_auto(auto: tuple) -> None:
  """For the commands that do not plan: `auto` values are the planner's to choose."""
  if auto:
    raise ConfigError(f"{auto[0]}=auto: only train and train_compile choose it (the planner); give a value")


def replace(config: Config, settings: dict) -> Config:
  """config with `settings` (base.yml keys: the planner's choice) changed, then checked and
  derived again exactly as initialize would, for the devices config was resolved for."""
  values = {k: _thaw(x) for k, x in config.to_dict().items() if k in _TYPES}
  _merge(values, settings, "the settings")
  _validate(values)
  return for_devices(values, config.num_devices, None, None)


def for_devices(values: dict, num_devices: int | None = None, memory_kinds: Sequence[str] | None = None,
                num_granules: int | None = None) -> Config:
  """The checks and derived values that need the run's devices (see initialize)."""
  run_devices = sharding.run_devices(values["compile_topology"], values["compile_topology_num_slices"])
  num_devices = num_devices or len(run_devices)
  memory_kinds = memory_kinds or [m.kind for m in run_devices[0].addressable_memories()]
  values["platform"] = run_devices[0].platform
  if values["attention"] == "flash":
    _derive_flash_kernel(values)
  policy = values["remat_policy"]
  if policy != "none" and remat.saved_names(policy, values)[1]:
    if "pinned_host" not in memory_kinds:
      raise ConfigError(f"remat_policy={policy!r}: offloads to host memory, which this backend lacks "
                        f"(it has {', '.join(memory_kinds)})")
    if values["platform"] == "cpu":
      logging.warning("remat_policy=%s: on CPU, host and device memory are one; offloading changes nothing", policy)
  _derive(values, num_devices, num_granules or sharding.granules(run_devices))
  return Config({k: _freeze(x) for k, x in values.items()})

