"""What each device sends over the network in a compiled step: its collectives read from the
HLO text at their loops' trip counts, each by the ring algorithms' bytes, split into what
crosses slices (dcn) and what stays within one (ici), by the mesh axes they run over
(`network_bytes`, which train_compile reports). `SENT_PER_BYTE` is also the cost model's count of
a traced step's collectives (costs.collective_bytes)."""

import collections
import functools
import math
import re
from typing import Callable, NamedTuple

import numpy as np

# Bytes one device sends per byte of its operand in a collective over n devices, by the ring
# algorithms: an all-gather forwards n - 1 shards, an all-reduce reduce-scatters then gathers.
SENT_PER_BYTE = {"ppermute": lambda n: 1.0, "all_gather": lambda n: n - 1.0, "reduce_scatter": lambda n: (n - 1) / n,
                  "all_to_all": lambda n: (n - 1) / n, "psum": lambda n: 2 * (n - 1) / n,
                  "psum_invariant": lambda n: 2 * (n - 1) / n, "ragged_all_to_all": lambda n: (n - 1) / n}


# Bytes per element of the HLO element types an array of a train step can have.
HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
              "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}

# An HLO collective -> the jax primitive whose SENT_PER_BYTE it sends by; its asynchronous
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

# A conditional phase of a loop body that runs in only some of the loop's iterations (a pipeline
# schedule's) declares it in its name scope (costs.runs_in): runs_in_<runs>_of_<iterations>.
RUNS_IN = re.compile(r"runs_in_(\d+)_of_(\d+)")


def runs_share(name: str) -> float:
  """The share of its loop's iterations that the innermost runs_in scope of `name` declares (1 where none)."""
  declared = RUNS_IN.findall(name)
  return int(declared[-1][0]) / int(declared[-1][1]) if declared else 1.0


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


def _typed_bytes(shape: str) -> collections.Counter:
  """{element type: bytes} of an HLO shape, a tuple's elements summed (tokens and layouts are not arrays)."""
  typed = collections.Counter()
  for dtype, dims in _ARRAY.findall(re.sub(r"\{[^}]*\}", "", shape)):
    if dtype in HLO_BYTES:
      typed[dtype] += math.prod(int(d) for d in dims.split(",") if d) * HLO_BYTES[dtype]
  return typed


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
  "by_type": {"<collective> <element type>", e.g. "all_gather bf16": {"dcn": ..., "ici": ...}},
  "unknown_trip_counts": loops with collectives whose trip count the HLO does not say, counted
  once}.

  Per device by the ring algorithms (SENT_PER_BYTE): an all-gather of n devices sends n - 1
  shards, a reduce-scatter (n - 1) / n of its input, an all-reduce twice that, an all-to-all
  (n - 1) / n, a collective-permute its operand from each source that is not its own target.
  Loop bodies count at their trip counts (nested loops multiply), a conditional its costliest
  branch (in the share of its loop's iterations its name scope declares, costs.runs_in). A
  group's device ids are positions in the compiled device assignment, which for a jitted
  function with NamedShardings over `mesh` is mesh.devices.flat; libtpu's program for
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
    sizes = [_typed_bytes(instructions[name].shape) for name in operands]
    # A ragged all-to-all as when balanced, like the jaxpr count: the smaller of its operand and output buffer.
    operand = (min(sizes[:2], key=lambda typed: sum(typed.values())) if primitive == "ragged_all_to_all"
               else sum(sizes, collections.Counter()))
    total = collections.Counter()
    for axes, crosses, n, count in sending(spec or "{}", primitive == "ppermute" and not megascale, megascale):
      senders = count if primitive == "ppermute" else count * n  # a permute's count is of sending pairs
      for dtype, size in operand.items():
        total[axes, crosses, primitive, dtype] += senders * SENT_PER_BYTE[primitive](n) * size * (
            1 if megascale else copies)
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
        costliest = max(branches, key=lambda b: sum(b.values()), default=collections.Counter())
        name = re.search(r'op_name="([^"]*)"', op.attributes)
        share = runs_share(name.group(1)) if name else 1.0
        total.update({key: share * sent_ for key, sent_ in costliest.items()})
    return total

  per_device = {key: sent_ / len(devices) for key, sent_ in executed(entry).items()}
  by_axes, by_type = {}, {}
  for (axes, crosses, primitive, dtype), sent_ in sorted(per_device.items()):
    where = "dcn" if crosses else "ici"
    by_axes.setdefault(axes, {"dcn": 0.0, "ici": 0.0})[where] += sent_
    by_type.setdefault(f"{primitive} {dtype}", {"dcn": 0.0, "ici": 0.0})[where] += sent_
  return {"dcn": sum((s for (_, crosses, _, _), s in per_device.items() if crosses), 0.0),
          "ici": sum((s for (_, crosses, _, _), s in per_device.items() if not crosses), 0.0),
          "by_axes": by_axes, "by_type": by_type, "unknown_trip_counts": len(unknown)}
