"""The two checkpoint tiers: python -m MaxText.benchmarks.checkpoint_tiers [--output_dir DIR] [--steps N]

One run, one model state (a 4-layer model of width 512 with its AdamW state), saved
N times alternately to the persistent tier (base_output_directory, a directory on disk) and the
local one (enable_emergency_checkpoint: local_checkpoint_directory on /dev/shm, a ramdisk, where
the host has one), as the train loop saves: how long each save blocks the loop (orbax writes in a
background thread; the loop waits for the host copy), how long until the save commits, and how
long a restore from each tier takes, checksums verified. Medians over the N saves and restores.
"""

import os
import statistics
import tempfile
import time

import jax
from matplotlib.figure import Figure

from MaxText import checkpointing, reports, runtime, sharding, train_step
from MaxText.benchmarks import common, provenance
from MaxText.input_pipeline import input_pipeline

MODEL = ("base_emb_dim=512", "base_num_query_heads=8", "base_num_kv_heads=8", "base_mlp_dim=2048",
         "base_num_decoder_layers=4", "vocab_size=8192", "max_target_length=128", "per_device_batch_size=2",
         "dataset_type=synthetic", "enable_tensorboard=false")


def measure(steps: int, persistent: str, local: str) -> dict:
  config = common.config(*MODEL, f"base_output_directory={persistent}", "enable_emergency_checkpoint=true",
                         f"local_checkpoint_directory={local}", "local_checkpoint_period=1", "checkpoint_period=1")
  trainer = train_step.build(config, sharding.create_mesh(config))
  with sharding.activate(trainer.mesh, config):
    state = trainer.init(jax.random.key(0))
  iterator = input_pipeline.create_train_iterator(config, input_pipeline.load(config))
  managers = {"persistent": checkpointing.create_manager(config), "local": checkpointing.create_manager(config, True)}
  times = {tier: {"blocking_s": [], "committed_s": [], "restore_s": []} for tier in managers}
  try:
    for step in range(1, steps + 1):
      for tier, manager in managers.items():
        start = time.perf_counter()
        checkpointing.save(manager, step, state, iterator)
        times[tier]["blocking_s"].append(time.perf_counter() - start)
        checkpointing.wait_for_saves(manager)
        times[tier]["committed_s"].append(time.perf_counter() - start)
        start = time.perf_counter()
        restored = checkpointing.restore_latest([manager], trainer.abstract_state, trainer.state_sharding, None)
        jax.block_until_ready(restored[0])
        times[tier]["restore_s"].append(time.perf_counter() - start)
  finally:
    for manager in managers.values():
      manager.close()
  size = sum(x.nbytes for x in jax.tree.leaves(state))
  return {"state_bytes": size, "directories": {"persistent": persistent, "local": local}, "times": times}


def main():
  args = common.parse_args(__doc__, steps=5)
  ramdisk = "/dev/shm" if os.path.isdir("/dev/shm") else None
  with tempfile.TemporaryDirectory() as persistent, tempfile.TemporaryDirectory(dir=ramdisk) as local:
    result = measure(args.steps, persistent, local)
  median = {tier: {k: statistics.median(v) for k, v in t.items()} for tier, t in result["times"].items()}
  rows = [[tier, "ramdisk (/dev/shm)" if tier == "local" and ramdisk else "disk",
           f"{m['blocking_s'] * 1e3:.1f} ms", f"{m['committed_s'] * 1e3:.1f} ms", f"{m['restore_s'] * 1e3:.1f} ms"]
          for tier, m in median.items()]
  markdown = (f"State of {reports.mib(result['state_bytes'])} MiB, {args.steps} saves and restores per tier, "
              "medians.\n\n" +
              reports.markdown_table(["tier", "on", "save blocks the loop", "save until committed",
                                      "restore (checksums verified)"], rows))
  print(markdown)
  figure = Figure(figsize=(7, 2.8))
  axis = figure.subplots()
  labels = ["blocking_s", "committed_s", "restore_s"]
  for offset, tier in enumerate(median):
    axis.barh([i + 0.4 * offset for i in range(3)], [median[tier][k] * 1e3 for k in labels], height=0.4, label=tier)
  axis.set_yticks([i + 0.2 for i in range(3)], ["save blocks", "save commits", "restore"])
  axis.set_xlabel("ms")
  axis.legend()
  axis.set_title("checkpoint tiers")
  provenance.save(args.output_dir, "checkpoint_tiers", markdown, {**result, "median": median}, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
