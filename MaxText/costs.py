"""What a train step costs: the model's FLOPs (training_flops_per_step), the FLOPs, bytes and
collectives a traced step executes (a walk of its jaxpr at loop trip counts), the compiled
step's memory against one device's, and the report train, train_compile and the planner all read
(memory_report, flops_report).

A Pallas kernel is a custom call whose FLOPs XLA does not see: each flash kernel declares its
count in its own record (layers/attentions.FlashKernel), which the model registers here in
KERNEL_FLOPS (this layer is below the model's); any other kernel counts its own cost estimate, and
one with neither stops the count naming it, never a silent zero.
"""

import math
import os
import re
from typing import Callable

import jax
import jax.extend

from MaxText import accelerators
from MaxText.hlo_network import HLO_BYTES, SENT_PER_BYTE, runs_share
from MaxText.layers.blocks import layer_kind, moe_layers

# pallas_call name prefix -> its FLOPs (eqn -> float), and a fused kernel that is a primitive of
# its own (cuDNN's attention) -> its FLOPs, as the flash kernels' records declare them
# (layers/attentions registers every record's).
KERNEL_FLOPS: dict[str, Callable] = {}
PRIMITIVE_FLOPS: dict[str, Callable] = {}
# attention_type -> (config -> (multiply-adds per token of a layer's attention projections, per
# (query, key) pair of its scores and context, all heads)), registered by layers/attentions.
ATTENTION_MACS: dict[str, Callable] = {}
# A linear token mixer (blocks.LayerKind.mixer other than attention) -> (config -> multiply-adds
# per token of a layer of it, all of them: its cost is linear in the length), registered by its layer.
MIXER_MACS: dict[str, Callable] = {}


def runs_in(runs: int, of: int):
  """Around a lax.cond in a loop body whose larger branch runs in only `runs` of the loop's `of`
  iterations (a pipeline schedule's phases): the walk (_executed) counts that branch runs / of
  times per iteration instead of in every one. Within another such branch, `of` counts the runs
  of that branch (the innermost scope is the cond's own)."""
  return jax.named_scope(f"runs_in_{runs}_of_{of}")


def _kernel_flops(eqn) -> float:
  name = eqn.params.get("name") or ""
  count = next((count for prefix, count in KERNEL_FLOPS.items() if name.startswith(prefix)), None)
  if count is not None:
    return count(eqn)
  estimate = eqn.params.get("cost_estimate")
  if estimate is None:
    raise ValueError(f"the Pallas kernel {name!r} declares no FLOPs (attentions.FlashKernel) and has no cost "
                     "estimate: the step's FLOPs cannot be counted")
  return float(estimate.flops)


def training_flops_per_step(config) -> float:
  """Model FLOPs of one optimizer step, all devices together (recomputation not counted).

  Matmuls: 2 FLOPs per multiply-add, forward plus a backward twice the forward. Causal
  attention scores and context count only the half of the T x T products that the mask keeps;
  the attention's own counts are its attention_type's (ATTENTION_MACS), a linear attention
  layer's its own (MIXER_MACS, by the layer's kind).
  A mixture of experts counts its active parameters only: the router, the
  num_experts_per_tok experts each token goes to and the shared experts; its dense layers
  (decoders.layer_kind) count a dense MLP. Multi-token prediction's mtp_num_layers layers count
  as decoder layers of their kind, each with its [2D, D] projection and its own pass through the
  output head.
  """
  d, m, v = config.base_emb_dim, config.base_mlp_dim, config.vocab_size
  mtp = config.mtp_num_layers
  layers, length, batch = config.base_num_decoder_layers, config.max_target_length, config.global_batch_size_to_train_on
  routed = moe_layers(config)
  active_experts = config.num_experts_per_tok + config.shared_experts
  moe_mlp = (d * config.num_experts + active_experts * 3 * d * config.base_moe_mlp_dim
             + d * bool(config.shared_experts and config.shared_expert_gate))
  mlp_params = routed * moe_mlp + (layers + mtp - routed) * 3 * d * m
  attention_params, per_pair = ATTENTION_MACS[config.attention_type](config)
  mixers = [layer_kind(config, i).mixer for i in range(layers + mtp)]
  attending = mixers.count("attention")
  mixing = attending * attention_params + sum(MIXER_MACS[m](config) for m in mixers if m != "attention")
  matmul = 2 * batch * length * (mixing + mlp_params + mtp * 2 * d * d + (1 + mtp) * d * v)
  attention = 2 * batch * length * length * per_pair * attending / 2
  return 3 * (matmul + attention)


def _dot_flops(eqn) -> float:
  if eqn.primitive.name in PRIMITIVE_FLOPS:
    return PRIMITIVE_FLOPS[eqn.primitive.name](eqn)
  if eqn.primitive.name == "pallas_call":
    return _kernel_flops(eqn)
  if eqn.primitive.name == "ragged_dot_general":
    return _ragged_dot_flops(eqn)
  (contracting, _), _ = eqn.params["dimension_numbers"]
  lhs = eqn.invars[0].aval
  return 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs.shape[d] for d in contracting)


def _ragged_dot_flops(eqn) -> float:
  """A grouped matmul does one group's product per row: every lhs element meets one group's
  rhs, so 2 * |lhs| * |rhs| / (contracted size * groups) (a dW product has no rhs groups)."""
  numbers = eqn.params["ragged_dot_dimension_numbers"]
  (_, rhs_contracting), _ = numbers.dot_dimension_numbers
  lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
  per_row = math.prod(rhs[d] for d in (*rhs_contracting, *numbers.rhs_group_dimensions))
  return 2 * math.prod(lhs) * math.prod(rhs) / per_row


def _dot_bytes(eqn) -> float:
  return sum(math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in (*eqn.invars, *eqn.outvars))


# The matrix products: dots, and Pallas kernels (custom calls to XLA, which counts no FLOPs in them).
_PRODUCTS = ("dot_general", "ragged_dot_general", "pallas_call")


def _executed(jaxpr, cost, axis_sizes=None) -> float:
  """cost(eqn, axis_sizes) summed over the equations a jaxpr executes (None: not counted, its
  sub-jaxprs are), all devices together:
  loop bodies times their trip counts, remat's recomputation included (it is in the traced
  backward pass), the larger branch of a cond (in the share of a loop's iterations it declares,
  runs_in). XLA's cost analysis counts a loop body once,
  which undercounts scanned layers and vocabulary tiles. axis_sizes: {mesh axis: size} of the
  enclosing shard_map, for collectives."""
  total = 0.0
  for eqn in jaxpr.eqns:
    own = cost(eqn, axis_sizes)
    if own is not None:
      total += own
      continue
    sizes = dict(eqn.params["mesh"].shape) if eqn.primitive.name == "shard_map" else axis_sizes
    inner = [_executed(getattr(sub, "jaxpr", sub), cost, sizes) for value in eqn.params.values()
             for sub in (value if isinstance(value, (tuple, list)) else (value,))
             if isinstance(sub, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))]
    if eqn.primitive.name == "scan":
      total += eqn.params["length"] * sum(inner)
    elif eqn.primitive.name == "cond":
      total += runs_share(str(eqn.source_info.name_stack)) * max(inner)
    elif eqn.primitive.name == "shard_map":  # the body sees one device's shard
      total += eqn.params["mesh"].size * sum(inner)
    else:
      total += sum(inner)
  return total


def _fused(eqn) -> bool:
  return eqn.primitive.name == "pallas_call" or eqn.primitive.name in PRIMITIVE_FLOPS


def _products(cost):
  """cost restricted to the matrix products."""
  return lambda eqn, _: cost(eqn) if eqn.primitive.name in _PRODUCTS or _fused(eqn) else None


def matmul_flops(jaxpr) -> float:
  """FLOPs of the matrix products a jaxpr executes (see _executed), grouped (ragged) ones and the
  Pallas kernels' (KERNEL_FLOPS) included."""
  return _executed(jaxpr, _products(_dot_flops))


def precision(eqn) -> str:
  """The type a matrix product multiplies in: int8 or fp8 where both operands are (quantization),
  else bf16 (whatever wider type: the chip's bfloat16 rate bounds it)."""
  types = {str(v.aval.dtype) for v in eqn.invars[:2]}
  if types == {"int8"}:
    return "int8"
  return "fp8" if all(t.startswith("float8") for t in types) else "bf16"


def flops_by_precision(jaxpr) -> dict:
  """matmul_flops split by the type each product multiplies in ({bf16, int8, fp8: FLOPs}, the
  last two where any); fused kernels count as bf16."""
  split = {kind: _executed(jaxpr, _products(lambda eqn, kind=kind: _dot_flops(eqn) if (
      "bf16" if _fused(eqn) else precision(eqn)) == kind else 0.0)) for kind in ("bf16", "int8", "fp8")}
  return {kind: flops for kind, flops in split.items() if flops or kind == "bf16"}


def seconds_at_peak(by_precision: dict, chip, devices: int) -> float:
  """The least time the products take on `devices` chips, each precision's at its own peak."""
  return sum(flops / devices / (chip.peak_tflops(kind) * 1e12) for kind, flops in by_precision.items())


def compiled_products(hlo_text: str) -> dict:
  """{"<lhs type> x <rhs type>": count} of the matrix products in compiled HLO text (dot, and the
  convolution a TPU compiles a matmul to), by their operands' element types as the compiled
  program holds them: whether the quantized products survived into what runs."""
  types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo_text))
  types.update(re.findall(r"\b(param_[\d.]+): (\w+)\[", hlo_text))  # fused computations' parameters
  counts = {}
  for lhs, rhs in re.findall(r"= \w+\[[^=]*? (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", hlo_text):
    key = f"{types.get(lhs, '?')} x {types.get(rhs, '?')}"
    counts[key] = counts.get(key, 0) + 1
  return dict(sorted(counts.items()))


def kernel_flops(jaxpr) -> float:
  """The part of matmul_flops in fused kernels (Pallas's and PRIMITIVE_FLOPS')."""
  return _executed(jaxpr, _products(lambda eqn: _dot_flops(eqn) if _fused(eqn) else 0.0))


def matmul_bytes(jaxpr) -> float:
  """Bytes the matrix products a jaxpr executes read and write, each operand and result once
  (see _executed): the memory traffic of the matmuls, fusion aside."""
  return _executed(jaxpr, _products(_dot_bytes))


def _axes_of(eqn) -> str:
  """The mesh axes a collective runs over, joined by "+" ("context", "fsdp+context+expert")."""
  axes = eqn.params.get("axis_name", eqn.params.get("axes"))
  return "+".join((axes,) if isinstance(axes, str) else axes)


def _sent_bytes(eqn, axis_sizes, over: str) -> float | None:
  """Bytes one device sends in collective `eqn` if it runs over the axes `over`, 0 if over
  others, None if it is no collective."""
  if eqn.primitive.name not in SENT_PER_BYTE:
    return None
  if _axes_of(eqn) != over:
    return 0.0
  n = math.prod(axis_sizes[a] for a in over.split("+"))
  sizes = [math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars]
  # A ragged all-to-all sends data-dependent slices: counted as when they are balanced, the
  # smaller of its operand and its output buffer (the MoE's token copies; the other is sized
  # for the worst case).
  operand = min(sizes[:2]) if eqn.primitive.name == "ragged_all_to_all" else sum(sizes)
  return SENT_PER_BYTE[eqn.primitive.name](n) * operand


def collective_bytes(jaxpr) -> dict:
  """{mesh axes joined by "+": bytes sent over them, where any} by the collectives a jaxpr calls
  inside shard_map (context parallelism's gathers or ring over "context", expert parallelism's
  exchange, the sharded vocabulary arrays' gathers over every batch axis), all devices
  together, at loop trip counts. The partitioner's own collectives (FSDP's weight gathers) are
  not in a jaxpr."""
  groups = set()

  def collect(eqn, _):
    if eqn.primitive.name not in SENT_PER_BYTE:
      return None
    groups.add(_axes_of(eqn))
    return 0.0

  _executed(jaxpr, collect)
  sent = {over: _executed(jaxpr, lambda eqn, sizes, over=over: _sent_bytes(eqn, sizes, over))
          for over in sorted(groups)}
  return {over: bytes_ for over, bytes_ in sent.items() if bytes_}  # axes of size 1 send nothing


def peak_tflops(device_kind: str) -> float | None:
  """The chip's peak dense bfloat16 TFLOP/s, or None where unknown (CPUs among them)."""
  chip = accelerators.chip_of(device_kind)
  return chip.peak_bf16_tflops if chip else None


def memory_limit_bytes(device, host_sharers: int) -> int | None:
  """Memory of one device: what the runtime reports for a device this process drives, the
  chip's HBM for one it only compiles for (compile_topology), for a CPU device its share of the
  host's memory with the run's other devices in this process (`host_sharers`, it included), None
  for a chip of unknown memory."""
  if device.platform == "cpu":
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // host_sharers
  if device in jax.local_devices():
    stats = device.memory_stats()
    if stats and "bytes_limit" in stats:
      return int(stats["bytes_limit"])
  chip = accelerators.chip_of(device.device_kind)
  return int(chip.hbm_gib * 2**30) if chip else None


def fit_message(stats: dict, device, host_sharers: int) -> str | None:
  """None when the compiled step fits one device's memory (or that is unknown); else one line."""
  limit = memory_limit_bytes(device, host_sharers)
  if limit is None or stats["total_bytes"] <= limit:
    return None
  return (f"does not fit: the train step needs {stats['total_bytes'] / 2**30:.2f} GiB per device, "
          f"{(stats['total_bytes'] - limit) / 2**30:.2f} GiB more than the {limit / 2**30:.1f} GiB of one "
          f"{device.device_kind}")


def memory_stats(compiled) -> dict:
  """Per-device bytes of a compiled step. total = arguments + outputs - aliased + temporaries,
  all in device memory; host_bytes the same sum in host memory."""
  m = compiled.memory_analysis()
  stats = {
      "argument_bytes": int(m.argument_size_in_bytes),
      "output_bytes": int(m.output_size_in_bytes),
      "alias_bytes": int(m.alias_size_in_bytes),
      "temp_bytes": int(m.temp_size_in_bytes),
  }
  stats["total_bytes"] = (stats["argument_bytes"] + stats["output_bytes"] - stats["alias_bytes"]
                          + stats["temp_bytes"])
  # Host memory (pinned_host): what *_offloaded remat policies move off the device.
  stats["host_bytes"] = int(m.host_argument_size_in_bytes + m.host_output_size_in_bytes
                            - m.host_alias_size_in_bytes + m.host_temp_size_in_bytes)
  return stats




def largest_vocab_arrays(compiled, vocab_size: int, num_devices: int, count: int = 5) -> list:
  """[(shape, bytes)] of the `count` largest distinct array shapes in the per-device program
  with a vocabulary dimension (vocab_size, or a shard of it), largest first: the loss side's
  buffers (logits tiles, the head kernel as the matmuls see it, its gradient and optimizer
  state), as named by the compiled HLO."""
  vocab = {vocab_size // k for k in range(1, num_devices + 1) if vocab_size % k == 0}
  sizes = {}
  for dtype, dims in re.findall(r"= (\w+)\[([\d,]+)\]", compiled.as_text()):
    shape = [int(d) for d in dims.split(",")]
    if dtype in HLO_BYTES and vocab & set(shape):
      sizes[f"{dtype}[{dims}]"] = math.prod(shape) * HLO_BYTES[dtype]
  return sorted(sizes.items(), key=lambda item: -item[1])[:count]


def format_memory_stats(stats: dict) -> str:
  return "\n".join(f"  {k:15s} {v:16,d} bytes  {v / 2**30:9.3f} GiB" for k, v in stats.items())


def memory_report(stats: dict, mesh) -> tuple[dict, str | None]:
  """(a compiled step's memory_stats with one device of `mesh`'s memory and whether the step fits
  it, None or the one line saying by how much it does not): what train checks before a run and
  memory_stats_file holds."""
  device = mesh.devices.flat[0]
  sharers = sum(d.process_index == jax.process_index() for d in mesh.devices.flat)
  problem = fit_message(stats, device, sharers)
  return {**stats, "fits": problem is None, "device_memory_bytes": memory_limit_bytes(device, sharers)}, problem


def flops_report(config, jaxpr) -> dict:
  """The model's FLOPs per step, those the traced step executes (recomputation, masked attention
  blocks and all; and by the type they multiply in) and the bytes each device sends in shard_map
  collectives, by mesh axes."""
  return {"model_flops_per_step": training_flops_per_step(config), "traced_flops_per_step": matmul_flops(jaxpr),
          "traced_flops_by_precision": flops_by_precision(jaxpr),
          "collective_bytes_per_device": {axes: sent / config.num_devices
                                          for axes, sent in collective_bytes(jaxpr).items()}}
