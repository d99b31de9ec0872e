"""Checkpoints with orbax: train state plus grain iterator state, saved atomically and verified.

Layout: <run_dir>/checkpoints/<step>/{state,data,checksums}. orbax writes each step into a
temporary directory and renames it only once complete, so a run killed mid-save leaves the
previous checkpoint as the latest and the partial one is never restored (cleanup_tmp_directories
removes it on the next start). Old checkpoints are deleted only after a newer save commits.
`data` is grain's iterator state, one file per process; it is restored only for streamed
data, whose position does not follow from the step (see input_pipeline.resumes_by_step), from
the files of every process that saved it (any number of processes may restore it).

orbax and tensorstore restore flipped bits inside array chunks without a word, so each save
records checksums of the state it saves and each restore recomputes them. A checkpoint that
fails to restore or to match is moved, whole, to <run_dir>/damaged_checkpoints/<step> once an
older one restores and matches, and the run resumes from that one; nothing is deleted.
"""

import asyncio
import contextlib
import json
import math
import os
import shutil

import flax.linen as nn
import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from MaxText.errors import ConfigError, UserError, first_line

_ORBAX_DIR = os.path.dirname(ocp.__file__)
COMMITTED = "_CHECKPOINT_METADATA"  # orbax's file in every step directory it committed (an empty stray one lacks it)


class CheckpointError(UserError):
  """A checkpoint exists but cannot be restored."""


def _leaf_checksum(x):
  """Two wrapping uint32 sums of x's bits, plain and weighted by position: integer sums, so
  the same for any mesh and reduction order; any one flipped bit changes the first."""
  if x.dtype == jnp.bool_:
    bits = x.astype(jnp.uint32)
  else:
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)
  weights = 2 * jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) + 1
  # One reduction with two outputs, so XLA fuses bits and weights into it: two separate sums
  # materialise both as uint32 arrays, twice x's size each when x is bfloat16.
  total, weighted = jax.lax.reduce((bits, bits * weights), (jnp.uint32(0), jnp.uint32(0)),
                                   lambda a, b: (a[0] + b[0], a[1] + b[1]), tuple(range(x.ndim)))
  return jnp.stack([total, weighted])


_tree_checksums = jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree))


def checksums(tree) -> dict[str, list[int]]:
  """{key path: [sum, weighted sum]} for every array of `tree`, computed where it lives."""
  sums = jax.device_get(_tree_checksums(tree))
  return {jax.tree_util.keystr(path): [int(x) for x in value]
          for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]}


class SliceChecksums:
  """checksums() of one array taken a slice at a time along its first axis, in order: each
  slice's position weights continue where the last slice's ended, so the result is the array's."""

  BLOCK = 2**24  # elements: a host array is summed in blocks of rows, each copied to the device alone

  def __init__(self):
    self.total = self.weighted = self.position = 0

  def add(self, x) -> None:
    rows = max(1, self.BLOCK // max(1, math.prod(x.shape[1:])))
    for start in range(0, x.shape[0], rows):
      block = x[start:start + rows]
      total, weighted = (int(v) for v in jax.device_get(_tree_checksums(block)))
      self.weighted = (self.weighted + weighted + 2 * self.position * total) % 2**32
      self.total = (self.total + total) % 2**32
      self.position += block.size

  def value(self) -> list[int]:
    return [self.total, self.weighted]


def mismatch(recorded: dict, restored: dict) -> str | None:
  bad = [key for key, value in restored.items() if recorded.get(key) != value]
  return f"{len(bad)} of {len(restored)} arrays differ from their checksums at save (first: {bad[0]})" if bad else None


def write_checksums(step_dir: str, sums: dict) -> None:
  """Records `sums` (from checksums()) as checkpoint `step_dir`'s checksums item, as save does."""
  checkpointer = ocp.Checkpointer(ocp.JsonCheckpointHandler())
  try:
    checkpointer.save(os.path.join(step_dir, "checksums"), args=ocp.args.JsonSave(sums))
  finally:
    checkpointer.close()


def _step_dir(path: str) -> str:
  """The step directory of checkpoint `path` (a step directory or its parameters item); named
  by the path alone, so that a step whose parameters item is missing is still that step."""
  path = os.path.abspath(path)
  return os.path.dirname(path) if os.path.basename(path) == "state" else path


def recorded_checksums(path: str) -> dict | None:
  """{parameter key path: checksums} recorded with checkpoint `path` (a step directory or its
  parameters item) at save, None if it has none."""
  recorded = os.path.join(_step_dir(path), "checksums")
  if not os.path.isdir(recorded):
    return None
  recorded = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(recorded)
  return {key.removeprefix(".params"): value for key, value in recorded.items() if key.startswith(".params")}


def check_verified(path: str, trust: bool) -> None:
  """ConfigError unless checkpoint `path` (a step directory or its parameters item) has the
  checksums every checkpoint this project writes carries, or trust_unverified_checkpoints is set:
  without them a damaged array would be read without a word."""
  step_dir = _step_dir(path)
  if not trust and not os.path.isdir(os.path.join(step_dir, "checksums")):
    raise ConfigError(f"checkpoint {step_dir} has no checksums, so damage to it cannot be detected; set "
                      "trust_unverified_checkpoints=true to use it anyway")


def checkpoint_dir(config) -> str:
  return os.path.abspath(os.path.join(config.run_dir, "checkpoints"))


def local_checkpoint_dir(config) -> str:
  """The local tier's checkpoints (enable_emergency_checkpoint): local_checkpoint_directory/run_name."""
  return os.path.abspath(os.path.join(config.local_checkpoint_directory, config.run_name))


def _tiers(config) -> list[str]:
  return [checkpoint_dir(config), *([local_checkpoint_dir(config)] if config.enable_emergency_checkpoint else [])]


def latest_checkpoint(config) -> str | None:
  """The newest complete step directory of this run, of either tier (orbax's temporary ones and
  step-named directories orbax did not commit never count)."""
  found = []
  for directory in _tiers(config):
    steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
    for step in sorted(steps, reverse=True):
      path = os.path.join(directory, str(step))
      if os.path.isfile(os.path.join(path, COMMITTED)):
        found.append((step, path))
        break
      logging.warning("%s is not a complete checkpoint (no %s): skipped", path, COMMITTED)
  return max(found)[1] if found else None


def _through_orbax(record) -> bool:
  """Whether `record` carries an exception raised in or logged by orbax."""
  if not record.exc_info:
    return False
  if _ORBAX_DIR in record.pathname:
    return True
  trace = record.exc_info[2]
  while trace is not None and _ORBAX_DIR not in trace.tb_frame.f_code.co_filename:
    trace = trace.tb_next
  return trace is not None


def _orbax_tracebacks_to_debug(record) -> bool:
  """A failed save or restore reaches the user as one line (CheckpointError, or the warning that
  sets a damaged checkpoint aside), but orbax logs it with its traceback from each thread that
  sees it, one after the interpreter began to exit, and asyncio reports each read orbax
  abandoned, on whatever loop ran it, as a task exception never retrieved. Those records go to
  the debug log as one line."""
  if _through_orbax(record):
    logging.debug("orbax: %s: %s", record.getMessage(), first_line(record.exc_info[1]))
    return False
  return True


def quiet_orbax_tracebacks() -> None:
  logging.get_absl_handler().addFilter(_orbax_tracebacks_to_debug)  # once: a filter already there is not added again


def create_manager(config, local: bool = False) -> ocp.CheckpointManager | None:
  """The run's persistent checkpoints, or with `local` its local tier's (None where off)."""
  if not (config.enable_emergency_checkpoint if local else config.enable_checkpointing):
    return None
  quiet_orbax_tracebacks()
  # The trainer decides when to save (every checkpoint_period steps and the last step; the local
  # tier every local_checkpoint_period, keeping two: the newest and one to fall back to).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=2 if local else config.max_to_keep,
      enable_async_checkpointing=config.async_checkpointing, cleanup_tmp_directories=True)
  manager = ocp.CheckpointManager(local_checkpoint_dir(config) if local else checkpoint_dir(config), options=options,
                                  item_names=("state", "data", "checksums"))
  for step in manager.all_steps():  # committed ones: a half-written step is set aside as damaged when restored
    if os.path.isfile(os.path.join(manager.directory, str(step), COMMITTED)):
      try:
        check_verified(os.path.join(manager.directory, str(step)), config.trust_unverified_checkpoints)
      except ConfigError:
        manager.close()
        raise
  return manager


def _save_failed(manager, step: int, e: Exception) -> CheckpointError:
  latest = manager.latest_step()
  return CheckpointError(f"checkpoint {step} could not be saved in {manager.directory} ({first_line(e)}); "
                         f"steps after {latest} are not saved (latest checkpoint: {latest}); rerun to resume from it")


def wait_for_saves(manager) -> None:
  """Waits for the save under way, if any; CheckpointError naming its step if it failed.
  Until it commits or fails, orbax counts that step as the latest one."""
  in_flight = manager.latest_step()
  try:
    manager.wait_until_finished()
  except Exception as e:  # orbax and tensorstore raise many types for a write that fails
    raise _save_failed(manager, in_flight, e) from None


def save(manager, step: int, state, data_iterator) -> None:
  """Saves `state`, its checksums and the iterator's position as checkpoint `step`
  (asynchronously if configured). A save that fails, now or in the background, stops the run:
  CheckpointError naming the step that failed and the steps not saved. The previous save is
  waited for here (orbax would wait inside save), so its failure is not taken for this one's.
  The directory is tried first: an async save into one that no longer takes writes fails in
  orbax's background thread, and the save waits out orbax's 300 s signal timeout before it
  says so, without the OS error."""
  wait_for_saves(manager)
  probe = os.path.join(manager.directory, f".write-probe-{jax.process_index()}")
  try:
    os.mkdir(probe)
    os.rmdir(probe)
  except OSError as e:
    raise _save_failed(manager, step, e) from None
  try:
    manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator),
        checksums=ocp.args.JsonSave(checksums(state))))
  except Exception as e:  # as in wait_for_saves
    raise _save_failed(manager, step, e) from None


def _with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def check_shapes(item: str, abstract_params, fix: str) -> None:
  """ConfigError naming the first parameter that parameters item `item` stores in another shape
  than `abstract_params` has: the checkpoint is of another model, not damaged, and orbax would
  fail deep inside the restore (leaving its reads running). `fix` says what to do."""
  handler = ocp.PyTreeCheckpointHandler()
  try:
    stored = handler.metadata(epath.Path(item)).tree["params"]
  except Exception:  # no readable metadata: the restore reports the damage
    return
  finally:
    handler.close()
  shapes = {jax.tree_util.keystr(path): tuple(m.shape) for path, m in jax.tree_util.tree_flatten_with_path(
      stored, is_leaf=lambda x: hasattr(x, "shape"))[0]}
  for path, wanted in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
    key = jax.tree_util.keystr(path)
    if shapes.get(key, tuple(wanted.shape)) != tuple(wanted.shape):
      raise ConfigError(f"checkpoint {os.path.dirname(os.path.abspath(item))}: parameter {key} has shape "
                        f"{shapes[key]}, this config's model {tuple(wanted.shape)}; {fix}")


class _QuietWhenClosedLoop(asyncio.SelectorEventLoop):
  """The event loop orbax makes for a restore. When a restore fails, orbax stops waiting on the
  reads still under way and closes this loop. Those reads then reach the closed loop two ways,
  each printed as a traceback, dozens of them, while orbax raises and after: tensorstore hands a
  finished read's result to call_soon_threadsafe, which raises RuntimeError('Event loop is
  closed') in tensorstore's thread; and a read that failed too, its exception never retrieved,
  is reported to call_exception_handler when its task is collected (how many failed before orbax
  stopped waiting is a race). A closed loop runs nothing and has nobody to report to, so both
  go to the debug log instead."""

  def call_soon_threadsafe(self, *args, **kwargs):
    return None if self.is_closed() else super().call_soon_threadsafe(*args, **kwargs)

  def call_exception_handler(self, context):
    if not self.is_closed():
      return super().call_exception_handler(context)
    logging.debug("a read on orbax's closed event loop: %s %r", context.get("message"), context.get("exception"))
    return None


@contextlib.contextmanager
def _abandoned_reads_quiet():
  """The loops created inside (orbax's, for a restore, metadata reads included) are
  _QuietWhenClosedLoop; every other loop of the process is left as it is, and so are these
  loops' calls while they are open."""
  new_event_loop = asyncio.new_event_loop
  asyncio.new_event_loop = _QuietWhenClosedLoop
  try:
    yield
  finally:
    asyncio.new_event_loop = new_event_loop


@_abandoned_reads_quiet()
def _restore_verified(manager, step: int, abstract_state, state_sharding, data_iterator):
  """(state, None) if checkpoint `step` restores and matches its checksums, else (None, why)."""
  check_shapes(str(manager.directory / str(step) / "state"), abstract_state.params,
               "resume with the model keys it was trained with, or use a new run_name")
  items = {"state": ocp.args.StandardRestore(_with_shardings(abstract_state, state_sharding))}
  if data_iterator is not None:
    try:
      saved, processes = _data_positions(manager.directory / str(step) / "data")
    except (OSError, ValueError) as e:  # json's errors are ValueErrors
      return None, f"its data position cannot be read: {first_line(e)}"
  verified = (manager.directory / str(step) / "checksums").is_dir()
  if verified:
    items["checksums"] = ocp.args.JsonRestore()
  try:
    restored = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # orbax and tensorstore raise many types for a damaged directory.
    return None, f"cannot be restored: {first_line(e)}"
  if not verified:  # create_manager refused it unless trust_unverified_checkpoints=true
    logging.warning("checkpoint %s has no checksums: restored unverified (trust_unverified_checkpoints=true)",
                    manager.directory / str(step))
  else:
    problem = mismatch(restored.checksums, checksums(restored.state))
    if problem:
      return None, problem
  if data_iterator is not None:
    data_iterator.restore(saved, processes)
  return restored.state, None


def _data_positions(directory) -> tuple[dict[int, dict], int]:
  """({process: its saved iterator state}, the processes that saved them) of a checkpoint's
  data item: grain writes one process_I-of-P.json per process, and a streamed dataset's position
  is all of them (input_pipeline.StreamBlocks.restore takes its part on any number of processes)."""
  files = sorted(directory.glob("process_*-of-*.json")) if directory.is_dir() else []
  counts = {int(path.name.removesuffix(".json").split("-of-")[1]) for path in files}
  if len(counts) != 1:
    raise ValueError(f"{directory} holds no one save's process_I-of-P.json files")
  processes = counts.pop()
  saved = {int(path.name.split("-of-")[0].removeprefix("process_")): json.loads(path.read_text()) for path in files}
  if sorted(saved) != list(range(processes)):
    raise ValueError(f"{directory}: the states of processes {sorted(set(range(processes)) - set(saved))} "
                     f"of {processes} are missing")
  return saved, processes


def restore_latest(managers, abstract_state, state_sharding, data_iterator):
  """(state, step, its manager) from the newest checkpoint of `managers` (the persistent tier,
  then the local one; the persistent's at a step both hold) that restores and matches its
  checksums, laid out by `state_sharding` (any mesh), with `data_iterator` moved to where that
  step left it (None: the data's position follows from the step); None if there is none. Newer
  damaged checkpoints are moved to their tier's damaged_checkpoints/ (they would block the saves
  of the steps trained again); if none is good, nothing is moved."""
  managers = [m for m in managers if m is not None]
  candidates = sorted(((step, tier) for tier, m in enumerate(managers) for step in m.all_steps()),
                      key=lambda candidate: (-candidate[0], candidate[1]))
  damaged = []
  for step, tier in candidates:
    manager = managers[tier]
    state, problem = _restore_verified(manager, step, abstract_state, state_sharding, data_iterator)
    if problem is None:
      break
    damaged.append((manager, step, problem))
  else:
    if damaged:
      raise CheckpointError("no checkpoint in " + " or ".join(str(m.directory) for m in managers) +
                            " is good, none was changed: " +
                            "; ".join(f"step {step}: {problem}" for _, step, problem in damaged))
    return None
  for bad, bad_step, problem in damaged:
    aside = bad.directory.parent / "damaged_checkpoints"
    logging.warning("checkpoint %s is damaged (%s): moved to %s; resuming from step %d instead",
                    bad.directory / str(bad_step), problem, aside / str(bad_step), step)
    if jax.process_index() == 0:
      aside.mkdir(exist_ok=True)
      shutil.move(bad.directory / str(bad_step), _unused(aside / str(bad_step)))
  if damaged:
    multihost_utils.sync_global_devices("damaged checkpoints set aside")
    for bad in {id(m): m for m, _, _ in damaged}.values():
      bad.reload()
  return state, step, manager


def _unused(path):
  """`path`, or path.1, path.2, ...: a checkpoint damaged twice at one step keeps both copies."""
  candidate, n = path, 0
  while candidate.exists():
    n += 1
    candidate = path.with_name(f"{path.name}.{n}")
  return candidate


def parameters_item(path: str) -> str:
  """The orbax item holding the parameters of checkpoint step directory `path` (of a run: its
  `state`; of to_maxtext: `path` itself)."""
  item = os.path.join(path, "state") if os.path.isdir(os.path.join(path, "state")) else path
  if not os.path.isdir(item):
    raise ConfigError(f"load_parameters_path={path!r}: no such checkpoint directory")
  return item


def check_parameter_shapes(path: str, abstract_params) -> str:
  """check_shapes for load_parameters_path=`path`; returns its parameters item."""
  item = parameters_item(path)
  check_shapes(item, abstract_params, f"load_parameters_path={path!r} needs the model keys it was saved with")
  return item


@_abandoned_reads_quiet()
def load_parameters(path: str, abstract_params, params_sharding):
  """Parameters only, from a checkpoint step directory (or its `state` item) of any run."""
  quiet_orbax_tracebacks()
  item = check_parameter_shapes(path, abstract_params)
  target = {"params": _with_shardings(abstract_params, params_sharding)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  except Exception as e:  # as above
    raise CheckpointError(f"load_parameters_path={path!r}: cannot restore parameters: {first_line(e)}") from None
  recorded = recorded_checksums(path)
  problem = recorded is not None and mismatch(recorded, checksums(restored["params"]))
  if problem:
    raise CheckpointError(f"load_parameters_path={path!r}: {problem}")
  return restored["params"]


def load_model_parameters(config, path: str):
  """The parameters of config's model from checkpoint `path` (as load_parameters reads it),
  whole on the first device: for sampling and export, not for training."""
  check_verified(path, config.trust_unverified_checkpoints)
  from MaxText.layers.models import Transformer  # noqa: PLC0415 (the model is not needed to save/restore)
  window = jax.numpy.zeros((1, config.max_target_length), jax.numpy.int32)
  abstract = nn.meta.unbox(jax.eval_shape(lambda: Transformer(config).init(jax.random.key(0), window, window, window)))
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return load_parameters(path, abstract["params"], jax.tree.map(lambda _: device, abstract["params"]))
