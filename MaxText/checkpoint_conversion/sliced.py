"""Parameters written and read one layer at a time, in orbax's own checkpoint format.

A stacked parameter can be larger than a host's memory: Qwen3-235B-A22B's expert projections
are [94 layers, 128 experts, 4096, 1536], 141 GiB each in bfloat16, and one layer of them 1.5
GiB. orbax saves and restores whole arrays, so the converters hand it `Slices` instead: an
orbax TypeHandler (NumpyHandler's metadata and tensorstore spec, a chunk per layer and expert)
writes each one slice at a time as it is produced, and restores a parameter as its open
TensorStore, which reads the slices asked for. What is written is an ordinary orbax array: a
run restores it sharded like any other.
"""

import asyncio
import dataclasses
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint import type_handlers
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.serialization import ocdbt_utils, tensorstore_utils


@dataclasses.dataclass(frozen=True)
class Slices:
  """An array of `shape` and `dtype` that exists a slice at a time: with stacked axes (layers,
  then experts), read(k) is its [k] along the first, produced when it is written, and each
  chunk on disk is one element of the stacked axes; without, read(None) is all of it."""
  shape: tuple
  dtype: np.dtype
  stacked: int  # how many leading axes are stacked
  read: Callable


class _Handler(type_handlers.NumpyHandler):
  """Saves Slices in order, one in memory at a time; restores np.ndarray leaves unread."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)

  async def _write(self, values, infos, args):
    for value, info, arg in zip(values, infos, args):  # in sequence: one slice of one parameter in memory
      await info.await_path_creation()
      spec = tensorstore_utils.build_array_write_spec(
          info=info, arg=arg, global_shape=value.shape,
          local_shape=(1,) * value.stacked + value.shape[value.stacked:], dtype=value.dtype,
          use_ocdbt=info.is_ocdbt_checkpoint,
          process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint),
          metadata_key=self._metadata_key).json
      store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
      for k in range(value.shape[0]) if value.stacked else [None]:
        # Nothing touches a slice once handed over: tensorstore may keep it instead of a copy.
        await (store[k] if value.stacked else store).write(value.read(k), can_reference_source_data_indefinitely=True)

  async def serialize(self, values, infos, args=None):
    args = args or [ocp.SaveArgs()] * len(values)
    return [future.CommitFutureAwaitingContractedSignals(self._write(values, infos, args), name="sliced")]

  async def deserialize(self, infos, args=None):
    return await asyncio.gather(*(ts.open(ts.Spec(tensorstore_utils.build_array_read_spec(
        info, use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=self._metadata_key).json),
        open=True, context=info.ts_context) for info in infos))


_HANDLER = _Handler()
# With jax.Array's own handler, as orbax warns without one; no leaf here is a jax.Array.
_REGISTRY = type_handlers.create_type_handler_registry((Slices, _HANDLER), (np.ndarray, _HANDLER),
                                                       (jax.Array, type_handlers.get_type_handler(jax.Array)))


def save(path: str, tree) -> None:
  """Saves `tree`, whose leaves are Slices, as checkpoint step directory `path` with one item,
  `state`, as a run's."""
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler(
      state=ocp.PyTreeCheckpointHandler(type_handler_registry=_REGISTRY)))
  try:
    checkpointer.save(path, args=ocp.args.Composite(state=ocp.args.PyTreeSave(tree)))
  finally:
    checkpointer.close()


def open_array(item: str, keys: tuple) -> ts.TensorStore:
  """The array at `keys` of orbax checkpoint item `item`, open but unread."""
  wanted, restore_args = np.empty(0), ocp.RestoreArgs(restore_type=np.ndarray)  # partial_restore's target: a leaf
  for key in reversed(keys):
    wanted, restore_args = {key: wanted}, {key: restore_args}
  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=_REGISTRY))
  try:
    restored = checkpointer.restore(item, args=ocp.args.PyTreeRestore(
        item=wanted, restore_args=restore_args, partial_restore=True))
  finally:
    checkpointer.close()
  for key in keys:
    restored = restored[key]
  return restored
