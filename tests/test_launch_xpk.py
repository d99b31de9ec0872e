"""end_to_end/launch_xpk.sh: compile first, and a command that XPK's own parser accepts.

XPK (PyPI `xpk`, installed by setup.sh into .venv/xpk apart from the venv) parses the
printed command; the training command inside it is parsed by pyconfig for the slice's devices.
"""

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import BASE_YML, ROOT, TINY

from MaxText import pyconfig

pytestmark = pytest.mark.e2e
XPK_PATH = ROOT / ".venv" / "xpk"
PARSE = """
import argparse, json, sys
from xpk.parser.core import set_parser
parser = argparse.ArgumentParser(prog="xpk")
set_parser(parser)
args = parser.parse_args(sys.argv[1:])
print(json.dumps({k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}))
"""


def launch(tpu_type, *extra):
  env = {**os.environ, "CLUSTER": "pod", "WORKLOAD": "llama-run", "TPU_TYPE": tpu_type, "DOCKER_IMAGE": "gcr.io/p/img",
         "NUM_SLICES": "2", "MODEL": "default", "PYTHON": sys.executable, "DRY_RUN": "1"}
  return subprocess.run(["bash", str(ROOT / "end_to_end" / "launch_xpk.sh"), *TINY, *extra], env=env,
                        capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_launch_command_is_one_xpk_accepts_and_trains_the_compiled_config():
  result = launch("v5p-8")
  assert result.returncode == 0, result.stderr[-3000:]
  argv = shlex.split(result.stdout.strip().splitlines()[-1])
  assert argv[:3] == ["xpk", "workload", "create"]
  parsed = subprocess.run([sys.executable, "-c", PARSE, *argv[1:]], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(XPK_PATH)})
  assert parsed.returncode == 0, parsed.stderr[-3000:]
  xpk_args = json.loads(parsed.stdout.splitlines()[-1])
  assert (xpk_args["cluster"], xpk_args["workload"], xpk_args["tpu_type"], xpk_args["num_slices"],
          xpk_args["docker_image"]) == ("pod", "llama-run", "v5p-8", 2, "gcr.io/p/img")
  cd, train = xpk_args["command"].split(" && ")
  assert cd == "cd /app"
  python, dash_m, module, config_file, *overrides = shlex.split(train)
  assert (dash_m, module, config_file) == ("-m", "MaxText.train", "configs/base.yml")
  # Two v5p-8 slices: 8 chips, data parallel across the slices, FSDP within each.
  config = pyconfig.initialize([BASE_YML, *overrides], num_devices=8, memory_kinds=["device", "pinned_host"],
                               num_granules=2)
  assert config.dcn_mesh_shape == (2, 1, 1, 1, 1, 1) and config.mesh_shape == (1, 1, 4, 1, 1, 1)
  assert config.run_name == "llama-run" and config.num_vocab_tiling == 8 and config.base_emb_dim == 32
  assert "train step memory per device (8 TPU v5 devices of v5p-8 x 2 slice(s)" in result.stderr


def test_nothing_is_launched_when_the_step_does_not_fit():
  # Untiled float32 logits of 64 x 2048 tokens x 32768 per chip are 16 GiB: more than a v5e chip has.
  result = launch("v5e-1", "vocab_size=32768", "max_target_length=2048", "per_device_batch_size=64",
                  "num_vocab_tiling=1")
  assert result.returncode == 1
  assert result.stdout == ""
  assert "does not fit" in result.stderr and "launch_xpk: not launched" in result.stderr
