"""prepare_data on generated corpora of growing size: python -m MaxText.benchmarks.prepare_data [--sizes_gb 0.5 2]

For each size, writes a .jsonl corpus of that many bytes (64 MiB files of documents cut at
random from the plays, 200 to 8,000 characters each), prepares it with a BPE of vocab_size
4096 trained on the plays (tokenizer_path), in a fresh process, and reads back what that
process measured (manifest.json's "preparation"): seconds, MB/s, tokens/s, and peak RSS of
the main process and of its largest tokenizer worker. Peak memory must not grow with the
corpus. The corpus and the shards are deleted after each size.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance
from MaxText.input_pipeline import corpus, tokenizer

_FILE_BYTES = 64 << 20


def play_slices(plays: str):
  """Documents cut at random from the plays, 200 to 8,000 characters each."""
  rng = np.random.default_rng(0)
  while True:
    start, length = int(rng.integers(0, len(plays) - 8000)), int(rng.integers(200, 8000))
    yield plays[start:start + length]


def write_corpus(directory: str, size: int, documents: Iterator[str]) -> None:
  """`size` bytes of .jsonl records of `documents`, in files of 64 MiB."""
  os.makedirs(directory)
  written, index = 0, 0
  while written < size:
    with open(os.path.join(directory, f"part-{index:05d}.jsonl"), "w") as f:
      in_file = 0
      while in_file < min(_FILE_BYTES, size - written):
        line = json.dumps({"text": next(documents)}) + "\n"
        f.write(line)
        in_file += len(line)
    written += in_file
    index += 1


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--workdir", default="outputs/prepare_data_benchmark")
  parser.add_argument("--sizes_gb", type=float, nargs="+", default=[0.5, 2.0])
  args = parser.parse_args()
  documents = corpus.read_documents(common.config())
  plays = "".join(documents)
  os.makedirs(args.workdir, exist_ok=True)
  tokenizer_path = os.path.join(args.workdir, "bpe-4096.json")
  tokenizer.save_atomic(tokenizer.train_bpe(corpus.split_documents(documents)[0], 4096), tokenizer_path)
  runs = {}
  for size_gb in args.sizes_gb:
    source, out = os.path.join(args.workdir, "corpus"), os.path.join(args.workdir, "shards")
    shutil.rmtree(source, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    write_corpus(source, int(size_gb * 1e9), play_slices(plays))
    subprocess.run([sys.executable, "-m", "MaxText.prepare_data", common.BASE_YML, f"dataset_path={source}",
                    f"tokenizer_path={tokenizer_path}", f"output_path={out}"], check=True)
    with open(os.path.join(out, "manifest.json")) as f:
      manifest = json.load(f)
    runs[size_gb] = {**manifest["preparation"], "tokens": sum(s["tokens"] for s in manifest["splits"].values()),
                     "shard_bytes": sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))}
    shutil.rmtree(source)
    shutil.rmtree(out)
  table = [[f"{g:g} GB", f"{r['seconds']:,.0f} s", f"{r['mb_per_s']:.2f}", f"{r['tokens_per_s']:,}",
            f"{r['peak_rss_mib']:,}", f"{r['peak_worker_rss_mib']:,}", f"{r['shard_bytes'] / 1e9:.2f} GB"]
           for g, r in runs.items()]
  markdown = reports.markdown_table(["corpus", "time", "MB/s", "tokens/s", "peak RSS main (MiB)",
                                    "peak RSS worker (MiB)", "shards on disk"], table)
  print(markdown)
  figure = Figure(figsize=(6, 2.5))
  axis = figure.subplots()
  sizes = [f"{g:g} GB" for g in runs]
  axis.bar(sizes, [r["peak_rss_mib"] for r in runs.values()], label="main")
  axis.bar(sizes, [r["peak_worker_rss_mib"] for r in runs.values()], bottom=[r["peak_rss_mib"] for r in runs.values()],
           label="largest worker")
  axis.set_ylabel("peak RSS (MiB)")
  axis.legend()
  provenance.save(args.output_dir, "prepare_data", markdown, runs, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
