"""Two processes x 4 CPU devices through jax.distributed reproduce one process x 8 devices,
through a checkpoint and a SIGTERM sent to one process only (both stop and save at one step)."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e


@pytest.mark.slow
def test_two_processes_match_one_process_through_a_checkpoint_and_a_sigterm_to_one_of_them(tmp_path):
  env = {**os.environ, "PYTHON": sys.executable, "LIMIT_SECONDS": "240"}
  result = subprocess.run(["bash", str(ROOT / "end_to_end" / "test_multiprocess.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  assert "PASS" in result.stdout and "losses match within rtol 1e-5" in result.stdout
