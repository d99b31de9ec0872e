"""The host's share of a train step: python -m MaxText.benchmarks.host_overhead [--output_dir DIR]

Trains a small model (real text through grain, the full logging loop, no checkpoints or
evaluation) and takes the median perf/step_time_seconds after warm-up: the loop's time per
step. Then runs the same compiled step back to back on a batch already on the device and
waits once at the end: the device's time per step. The host's share is the difference over
the loop's time: what the device spends waiting for Python, the input pipeline and metric
fetches. Both are measured in the same run, in alternating rounds.
"""

import json
import os
import statistics
import tempfile
import time

import jax
from matplotlib.figure import Figure

from MaxText import reports, runtime, sharding, train, train_step
from MaxText.benchmarks import common, provenance
from MaxText.input_pipeline import input_pipeline

SMALL = ("base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=256",
         "base_num_decoder_layers=2", "vocab_size=512", "max_target_length=128", "per_device_batch_size=8",
         "enable_checkpointing=false", "enable_tensorboard=false", "eval_interval=0", "log_period=1000")


def loop_step_seconds(steps: int, warmup: int, tmp: str, run: int) -> float:
  metrics_file = os.path.join(tmp, f"metrics{run}.jsonl")
  train.train(common.config(*SMALL, f"steps={warmup + steps}", f"base_output_directory={tmp}",
                            f"run_name=loop{run}", f"metrics_file={metrics_file}"))
  with open(metrics_file) as f:
    times = [json.loads(line)["perf/step_time_seconds"] for line in f]
  return statistics.median(times[warmup:])


def device_step_seconds(steps: int, tmp: str) -> float:
  config = common.config(*SMALL, f"base_output_directory={tmp}")
  trainer = train_step.build(config, sharding.create_mesh(config))
  compiled = train_step.compile_train_step(trainer, config)
  with sharding.activate(trainer.mesh, config):
    state = trainer.init(jax.random.key(0))
  rows = next(input_pipeline.create_train_iterator(config, input_pipeline.load(config)))
  batch = train_step.device_batch(trainer, rows)
  state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  start = time.perf_counter()
  for _ in range(steps):
    state, step_metrics = compiled(state, batch)
  jax.block_until_ready((state, step_metrics))
  return (time.perf_counter() - start) / steps


def main():
  args = common.parse_args(__doc__, steps=60)
  loop, device = [], []
  with tempfile.TemporaryDirectory() as tmp:
    for run in range(3):
      loop.append(loop_step_seconds(args.steps, max(args.warmup, 5), tmp, run))
      device.append(device_step_seconds(args.steps, tmp))
  loop_s, device_s = statistics.median(loop), statistics.median(device)
  share = 1 - device_s / loop_s
  markdown = reports.markdown_table(
      ["loop s/step (median)", "device s/step (back to back)", "host share"],
      [[f"{loop_s * 1e3:.2f} ms", f"{device_s * 1e3:.2f} ms", f"{share:.1%}"]])
  print(markdown)
  figure = Figure(figsize=(6, 2.5))
  axis = figure.subplots()
  axis.barh(["device", "loop"], [device_s * 1e3, loop_s * 1e3], color=["tab:gray", "tab:blue"])
  axis.set_xlabel("ms per step")
  axis.set_title(f"host share of a small model's step: {share:.1%}")
  provenance.save(args.output_dir, "host_overhead", markdown,
              {"loop_step_seconds": loop, "device_step_seconds": device, "host_share": share}, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
