"""The devices and their mesh: which devices a run is for, the (data, pipeline, fsdp, tensor,
context, expert) mesh sizes from ici_*/dcn_*_parallelism, the check that every sharded dimension divides, and
logical-axis sharding (flax logical axis rules over jax.sharding)."""

import contextlib
import math
import os

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from MaxText import accelerators
from MaxText.errors import ConfigError, UserError, first_line

MESH_AXES = ("data", "pipeline", "fsdp", "tensor", "context", "expert")
BATCH = ("activation_batch", "activation_length")


def _resolve(v: dict, prefix: str, total: int, what: str) -> tuple:
  """The {prefix}_*_parallelism sizes, one per mesh axis, with a -1 filled, multiplying to `total`."""
  keys = [f"{prefix}_{axis}_parallelism" for axis in MESH_AXES]
  sizes = [v[k] for k in keys]
  for key, size in zip(keys, sizes):
    if not (size >= 1 or size == -1):
      raise ConfigError(f"{key}={size!r}: must be >= 1, or -1 to fill the rest")
  fills = [k for k, s in zip(keys, sizes) if s == -1]
  if len(fills) > 1:
    raise ConfigError(f"{', '.join(fills)}: at most one {prefix}_*_parallelism may be -1")
  known = math.prod(s for s in sizes if s != -1)
  if fills:
    if total % known:
      raise ConfigError(f"{fills[0]}=-1: the other {prefix}_*_parallelism multiply to {known}, "
                        f"which does not divide the {total} {what}")
    sizes = [total // known if s == -1 else s for s in sizes]
  if math.prod(sizes) != total:
    raise ConfigError(f"{'*'.join(keys)} = {math.prod(sizes)}: must equal the {total} {what}")
  return tuple(sizes)


def mesh_shapes(v: dict, num_devices: int, num_granules: int) -> tuple[tuple, tuple]:
  """(ici shape, dcn shape) over MESH_AXES; granules are TPU slices or processes."""
  if all(v[f"dcn_{axis}_parallelism"] == 1 for axis in MESH_AXES):
    if v["platform"] == "tpu" and num_granules > 1:  # ici axes stay within a slice
      raise ConfigError(f"dcn_*_parallelism: all 1, but the devices are {num_granules} TPU slices, which only dcn_* "
                        f"axes join; set them to multiply to {num_granules} (e.g. dcn_data_parallelism={num_granules})")
    return _resolve(v, "ici", num_devices, "devices"), (1,) * len(MESH_AXES)
  dcn = _resolve(v, "dcn", num_granules, "slices/processes")
  if num_devices % num_granules:
    raise ConfigError(f"dcn_*_parallelism: the {num_devices} devices do not split evenly over "
                      f"{num_granules} slices/processes")
  return _resolve(v, "ici", num_devices // num_granules, "devices per slice/process"), dcn


def initialize_distributed(v: dict) -> None:
  """jax.distributed.initialize when this is one of several processes (see base.yml)."""
  launched = (any(int(os.environ.get(k, "1")) > 1 for k in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"))
              or "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""))
  wanted = (v["jax_distributed_coordinator"] or os.environ.get("JAX_COORDINATOR_ADDRESS")
            or (v["jax_num_processes"] or 1) > 1 or launched)
  if not wanted or jax.distributed.is_initialized():
    return
  try:
    jax.distributed.initialize(coordinator_address=v["jax_distributed_coordinator"] or None,
                               num_processes=v["jax_num_processes"], process_id=v["jax_process_id"])
  except (ValueError, RuntimeError) as e:
    raise UserError(f"jax.distributed.initialize failed (jax_distributed_coordinator="
                    f"{v['jax_distributed_coordinator']!r}): {first_line(e)}") from None


def run_devices(compile_topology: str, num_slices: int) -> list:
  """The devices a run is for: compile_topology's TPU slices (for train_compile), or JAX's."""
  if not compile_topology:
    return jax.devices()
  try:
    return accelerators.slice_devices(compile_topology, num_slices)
  except RuntimeError as e:
    raise UserError(str(e)) from None


def granules(devices: list) -> int:
  """TPU slices, or else processes: the units that dcn_* axes span."""
  if devices[0].platform == "tpu":
    return len({getattr(d, "slice_index", 0) for d in devices})
  return jax.process_count()


def check_divisible(v: dict) -> None:
  """Every sharded dimension splits evenly over the mesh axes its logical axis rule names
  (the first rule for each name), so no shape reaches the partitioner that it cannot divide."""
  shards = {axis: ici * dcn for axis, ici, dcn in zip(MESH_AXES, v["mesh_shape"], v["dcn_mesh_shape"])}
  sizes = {  # logical axis -> (what sets its size, size)
      "activation_batch": ("rows per step (per_device_batch_size x devices)", v["micro_batch_size"]),
      "activation_length": ("max_target_length", v["max_target_length"]),
      "activation_heads": ("base_num_query_heads", v["base_num_query_heads"]),
      "activation_kv_heads": ("base_num_kv_heads", v["base_num_kv_heads"]),
      "activation_mlp": ("base_mlp_dim", v["base_mlp_dim"]), "activation_vocab": ("vocab_size", v["vocab_size"]),
      "activation_embed": ("base_emb_dim", v["base_emb_dim"]), "embed": ("base_emb_dim", v["base_emb_dim"]),
      "vocab": ("vocab_size", v["vocab_size"]), "q_heads": ("base_num_query_heads", v["base_num_query_heads"]),
      "kv_heads": ("base_num_kv_heads", v["base_num_kv_heads"]), "heads": ("base_num_query_heads",
                                                                         v["base_num_query_heads"]),
      "mlp": ("base_mlp_dim", v["base_mlp_dim"]), "kv": ("head_dim", v["head_dim"]),
  }
  rules = {}
  for name, axes in v["logical_axis_rules"]:
    rules.setdefault(name, axes)
  checks = list(sizes.items())
  if v["attention_type"] == "mla":  # wq_b [q_lora, q_heads, kv], wkv_b [kv_lora, kv_heads, kv_head_dim]
    checks += [("q_lora", ("q_lora_rank", v["q_lora_rank"])), ("kv_lora", ("kv_lora_rank", v["kv_lora_rank"]))]
  if v["moe"]:  # the experts' weights: [exp, embed, mlp]
    checks += [("exp", ("num_experts", v["num_experts"])), ("mlp", ("base_moe_mlp_dim", v["base_moe_mlp_dim"]))]
  for name, (what, size) in checks:
    axes = [a for a in rules.get(name, []) if shards[a] > 1]
    if size % math.prod(shards[a] for a in axes):
      parallelism = " x ".join(f"{a} ({shards[a]})" for a in axes)
      raise ConfigError(f"{what}={size}: not divisible by the mesh axes that shard {name}: {parallelism} "
                        f"(set by ici_*/dcn_*_parallelism and logical_axis_rules)")


def logical_shards(v: dict, name: str) -> int:
  """How many shards the mesh splits logical axis `name` into (its first rule, ici x dcn)."""
  shards = {axis: ici * dcn for axis, ici, dcn in zip(MESH_AXES, v["mesh_shape"], v["dcn_mesh_shape"])}
  axes = next((axes for rule, axes in v["logical_axis_rules"] if rule == name), [])
  return math.prod(shards[a] for a in axes)


def create_mesh(config) -> jax.sharding.Mesh:
  """The (data, pipeline, fsdp, tensor, context, expert) mesh; with dcn_* sizes, a hybrid mesh whose dcn part
  spans slices (TPU) or processes (GPU, CPU) and whose ici part spans devices within one.
  With compile_topology, the devices are that TPU slice's, to compile for."""
  # Auto axes: XLA's SPMD partitioner propagates shardings from the constraints we place.
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  devices = run_devices(config.compile_topology, config.compile_topology_num_slices)
  if math.prod(config.dcn_mesh_shape) == 1:
    try:
      return jax.make_mesh(config.mesh_shape, MESH_AXES, axis_types=axis_types, devices=devices)
    except NotImplementedError:  # an axis no product of the physical ones (expert 8 on a 4x4x4 v5p-128): split one
      devices = mesh_utils.create_device_mesh(config.mesh_shape, devices, allow_split_physical_axes=True)
      return jax.sharding.Mesh(devices, MESH_AXES, axis_types=axis_types)
  devices = mesh_utils.create_hybrid_device_mesh(config.mesh_shape, config.dcn_mesh_shape, devices,
                                                 process_is_granule=devices[0].platform != "tpu")
  return jax.sharding.Mesh(devices, MESH_AXES, axis_types=axis_types)


def axes_of(logical_name) -> tuple[str, ...]:
  """The mesh axes one logical axis name maps to under the active rules, on its own (as in an
  array with no other named dimension)."""
  return mesh_axes(logical_name)[0]


def mesh_axes(*logical_names) -> list[tuple[str, ...]]:
  """The mesh axes of each dimension of an array whose dimensions have these logical names (or
  None), under the active rules, as tuples. The names resolve together, as flax resolves one
  array's: a mesh axis an earlier name took is not given to a later one."""
  return [() if a is None else (a,) if isinstance(a, str) else tuple(a) for a in nn.logical_to_mesh_axes(logical_names)]


def axis_rules(config) -> tuple:
  """config.logical_axis_rules as flax wants them: (name, tuple of mesh axes or None)."""
  return tuple((name, tuple(axes) or None) for name, axes in config.logical_axis_rules)


@contextlib.contextmanager
def activate(mesh, config):
  """Mesh and rules in effect, so layers' logical constraints bind to mesh axes when traced."""
  with jax.set_mesh(mesh), nn.logical_axis_rules(axis_rules(config)):
    yield


def logical_to_sharding(logical_specs, mesh, config):
  """A tree of logical PartitionSpecs -> a tree of NamedShardings on `mesh`."""
  return nn.logical_to_mesh_sharding(logical_specs, mesh, axis_rules(config))


def batch_sharding(mesh, config) -> NamedSharding:
  """Sharding of every [batch, length] input array: batch over data+fsdp, length over context."""
  return logical_to_sharding(PartitionSpec(*BATCH), mesh, config)


def as_cotangent_of(x, like):
  """x, a per-shard cotangent, as like's: its dtype, summed over the manual mesh axes (shard_map)
  x varies over and like does not (like is the same on each of their shards, so its cotangent
  is the sum of theirs, as JAX's own transpose makes it), marked varying over those like does."""
  varying = lambda y: jax.typeof(y).manual_axis_type.varying
  summed, missing = tuple(sorted(varying(x) - varying(like))), tuple(sorted(varying(like) - varying(x)))
  x = (jax.lax.psum(x, summed) if summed else x).astype(like.dtype)
  return jax.lax.pcast(x, missing, to="varying") if missing else x
