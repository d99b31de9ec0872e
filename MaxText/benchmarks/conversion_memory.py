"""Peak memory of the Hugging Face converters on a dense and a mixture-of-experts model:
python -m MaxText.benchmarks.conversion_memory [--output_dir DIR] [--work_dir DIR]

For each model, writes a random Hugging Face directory of its shape in bfloat16 (numpy +
safetensors, sharded as the Hub's are), then runs, each in a child process whose peak resident
memory (ru_maxrss from wait4) is taken, forked from this small process: the converters' imports
alone (the baseline), `to_maxtext`, and `to_huggingface` with the default 5 GB shards and with 1
GB shards. The scales to read the peaks against: the model's bytes, its largest parameter
(stacked over layers, and experts) and one layer of that, the most the converters hold of a
parameter at a time. Needs about 25 GB of disk under --work_dir; 15-20 minutes.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np
from matplotlib.figure import Figure
from safetensors.numpy import save_file

from MaxText import pyconfig, reports, runtime
from MaxText.benchmarks import common, provenance
from MaxText.checkpoint_conversion import mapping

# The MoE cut to 4 and 8 of its 48 layers: its stacked expert projections (1.5 and 3 GiB)
# are the largest parameters, and the peaks show what grows with the layers.
MODELS = {"llama3.2-1b": ("Llama 3.2 1B", ["model_name=llama3.2-1b"])}
MODELS.update({f"qwen3-30b-a3b, {n} layers": (f"Qwen3-30B-A3B, {n} of 48 layers", ["model_name=qwen3-30b-a3b",
                                                                                 f"base_num_decoder_layers={n}"])
               for n in (4, 8)})
HUB_SHARD_BYTES = 2 * 10**9


def sizes(config) -> tuple[int, int, int]:
  """(bytes of all tensors, of the largest parameter, of one layer of it) in bfloat16."""
  parameters = [(int(np.prod(mapping.hf_shape(entry))) * 2 * len(mapping.hf_names(config, entry)),
                 entry[2][0] if entry[2] else 1) for entry in mapping.layout(config)]
  largest, layers = max(parameters)
  return sum(nbytes for nbytes, _ in parameters), largest, largest // layers


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


def measure(config, work: str) -> dict:
  """{step: (peak resident bytes, wall seconds)}, the checkpoint's bytes on disk, exported files."""
  hf = os.path.join(work, "hf")
  # In a child: a child's peak counts the memory of the process it was forked from (Linux
  # keeps the high-water mark across exec), so this process never holds the model.
  peak_rss(["-m", "MaxText.benchmarks.conversion_memory", f"--write_model={hf}", *config])
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
  results = {}
  for name, step in steps.items():
    results[name] = peak_rss(step)
    if name == "to_maxtext":
      shutil.rmtree(hf)  # the disk holds the model in two forms at a time
    elif name.startswith("to_huggingface"):
      shutil.rmtree(step[-1].partition("=")[2])
  return {"peak_rss": results, "checkpoint_bytes": disk_bytes(checkpoint)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--work_dir", default=None, help="where the model copies go (default: a temporary directory)")
  parser.add_argument("--write_model", help=argparse.SUPPRESS)  # the child that writes the random model
  args, model_args = parser.parse_known_args()
  if args.write_model:
    write_random_model(pyconfig.initialize([common.BASE_YML, *model_args, mapping.NO_DATA]), args.write_model)
    return
  rows, data = [], {}
  for model, (title, model_args) in MODELS.items():
    model_bytes, largest, layer = sizes(pyconfig.initialize([common.BASE_YML, *model_args, mapping.NO_DATA]))
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
      measured = measure(model_args, work)
    data[model] = {"model_bytes": model_bytes, "largest_parameter_bytes": largest, "largest_layer_bytes": layer,
                   "checkpoint_bytes": measured["checkpoint_bytes"],
                   "peak_rss_bytes": {k: v[0] for k, v in measured["peak_rss"].items()},
                   "wall_seconds": {k: v[1] for k, v in measured["peak_rss"].items()}}
    baseline = measured["peak_rss"]["imports only (baseline)"][0]
    rows += [[title, reports.gib(model_bytes), reports.gib(largest), reports.gib(layer), name, reports.gib(rss),
              reports.gib(rss - baseline), f"{(rss - baseline) / layer:.1f}", f"{seconds:.0f}"]
             for name, (rss, seconds) in measured["peak_rss"].items()]
  markdown = ("bfloat16, random weights; GiB. A stacked parameter is held a layer at a time, so the peaks do not "
              "grow with the layers.\n\n" +
              reports.markdown_table(["model", "model", "largest parameter", "one layer of it", "step", "peak RSS",
                                      "above baseline", "above baseline / layer", "wall s"], rows))
  print(markdown)
  figure = Figure(figsize=(14, 2.8))
  axes = figure.subplots(1, len(MODELS), sharey=True)
  for axis, (model, (title, _)) in zip(axes, MODELS.items()):
    peaks = data[model]["peak_rss_bytes"]
    axis.barh(list(peaks), [rss / 2**30 for rss in peaks.values()], color="tab:blue")
    axis.axvline(data[model]["largest_parameter_bytes"] / 2**30, color="tab:red", linestyle="--",
                 label="largest parameter")
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("peak RSS, GiB")
    axis.legend(fontsize=8)
  figure.tight_layout()
  provenance.save(args.output_dir, "conversion_memory", markdown, data, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
