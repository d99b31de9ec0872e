"""The device mesh and logical-axis sharding (flax logical axis rules over jax.sharding)."""

import contextlib
import math

import flax.linen as nn
import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from MaxText import pyconfig
from MaxText.pyconfig import MESH_AXES

BATCH = ("activation_batch", "activation_length")


def create_mesh(config) -> jax.sharding.Mesh:
  """The (data, fsdp, tensor, sequence) mesh; with dcn_* sizes, a hybrid mesh whose dcn part
  spans slices (TPU) or processes (GPU, CPU) and whose ici part spans devices within one.
  With compile_topology, the devices are that TPU slice's, to compile for."""
  # Auto axes: XLA's SPMD partitioner propagates shardings from the constraints we place.
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  devices = pyconfig.devices(config.compile_topology, config.compile_topology_num_slices)
  if math.prod(config.dcn_mesh_shape) == 1:
    return jax.make_mesh(config.mesh_shape, MESH_AXES, axis_types=axis_types, devices=devices)
  devices = mesh_utils.create_hybrid_device_mesh(config.mesh_shape, config.dcn_mesh_shape, devices,
                                                 process_is_granule=devices[0].platform != "tpu")
  return jax.sharding.Mesh(devices, MESH_AXES, axis_types=axis_types)


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
  """Sharding of every [batch, length] input array: batch over data+fsdp, length over sequence."""
  return logical_to_sharding(PartitionSpec(*BATCH), mesh, config)
