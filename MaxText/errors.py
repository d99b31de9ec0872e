"""What a command reports when the user's input or files are wrong: one line, no traceback.

Every module raises these; every command runs through `runtime.run`, which turns them into exit codes.
"""


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
