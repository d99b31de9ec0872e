"""A command's process set-up, done by its entry point and never at import: `run(main)` is every
command's `__main__`, `setup()` the part of it that benchmarks and tests call themselves, and
`config(argv)` the command's config with what parsing leaves to the command."""

import logging as python_logging
import os
import sys

from absl import app, logging

from MaxText import accelerators, auto, checkpointing, pyconfig, sharding
from MaxText.errors import ConfigError, UserError


def _quiet_library_logs() -> None:
  """Keeps this package's INFO lines and every library's warnings; drops libraries' INFO chatter
  (orbax logs a dozen lines per checkpoint)."""
  package_dir = os.path.dirname(os.path.abspath(__file__))
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= python_logging.WARNING or record.pathname.startswith(package_dir))


def setup() -> None:
  """Before JAX starts its backends: libtpu told there is no TPU where there is none."""
  accelerators.quiet_libtpu_without_tpus()


def config(argv, plans: bool = False) -> pyconfig.Config:
  """pyconfig.parse(argv), then: load_parameters_path's checksums (before anything is written),
  jax.distributed (before JAX lists its devices), the devices, and `auto` values, which only the
  commands that plan (`plans`: train, train_compile) resolve."""
  values, auto_keys = pyconfig.parse(argv)
  if auto_keys and not plans:
    raise ConfigError(f"{auto_keys[0]}=auto: only train and train_compile choose it (the planner); give a value")
  if values["load_parameters_path"]:
    checkpointing.check_verified(values["load_parameters_path"], values["trust_unverified_checkpoints"])
  if not values["compile_topology"]:
    sharding.initialize_distributed(values)
  return auto.resolve(pyconfig.for_devices(values), auto_keys)


def run(main) -> None:
  """absl's app.run(main) for a command, after setup(): a UserError prints one line to stderr
  and exits with its code (2 for config errors), no traceback."""

  def guarded(argv):
    setup()
    _quiet_library_logs()
    try:
      return main(argv)
    except UserError as e:
      print(f"{e.label}: {e}", file=sys.stderr)
      sys.exit(e.exit_code)

  app.run(guarded)
