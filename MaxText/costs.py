"""What a train step costs: the model's FLOPs (training_flops_per_step), the FLOPs, bytes and
collectives a traced step executes (a walk of its jaxpr at loop trip counts), the compiled
step's memory against one device's, and the report train, train_compile and the planner all read
(memory_report, flops_report).

A Pallas kernel is a custom call whose FLOPs XLA does not see: each flash kernel declares its
count in its own record (layers/attentions.FlashKernel), which the model registers here in
KERNEL_FLOPS (this layer is below the model's); any other kernel counts its own cost estimate, and
one with neither stops the count naming it, never a silent zero.
"""

import collections
import functools
import math
import os
import re
from typing import Callable, NamedTuple

import jax
import jax.extend
import numpy as np

from MaxText import accelerators
from MaxText.layers.blocks import layer_kind

# pallas_call name prefix -> its FLOPs (eqn -> float), and a fused kernel that is a primitive of
# its own (cuDNN's attention) -> its FLOPs, as the flash kernels' records declare them
# (layers/attentions registers every record's).
KERNEL_FLOPS: dict[str, Callable] = {}
PRIMITIVE_FLOPS: dict[str, Callable] = {}
# attention_type -> (config -> (multiply-adds per token of a layer's attention projections, per
# (query, key) pair of its scores and context, all heads)), registered by layers/attentions.
ATTENTION_MACS: dict[str, Callable] = {}


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
  the attention's own counts are its attention_type's (ATTENTION_MACS).
  A mixture of experts counts its active parameters only: the router, the
  num_experts_per_tok experts each token goes to and the shared experts; its dense layers
  (decoders.layer_kind) count a dense MLP. Multi-token prediction's mtp_num_layers layers count
  as decoder layers of their kind, each with its [2D, D] projection and its own pass through the
  output head.
  """
  d, m, v = config.base_emb_dim, config.base_mlp_dim, config.vocab_size
  mtp = config.mtp_num_layers
  layers, length, batch = config.base_num_decoder_layers, config.max_target_length, config.global_batch_size_to_train_on
  moe_layers = sum(layer_kind(config, i).moe for i in range(layers + mtp))
  active_experts = config.num_experts_per_tok + config.shared_experts
  moe_mlp = d * config.num_experts + active_experts * 3 * d * config.base_moe_mlp_dim
  mlp_params = moe_layers * moe_mlp + (layers + mtp - moe_layers) * 3 * d * m
  attention_params, per_pair = ATTENTION_MACS[config.attention_type](config)
  matmul = 2 * batch * length * ((layers + mtp) * attention_params + mlp_params + mtp * 2 * d * d + (1 + mtp) * d * v)
  attention = 2 * batch * length * length * per_pair * (layers + mtp) / 2
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
  backward pass), the larger branch of a cond. XLA's cost analysis counts a loop body once,
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
      total += max(inner)
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


def kernel_flops(jaxpr) -> float:
  """The part of matmul_flops in fused kernels (Pallas's and PRIMITIVE_FLOPS')."""
  return _executed(jaxpr, _products(lambda eqn: _dot_flops(eqn) if _fused(eqn) else 0.0))


def matmul_bytes(jaxpr) -> float:
  """Bytes the matrix products a jaxpr executes read and write, each operand and result once
  (see _executed): the memory traffic of the matmuls, fusion aside."""
  return _executed(jaxpr, _products(_dot_bytes))


# Bytes one device sends per byte of its operand in a collective over n devices, by the ring
# algorithms: an all-gather forwards n - 1 shards, an all-reduce reduce-scatters then gathers.
_SENT_PER_BYTE = {"ppermute": lambda n: 1.0, "all_gather": lambda n: n - 1.0, "reduce_scatter": lambda n: (n - 1) / n,
                  "all_to_all": lambda n: (n - 1) / n, "psum": lambda n: 2 * (n - 1) / n,
                  "psum_invariant": lambda n: 2 * (n - 1) / n, "ragged_all_to_all": lambda n: (n - 1) / n}


def _axes_of(eqn) -> str:
  """The mesh axes a collective runs over, joined by "+" ("context", "fsdp+context+expert")."""
  axes = eqn.params.get("axis_name", eqn.params.get("axes"))
  return "+".join((axes,) if isinstance(axes, str) else axes)


def _sent_bytes(eqn, axis_sizes, over: str) -> float | None:
  """Bytes one device sends in collective `eqn` if it runs over the axes `over`, 0 if over
  others, None if it is no collective."""
  if eqn.primitive.name not in _SENT_PER_BYTE:
    return None
  if _axes_of(eqn) != over:
    return 0.0
  n = math.prod(axis_sizes[a] for a in over.split("+"))
  sizes = [math.prod(v.aval.shape) * v.aval.dtype.itemsize for v in eqn.invars]
  # A ragged all-to-all sends data-dependent slices: counted as when they are balanced, the
  # smaller of its operand and its output buffer (the MoE's token copies; the other is sized
  # for the worst case).
  operand = min(sizes[:2]) if eqn.primitive.name == "ragged_all_to_all" else sum(sizes)
  return _SENT_PER_BYTE[eqn.primitive.name](n) * operand


def collective_bytes(jaxpr) -> dict:
  """{mesh axes joined by "+": bytes sent over them, where any} by the collectives a jaxpr calls
  inside shard_map (context parallelism's gathers or ring over "context", expert parallelism's
  exchange, the sharded vocabulary arrays' gathers over every batch axis), all devices
  together, at loop trip counts. The partitioner's own collectives (FSDP's weight gathers) are
  not in a jaxpr."""
  groups = set()

  def collect(eqn, _):
    if eqn.primitive.name not in _SENT_PER_BYTE:
      return None
    groups.add(_axes_of(eqn))
    return 0.0

  _executed(jaxpr, collect)
  sent = {over: _executed(jaxpr, lambda eqn, sizes, over=over: _sent_bytes(eqn, sizes, over))
          for over in sorted(groups)}
  return {over: bytes_ for over, bytes_ in sent.items() if bytes_}  # axes of size 1 send nothing


# Bytes per element of the HLO element types an array of a train step can have.
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
              "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}

# An HLO collective -> the jax primitive whose _SENT_PER_BYTE it sends by; its asynchronous
# -start/-done pair counts once, at the -done.
_HLO_COLLECTIVES = {"all-gather": "all_gather", "all-reduce": "psum", "reduce-scatter": "reduce_scatter",
                    "all-to-all": "all_to_all", "collective-permute": "ppermute",
                    "ragged-all-to-all": "ragged_all_to_all"}
# libtpu compiles a multi-slice step as one slice's program: the collectives between slices are
# sends to its megascale (DCN) runtime, of these kinds, naming their peers by device id.
_MEGASCALE_TRANSFERS = {"ALL_GATHER": "all_gather", "ALL_REDUCE": "psum", "REDUCE_SCATTER": "reduce_scatter",
                        "ALL_TO_ALL": "all_to_all", "ONE_TO_ONE": "ppermute"}
# libtpu numbers a multi-slice topology's devices (slice_index + 1) * 100000 + their number in the
# slice; a megascale target "{1,2}x{0:3}" is slices 1 and 2 of that numbering times chips 0 to 3.
_MEGASCALE_SLICE_STRIDE = 100000

_INSTRUCTION = re.compile(r"\s*(?:ROOT )?%(\S+) = ")
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")


class _Op(NamedTuple):
  """One instruction of an HLO module's text."""
  name: str
  shape: str
  opcode: str
  operands: list  # the names of its operands
  args: str  # the text between its parentheses (a constant's value)
  attributes: str


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape, a tuple's elements summed (tokens and layouts are not arrays)."""
  return sum(math.prod(int(d) for d in dims.split(",") if d) * _HLO_BYTES[dtype]
             for dtype, dims in _ARRAY.findall(re.sub(r"\{[^}]*\}", "", shape)) if dtype in _HLO_BYTES)


def _closing(text: str, start: int) -> int:
  """The index just past the bracket that closes the one at text[start]."""
  pairs, depth = {"(": ")", "{": "}", "[": "]"}, []
  for i in range(start, len(text)):
    if text[i] in pairs:
      depth.append(pairs[text[i]])
    elif depth and text[i] == depth[-1]:
      depth.pop()
      if not depth:
        return i + 1
  raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


def _parse_hlo(text: str) -> tuple[dict, str, int]:
  """({computation: [its instructions]}, the entry computation, num_partitions) of a compiled
  module's text."""
  computations, entry, current = {}, None, None
  partitions = re.search(r"num_partitions=(\d+)", text.split("\n", 1)[0])
  for line in text.splitlines():
    header = re.match(r"(ENTRY )?%(\S+) \(", line)
    if header:
      current = computations.setdefault(header.group(2), [])
      entry = header.group(2) if header.group(1) else entry
      continue
    head = _INSTRUCTION.match(line)
    if not head or current is None:
      continue
    rest = line[head.end():]
    end = _closing(rest, 0) if rest.startswith("(") else rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    opcode = rest[:rest.index("(")]
    close = _closing(rest, len(opcode))
    args = rest[len(opcode) + 1:close - 1]
    current.append(_Op(head.group(1), shape, opcode, re.findall(r"%([^\s,)]+)", args), args, rest[close:]))
  return computations, entry, int(partitions.group(1)) if partitions else 1


def _braced(attributes: str, key: str) -> str | None:
  """The value of `key=` in an instruction's attributes, brackets and all."""
  at = attributes.find(f"{key}=")
  if at < 0:
    return None
  start = at + len(key) + 1
  bracket = start + 4 if attributes.startswith("mesh[", start) else start
  if attributes[bracket] in "{[(":
    end = _closing(attributes, bracket)
    # The iota form [2,4]<=[8]T(1,0) and a mesh's axes {'x'} run on past the first bracket.
    tail = re.match(r"<=\[[\d,]*\](?:T\([\d,]*\))?|(?:, device_ids=\([^)]*\))? \{[^}]*\}", attributes[end:])
    return attributes[start:end + (tail.end() if tail else 0)]
  return re.match(r'"[^"]*"|[^,\s]*', attributes[start:]).group(0)


def _iota(dims: str, reshape: str, perm: str | None) -> np.ndarray:
  """XLA's iota tile assignment [dims]<=[reshape]T(perm)."""
  ints = lambda s: [int(d) for d in s.split(",") if d]
  ids = np.arange(math.prod(ints(reshape))).reshape(ints(reshape))
  return (ids.transpose(ints(perm)) if perm else ids).reshape(ints(dims))


def _mesh_groups(spec: str) -> np.ndarray:
  """Groups of the mesh form mesh['x'=2,'y'=4](, device_ids=(...)) {'y'}: the devices that differ
  only along the named axes (a sub-axis 'y':(p)s being the middle factor of y = [p, s, rest])."""
  axes_text, ids_text, group_text = re.fullmatch(r"mesh\[([^\]]*)\](?:, device_ids=\((.*)\))? \{(.*)\}", spec).groups()
  names = [n.strip("'\"") for n, _ in (a.split("=") for a in axes_text.split(","))]
  sizes = [int(size) for _, size in (a.split("=") for a in axes_text.split(","))]
  if ids_text is None:
    ids = np.arange(math.prod(sizes)).reshape(sizes)
  elif "<=" in ids_text:
    ids = _iota(*re.fullmatch(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", ids_text.strip()).groups())
  else:
    ids = np.array([int(d) for d in re.findall(r"\d+", ids_text)])
  refs = [re.fullmatch(r"'?([^':]+)'?(?::\((\d+)\)(\d+))?", r.strip()).groups() for r in group_text.split(",")]
  # Split each axis at its sub-axes' edges, and take the factors the named (sub-)axes cover.
  factors, grouped = [], []
  for name, size in zip(names, sizes):
    edges = sorted({1, size} | {e for n, pre, sub in refs if n == name and pre
                                for e in (int(pre), int(pre) * int(sub))})
    for low, high in zip(edges, edges[1:]):
      if any(n == name and (not pre or int(pre) <= low and high <= int(pre) * int(sub)) for n, pre, sub in refs):
        grouped.append(len(factors))
      factors.append(high // low)
  ids = ids.reshape(factors)
  rest = [i for i in range(len(factors)) if i not in grouped]
  return ids.transpose(rest + grouped).reshape(-1, math.prod(factors[i] for i in grouped))


def _replica_groups(spec: str, partitions: int) -> list:
  """The device groups (as ids in the program's device assignment) of a replica_groups value."""
  if spec.startswith("mesh"):
    return _mesh_groups(spec).tolist()
  iota = re.fullmatch(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?", spec)
  if iota:
    return _iota(*iota.groups()).tolist()
  groups = [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", spec)]
  return groups or [list(range(partitions))]  # {}: every device in one group


def _megascale_peers(target: str) -> tuple[list, list]:
  """(groups, source-target pairs) of device ids of a megascale transfer's target."""
  pairs = [(int(a), int(b)) for a, b in re.findall(r"\{(\d+)->(\d+)\}", target)]
  product = re.fullmatch(r'"?\{([\d,:]*)\}x\{([\d,:]*)\}"?', target)
  if product:
    def members(text):
      return [i for item in text.split(",") for i in (range(int(item.split(":")[0]), int(item.split(":")[1]) + 1)
                                                       if ":" in item else [int(item)])]
    slices, chips = members(product.group(1)), members(product.group(2))
    return [[s * _MEGASCALE_SLICE_STRIDE + c for s in slices] for c in chips], pairs
  return ([] if pairs else [[int(d) for d in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", target)]), pairs


def _trip_count(op, instructions: dict, computations: dict) -> int | None:
  """Iterations of a while loop: XLA's known_trip_count where the compiler writes it (XLA:CPU),
  else from its condition `i < n` on a counter that starts at a constant and that jax's loops
  step by 1 (libtpu writes no count); None when neither says."""
  known = re.search(r'"known_trip_count":\{"n":"(\d+)"', op.attributes)
  if known:
    return int(known.group(1))
  root = computations[_braced(op.attributes, "condition").lstrip("%")][-1]
  direction = re.search(r"direction=(\w+)", root.attributes)
  if root.opcode != "compare" or direction is None or direction.group(1) not in ("LT", "GT"):
    return None

  def resolve(name):  # a constant's value, or ("counter", its index in the loop's tuple)
    value = instructions[name]
    while value.opcode in ("copy", "bitcast", "convert"):
      value = instructions[value.operands[0]]
    if value.opcode == "constant" and re.fullmatch(r"-?\d+", value.args):
      return int(value.args)
    index = re.search(r"index=(\d+)", value.attributes)
    return ("counter", int(index.group(1))) if value.opcode == "get-tuple-element" and index else None

  counter, bound = (resolve(n) for n in root.operands)
  if direction.group(1) == "GT":
    counter, bound = bound, counter
  if not (isinstance(counter, tuple) and isinstance(bound, int)):
    return None
  start = instructions[op.operands[0]]
  if start.opcode != "tuple":
    return None
  first = resolve(start.operands[counter[1]])
  return max(bound - first, 0) if isinstance(first, int) else None


def _called(op) -> list:
  """The computations an instruction runs once each time it runs (a fusion's, a call's, an
  asynchronous op's at its start)."""
  if op.opcode in ("async-done", "async-update", "while", "conditional"):
    return []
  return [name for key in ("calls", "to_apply", "called_computations")
          for name in re.findall(r"%([^\s,}]+)", _braced(op.attributes, key) or "")]


def _device_slice(device):
  """The unit that dcn_* axes span: a TPU slice, or else a process."""
  # A single slice's devices have no slice_index.
  return getattr(device, "slice_index", 0) if device.platform == "tpu" else device.process_index


def network_bytes(hlo: str, mesh, slice_of: Callable | None = None) -> dict:
  """Bytes a device sends per step in the collectives of a compiled step (`compiled.as_text()`
  of a program jitted with shardings over `mesh`), the partitioner's and shard_map's alike, the
  mean over the mesh's devices: {"dcn": sent in collectives whose groups span more than one
  slice (`slice_of(device)`, the TPU slice or else the process), "ici": in those within a slice,
  "by_axes": {the mesh axes a group spans, joined by "+": {"dcn": ..., "ici": ...}},
  "unknown_trip_counts": loops with collectives whose trip count the HLO does not say, counted
  once}.

  Per device by the ring algorithms (_SENT_PER_BYTE): an all-gather of n devices sends n - 1
  shards, a reduce-scatter (n - 1) / n of its input, an all-reduce twice that, an all-to-all
  (n - 1) / n, a collective-permute its operand from each source that is not its own target.
  Loop bodies count at their trip counts (nested loops multiply), a conditional its costliest
  branch. A group's device ids are positions in the compiled device assignment, which for a
  jitted function with NamedShardings over `mesh` is mesh.devices.flat; libtpu's program for
  several slices is one slice's (num_partitions the slice's devices), and its sends to the
  megascale runtime, which name devices by id, are the collectives between slices.
  """
  slice_of = slice_of or _device_slice
  computations, entry, partitions = _parse_hlo(hlo)
  instructions = {op.name: op for ops in computations.values() for op in ops}
  devices = list(mesh.devices.flat)
  program = devices if partitions == len(devices) else [d for d in devices if slice_of(d) == slice_of(devices[0])]
  if len(program) != partitions:
    raise ValueError(f"a program for {partitions} devices, over a mesh of {len(devices)}")
  position = {d: i for i, d in enumerate(devices)}
  by_id = {d.id: d for d in devices}
  coords = np.stack(np.unravel_index(np.arange(len(devices)), mesh.devices.shape), axis=1)
  copies = len(devices) // partitions  # every slice runs a one-slice program

  def over(group) -> tuple[str, bool]:  # (the mesh axes a group spans, whether it spans slices)
    spread = np.ptp(coords[[position[d] for d in group]], axis=0)
    return "+".join(a for a, s in zip(mesh.axis_names, spread) if s), len({slice_of(d) for d in group}) > 1

  @functools.cache
  def sending(spec: str, pairs: bool, megascale: bool) -> tuple:
    """((mesh axes, across slices, devices in the group, how many such groups or sending pairs))."""
    device = by_id.__getitem__ if megascale else program.__getitem__
    if megascale:
      groups, edges = _megascale_peers(spec)
    elif pairs:
      groups, edges = [], [(int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", spec)]
    else:
      groups, edges = _replica_groups(spec, partitions), []
    counts = collections.Counter((*over([device(i) for i in g]), len(g)) for g in groups if len(g) > 1)
    counts.update((*over([device(a), device(b)]), 2) for a, b in edges if a != b)
    return tuple((*key, count) for key, count in counts.items())

  def sent(op) -> collections.Counter:
    """{(mesh axes, across slices): bytes}, all devices together, of one collective."""
    megascale = op.opcode == "send" and "_xla_megascale_transfer_type" in op.attributes
    if megascale:
      primitive = _MEGASCALE_TRANSFERS[re.search(r'_xla_megascale_transfer_type="(\w+)"', op.attributes).group(1)]
      spec, operands = _braced(op.attributes, "_xla_megascale_target"), op.operands[:1]
    else:
      primitive = _HLO_COLLECTIVES.get(op.opcode.removesuffix("-done"))
      if primitive is None:  # not a collective, or an asynchronous one's -start
        return collections.Counter()
      start = instructions[op.operands[0]] if op.opcode.endswith("-done") else op
      spec = _braced(start.attributes, "source_target_pairs" if primitive == "ppermute" else "replica_groups")
      operands = start.operands[:1] if primitive == "ppermute" else start.operands
    sizes = [_shape_bytes(instructions[name].shape) for name in operands]
    # A ragged all-to-all as when balanced, like the jaxpr count: the smaller of its operand and output buffer.
    operand = min(sizes[:2]) if primitive == "ragged_all_to_all" else sum(sizes)
    total = collections.Counter()
    for axes, crosses, n, count in sending(spec or "{}", primitive == "ppermute" and not megascale, megascale):
      senders = count if primitive == "ppermute" else count * n  # a permute's count is of sending pairs
      total[axes, crosses] += senders * _SENT_PER_BYTE[primitive](n) * operand * (1 if megascale else copies)
    return total

  unknown = set()

  @functools.cache
  def executed(computation: str) -> collections.Counter:
    total = collections.Counter()
    for op in computations[computation]:
      total.update(sent(op))
      for called in _called(op):
        total.update(executed(called))
      if op.opcode == "while":
        body = executed(_braced(op.attributes, "body").lstrip("%"))
        trips = _trip_count(op, instructions, computations)
        if trips is None and body:
          unknown.add(op.name)
        total.update({key: (1 if trips is None else trips) * sent_ for key, sent_ in body.items()})
      elif op.opcode == "conditional":
        branches = [executed(name) for key in ("branch_computations", "true_computation", "false_computation")
                    for name in re.findall(r"%([^\s,}]+)", _braced(op.attributes, key) or "")]
        total.update(max(branches, key=lambda b: sum(b.values()), default=collections.Counter()))
    return total

  per_device = {key: sent_ / len(devices) for key, sent_ in executed(entry).items()}
  by_axes = {}
  for (axes, crosses), sent_ in sorted(per_device.items()):
    by_axes.setdefault(axes, {"dcn": 0.0, "ici": 0.0})["dcn" if crosses else "ici"] += sent_
  return {"dcn": sum((s for (_, crosses), s in per_device.items() if crosses), 0.0),
          "ici": sum((s for (_, crosses), s in per_device.items() if not crosses), 0.0),
          "by_axes": by_axes, "unknown_trip_counts": len(unknown)}


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
    if dtype in _HLO_BYTES and vocab & set(shape):
      sizes[f"{dtype}[{dims}]"] = math.prod(shape) * _HLO_BYTES[dtype]
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
  blocks and all) and the bytes each device sends in shard_map collectives, by mesh axes."""
  return {"model_flops_per_step": training_flops_per_step(config), "traced_flops_per_step": matmul_flops(jaxpr),
          "collective_bytes_per_device": {axes: sent / config.num_devices
                                          for axes, sent in collective_bytes(jaxpr).items()}}
