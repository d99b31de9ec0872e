"""Mixture-of-experts benchmark: python -m MaxText.benchmarks.moe [--output_dir DIR] [--target cpu|tpu|all]

CPU (moe_cpu.*, measured): the default model (4 layers, D=256, float32, 4 x 256 tokens per
step) with its dense SwiGLU MLP of width 768 against the same model with every MLP a mixture
of 8 experts of width 384, 2 per token (the same active width: 2 x 384), dropless and with
capacity_factor=1.25; compiled temp memory and median step time as ratios to the dense model,
all in one run, plus the model FLOPs each step counts (active parameters only).
TPU (moe_tpu.*, compile only): qwen3-30b-a3b at 8192 tokens per chip on v5p-64 and v5p-128,
FSDP over every chip and with ici_expert_parallelism=8, tiles 1 and 8, remat full and minimal,
dropless, flash attention; each cell is what
  python -m MaxText.train_compile configs/base.yml model_name=qwen3-30b-a3b compile_topology=S \\
    per_device_batch_size=1 max_target_length=8192 attention=flash num_vocab_tiling=T remat_policy=P
prints. Then the token exchange (moe_exchange_tpu.*): mixtral-8x7b (top 2) on v5p-64 with
ici_expert_parallelism=8, 8 tiles, remat full, with expert_exchange=all_gather and all_to_all:
memory per chip and the bytes each chip sends over the expert axis per step.
"""

import argparse
import itertools

from matplotlib.figure import Figure

from MaxText import costs, reports, runtime
from MaxText.benchmarks import common, provenance

MODEL = ("dataset_type=synthetic", "per_device_batch_size=4", "enable_checkpointing=false", "eval_interval=0")
MOE = ("decoder_block=mixtral", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=384")
CPU_VARIANTS = {"dense (mlp 768)": ("decoder_block=llama2", "base_mlp_dim=768"),
                "moe 8 x 384, top 2, dropless": (*MOE, "capacity_factor=null"),
                "moe 8 x 384, top 2, capacity 1.25": (*MOE, "capacity_factor=1.25")}
TPU_SLICES = ("v5p-64", "v5p-128")
TPU_MESHES = {"fsdp": ("ici_fsdp_parallelism=-1",), "expert 8 x fsdp": ("ici_expert_parallelism=8",
                                                                         "ici_fsdp_parallelism=-1")}
TPU_TILES = (1, 8)
TPU_POLICIES = ("full", "minimal")
QWEN3_30B = ("model_name=qwen3-30b-a3b", "dataset_type=synthetic", "per_device_batch_size=1",
             "max_target_length=8192", "attention=flash")
MIXTRAL_EXPERT_8 = ("model_name=mixtral-8x7b", "compile_topology=v5p-64", "dataset_type=synthetic",
                    "per_device_batch_size=1", "max_target_length=8192", "attention=flash", "ici_expert_parallelism=8",
                    "ici_fsdp_parallelism=-1", "num_vocab_tiling=8", "remat_policy=full")


def cpu_table(output_dir: str, warmup: int, steps: int) -> None:
  configs = {name: common.config(*MODEL, *overrides) for name, overrides in CPU_VARIANTS.items()}
  results = common.measure(configs, warmup, steps)
  base = results["dense (mlp 768)"]
  rows = []
  for name, r in results.items():
    r["model_flops_per_step"] = costs.training_flops_per_step(configs[name])
    r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
    r["time_ratio"] = r["step_seconds"] / base["step_seconds"]
    rows.append([name, f"{r['model_flops_per_step']:.4g}", reports.mib(r["temp_bytes"]), f"{r['memory_ratio']:.3f}",
                 f"{r['step_seconds']:.3f}", f"{r['time_ratio']:.3f}"])
  markdown = (f"## Default model, dense MLP against 8 experts of half its width, top 2 (XLA:CPU, float32, "
              f"{steps} timed steps after {warmup} warm-up)\n\n"
              + reports.markdown_table(["MLP", "model FLOPs/step", "temp MiB", "temp / dense", "median step s",
                                        "time / dense"], rows))
  print(markdown)
  figure = Figure(figsize=(8, 3))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r["time_ratio"] for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results), fontsize=8)
  axis.invert_yaxis()
  axis.axvline(1.0, color="black", linestyle="--")
  axis.set_xlabel("median step time / dense (XLA:CPU)")
  provenance.save(output_dir, "moe_cpu", markdown, results, figure)


def tpu_table(output_dir: str) -> None:
  results, rows = {}, []
  for topology, (mesh, mesh_keys), tiles, policy in itertools.product(TPU_SLICES, TPU_MESHES.items(), TPU_TILES,
                                                                       TPU_POLICIES):
    name = f"qwen3-30b-a3b {topology} {mesh} num_vocab_tiling={tiles} remat_policy={policy}"
    r = results[name] = common.compiled_memory_on(None, *QWEN3_30B, f"compile_topology={topology}", *mesh_keys,
                                                  f"num_vocab_tiling={tiles}", f"remat_policy={policy}")
    cell = ([reports.gib(r["argument_bytes"]), reports.gib(r["temp_bytes"]), reports.gib(r["total_bytes"])]
            if "error" not in r else ["", "", common.gib_or_refusal(r, "total_bytes")])
    rows.append([topology, mesh, tiles, policy, *cell])
    print(f"{name}: {cell[-1]}", flush=True)
  markdown = ("## qwen3-30b-a3b, 8192 tokens per chip, dropless, flash attention (TPU compiler, compile only)\n\n"
              + reports.markdown_table(["slice", "mesh", "num_vocab_tiling", "remat_policy", "params+opt GiB",
                                        "temp GiB", "total GiB/chip"], rows))
  print(markdown)
  figure = Figure(figsize=(9, 6))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r.get("total_bytes", 0) / 2**30 for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), [n.removeprefix("qwen3-30b-a3b ") for n in results], fontsize=7)
  axis.invert_yaxis()
  axis.set_xlabel("compiled memory per chip, GiB (TPU compiler)")
  provenance.save(output_dir, "moe_tpu", markdown, results, figure)


def exchange_table(output_dir: str) -> None:
  results, rows = {}, []
  for exchange in ("all_gather", "all_to_all"):
    r = results[exchange] = common.compiled_memory_on(None, *MIXTRAL_EXPERT_8, f"expert_exchange={exchange}")
    sent = r["collective_bytes_per_device"].get("expert", 0)
    rows.append([exchange, reports.gib(r["temp_bytes"]) if "error" not in r else "",
                 common.gib_or_refusal(r, "total_bytes"), reports.gib(sent)])
    print(f"mixtral-8x7b expert_exchange={exchange}: {rows[-1][2]} GiB/chip, {rows[-1][3]} GiB sent", flush=True)
  markdown = ("## mixtral-8x7b (8 experts, top 2), v5p-64, expert 8 x fsdp 4, 8192 tokens per chip, 8 tiles, remat "
              "full, dropless (TPU compiler, compile only)\n\n"
              + reports.markdown_table(["expert_exchange", "temp GiB", "total GiB/chip",
                                        "sent over the expert axis, GiB/chip/step"], rows))
  print(markdown)
  figure = Figure(figsize=(6, 2))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r.get("collective_bytes_per_device", {}).get("expert", 0) / 2**30
                                  for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results))
  axis.set_xlabel("GiB each chip sends over the expert axis per step")
  provenance.save(output_dir, "moe_exchange_tpu", markdown, results, figure)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--target", choices=("cpu", "tpu", "all"), default="all")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--steps", type=int, default=9)
  args = parser.parse_args()
  if args.target in ("cpu", "all"):
    cpu_table(args.output_dir, args.warmup, args.steps)
  if args.target in ("tpu", "all"):
    tpu_table(args.output_dir)
    exchange_table(args.output_dir)


if __name__ == "__main__":
  runtime.setup()
  main()
