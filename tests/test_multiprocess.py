"""Two processes x 4 CPU devices through jax.distributed reproduce one process x 8 devices."""

import os
import subprocess
import sys

from conftest import ROOT


def test_two_processes_match_one_process_with_a_checkpoint_in_between(tmp_path):
  env = {**os.environ, "PYTHON": sys.executable, "LIMIT_SECONDS": "240"}
  result = subprocess.run(["bash", str(ROOT / "end_to_end" / "test_multiprocess.sh"), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
  assert "PASS" in result.stdout and "losses match within rtol 1e-5" in result.stdout
