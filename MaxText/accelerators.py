"""Accelerator chips (memory, peak FLOP/s) and TPU slices by name, to compile for without them.

A slice name is `<generation>-<count>` as Cloud TPU spells it: the count is TensorCores for
v4 and v5p (two per chip; JAX sees one megacore device per chip) and chips for v5e and v6e.
libtpu's compiler runs on any machine: `slice_devices("v5p-256", 2)` returns the 256 devices
of two v5p-256 slices, which a Mesh can be built over and a step AOT-compiled for.
"""

import math
import os
import signal
from typing import NamedTuple


def quiet_libtpu_without_tpus() -> None:
  """libtpu loads with JAX whenever it is installed (setup.sh installs it). On a machine with
  no TPU chip it then logs errors about the TPU it cannot find, and its lock on the TPU keeps
  a second process from compiling for one. Telling it a topology quiets it; with no TPU to
  guard, the lock goes. A TPU VM is left to describe itself."""
  from jax._src import hardware_utils  # noqa: PLC0415 (JAX's own PCI scan for TPU chips; imports no backend)
  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    return
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def sigterm_without_stack_dump() -> None:
  """libtpu, started with JAX's backends even where there is no TPU, installs a handler that
  prints a C++ stack trace (30-odd lines) for SIGTERM. A start-up stopped by a scheduler should
  end as quietly as one stopped before JAX started, so Python's own handler (the default action)
  is put back once the backends are up. With several processes jax.distributed's preemption
  notifier handles SIGTERM, and it is left alone."""
  import jax  # noqa: PLC0415 (this module imports no JAX at import: setup runs before JAX starts)
  if jax.process_count() == 1:
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGTERM))


class Chip(NamedTuple):
  hbm_gib: float  # memory per chip (per JAX device)
  peak_bf16_tflops: float  # dense bfloat16, per chip
  hbm_gb_per_s: float  # HBM bandwidth per chip, 10^9 bytes/s (the planner's roofline)
  torus_dims: int = 0  # TPU only: 3 (v4, v5p) or 2 (v5e, v6e)
  cores_per_chip: int = 1  # TensorCores the slice name counts per chip
  max_chips: int = 0  # largest slice
  peak_int8_tops: float = 0.0  # dense int8, per chip; 0: no faster than bfloat16
  peak_fp8_tflops: float = 0.0  # dense fp8; 0: no native fp8 (XLA computes it in bfloat16)

  def peak_tflops(self, precision: str = "bf16") -> float:
    """Dense peak for matmuls of `precision` (bf16, int8 or fp8): bfloat16's where the chip has no faster one."""
    faster = {"int8": self.peak_int8_tops, "fp8": self.peak_fp8_tflops}.get(precision, 0.0)
    return faster or self.peak_bf16_tflops


# Generation name -> chip, from the vendors' published specifications (memory, peak FLOP/s
# and HBM bandwidth are the vendors' figures, not measured here; H100 and H200 are the SXM parts).
CHIPS = {
    "v4": Chip(32, 275, 1228, 3, 2, 4096),
    "v5e": Chip(16, 197, 819, 2, 1, 256, peak_int8_tops=394),
    "v5p": Chip(95, 459, 2765, 3, 2, 8192, peak_int8_tops=918),
    "v6e": Chip(32, 918, 1640, 2, 1, 256, peak_int8_tops=1836),
    "A100": Chip(80, 312, 2039, peak_int8_tops=624),
    "H100": Chip(80, 989, 3350, peak_int8_tops=1979, peak_fp8_tflops=1979),
    "H200": Chip(141, 989, 4800, peak_int8_tops=1979, peak_fp8_tflops=1979),
}
SLICE_GENERATIONS = {"v4": "v4", "v5e": "v5e", "v5litepod": "v5e", "v5p": "v5p", "v6e": "v6e"}
# A fragment of JAX's device_kind -> generation; the first fragment found wins ("v5 lite"
# before "v5").
_DEVICE_KINDS = (("v5 lite", "v5e"), ("v5e", "v5e"), ("v5p", "v5p"), ("v5", "v5p"), ("v6 lite", "v6e"),
                 ("v6e", "v6e"), ("v4", "v4"), ("H100", "H100"), ("H200", "H200"), ("A100", "A100"))


def chip_of(device_kind: str) -> Chip | None:
  """The chip a JAX device_kind names, or None where unknown (CPUs among them)."""
  return next((CHIPS[gen] for fragment, gen in _DEVICE_KINDS if fragment in device_kind), None)


class SliceShape(NamedTuple):
  generation: str
  chip: Chip
  topology: str  # libtpu's spelling: "v5p:4x4x8"
  chips_per_host: tuple


def _torus(chips: int, dims: int) -> tuple:
  """The standard torus of a power-of-two chip count, smaller dimensions first."""
  if dims == 3 and chips == 4:
    return (2, 2, 1)  # one host's four chips
  exponent = int(math.log2(chips))
  parts = [exponent // dims + (i >= dims - exponent % dims) for i in range(dims)]
  return tuple(2**p for p in parts)


def parse_slice(name: str) -> SliceShape:
  """v5p-256 -> its generation, chip and libtpu topology; ValueError saying what is allowed."""
  generation, _, count = name.partition("-")
  usage = (f"compile_topology={name!r}: expected <generation>-<count> with generation one of "
           f"{', '.join(SLICE_GENERATIONS)}, e.g. v5p-256 (count is TensorCores for v4 and v5p, chips "
           f"for v5e and v6e)")
  if generation not in SLICE_GENERATIONS or not count.isdigit():
    raise ValueError(usage)
  generation = SLICE_GENERATIONS[generation]
  chip = CHIPS[generation]
  smallest = 8 if chip.torus_dims == 3 else 1
  sizes = [smallest * 2**k for k in range(int(math.log2(chip.max_chips * chip.cores_per_chip // smallest)) + 1)
           if smallest * 2**k != 2]  # no 1x2 slices
  if int(count) not in sizes:
    raise ValueError(f"compile_topology={name!r}: a {generation} slice has one of "
                      f"{', '.join(map(str, sizes))} {'TensorCores' if chip.cores_per_chip > 1 else 'chips'}")
  shape = _torus(int(count) // chip.cores_per_chip, chip.torus_dims)
  # Hosts of v4/v5p and of multi-host v5e/v6e slices hold 2x2 chips; single-host slices all.
  per_host = (2, 2, 1) if chip.torus_dims == 3 or math.prod(shape) > 8 else (*shape, 1)
  return SliceShape(generation, chip, f"{generation}:{'x'.join(map(str, shape))}", per_host)


def slice_devices(name: str, num_slices: int) -> list:
  """The devices of `num_slices` slices `name`, from libtpu's compiler: nothing runs on them."""
  shape = parse_slice(name)
  from jax.experimental import topologies  # noqa: PLC0415 (imported where libtpu is wanted)
  try:
    return topologies.get_topology_desc(
        platform="tpu", topology_name=shape.topology,
        chip_config_name="megacore" if shape.chip.cores_per_chip > 1 else "default",
        chips_per_host_bounds=shape.chips_per_host, num_slices=num_slices).devices
  except Exception as e:  # no libtpu: jax raises RuntimeError or one of its own error types
    import jax  # noqa: PLC0415
    raise RuntimeError(f"compile_topology={name!r}: the TPU compiler is not available ({str(e).splitlines()[0]}); "
                       f"install it with: pip install \"jax[tpu]=={jax.__version__}\"") from None
