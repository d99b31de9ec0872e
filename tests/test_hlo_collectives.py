"""The bytes each device sends per step, counted from a compiled program's HLO
(hlo_network.network_bytes), against hand counts by the ring algorithms: on this process's 8 CPU
devices, and on two v5p-8 slices that libtpu compiles for (a multi-slice program is one slice's,
with sends to the megascale runtime between slices, and no trip counts written on its loops)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from MaxText import accelerators, costs, hlo_network

F32 = 4


def auto_mesh(devices, names):
  return jax.sharding.Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


@pytest.fixture(scope="module")
def mesh():
  """data 2 x fsdp 4, its devices out of id order: rows (0, 4, 1, 5) and (2, 6, 3, 7)."""
  return auto_mesh(np.array(jax.devices())[[0, 4, 1, 5, 2, 6, 3, 7]].reshape(2, 4), ("data", "fsdp"))


def array(mesh, shape, *spec):
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P(*spec)))


def sent(dcn=None, ici=None):
  """network_bytes' answer for {axes: bytes} sent across slices and within one."""
  dcn, ici = dcn or {}, ici or {}
  return {"dcn": float(sum(dcn.values())), "ici": float(sum(ici.values())),
          "by_axes": {axes: {"dcn": dcn.get(axes, 0.0), "ici": ici.get(axes, 0.0)} for axes in sorted({*dcn, *ici})},
          "unknown_trip_counts": 0}


def network_bytes(text, mesh, slice_of=None):
  """hlo_network.network_bytes without its split by collective and type (tested on its own)."""
  counted = hlo_network.network_bytes(text, mesh, slice_of)
  counted.pop("by_type")
  return counted


def gather_and_sums(mesh):
  """An FSDP weight [32, 64] gathered for a matmul, a block of 16 floats summed over data in a
  5-step scan, and once over both axes."""
  def f(x, w, blocks):
    def body(block):
      def step(carry, _):
        return jax.lax.psum(carry, "data") / 2, None
      return jax.lax.scan(step, block, None, length=5)[0] + jax.lax.psum(block, ("data", "fsdp"))
    summed = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"), check_vma=False)(blocks)
    return x @ jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())), summed
  return f, (array(mesh, (8, 32), "data"), array(mesh, (32, 64), "fsdp"), array(mesh, (64,), "fsdp"))


BLOCK, WEIGHT = 16 * F32, 32 * 64 * F32
# An all-gather over fsdp sends 3 of its 4 shards; an all-reduce of n devices 2 (n - 1) / n of its input.
GATHER_AND_SUMS = {"fsdp": 3 / 4 * WEIGHT, "data": 5 * 2 * (1 / 2) * BLOCK, "data+fsdp": 2 * (7 / 8) * BLOCK}


def test_the_replica_groups_index_the_mesh_devices_in_order(mesh):
  compiled = jax.jit(lambda x: x * 2).lower(array(mesh, (8,), ("data", "fsdp"))).compile()
  assert compiled.runtime_executable().local_devices() == list(mesh.devices.flat)


@pytest.mark.parametrize("mesh_axes_groups", [True, False])
def test_partitioner_and_shard_map_collectives_at_loop_trip_counts(mesh, mesh_axes_groups):
  """The partitioner writes replica groups by mesh axes, mesh['data'=2,'fsdp'=4] {'fsdp'}, or else
  as an iota, [2,4]<=[8] (shard_map's are by mesh axes): both count the same."""
  f, args = gather_and_sums(mesh)
  text = jax.jit(f).lower(*args).compile({"xla_enable_rgv3_materialization": mesh_axes_groups}).as_text()
  gather = next(line for line in text.splitlines() if " all-gather(" in line)
  assert ("replica_groups=mesh[" in gather) == mesh_axes_groups and ("]<=[" in gather) != mesh_axes_groups
  assert network_bytes(text, mesh) == sent(ici=GATHER_AND_SUMS)


# XLA:CPU gathers bfloat16 as float32.
@pytest.mark.parametrize("dtype, name, size", [(jnp.float32, "f32", 4), (jnp.int8, "s8", 1)])
def test_the_bytes_are_split_by_collective_and_element_type(mesh, dtype, name, size):
  f, args = gather_and_sums(mesh)
  text = jax.jit(f).lower(*args).compile().as_text()
  sums = GATHER_AND_SUMS["data"] + GATHER_AND_SUMS["data+fsdp"]
  assert hlo_network.network_bytes(text, mesh)["by_type"] == {
      "all_gather f32": {"dcn": 0.0, "ici": GATHER_AND_SUMS["fsdp"]}, "psum f32": {"dcn": 0.0, "ici": sums}}
  weight = jax.ShapeDtypeStruct((32, 64), dtype, sharding=NamedSharding(mesh, P("fsdp")))
  gathered = jax.jit(lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))).lower(weight)
  assert hlo_network.network_bytes(gathered.compile().as_text(), mesh)["by_type"] == {
      f"all_gather {name}": {"dcn": 0.0, "ici": 3 / 4 * 32 * 64 * size}}


def test_groups_that_span_slices_are_dcn(mesh):
  f, args = gather_and_sums(mesh)
  text = jax.jit(f).lower(*args).compile().as_text()
  row = {d: i // 4 for i, d in enumerate(mesh.devices.flat)}  # as if each row of data were a slice
  dcn = {axes: GATHER_AND_SUMS[axes] for axes in ("data", "data+fsdp")}
  assert network_bytes(text, mesh, row.get) == sent(dcn=dcn, ici={"fsdp": GATHER_AND_SUMS["fsdp"]})


def test_a_roll_over_a_sharded_axis_permutes_the_rows_that_cross_shards(mesh):
  rows = array(mesh, (32, 8), "fsdp")  # 8 rows a device: each sends its last 3 to the next
  text = jax.jit(lambda x: jnp.roll(x, 3, axis=0)).lower(rows).compile().as_text()
  assert "collective-permute" in text
  assert network_bytes(text, mesh) == sent(ici={"fsdp": 3 * 8 * F32})


def test_a_conditional_counts_its_costliest_branch(mesh):
  def body(flag, block):  # a sum of all 16 floats over data, or of 4 of them over fsdp
    return jax.lax.cond(flag[0] > 0, lambda b: jax.lax.psum(b, "data"),
                        lambda b: jax.lax.psum(b[:4], "fsdp").sum() * b, block)
  f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("fsdp")), out_specs=P("fsdp"), check_vma=False)
  text = jax.jit(f).lower(array(mesh, (1,), None), array(mesh, (64,), "fsdp")).compile().as_text()
  assert "conditional(" in text
  assert network_bytes(text, mesh) == sent(ici={"data": 2 * (1 / 2) * BLOCK})


def test_a_conditional_in_a_loop_counts_in_the_iterations_it_declares(mesh):
  """costs.runs_in around a loop's conditional phase: its branch counts in the 3 of the loop's 5
  iterations it declares, as the jaxpr count takes it (costs.matmul_flops); the loop and the
  all-reduce in the branch are the compiled program's, named by the scope's op_name."""
  def body(carry, t):
    with costs.runs_in(3, 5):
      return jax.lax.cond(t < 3, lambda c: jax.lax.psum(c, "data"), lambda c: c, carry), None
  f = jax.shard_map(lambda block: jax.lax.scan(body, block, jnp.arange(5))[0], mesh=mesh, in_specs=P("fsdp"),
                    out_specs=P("fsdp"), check_vma=False)
  text = jax.jit(f).lower(array(mesh, (64,), "fsdp")).compile().as_text()
  assert "conditional(" in text and "while(" in text
  assert network_bytes(text, mesh) == sent(ici={"data": 3 * 2 * (1 / 2) * BLOCK})


@pytest.mark.parametrize("spec, groups", [
    ("{{0,2},{1,3}}", [[0, 2], [1, 3]]),
    ("{}", [[0, 1, 2, 3]]),
    ("[2,2]<=[4]", [[0, 1], [2, 3]]),
    ("[2,2]<=[2,2]T(1,0)", [[0, 2], [1, 3]]),
    ("mesh['x'=2,'y'=2] {'x'}", [[0, 2], [1, 3]]),
    ("mesh['x'=2,'y'=2], device_ids=(3,2,1,0) {'y'}", [[3, 2], [1, 0]]),
    # y = 4 split as (1)2 and (2)2: its major half pairs devices 0 and 2 apart.
    ("mesh['x'=2,'y'=4] {'y':(1)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['x'=2,'y'=4] {'x','y':(2)2}", [[0, 1, 4, 5], [2, 3, 6, 7]]),
])
def test_replica_group_forms(spec, groups):
  assert sorted(map(sorted, hlo_network._replica_groups(spec, 4))) == sorted(map(sorted, groups))


def test_two_tpu_slices_send_between_them_through_the_megascale_runtime():
  devices = accelerators.slice_devices("v5p-8", 2)  # 4 chips a slice
  mesh = auto_mesh(mesh_utils.create_hybrid_device_mesh((1, 4), (2, 1), devices), ("data", "fsdp"))

  def f(blocks, w, rows, columns):
    def body(block):
      def step(carry, _):
        return jax.lax.psum(carry, "data") / 2, None
      return jax.lax.scan(step, block, None, length=5)[0]
    summed = jax.shard_map(body, mesh=mesh, in_specs=P("fsdp"), out_specs=P("fsdp"))(blocks)
    gathered = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P())) * 2
    return summed, gathered, jnp.roll(rows, 1, axis=0), jnp.roll(columns, 1, axis=0)

  # Whole (8, 128) tiles, which libtpu sends unpadded: a block of 128 floats, a weight [8, 256],
  # rows [8, 128] split over the two slices and [16, 128] over the four chips of one (each device
  # sends its last row to the next).
  args = (array(mesh, (512,), "fsdp"), array(mesh, (8, 256), "fsdp"), array(mesh, (8, 128), "data"),
          array(mesh, (16, 128), "fsdp"))
  outs = tuple(NamedSharding(mesh, spec) for spec in (P("fsdp"), P(), P("data"), P("fsdp")))
  text = jax.jit(f, out_shardings=outs).lower(*args).compile().as_text()
  assert "_xla_megascale_transfer_type" in text and "known_trip_count" not in text
  assert "collective-permute-done" in text  # counted once with its -start
  dcn = {"data": 5 * 2 * (1 / 2) * 128 * F32 + 128 * F32}
  assert network_bytes(text, mesh) == sent(dcn=dcn, ici={"fsdp": 3 / 4 * 8 * 256 * F32 + 128 * F32})
