"""dataset_type=grain alone, against the train step: python -m MaxText.benchmarks.input_pipeline [--shards DIR]

Prepares the default corpus (tokenizer_type=byte) with prepare_data, or reads the prepared
corpus in --shards, and draws batches of the default model's shape (base.yml's batch and
sequence length on this host's devices) from the grain train iterator with
grain_worker_count = 0, 1 and 2: rows/s and tokens/s after warm-up, the median of three
rounds; and, with threads (grain_worker_count=0), from a mixture of MIXTURE_WEIGHTS's sources
(the same shards under each, so only the mixing differs). Then times the default model's train
step on the same devices (median after warm-up) and reports the headroom: the step's time over
the time the pipeline takes to make one batch, > 1 when a batch is ready before the step asks
for it.
"""

import argparse
import os
import statistics
import tempfile
import time

from absl import flags
from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance
from MaxText.input_pipeline import input_pipeline, prepare_data

WORKERS = (0, 1, 2)
MIXTURE_WEIGHTS = (0.4, 0.3, 0.2, 0.1)


def batch_seconds(cfg, batches: int, warmup: int) -> float:
  """Seconds per batch of the grain train iterator, after `warmup` batches."""
  iterator = input_pipeline.create_train_iterator(cfg, input_pipeline.load(cfg))
  for _ in range(warmup):
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return (time.perf_counter() - start) / batches


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--shards", default="", help="a prepare_data output_path; default: prepare the plays")
  parser.add_argument("--batches", type=int, default=50)
  parser.add_argument("--warmup", type=int, default=5)
  args = parser.parse_args()
  flags.FLAGS.mark_as_parsed()  # grain's worker processes read its absl flags
  with tempfile.TemporaryDirectory() as tmp:
    shards = args.shards or os.path.join(tmp, "shards")
    if not args.shards:
      prepare_data.prepare(common.config("tokenizer_type=byte", f"output_path={shards}", "num_train_shards=4"))
    data = (f"grain_train_files={shards}/train-*", "eval_interval=0", "dataset_type=grain")
    seconds = {}
    for workers in WORKERS:
      cfg = common.config(*data, f"grain_worker_count={workers}")
      seconds[workers] = statistics.median(batch_seconds(cfg, args.batches, args.warmup) for _ in range(3))
    mixture = ";".join(f"{shards}/train-*,{w}" for w in MIXTURE_WEIGHTS)
    mixed_cfg = common.config(*data, f"grain_train_files={mixture}", "grain_worker_count=0")
    mixed = statistics.median(batch_seconds(mixed_cfg, args.batches, args.warmup) for _ in range(3))
    step_cfg = common.config("dataset_type=synthetic", "enable_checkpointing=false", f"base_output_directory={tmp}")
    step = common.measure({"default": step_cfg}, args.warmup, 10)["default"]["step_seconds"]
  rows, length = cfg.global_batch_size_to_train_on, cfg.max_target_length
  table = [[w, f"{rows / s:,.0f}", f"{rows * length / s:,.0f}", f"{s * 1e3:.2f} ms", f"{step / s:,.1f}x"]
           for w, s in seconds.items()]
  sources = [[n, f"{rows / s:,.0f}", f"{rows * length / s:,.0f}", f"{s * 1e3:.2f} ms"]
             for n, s in ((1, seconds[0]), (len(MIXTURE_WEIGHTS), mixed))]
  markdown = (f"default model: {rows} rows x {length} tokens per step, train step {step * 1e3:.1f} ms (median)\n\n" +
              reports.markdown_table(["grain_worker_count", "rows/s", "tokens/s", "s/batch", "headroom (step / batch)"],
                                    table) +
              f"\n\ngrain_worker_count=0, one corpus alone or mixed with weights {MIXTURE_WEIGHTS}:\n\n" +
              reports.markdown_table(["sources", "rows/s", "tokens/s", "s/batch"], sources))
  print(markdown)
  figure = Figure(figsize=(6, 2.5))
  axis = figure.subplots()
  axis.bar([str(w) for w in seconds], [rows * length / s for s in seconds.values()], color="tab:blue")
  axis.axhline(rows * length / step, color="tab:red", label="train step's tokens/s")
  axis.set_xlabel("grain_worker_count")
  axis.set_ylabel("tokens/s")
  axis.legend()
  provenance.save(args.output_dir, "input_pipeline", markdown,
              {"batch_seconds": seconds, "mixture_batch_seconds": {len(MIXTURE_WEIGHTS): mixed}, "step_seconds": step,
               "rows_per_batch": rows, "tokens_per_row": length},
              figure)


if __name__ == "__main__":
  runtime.setup()
  main()
