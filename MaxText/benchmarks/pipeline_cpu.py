"""Pipeline schedules' step time on 8 CPU devices: python -m MaxText.benchmarks.pipeline_cpu [--output_dir DIR]

4 stages x fsdp 2 on 8 simulated CPU devices, 8 layers of width 256, 256 tokens, 8 microbatches
of 2 rows, remat_policy=full: GPipe and 1F1B (1F1B with and without pipeline_keep_residuals),
each plain and with 2 repeats (circular GPipe, interleaved 1F1B), compiled in one process, then
timed in alternating rounds (a warm-up step, then --steps steps each round), on the same batch.
XLA:CPU runs the 8 devices on the host's shared cores, so a step's time is the work all stages
execute, idle iterations' masked work included: the measure of a schedule's waste available
without accelerators.
"""

import os
import statistics
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")  # before JAX starts

import jax
import numpy as np
from matplotlib.figure import Figure

from MaxText import reports, runtime, sharding, train_step
from MaxText.benchmarks import common, provenance

MODEL = ("base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=1024",
         "base_num_decoder_layers=8", "vocab_size=1024", "max_target_length=256", "per_device_batch_size=2",
         "dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false", "remat_policy=full",
         "ici_pipeline_parallelism=4", "ici_fsdp_parallelism=2", "num_pipeline_microbatches=8")
# name -> overrides
SCHEDULES = {"gpipe": ("pipeline_schedule=gpipe",), "1f1b": ("pipeline_schedule=1f1b",),
             "1f1b, residuals kept": ("pipeline_schedule=1f1b", "pipeline_keep_residuals=true"),
             "gpipe, 2 repeats": ("pipeline_schedule=gpipe", "num_pipeline_repeats=2"),
             "1f1b, 2 repeats": ("pipeline_schedule=1f1b", "num_pipeline_repeats=2"),
             "1f1b, 2 repeats, residuals kept": ("pipeline_schedule=1f1b", "num_pipeline_repeats=2",
                                                 "pipeline_keep_residuals=true")}


def compiled_step(overrides: tuple):
  """(the compiled train step, an initial state, a batch on the devices)."""
  config = common.config(*MODEL, *overrides)
  trainer = train_step.build(config, sharding.create_mesh(config))
  compiled = train_step.compile_train_step(trainer, config)
  with sharding.activate(trainer.mesh, config):
    state = trainer.init(jax.random.key(0))
  rows, length = config.global_batch_size_to_train_on, config.max_target_length
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (rows, length), dtype=np.int32)
  ones = np.ones((rows, length), np.int32)
  batch = {"inputs": tokens, "targets": np.roll(tokens, -1, 1), "inputs_segmentation": ones,
           "inputs_position": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
           "targets_segmentation": ones}
  return compiled, state, train_step.device_batch(trainer, batch)


def main():
  args = common.parse_args(__doc__, steps=3)
  runs = {schedule: list(compiled_step(overrides)) for schedule, overrides in SCHEDULES.items()}
  seconds = {schedule: [] for schedule in SCHEDULES}
  for _ in range(3):
    for schedule, run in runs.items():
      compiled, state, batch = run
      for step in range(args.steps + 1):
        start = time.perf_counter()
        state, step_metrics = compiled(state, batch)
        jax.block_until_ready(step_metrics)
        if step:  # the first of a round waits for the other schedule's buffers to go
          seconds[schedule].append(time.perf_counter() - start)
      run[1] = state
  median = {schedule: statistics.median(values) for schedule, values in seconds.items()}
  markdown = reports.markdown_table(
      ["schedule", "median s/step", "over GPipe's", "over 1F1B's"],
      [[s, f"{median[s]:.3f}", f"{median[s] / median['gpipe']:.3f}x", f"{median[s] / median['1f1b']:.3f}x"]
       for s in SCHEDULES])
  print(markdown)
  figure = Figure(figsize=(6, 2.5))
  axis = figure.subplots()
  axis.barh(list(SCHEDULES), [median[s] for s in SCHEDULES], color=["tab:gray", "tab:blue", "tab:green"] * 2)
  axis.set_xlabel("median seconds per step (8 CPU devices)")
  axis.set_title("4 stages x fsdp 2, 8 microbatches")
  provenance.save(args.output_dir, "pipeline_cpu", markdown, {"seconds": seconds, "median": median}, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
