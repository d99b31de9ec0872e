"""A command's process set-up, done by its entry point and never at import: `run(main)` is every
command's `__main__`, `setup()` the part of it that benchmarks and tests call themselves."""

import logging as python_logging
import os
import sys

from absl import app, logging

from MaxText import accelerators
from MaxText.errors import UserError


def _quiet_library_logs() -> None:
  """Keeps this package's INFO lines and every library's warnings; drops libraries' INFO chatter
  (orbax logs a dozen lines per checkpoint)."""
  package_dir = os.path.dirname(os.path.abspath(__file__))
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= python_logging.WARNING or record.pathname.startswith(package_dir))


def setup() -> None:
  """Before JAX starts its backends: libtpu told there is no TPU where there is none."""
  accelerators.quiet_libtpu_without_tpus()


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
