"""setup.sh picks a Python >= 3.12 or stops with one line, exit 2, nothing built."""

import os
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e


@pytest.fixture
def checkout(tmp_path):
  """A copy of what setup.sh reads, without a venv."""
  for name in ("setup.sh", "pyproject.toml", "requirements.txt"):
    shutil.copy(ROOT / name, tmp_path / name)
  for lock in ROOT.glob("requirements*.lock"):
    shutil.copy(lock, tmp_path / lock.name)
  return tmp_path


def fake_python(directory, name, minor):
  """An executable that answers setup.sh's version probe as Python 3.<minor> would."""
  path = directory / name
  path.write_text(f"#!/bin/sh\n[ {minor} -ge 12 ] && echo {minor} && exit 0\nexit 1\n")
  path.chmod(0o755)
  return path


def setup(checkout, env):
  return subprocess.run(["bash", str(checkout / "setup.sh")], cwd=checkout, capture_output=True, text=True,
                        env=env, timeout=60)


def test_no_python_3_12_is_one_line_exit_2_and_nothing_built(checkout, tmp_path_factory):
  bin_dir = tmp_path_factory.mktemp("bin")
  fake_python(bin_dir, "python3.11", 11)
  for tool in ("bash", "dirname", "cat", "sha256sum", "cut", "sort", "grep", "rm"):
    os.symlink(shutil.which(tool), bin_dir / tool)
  env = {"PATH": str(bin_dir), "HOME": str(tmp_path_factory.mktemp("home")),
         "PYENV_ROOT": str(tmp_path_factory.mktemp("pyenv"))}
  result = setup(checkout, env)
  assert result.returncode == 2, result.stderr
  assert result.stderr.count("\n") == 1 and "no Python >= 3.12 found" in result.stderr
  assert not (checkout / ".venv").exists()


def test_a_python_given_too_old_is_one_line_exit_2(checkout, tmp_path_factory):
  old = fake_python(tmp_path_factory.mktemp("bin"), "python3", 11)
  result = setup(checkout, {**os.environ, "PYTHON": str(old)})
  assert result.returncode == 2 and result.stderr.count("\n") == 1 and "PYTHON=" in result.stderr
  assert not (checkout / ".venv").exists()


def test_this_suite_runs_on_the_locked_versions():
  import flax
  import jax
  locked = dict(line.strip().split("==") for line in (ROOT / "requirements.lock").read_text().splitlines()
                if "==" in line)
  assert sys.version_info[:2] >= (3, 12)
  assert jax.__version__ == locked["jax"] and flax.__version__ == locked["flax"]
