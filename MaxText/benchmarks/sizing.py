"""Sizing before paying for it: python -m MaxText.benchmarks.sizing [--output_dir DIR] [--target tpu|cpu|all]

TPU (sizing_tpu.*): the TPU compiler (libtpu, compile only, runs here without TPUs) sizes
llama3-8b (8192 tokens per chip) on a v5p-64 and a v6e-256 and qwen3-0.6b (4096 tokens per
chip) on a v5e-16, FSDP over every chip, num_vocab_tiling x remat_policy, and llama3-8b's
attention implementations; per chip, against the chip's HBM. Each cell is what
  python -m MaxText.train_compile configs/base.yml model_name=M compile_topology=S \\
    per_device_batch_size=1 num_vocab_tiling=T remat_policy=P
prints (exit code 1 and the compiler's line where it does not fit).

CPU (sizing.*): XLA:CPU's estimate for llama3-8b on 64 and 256 simulated devices, and the
loss side's largest arrays (those with a vocabulary dimension) on 8.
"""

import argparse
import itertools

from matplotlib.figure import Figure

from MaxText import accelerators, reports, runtime
from MaxText.benchmarks import common, provenance

TPU_SLICES = (("llama3-8b", "v5p-64"), ("llama3-8b", "v6e-256"), ("qwen3-0.6b", "v5e-16"))
TPU_TILES = (1, 8, 16)
TPU_POLICIES = ("full", "save_qkv_proj", "minimal", "minimal_offloaded")
CPU_DEVICES = (64, 256)
CPU_TILES = (1, 8)
CPU_POLICIES = ("full", "minimal")


def _cell(r: dict) -> list:
  """[params+opt, temp, host, total, verdict] in GiB per chip."""
  if "error" in r:
    return ["", "", "", "", common.gib_or_refusal(r, "total_bytes")]
  verdict = "fits" if r["fits"] else "does not fit"
  return [reports.gib(r["argument_bytes"]), reports.gib(r["temp_bytes"]), reports.gib(r["host_bytes"]),
          reports.gib(r["total_bytes"]), f"{verdict} ({r['device_memory_bytes'] / 2**30:.0f} GiB)"]


def attention_table(results: dict) -> str:
  """llama3-8b at 8192 tokens on v5p-64, 8 tiles, remat full, by attention implementation."""
  rows = []
  for attention in ("dot_product", "chunked", "flash"):
    name = f"llama3-8b v5p-64 num_vocab_tiling=8 remat_policy=full attention={attention}"
    r = results[name] = common.compiled_memory_on(
        None, "model_name=llama3-8b", "compile_topology=v5p-64", "dataset_type=synthetic", "per_device_batch_size=1",
        "num_vocab_tiling=8", "remat_policy=full", f"attention={attention}")
    rows.append([attention, *_cell(r)])
    print(f"{name}: {rows[-1][-1]} {rows[-1][-2]}", flush=True)
  return ("## llama3-8b on v5p-64, 8192 tokens per chip, 8 tiles, remat full: attention implementations "
          "(TPU compiler)\n\n" + reports.markdown_table(
              ["attention", "params+opt GiB", "temp GiB", "host GiB", "total GiB/chip", "verdict"], rows))


def tpu_tables(output_dir: str) -> None:
  results, sections = {}, []
  figure = Figure(figsize=(16, 5))
  axes = figure.subplots(1, len(TPU_SLICES))
  for axis, (model, topology) in zip(axes, TPU_SLICES):
    rows, bars = [], []
    for tiles, policy in itertools.product(TPU_TILES, TPU_POLICIES):
      name = f"{model} {topology} num_vocab_tiling={tiles} remat_policy={policy}"
      r = results[name] = common.compiled_memory_on(
          None, f"model_name={model}", f"compile_topology={topology}", "dataset_type=synthetic",
          "per_device_batch_size=1", f"num_vocab_tiling={tiles}", f"remat_policy={policy}")
      rows.append([tiles, policy, *_cell(r)])
      bars.append((f"{tiles} / {policy}", r.get("total_bytes", 0) / 2**30, r["fits"]))
      print(f"{name}: {rows[-1][-1]} {rows[-1][-2]}", flush=True)
    sections.append(f"## {model} on {topology}, FSDP over every chip (TPU compiler, compile only)\n\n"
                    + reports.markdown_table(["num_vocab_tiling", "remat_policy", "params+opt GiB", "temp GiB",
                                             "host GiB", "total GiB/chip", "verdict"], rows))
    axis.barh(range(len(bars)), [b[1] for b in bars], color=["tab:blue" if b[2] else "tab:red" for b in bars])
    axis.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=7)
    axis.invert_yaxis()
    axis.axvline(accelerators.parse_slice(topology).chip.hbm_gib, color="black", linestyle="--", label="HBM per chip")
    axis.legend(fontsize=7)
    axis.set_xlabel("compiled memory per chip, GiB (red: does not fit)")
    axis.set_title(f"{model} on {topology}", fontsize=9)
  sections.append(attention_table(results))
  markdown = "\n\n".join(sections)
  print(markdown)
  provenance.save(output_dir, "sizing_tpu", markdown, results, figure)


def loss_side_table():
  """llama3-8b on fsdp=8, tiles 1 and 8: temp memory and the largest vocabulary-sized arrays."""
  results, rows = {}, []
  for tiles in CPU_TILES:
    r = results[f"num_vocab_tiling={tiles}"] = common.compiled_memory_on(
        8, "model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1", "ici_fsdp_parallelism=8",
        f"num_vocab_tiling={tiles}")
    arrays = ", ".join(f"{shape} {size / 2**20:,.0f} MiB" for shape, size in r["largest_vocab_arrays"])
    rows.append([tiles, reports.gib(r["temp_bytes"]), arrays])
  return reports.markdown_table(["num_vocab_tiling", "temp GiB", "largest arrays with a vocabulary dimension"],
                               rows), results


def cpu_tables(output_dir: str) -> None:
  results, rows = {}, []
  for devices, tiles, policy in itertools.product(CPU_DEVICES, CPU_TILES, CPU_POLICIES):
    name = f"fsdp={devices} num_vocab_tiling={tiles} remat_policy={policy}"
    results[name] = common.compiled_memory_on(
        devices, "model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1",
        f"ici_fsdp_parallelism={devices}", f"num_vocab_tiling={tiles}", f"remat_policy={policy}")
    r = results[name]
    print(f"{name}: total {reports.gib(r['total_bytes'])} GiB", flush=True)
    rows.append([f"fsdp={devices}", tiles, policy, reports.gib(r["argument_bytes"]), reports.gib(r["temp_bytes"]),
                 reports.gib(r["total_bytes"])])
  table = reports.markdown_table(["mesh", "num_vocab_tiling", "remat_policy", "params+opt GiB", "temp GiB",
                                 "total GiB/device"], rows)
  loss_table, loss_results = loss_side_table()
  markdown = (f"## llama3-8b, 8192 tokens per device, bfloat16 activations (XLA:CPU estimate, compile only)\n\n"
              f"{table}\n\n## The loss side per device, fsdp=8 (XLA:CPU estimate, compile only)\n\n{loss_table}")
  print(markdown)
  figure = Figure(figsize=(9, 4))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r["total_bytes"] / 2**30 for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results), fontsize=8)
  axis.invert_yaxis()
  axis.set_xlabel("compiled memory per device, GiB (XLA:CPU)")
  axis.set_title("llama3-8b train step, 8192 tokens/device")
  provenance.save(output_dir, "sizing", markdown, {**results, "loss_side_fsdp8": loss_results}, figure)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--target", choices=("tpu", "cpu", "all"), default="all")
  args = parser.parse_args()
  if args.target in ("tpu", "all"):
    tpu_tables(args.output_dir)
  if args.target in ("cpu", "all"):
    cpu_tables(args.output_dir)


if __name__ == "__main__":
  runtime.setup()
  main()
