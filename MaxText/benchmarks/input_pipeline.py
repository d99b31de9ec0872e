"""dataset_type=grain alone, against the train step: python -m MaxText.benchmarks.input_pipeline [--corpus_mb 1000]

Generates two corpora of --corpus_mb each (.jsonl, in --workdir; a corpus already prepared there
is reused): "plays", documents of LINES_PER_DOCUMENT lines of the plays shuffled, and "sums",
documents of as many lines "a + b = c" (no letter in them, so a row tells which corpus it came
from). Each is prepared with prepare_data (tokenizer_type=byte, one tokenizer worker) in a fresh
process, which measures itself (manifest.json's "preparation").

Then draws batches of the default model's shape (base.yml's batch and sequence length on this
host's devices) from the grain train iterator, each setting in a fresh process (so each peak
RSS is its own): rows/s and tokens/s after warm-up, the median of three rounds, and the peak RSS
of that process, for the plays with grain_worker_count = 0, 1 and 2, and with threads
(grain_worker_count=0) from MIXTURE_WEIGHTS's four sources (each corpus's shards split in two).
Times the default model's train step on the same devices (median after warm-up) and reports the
headroom: the step's time over the time the pipeline takes to make one batch, > 1 when a batch
is ready before the step asks for it. Last, trains the default model for TRAIN_STEPS steps from
TRAIN_WEIGHTS's mixture of the two corpora and reports the shares of its rows: as its metrics
say (data/fraction/SOURCE) and as counted from the batches it drew (a row with a letter is a
row of the plays).
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import flags
from matplotlib.figure import Figure

from MaxText import reports, runtime, train
from MaxText.benchmarks import common, provenance
from MaxText.benchmarks.prepare_data import write_corpus
from MaxText.input_pipeline import corpus, input_pipeline

WORKERS = (0, 1, 2)
MIXTURE_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
TRAIN_WEIGHTS = {"plays": 3, "sums": 1}
TRAIN_STEPS = 6
LINES_PER_DOCUMENT = 40


def plays_documents(rng):
  """Documents of LINES_PER_DOCUMENT lines of the plays, the lines shuffled anew each pass."""
  lines = []
  for path in corpus.files(corpus.shakespeare_dir()):
    with open(path) as f:
      lines += [line for line in corpus.strip_markdown(f.read()).splitlines() if line.strip()]
  while True:
    order = rng.permutation(len(lines))
    for start in range(0, len(order) - LINES_PER_DOCUMENT + 1, LINES_PER_DOCUMENT):
      yield "\n".join(lines[i] for i in order[start:start + LINES_PER_DOCUMENT])


def sums_documents(rng):
  while True:
    a, b = rng.integers(0, 10**6, (2, LINES_PER_DOCUMENT))
    yield "\n".join(f"{x} + {y} = {x + y}" for x, y in zip(a.tolist(), b.tolist()))


CORPORA = {"plays": plays_documents, "sums": sums_documents}


def prepared(workdir: str, name: str, size: int) -> tuple[str, dict]:
  """(output_path, its manifest's "preparation") of corpus `name`, generated and prepared unless
  workdir holds it prepared already."""
  out, text = os.path.join(workdir, name), os.path.join(workdir, f"{name}-text")
  if not os.path.exists(os.path.join(out, "manifest.json")):
    shutil.rmtree(text, ignore_errors=True)
    write_corpus(text, size, CORPORA[name](np.random.default_rng(0)))
    subprocess.run([sys.executable, "-m", "MaxText.prepare_data", common.BASE_YML, f"dataset_path={text}",
                    "tokenizer_type=byte", f"output_path={out}", "num_train_shards=4", "prepare_workers=1"],
                   check=True)
    shutil.rmtree(text)
  with open(os.path.join(out, "manifest.json")) as f:
    return out, json.load(f)["preparation"]


def batch_seconds(cfg, batches: int, warmup: int) -> float:
  """Seconds per batch of the grain train iterator, after `warmup` batches."""
  iterator = input_pipeline.create_train_iterator(cfg, input_pipeline.load(cfg))
  for _ in range(warmup):
    next(iterator)
  start = time.perf_counter()
  for _ in range(batches):
    next(iterator)
  return (time.perf_counter() - start) / batches


def measure_case(overrides: list[str], batches: int, warmup: int) -> None:
  """Prints {"seconds": the median of three rounds, "peak_rss_mib": this process's, and its
  largest worker's} for the grain train iterator of the default config with `overrides`."""
  cfg = common.config("dataset_type=grain", "eval_interval=0", *overrides)
  seconds = statistics.median(batch_seconds(cfg, batches, warmup) for _ in range(3))
  print(json.dumps({"seconds": seconds, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "peak_worker_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))


def case(overrides: list[str], batches: int, warmup: int) -> dict:
  """measure_case in a fresh process."""
  result = subprocess.run([sys.executable, "-m", "MaxText.benchmarks.input_pipeline", "--batches", str(batches),
                           "--warmup", str(warmup), "--case", *overrides], capture_output=True, text=True)
  if result.returncode:
    raise RuntimeError(f"{' '.join(overrides)} failed:\n{result.stderr[-2000:]}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def train_on_mixture(shards: dict, tmp: str) -> dict:
  """Trains the default model TRAIN_STEPS steps on TRAIN_WEIGHTS's mixture: its last logged
  data/fraction/SOURCE, and each source's share of the rows of the batches it drew, counted."""
  mixture = ";".join(f"{shards[name]}/train-*,{w}" for name, w in TRAIN_WEIGHTS.items())
  metrics_file = os.path.join(tmp, "mixture.jsonl")
  cfg = common.config("dataset_type=grain", f"grain_train_files={mixture}", "eval_interval=0",
                      "enable_checkpointing=false", f"base_output_directory={tmp}", "run_name=mixture",
                      f"steps={TRAIN_STEPS}", f"metrics_file={metrics_file}")
  train.train(cfg)
  with open(metrics_file) as f:
    records = [json.loads(line) for line in f]
  data = input_pipeline.load(cfg)
  iterator = input_pipeline.create_train_iterator(cfg, data)
  plays = 0
  for _ in range(TRAIN_STEPS):
    plays += sum(any(c.isalpha() for c in data.tokenizer.decode(row.tolist())) for row in next(iterator)["inputs"])
  rows = TRAIN_STEPS * cfg.global_batch_size_to_train_on
  return {"steps": TRAIN_STEPS, "rows": rows, "loss": records[-1]["learning/loss"],
          "metrics": {name: records[-1][f"data/fraction/{name}"] for name in TRAIN_WEIGHTS},
          "counted": {"plays": plays / rows, "sums": (rows - plays) / rows}}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--workdir", default="", help="where the corpora are generated and prepared (kept); "
                      "default: a temporary directory")
  parser.add_argument("--corpus_mb", type=float, default=1000, help="each corpus's size before preparation")
  parser.add_argument("--batches", type=int, default=50)
  parser.add_argument("--warmup", type=int, default=5)
  parser.add_argument("--note", default="", help="a line on the conditions, written under the first")
  parser.add_argument("--case", nargs="+", help=argparse.SUPPRESS)  # measure_case, in a fresh process
  args = parser.parse_args()
  flags.FLAGS.mark_as_parsed()  # grain's worker processes read its absl flags
  if args.case:
    measure_case(args.case, args.batches, args.warmup)
    return
  load = [os.getloadavg()[1]]  # others' work on the machine slows every row alike
  with tempfile.TemporaryDirectory() as tmp:
    workdir = args.workdir or tmp
    os.makedirs(workdir, exist_ok=True)
    shards, preparation = {}, {}
    for name in CORPORA:
      shards[name], preparation[name] = prepared(workdir, name, int(args.corpus_mb * 1e6))
    one = [f"grain_train_files={shards['plays']}/train-*"]
    runs = {w: case([*one, f"grain_worker_count={w}"], args.batches, args.warmup) for w in WORKERS}
    halves = [f"{shards[name]}/train-0000{half}-*" for name in CORPORA for half in ("[01]", "[23]")]
    four = ";".join(f"{glob},{w}" for glob, w in zip(halves, MIXTURE_WEIGHTS))
    mixed = case([f"grain_train_files={four}", "grain_worker_count=0"], args.batches, args.warmup)
    step_cfg = common.config("dataset_type=synthetic", "enable_checkpointing=false", f"base_output_directory={tmp}")
    step = common.measure({"default": step_cfg}, args.warmup, 10)["default"]["step_seconds"]
    trained = train_on_mixture(shards, tmp)
  load.append(os.getloadavg()[1])
  seconds = {w: r["seconds"] for w, r in runs.items()}
  rows, length = step_cfg.global_batch_size_to_train_on, step_cfg.max_target_length
  table = [[w, f"{rows / s:,.0f}", f"{rows * length / s:,.0f}", f"{s * 1e3:.2f} ms", f"{step / s:,.1f}x"]
           for w, s in seconds.items()]
  by_sources = {1: runs[0], len(MIXTURE_WEIGHTS): mixed}
  sources = [[n, f"{rows / r['seconds']:,.0f}", f"{rows * length / r['seconds']:,.0f}", f"{r['seconds'] * 1e3:.2f} ms",
              f"{step / r['seconds']:,.1f}x", f"{r['peak_rss_mib']:,.0f} MiB"] for n, r in by_sources.items()]
  sizes = ", ".join(f"{name} {p['input_bytes'] / 1e6:,.0f} MB ({p['mb_per_s']} MB/s, {p['seconds']:,.0f} s)"
                    for name, p in preparation.items())
  total = sum(TRAIN_WEIGHTS.values())
  shares = [[name, f"{w}/{total} = {w / total:.4f}", f"{trained['metrics'][name]:.4f}",
             f"{trained['counted'][name]:.4f}"] for name, w in TRAIN_WEIGHTS.items()]
  markdown = (f"{args.note}\n\n" * bool(args.note) +
              f"Load average (5 min) of the {os.cpu_count()}-core machine: {load[0]:.1f} at the start, {load[1]:.1f} "
              "at the end.\n\n"
              f"default model: {rows} rows x {length} tokens per step, train step {step * 1e3:.1f} ms (median)\n\n"
              f"Corpora generated and prepared by this script (tokenizer_type=byte, prepare_workers=1, the "
              f"preparation's own rate and time): {sizes}.\n\n"
              "The plays' shards:\n\n" +
              reports.markdown_table(["grain_worker_count", "rows/s", "tokens/s", "s/batch", "headroom (step / batch)"],
                                    table) +
              f"\n\ngrain_worker_count=0, the plays alone or four sources (each corpus's shards in two halves) "
              f"with weights {MIXTURE_WEIGHTS}; peak RSS of the process drawing the batches, one process per row:\n\n" +
              reports.markdown_table(["sources", "rows/s", "tokens/s", "s/batch", "headroom (step / batch)",
                                      "peak RSS"], sources) +
              f"\n\nThe default model trained {trained['steps']} steps ({trained['rows']} rows) on plays:sums "
              f"{TRAIN_WEIGHTS['plays']}:{TRAIN_WEIGHTS['sums']} (last loss {trained['loss']:.3f}); the shares of "
              "its rows as its metrics logged them and as counted from the batches it drew:\n\n" +
              reports.markdown_table(["source", "weight", "data/fraction (metrics)", "counted in the batches"], shares))
  print(markdown)
  figure = Figure(figsize=(9, 2.5))
  workers_axis, sources_axis = figure.subplots(1, 2)
  bars = {**{str(w): s for w, s in seconds.items()}, f"0, {len(MIXTURE_WEIGHTS)} sources": mixed["seconds"]}
  workers_axis.bar(list(bars), [rows * length / s for s in bars.values()], color="tab:blue")
  workers_axis.axhline(rows * length / step, color="tab:red", label="train step's tokens/s")
  workers_axis.set_xlabel("grain_worker_count")
  workers_axis.set_ylabel("tokens/s")
  workers_axis.legend()
  labels = [f"{n} source{'s' * (n > 1)}" for n in by_sources]
  sources_axis.bar(labels, [r["peak_rss_mib"] for r in by_sources.values()], color="tab:green")
  sources_axis.set_ylabel("peak RSS (MiB)")
  provenance.save(args.output_dir, "input_pipeline", markdown,
                  {"batch_seconds": seconds, "mixture_batch_seconds": {len(MIXTURE_WEIGHTS): mixed["seconds"]},
                   "step_seconds": step, "rows_per_batch": rows, "tokens_per_row": length,
                   "peak_rss_mib": {n: r["peak_rss_mib"] for n, r in by_sources.items()},
                   "workers": runs, "preparation": preparation, "mixture_training": trained, "load_average": load},
                  figure)


if __name__ == "__main__":
  runtime.setup()
  main()
