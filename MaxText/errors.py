"""What a command reports when the user's input or files are wrong: one line, no traceback.

Every module raises these; every `main` runs through `run`, which turns them into exit codes.
"""

import logging as python_logging
import os
import sys

from absl import app, logging


class UserError(Exception):
  """A failure caused by the user's input or files: reported as one line, no traceback."""

  exit_code = 1
  label = "error"


class ConfigError(UserError, ValueError):
  """A bad config: the message names the key and what is allowed."""

  exit_code = 2
  label = "config error"


def first_line(e: Exception) -> str:
  """The first line of an exception's message (its type's name if it has none), for one-line errors."""
  return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _quiet_library_logs() -> None:
  """Keeps this package's INFO lines and every library's warnings; drops libraries' INFO chatter
  (orbax logs a dozen lines per checkpoint)."""
  package_dir = os.path.dirname(os.path.abspath(__file__))
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= python_logging.WARNING or record.pathname.startswith(package_dir))


def run(main) -> None:
  """absl's app.run(main) for a command: a UserError prints one line to stderr and exits with
  its code (2 for config errors)."""

  def guarded(argv):
    _quiet_library_logs()
    try:
      return main(argv)
    except UserError as e:
      print(f"{e.label}: {e}", file=sys.stderr)
      sys.exit(e.exit_code)

  app.run(guarded)
