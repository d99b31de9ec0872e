"""`auto`: num_vocab_tiling=auto, remat_policy=auto and per_device_batch_size=auto, resolved at
the start of train and train_compile by the planner's search (MaxText.plan; only those keys
searched, in-process, on the run's devices). The choice is logged in one line and kept in
run_dir/auto_plan.json under a fingerprint of the config: a rerun (a resume) with the same model,
mesh, devices and budget reuses it. The choices are memory settings: parameters and losses are
those of the setting given explicitly.
"""

import hashlib
import json
import os
import time

from absl import logging

from MaxText import config_schema, plan, pyconfig, remat, sharding
from MaxText.errors import ConfigError

# The keys train and train_compile resolve; max_target_length=auto is the planner command's.
AUTO_KEYS = tuple(k for k in pyconfig.AUTO_KEYS if k != "max_target_length")
# Keys that change neither the compiled step's memory nor its speed: changing them (more steps,
# another output directory) keeps a run's `auto` decision. compile_topology is among them so that a
# decision train_compile made for a slice is the one train reuses on it (the device kind and
# count are in the fingerprint).
RUN_CONTROL_KEYS = frozenset((*config_schema.fields("run"), "run_dir"))
CACHE_FILE = "auto_plan.json"


def _fingerprint(config, auto_keys, device) -> str:
  values = {k: v for k, v in config.to_dict().items() if k not in RUN_CONTROL_KEYS and k not in auto_keys}
  text = json.dumps([values, sorted(auto_keys), device.device_kind], sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read_decision(path: str, fingerprint: str) -> dict | None:
  try:
    with open(path) as f:
      decision = json.load(f)
  except (OSError, ValueError):
    return None
  return decision if decision.get("fingerprint") == fingerprint else None


def resolve(config: pyconfig.Config, auto: tuple) -> pyconfig.Config:
  """config with the keys in `auto` (given as `auto`, holding their defaults in config) replaced by
  the planner's choice."""
  if not auto:
    return config
  refused = [k for k in auto if k not in AUTO_KEYS]
  if refused:
    raise ConfigError(f"{refused[0]}=auto: only python -m MaxText.plan chooses it; give a value")
  contradicting = [k for k in remat.TENSOR_NAMES if getattr(config, k) != "remat"]
  if "remat_policy" in auto and contradicting:
    raise ConfigError(f"remat_policy=auto: {', '.join(contradicting)} only apply to remat_policy=custom, "
                      "which auto never picks; drop them or name the policy")
  device = sharding.run_devices(config.compile_topology, config.compile_topology_num_slices)[0]
  fingerprint = _fingerprint(config, auto, device)
  path = os.path.join(config.run_dir, CACHE_FILE)
  decision = _read_decision(path, fingerprint)
  if decision:
    logging.info("auto: %s (reused from %s)", decision["why"], path)
  else:
    budget, how = plan.budget_bytes(config, device)
    start = time.perf_counter()
    records = plan.search(config, plan.search_space(config, set(auto)), budget, plan.roofline_rates(device),
                          workers=1)
    chosen = plan.choose(records, budget, how)
    settings = {k: chosen["settings"][k] for k in auto}
    why = (f"{plan.describe(settings)}: the fastest predicted of {sum(r['fits'] for r in records)} candidates that "
           f"fit {budget / 2**30:.2f} GiB per device ({how}), {chosen['total_bytes'] / 2**30:.2f} GiB, "
           f"{chosen['tokens_per_second_per_chip']:,.0f} tokens/s/chip ({len(records)} compiles in "
           f"{time.perf_counter() - start:.1f} s)")
    decision = {"fingerprint": fingerprint, "settings": settings, "why": why}
    os.makedirs(config.run_dir, exist_ok=True)
    with open(path + ".tmp", "w") as f:
      json.dump(decision, f, indent=2)
    os.replace(path + ".tmp", path)  # a reader never sees half a decision
    logging.info("auto: %s (kept in %s)", why, path)
  return pyconfig.replace(config, decision["settings"])
