"""Long context: python -m MaxText.benchmarks.long_context [--output_dir DIR] [--target tpu|cpu|all]

TPU (long_context_tpu.*, compile only): llama3-8b on a v5p-128 (64 chips), one sequence per 16
chips (fsdp 4 x context 16), 16 vocabulary tiles, load-balanced, mlp_chunks 16, at 64k to 1M
tokens per sequence: the ring with chunked attention per context shard, attention in 8 slices,
and remat_policy full, input_offloaded and attention_out_input_offloaded; at 64k the all-gather
with full (chunked, and flash: splash attention per shard, its backward two kernels or one,
sa_use_fused_bwd_kernel=true sa_block_kv_dkv=4096) in 8 slices, and flash with
attention_out_input_offloaded unsliced (libtpu does not offload splash's residuals from slices).
Each cell is what
  python -m MaxText.train_compile configs/base.yml model_name=llama3-8b compile_topology=v5p-128 \\
    dataset_type=synthetic per_device_batch_size=0.0625 ici_fsdp_parallelism=4 ici_context_parallelism=16 \\
    num_vocab_tiling=16 attention=A attention_chunk_size=512 mlp_chunks=16 attention_head_chunks=N \\
    max_target_length=L context_parallel_strategy=S remat_policy=P
prints: GiB per chip on device and on host, the traced FLOPs (recomputation and each kernel's
blocks as it runs them) over the model's, the step at the chip's peak and the MFU bound from
them, and the bytes each chip sends in the context axis's collectives and in all those called in
shard_map (the sharded vocabulary arrays' gathers over every batch axis among them).

CPU (long_context_cpu.*, measured): the default model at 1024 tokens per sequence on 4 simulated
devices, 4 sequences per step: each device holding whole sequences (fsdp 4, attention not split)
against the sequences split over context 4 (all-gather and ring); compiled temp memory and median
step time as ratios to fsdp 4, all in one run.
"""

import argparse
import itertools
import os
import subprocess
import sys

import jax
from matplotlib.figure import Figure

from MaxText import accelerators, reports, runtime
from MaxText.benchmarks import common, provenance

LLAMA3_8B = ("model_name=llama3-8b", "compile_topology=v5p-128", "dataset_type=synthetic",
             "per_device_batch_size=0.0625", "ici_fsdp_parallelism=4", "ici_context_parallelism=16",
             "num_vocab_tiling=16", "attention_chunk_size=512", "mlp_chunks=16")
LENGTHS = (65536, 131072, 262144, 524288, 1048576)
# attention per shard -> its keys: splash's fused backward in 4096-key blocks, its partial dq's
# (one per key block) 16 copies of an attention slice's queries at 64k; 8192-key blocks overflow
# the kernel's VMEM on a v5p.
ATTENTION = {"chunked": ("attention=chunked",), "flash": ("attention=flash",),
             "flash, fused backward": ("attention=flash", "sa_use_fused_bwd_kernel=true", "sa_block_kv_dkv=4096")}
# (strategy, remat_policy, attention per shard, attention_head_chunks)
TPU_VARIANTS = (("ring", "full", "chunked", 8), ("ring", "input_offloaded", "chunked", 8),
                ("ring", "attention_out_input_offloaded", "chunked", 8), ("all_gather", "full", "chunked", 8),
                ("all_gather", "full", "flash", 8), ("all_gather", "full", "flash, fused backward", 8),
                ("all_gather", "attention_out_input_offloaded", "flash", 1))
ALL_GATHER_UP_TO = 65536  # beyond, every chip holds the whole sequence's keys and values per layer (11.7 GiB at 64k)
CPU_DEVICES = 4
CPU_MODEL = ("dataset_type=synthetic", "max_target_length=1024", "per_device_batch_size=1",
             "enable_checkpointing=false", "eval_interval=0")
CPU_VARIANTS = {"fsdp 4 (whole sequences)": ("ici_fsdp_parallelism=4",),
                "context 4 all_gather": ("ici_fsdp_parallelism=1", "ici_context_parallelism=4"),
                "context 4 ring": ("ici_fsdp_parallelism=1", "ici_context_parallelism=4",
                                   "context_parallel_strategy=ring")}


def _cell(length, strategy, policy, attention, slices) -> str:
  """A TPU cell's name in the JSON."""
  return f"llama3-8b v5p-128 {length} {strategy} {policy} {attention} {slices} slices"


def tpu_table(output_dir: str) -> None:
  peak = accelerators.chip_of("TPU v5").peak_bf16_tflops * 1e12
  results, rows = {}, []
  for length, (strategy, policy, attention, slices) in itertools.product(LENGTHS, TPU_VARIANTS):
    if strategy == "all_gather" and length > ALL_GATHER_UP_TO:
      continue
    name = _cell(length, strategy, policy, attention, slices)
    r = results[name] = common.compiled_memory_on(None, *LLAMA3_8B, f"max_target_length={length}",
                                                  f"context_parallel_strategy={strategy}", f"remat_policy={policy}",
                                                  *ATTENTION[attention], f"attention_head_chunks={slices}")
    if "error" in r:
      rows.append([f"{length:,}", strategy, policy, attention, slices, common.gib_or_refusal(r, "total_bytes"), "", "",
                   "", "", "", ""])
    else:
      seconds = r["traced_flops_per_step"] / 64 / peak
      rows.append([f"{length:,}", strategy, policy, attention, slices, reports.gib(r["total_bytes"]),
                   f"{r['traced_flops_per_step'] / r['model_flops_per_step']:.2f}x", reports.gib(r["host_bytes"]),
                   f"{seconds:.3g} s", f"{r['model_flops_per_step'] / r['traced_flops_per_step']:.1%}",
                   reports.gib(int(r["collective_bytes_per_device"].get("context", 0))),
                   reports.gib(int(sum(r["collective_bytes_per_device"].values())))])
    print(f"{name}: {rows[-1][5:]}", flush=True)
  markdown = ("## llama3-8b on v5p-128, fsdp 4 x context 16, 16 tiles, mlp_chunks 16 "
              "(TPU compiler, compile only)\n\n"
              + reports.markdown_table(["tokens per sequence", "strategy", "remat_policy", "attention per shard",
                                        "attention_head_chunks", "device GiB/chip", "traced / model FLOPs",
                                        "host GiB/chip", "step at peak", "MFU bound",
                                        "context-axis collectives GiB/chip", "all shard_map collectives GiB/chip"],
                                       rows))
  print(markdown)
  figure = Figure(figsize=(8, 5))
  axis = figure.subplots()
  for variant in TPU_VARIANTS:
    points = [(length, results[_cell(length, *variant)].get("total_bytes"))
              for length in LENGTHS if _cell(length, *variant) in results]
    points = [(x, y / 2**30) for x, y in points if y]
    axis.plot(*zip(*points), marker="o", label="{}, {}, {}, {} slices".format(*variant))
  axis.axhline(95, color="black", linestyle="--", label="v5p HBM (95 GiB)")
  axis.set_xscale("log", base=2)
  axis.set_xlabel("tokens per sequence")
  axis.set_ylabel("device GiB per chip (TPU compiler)")
  axis.legend()
  provenance.save(output_dir, "long_context_tpu", markdown, results, figure)


def cpu_table(output_dir: str, warmup: int, steps: int) -> None:
  assert jax.device_count() == CPU_DEVICES, jax.device_count()
  configs = {name: common.config(*CPU_MODEL, *overrides) for name, overrides in CPU_VARIANTS.items()}
  results = common.measure(configs, warmup, steps)
  base = results["fsdp 4 (whole sequences)"]
  rows = []
  for name, r in results.items():
    r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
    r["time_ratio"] = r["step_seconds"] / base["step_seconds"]
    rows.append([name, reports.mib(r["temp_bytes"]), f"{r['memory_ratio']:.3f}", f"{r['step_seconds']:.3f}",
                 f"{r['time_ratio']:.3f}"])
  markdown = (f"## Default model, 4 x 1024 tokens per step on {CPU_DEVICES} simulated devices (XLA:CPU, float32, "
              f"{steps} timed steps after {warmup} warm-up)\n\n"
              + reports.markdown_table(["mesh", "temp MiB", "temp / fsdp 4", "median step s", "time / fsdp 4"], rows))
  print(markdown)
  figure = Figure(figsize=(8, 3))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r["time_ratio"] for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results), fontsize=8)
  axis.invert_yaxis()
  axis.axvline(1.0, color="black", linestyle="--")
  axis.set_xlabel("median step time / fsdp 4 (XLA:CPU)")
  provenance.save(output_dir, "long_context_cpu", markdown, results, figure)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--target", choices=("cpu", "tpu", "all"), default="all")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=9)
  args = parser.parse_args()
  if args.target in ("tpu", "all"):
    tpu_table(args.output_dir)
  if args.target in ("cpu", "all"):
    if jax.device_count() == CPU_DEVICES:
      cpu_table(args.output_dir, args.warmup, args.steps)
    else:  # the device count is fixed when JAX starts: a fresh process with the simulated devices
      subprocess.run([sys.executable, "-m", __spec__.name, "--target", "cpu", "--output_dir", args.output_dir,
                      "--warmup", str(args.warmup), "--steps", str(args.steps)],
                     env={**os.environ, "JAX_NUM_CPU_DEVICES": str(CPU_DEVICES)}, check=True)


if __name__ == "__main__":
  runtime.setup()
  main()
