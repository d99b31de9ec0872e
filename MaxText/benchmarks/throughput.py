"""Training throughput on this machine: python -m MaxText.benchmarks.throughput [--target gpu|gpu_long|gpu_kernels|cpu]

Each setting trains in a fresh process (`MaxText.train`: synthetic batches, no checkpoints, no
evaluation), so it has the device to itself and its own peak. Reported per device: the medians
of the logged tokens/s, TFLOP/s (model FLOPs, recomputation not counted) and MFU over the steps
after warm-up; the compiled step's memory (`memory_analysis()`, what `train_compile` reports);
and, where the runtime keeps it (GPU, TPU), the device's peak bytes in use over the whole run,
parameter initialisation included.

--target gpu: llama3.2-1b (16 layers, 2048 wide, 128k vocabulary), 4 x 8192 tokens per step,
bfloat16 activations and float32 parameters, on one GPU; last, a mixture of experts of the same
width (qwen3-30b-a3b cut to 2 of its 48 layers, to fit one GPU with its optimizer state).
--target gpu_long: the same model with one sequence of 65,536 or 131,072 tokens per step (one
GPU: no context parallelism), with and without `mlp_chunks`, beside the 8,192-token setting run
again on the same device.
--target gpu_kernels: the same model at 8,192 x 4 and 65,536 x 1 tokens per step with each GPU
flash_kernel, cudnn (with 32 and with 8 document slots, max_segments_per_seq) and triton, on the
same device.
--target cpu: a small Llama on this machine's CPU, chunked attention in place of the flash kernel
the CPU lacks.
Results go to throughput_<target>.{md,json,png}, rewritten after every setting.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import provenance

RUN = ("dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false", "eval_interval=0",
       "log_period=1")
MODELS = {
    "gpu": ("model_name=llama3.2-1b", "max_target_length=8192", "per_device_batch_size=4"),
    "gpu_long": ("model_name=llama3.2-1b", "attention=flash", "remat_policy=full"),
    "gpu_kernels": ("model_name=llama3.2-1b", "attention=flash", "remat_policy=full"),
    "cpu": ("base_emb_dim=256", "base_num_query_heads=4", "base_num_kv_heads=2", "base_mlp_dim=1024",
            "base_num_decoder_layers=4", "head_dim=64", "vocab_size=32768", "max_target_length=1024",
            "per_device_batch_size=2"),
}
QWEN3_MOE_2_LAYERS = ("model_name=qwen3-30b-a3b", "base_num_decoder_layers=2", "attention=flash", "num_vocab_tiling=8",
                      "remat_policy=full")
# (name, overrides), most telling first: a run cut short still has the comparisons that matter.
SETTINGS = {
    "gpu": (
        ("flash, 8 tiles, full", ("attention=flash", "num_vocab_tiling=8", "remat_policy=full")),
        ("flash, untiled, full", ("attention=flash", "num_vocab_tiling=1", "remat_policy=full")),
        ("chunked 512, 8 tiles, full", ("attention=chunked", "num_vocab_tiling=8", "remat_policy=full")),
        ("flash, 8 tiles, minimal", ("attention=flash", "num_vocab_tiling=8", "remat_policy=minimal")),
        ("flash, 8 tiles, save_qkv_proj", ("attention=flash", "num_vocab_tiling=8", "remat_policy=save_qkv_proj")),
        ("flash, 8 tiles, input_offloaded", ("attention=flash", "num_vocab_tiling=8",
                                             "remat_policy=input_offloaded")),
        ("qwen3-30b-a3b, 2 of 48 layers: dropless, flash, 8 tiles, full",
         (*QWEN3_MOE_2_LAYERS, "capacity_factor=null")),
        ("qwen3-30b-a3b, 2 of 48 layers: capacity 1.25, flash, 8 tiles, full",
         (*QWEN3_MOE_2_LAYERS, "capacity_factor=1.25")),
    ),
    "gpu_long": (
        ("8,192 x 4, 8 tiles", ("max_target_length=8192", "per_device_batch_size=4", "num_vocab_tiling=8")),
        ("65,536 x 1, 16 tiles, 8 MLP slices", ("max_target_length=65536", "per_device_batch_size=1",
                                                "num_vocab_tiling=16", "mlp_chunks=8")),
        ("131,072 x 1, 16 tiles, 8 MLP slices", ("max_target_length=131072", "per_device_batch_size=1",
                                                 "num_vocab_tiling=16", "mlp_chunks=8")),
        ("65,536 x 1, 16 tiles", ("max_target_length=65536", "per_device_batch_size=1", "num_vocab_tiling=16")),
    ),
    "gpu_kernels": tuple(
        (f"{length:,} x {rows}, {kernel}", (f"max_target_length={length}", f"per_device_batch_size={rows}",
                                            f"num_vocab_tiling={tiles}", *options))
        for length, rows, tiles in ((8192, 4, 8), (65536, 1, 16))
        for kernel, options in (("cudnn, 32 document slots", ("flash_kernel=cudnn", "max_segments_per_seq=32")),
                                ("triton", ("flash_kernel=triton",)),
                                ("cudnn, 8 document slots", ("flash_kernel=cudnn", "max_segments_per_seq=8")))),
    "cpu": (
        ("chunked 256, 8 tiles, full", ("attention=chunked", "attention_chunk_size=256", "num_vocab_tiling=8",
                                        "remat_policy=full")),
        ("chunked 256, untiled, full", ("attention=chunked", "attention_chunk_size=256", "num_vocab_tiling=1",
                                        "remat_policy=full")),
        ("dot_product, 8 tiles, full", ("attention=dot_product", "num_vocab_tiling=8", "remat_policy=full")),
        ("chunked 256, 8 tiles, minimal", ("attention=chunked", "attention_chunk_size=256", "num_vocab_tiling=8",
                                           "remat_policy=minimal")),
        ("chunked 256, 8 tiles, save_qkv_proj", ("attention=chunked", "attention_chunk_size=256",
                                                 "num_vocab_tiling=8", "remat_policy=save_qkv_proj")),
    ),
}
PERF = ("perf/per_device_tokens_per_sec", "perf/per_device_tflops_per_sec", "perf/mfu", "perf/step_time_seconds")


def run_setting(overrides: list, warmup: int) -> dict:
  """In this process: trains, then returns the medians of PERF after warm-up and the memory."""
  import jax  # noqa: PLC0415 (the parent process never starts JAX: each setting has the device alone)

  from MaxText import errors, train  # noqa: PLC0415 (they start JAX, as above)
  from MaxText.benchmarks import common  # noqa: PLC0415 (as above)

  with tempfile.TemporaryDirectory() as tmp:
    metrics_file, memory_file = os.path.join(tmp, "metrics.jsonl"), os.path.join(tmp, "memory.json")
    try:
      train.train(common.config(*overrides, f"base_output_directory={tmp}", "run_name=throughput",
                                f"metrics_file={metrics_file}", f"memory_stats_file={memory_file}"))
    except errors.UserError as e:  # the compiled step does not fit the device
      return {"error": str(e)}
    with open(metrics_file) as f:
      steps = [json.loads(line) for line in f][warmup:]
    with open(memory_file) as f:
      compiled = json.load(f)
  device = jax.devices()[0]
  result = {key.split("/")[1]: statistics.median(s[key] for s in steps) for key in PERF if key in steps[0]}
  result.update(timed_steps=len(steps), compiled_total_bytes=compiled["total_bytes"],
                compiled_host_bytes=compiled["host_bytes"], device_kind=device.device_kind,
                peak_bytes_in_use=(device.memory_stats() or {}).get("peak_bytes_in_use"), jax=jax.__version__)
  return result


def report(target: str, results: dict, output_dir: str) -> None:
  kind = next((r["device_kind"] for r in results.values() if "device_kind" in r), "?")
  rows = []
  for name, r in results.items():
    if "error" in r:
      rows.append([name, r["error"][:120], "", "", "", "", ""])
      continue
    mfu = f"{r['mfu']:.1%}" if "mfu" in r else "n/a"
    peak = reports.gib(r["peak_bytes_in_use"]) if r.get("peak_bytes_in_use") else "n/a"
    rows.append([name, f"{r['per_device_tokens_per_sec']:,.0f}", f"{r['per_device_tflops_per_sec']:.3g}", mfu,
                 f"{r['step_time_seconds']:.3f}", reports.gib(r["compiled_total_bytes"]), peak])
  header = ["setting", "tokens/s/device", "TFLOP/s/device", "MFU", "step s", "compiled GiB", "peak GiB in use"]
  markdown = (f"# Training throughput, {target} ({kind})\n\n`python -m MaxText.benchmarks.throughput --target "
              f"{target}`; model: `{' '.join(MODELS[target])}`\n\n" + reports.markdown_table(header, rows))
  ok = {n: r for n, r in results.items() if "error" not in r}
  figure = Figure(figsize=(12, 0.6 * len(results) + 1.5))
  (left, right) = figure.subplots(1, 2, sharey=True)
  names = list(ok)
  left.barh(names, [ok[n]["per_device_tokens_per_sec"] for n in names])
  left.set_xlabel("tokens/s per device")
  right.barh(names, [(ok[n].get("peak_bytes_in_use") or ok[n]["compiled_total_bytes"]) / 2**30 for n in names])
  right.set_xlabel("GiB per device (peak in use; compiled where the runtime keeps no peak)")
  left.invert_yaxis()
  figure.suptitle(f"{' '.join(MODELS[target])} on {kind}")
  provenance.save(output_dir, f"throughput_{target}", markdown, {"target": target, "results": results}, figure)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--target", choices=tuple(MODELS), default="cpu")
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--budget_s", type=float, default=float("inf"),
                      help="start no setting after this many seconds (the rest are left out of the table)")
  parser.add_argument("--only", default="", help="run the settings whose name contains this; the table keeps "
                      "the others' results from the last run in --output_dir")
  parser.add_argument("--setting", help=argparse.SUPPRESS)  # a child process: one setting, its result as JSON
  args = parser.parse_args()
  if args.setting:
    overrides = [*RUN, *MODELS[args.target], *dict(SETTINGS[args.target])[args.setting],
                 f"steps={args.warmup + args.steps}"]
    print("RESULT " + json.dumps(run_setting(overrides, args.warmup)), flush=True)
    return
  start, results = time.monotonic(), {}
  last_run = os.path.join(args.output_dir, f"throughput_{args.target}.json")
  if args.only and os.path.exists(last_run):
    with open(last_run) as f:
      results = {n: r for n, r in json.load(f)["results"].items() if n in dict(SETTINGS[args.target])}
  for name, _ in SETTINGS[args.target]:
    if args.only not in name:
      continue
    if time.monotonic() - start > args.budget_s:
      break
    print(f"== {name}", flush=True)
    child = subprocess.run([sys.executable, "-m", __spec__.name, "--target", args.target, "--setting", name,
                            "--warmup", str(args.warmup), "--steps", str(args.steps)],
                           capture_output=True, text=True)
    line = next((out for out in child.stdout.splitlines() if out.startswith("RESULT ")), None)
    if line:
      results[name] = json.loads(line[len("RESULT "):])
    else:  # the exception's line, not JAX's note on filtered frames printed after it
      lines = child.stderr.strip().splitlines() or ["no result"]
      results[name] = {"error": next((err for err in reversed(lines) if "Error" in err), lines[-1]).strip()}
      print(child.stderr[-3000:], flush=True)
    print(json.dumps(results[name]), flush=True)
    order = [n for n, _ in SETTINGS[args.target]]
    results = dict(sorted(results.items(), key=lambda item: order.index(item[0])))
    report(args.target, results, args.output_dir)


if __name__ == "__main__":
  runtime.setup()
  main()
