"""Peak memory of the Hugging Face converters on a 1B model:
python -m MaxText.benchmarks.conversion_memory [--output_dir DIR] [--work_dir DIR]

Writes a random Llama 3.2 1B-shaped Hugging Face directory in bfloat16 (numpy + safetensors,
sharded as the Hub's are), then runs, each in a child process whose peak resident memory
(ru_maxrss from wait4) is taken, forked from this small process: the converters' imports alone (the baseline), `to_maxtext`,
and `to_huggingface` with the default 5 GB shards (one file here) and with 1 GB shards. The
model's bytes, the checkpoint's bytes on disk and the largest parameter (stacked over layers)
are the scales to read the peaks against. Needs about 10 GB of disk under --work_dir.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import matplotlib
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from MaxText import pyconfig, reports  # noqa: E402
from MaxText.benchmarks import common  # noqa: E402
from MaxText.checkpoint_conversion import mapping  # noqa: E402

MODEL = "model_name=llama3.2-1b"
HUB_SHARD_BYTES = 2 * 10**9


def sizes(config) -> tuple[int, int]:
  """(bytes of all tensors, bytes of the largest parameter, stacked over layers) in bfloat16."""
  parameters = [int(np.prod(mapping.hf_shape(entry))) * 2 * len(mapping.hf_names(config, entry))
                for entry in mapping.layout(config)]
  return sum(parameters), max(parameters)


def write_random_model(config, path: str) -> None:
  """A bfloat16 Hugging Face directory of config's shape, one shard in memory at a time."""
  os.makedirs(path)
  rng = np.random.default_rng(0)
  shard, shard_bytes, weight_map, files = {}, 0, {}, []

  def flush():
    files.append(f"model-{len(files) + 1:05d}.safetensors")
    save_file(shard, os.path.join(path, files[-1]), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, files[-1]))
    shard.clear()

  for entry in mapping.layout(config):
    nbytes = int(np.prod(mapping.hf_shape(entry))) * 2
    for name in mapping.hf_names(config, entry):
      if shard and shard_bytes + nbytes > HUB_SHARD_BYTES:
        flush()
        shard_bytes = 0
      shard[name] = (rng.standard_normal(mapping.hf_shape(entry), np.float32) * 0.02).astype(ml_dtypes.bfloat16)
      shard_bytes += nbytes
  flush()
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sizes(config)[0]}, "weight_map": weight_map}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(mapping.hf_config(config, "bfloat16"), f)


def peak_rss(args: list) -> tuple[int, float]:
  """(peak resident bytes, wall seconds) of a child process running `python args...`."""
  start = time.perf_counter()
  child = subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  stderr = child.stderr.read()
  _, status, usage = os.wait4(child.pid, 0)
  if os.waitstatus_to_exitcode(status):
    raise RuntimeError(f"{' '.join(args)} failed:\n{stderr[-2000:]}")
  return usage.ru_maxrss * 1024, time.perf_counter() - start


def disk_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--work_dir", default=None, help="where the model copies go (default: a temporary directory)")
  parser.add_argument("--write_model", help=argparse.SUPPRESS)  # the child that writes the random model
  args = parser.parse_args()
  config = pyconfig.initialize([common.BASE_YML, MODEL, mapping.NO_DATA])
  if args.write_model:
    write_random_model(config, args.write_model)
    return
  model_bytes, largest = sizes(config)
  with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
    hf = os.path.join(work, "hf")
    # In a child: a child's peak counts the memory of the process it was forked from (Linux
    # keeps the high-water mark across exec), so this process never holds the model.
    peak_rss(["-m", "MaxText.benchmarks.conversion_memory", f"--write_model={hf}"])
    checkpoint = os.path.join(work, "run", "imported", "checkpoints", "0")
    steps = {
        "imports only (baseline)": ["-c", "import jax; jax.devices(); from MaxText.checkpoint_conversion import "
                                    "to_maxtext, to_huggingface"],
        "to_maxtext": ["-m", "MaxText.checkpoint_conversion.to_maxtext", common.BASE_YML, f"hf_model_path={hf}",
                       f"base_output_directory={work}/run", "run_name=imported"],
        "to_huggingface (5 GB shards)": ["-m", "MaxText.checkpoint_conversion.to_huggingface", common.BASE_YML,
                                         f"load_parameters_path={checkpoint}", f"hf_output_path={work}/out5"],
        "to_huggingface (1 GB shards)": ["-c", "import sys; from MaxText import pyconfig; from MaxText."
                                         "checkpoint_conversion import mapping, to_huggingface; to_huggingface."
                                         "convert(pyconfig.initialize(sys.argv[1:]), max_shard_bytes=10**9)",
                                         common.BASE_YML, mapping.NO_DATA, f"load_parameters_path={checkpoint}",
                                         f"hf_output_path={work}/out1"],
    }
    results = {name: peak_rss(step) for name, step in steps.items()}
    checkpoint_bytes = disk_bytes(checkpoint)
    files = {"to_huggingface (5 GB shards)": len(os.listdir(f"{work}/out5")) - 1,
             "to_huggingface (1 GB shards)": len(os.listdir(f"{work}/out1")) - 2}
  baseline = results["imports only (baseline)"][0]
  rows = [[name, reports.gib(rss), reports.gib(rss - baseline), f"{(rss - baseline) / model_bytes:.2f}",
           f"{seconds:.0f}"] for name, (rss, seconds) in results.items()]
  markdown = (f"Llama 3.2 1B shape, bfloat16: model {reports.gib(model_bytes)} GiB, checkpoint "
              f"{reports.gib(checkpoint_bytes)} GiB on disk, largest parameter {reports.gib(largest)} GiB; "
              f"exported files: {files}.\n\n" +
              reports.markdown_table(["step", "peak RSS GiB", "above baseline GiB", "above baseline / model",
                                     "wall s"], rows))
  print(markdown)
  figure, axis = plt.subplots(figsize=(7, 2.8))
  axis.barh(list(results), [rss / 2**30 for rss, _ in results.values()], color="tab:blue")
  axis.axvline(model_bytes / 2**30, color="tab:red", linestyle="--", label="model bytes")
  axis.set_xlabel("peak RSS, GiB")
  axis.legend()
  reports.save(args.output_dir, "conversion_memory", markdown,
              {"model_bytes": model_bytes, "checkpoint_bytes": checkpoint_bytes, "largest_parameter_bytes": largest,
               "files": files, "peak_rss_bytes": {k: v[0] for k, v in results.items()},
               "wall_seconds": {k: v[1] for k, v in results.items()}}, figure)


if __name__ == "__main__":
  main()
