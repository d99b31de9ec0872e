"""Measuring train-step variants in one run: compiled memory, and step time as a median.

Every variant is compiled first (memory comes from `memory_analysis()`, deterministic);
then steps are timed round-robin, one step of each variant per round, so slow drift of a
noisy machine lands on every variant alike. Times are reported as ratios to a baseline
measured in the same rounds.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from MaxText import costs, pyconfig, reports, sharding, train_step
from MaxText.input_pipeline import input_pipeline

BASE_YML = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "base.yml")


def parse_args(doc: str, steps: int | None = None) -> argparse.Namespace:
  """--output_dir, and --warmup/--steps for benchmarks that time steps."""
  parser = argparse.ArgumentParser(description=doc.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  if steps is not None:
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=steps)
  return parser.parse_args()


def config(*overrides, num_devices=None):
  return pyconfig.initialize([BASE_YML, *overrides], num_devices=num_devices)


def compiled_memory(cfg) -> dict:
  """Memory stats of cfg's train step, compiled for this process's devices; runs nothing."""
  trainer = train_step.build(cfg, sharding.create_mesh(cfg))
  return costs.memory_stats(train_step.compile_train_step(trainer, cfg))


def compiled_memory_on(num_devices: int | None, *overrides) -> dict:
  """The memory_stats_file of `python -m MaxText.train_compile` for num_devices simulated CPU
  devices (a device count is fixed when JAX starts, so this runs in a fresh process), or with
  num_devices=None for the devices the overrides name (compile_topology). A step that does not
  fit the device gives {"fits": False, "error": the compiler's line}."""
  with tempfile.TemporaryDirectory() as tmp:
    stats_file = os.path.join(tmp, "memory.json")
    env = {**os.environ, **({"JAX_NUM_CPU_DEVICES": str(num_devices)} if num_devices else {})}
    result = subprocess.run([sys.executable, "-m", "MaxText.train_compile", BASE_YML, *overrides,
                             f"memory_stats_file={stats_file}"], env=env, capture_output=True, text=True)
    if result.returncode not in (0, 1) or not os.path.exists(stats_file):
      raise RuntimeError(f"train_compile {' '.join(overrides)} failed:\n{result.stderr[-2000:]}")
    with open(stats_file) as f:
      return json.load(f)


def measure(variants: dict, warmup: int, steps: int) -> dict:
  """{name: {"temp_bytes", "total_bytes", "step_seconds" (median), "times"}} for configs."""
  runs, initialised = {}, {}
  for name, cfg in variants.items():
    trainer = train_step.build(cfg, sharding.create_mesh(cfg))
    compiled = train_step.compile_train_step(trainer, cfg)
    # Compiling an initialiser costs as much as a step; variants with the same parameter
    # shapes (all but those with another remat_layer_interval) share one, each on a copy.
    layout = str(jax.tree.map(lambda x: (x.shape, str(x.dtype)), trainer.abstract_state))
    if layout not in initialised:
      with sharding.activate(trainer.mesh, cfg):
        initialised[layout] = trainer.init(jax.random.key(cfg.init_weights_seed))
    state = jax.tree.unflatten(jax.tree.structure(trainer.abstract_state),
                               [jnp.copy(x) for x in jax.tree.leaves(initialised[layout])])
    batch = train_step.device_batch(trainer, next(input_pipeline.create_train_iterator(cfg, input_pipeline.load(cfg))))
    runs[name] = {"compiled": compiled, "state": state, "batch": batch, "times": [],
                  **costs.memory_stats(compiled)}
    print(f"compiled {name}: temp {runs[name]['temp_bytes'] / 2**20:,.1f} MiB", flush=True)
  for round_index in range(warmup + steps):
    for run in runs.values():
      start = time.perf_counter()
      run["state"], step_metrics = run["compiled"](run["state"], run["batch"])
      jax.block_until_ready(step_metrics)
      if round_index >= warmup:
        run["times"].append(time.perf_counter() - start)
  return {name: {"temp_bytes": r["temp_bytes"], "total_bytes": r["total_bytes"],
                 "step_seconds": statistics.median(r["times"]), "times": r["times"]}
          for name, r in runs.items()}


def gib_or_refusal(r: dict, key: str) -> str:
  """r[key] in GiB, or, where the TPU compiler refused the step, the temporaries it needed."""
  if "error" not in r:
    return reports.gib(r[key])
  needed = re.search(r"temporaries \(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", r["error"])
  return f"does not fit (compiler: temp {needed[1]} > {needed[2]})" if needed else "does not fit"
