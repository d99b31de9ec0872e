"""What a results table was measured with: the date, the commit and the jax, jaxlib and libtpu
versions, as the first line of every table and a "measured_with" entry of its JSON, so that a
table read later is never mistaken for one measured on other code or other software.

Apart from common.py, which imports JAX: throughput's parent process saves tables but never
starts JAX, leaving each setting's child process the device alone. Versions come from the
installed packages' metadata for the same reason.
"""

import datetime
import importlib.metadata
import os
import subprocess

from MaxText import reports

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def _commit() -> str:
  """HEAD's short hash, flagged when the code or configs differ from it: the table then measured
  code that no commit holds. Results files are left out of the check, since a benchmark that
  writes several tables changes them as it goes."""
  head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
  if head.returncode:
    return "unknown (not a git checkout)"
  changed = subprocess.run(["git", "-C", REPO, "diff", "--quiet", "HEAD", "--", "MaxText", "configs"]).returncode
  return head.stdout.strip() + (" with uncommitted changes" if changed else "")


def measured_with() -> dict:
  return {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"), "commit": _commit(),
          **{package: _version(package) for package in ("jax", "jaxlib", "libtpu")}}


def line(measured: dict) -> str:
  return (f"Measured {measured['date']} at commit {measured['commit']}; jax {measured['jax']}, "
          f"jaxlib {measured['jaxlib']}, libtpu {measured['libtpu']}.")


def save(output_dir: str, name: str, markdown: str, data: dict, figure) -> None:
  """reports.save, the table headed by what it was measured with."""
  measured = measured_with()
  reports.save(output_dir, name, f"{line(measured)}\n\n{markdown}", {"measured_with": measured, **data}, figure)
