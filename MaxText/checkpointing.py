"""Checkpoints with orbax: train state plus grain iterator state, saved atomically.

Layout: <run_dir>/checkpoints/<step>/{state,data}. orbax writes each step into a temporary
directory and renames it only once complete, so a run killed mid-save leaves the previous
checkpoint as the latest and the partial one is never restored (cleanup_tmp_directories
removes it on the next start). Old checkpoints are deleted only after a newer save commits.
"""

import os

import grain
import jax
import orbax.checkpoint as ocp

from MaxText.pyconfig import ConfigError, UserError


class CheckpointError(UserError):
  """A checkpoint exists but cannot be restored."""


def _first_line(e: Exception) -> str:
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def checkpoint_dir(config) -> str:
  return os.path.abspath(os.path.join(config.run_dir, "checkpoints"))


def latest_checkpoint(config) -> str | None:
  """The newest complete step directory of this run (orbax's temporary ones never count)."""
  directory = checkpoint_dir(config)
  steps = [int(d) for d in os.listdir(directory) if d.isdigit()] if os.path.isdir(directory) else []
  return os.path.join(directory, str(max(steps))) if steps else None


def create_manager(config) -> ocp.CheckpointManager | None:
  if not config.enable_checkpointing:
    return None
  # The trainer decides when to save (every checkpoint_period steps and the last step).
  options = ocp.CheckpointManagerOptions(
      max_to_keep=config.max_to_keep,
      enable_async_checkpointing=config.async_checkpointing, cleanup_tmp_directories=True)
  return ocp.CheckpointManager(checkpoint_dir(config), options=options, item_names=("state", "data"))


def save(manager, step: int, state, data_iterator) -> None:
  """Saves `state` and the iterator's position as checkpoint `step` (asynchronously if configured)."""
  manager.save(step, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state), data=grain.checkpoint.CheckpointSave(data_iterator)))


def _with_shardings(abstract, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


def restore_latest(manager, abstract_state, state_sharding, data_iterator):
  """(state, step) from the latest complete checkpoint, laid out by `state_sharding` (any
  mesh), with `data_iterator` moved to where that step left it; None if there is none."""
  step = manager.latest_step()
  if step is None:
    return None
  try:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_with_shardings(abstract_state, state_sharding)),
        data=grain.checkpoint.CheckpointRestore(data_iterator)))
  except Exception as e:  # orbax and tensorstore raise many types for a damaged directory.
    raise CheckpointError(f"checkpoint {manager.directory / str(step)} cannot be restored: "
                          f"{_first_line(e)}") from None
  return restored.state, step


def load_parameters(path: str, abstract_params, params_sharding):
  """Parameters only, from a checkpoint step directory (or its `state` item) of any run."""
  item = os.path.join(path, "state") if os.path.isdir(os.path.join(path, "state")) else path
  if not os.path.isdir(item):
    raise ConfigError(f"load_parameters_path={path!r}: no such checkpoint directory")
  target = {"params": _with_shardings(abstract_params, params_sharding)}
  try:
    restored = ocp.PyTreeCheckpointer().restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True))
  except Exception as e:  # as above
    raise CheckpointError(f"load_parameters_path={path!r}: cannot restore parameters: {_first_line(e)}") from None
  return restored["params"]
