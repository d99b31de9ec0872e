"""Pipeline stages across two slices: python -m MaxText.benchmarks.pipeline [--output_dir DIR] [--only NAME ...]

Compile only (TPU compiler, libtpu on this host): llama3-70b over 2 x v5p-128, 8,192 tokens per
chip, 8 vocabulary tiles, remat_policy=full, attention=flash, ici_fsdp_parallelism=-1. Each cell is
what
  python -m MaxText.train_compile configs/base.yml model_name=llama3-70b compile_topology=v5p-128 \\
    compile_topology_num_slices=2 dataset_type=synthetic max_target_length=8192 num_vocab_tiling=8 \\
    remat_policy=full attention=flash ici_fsdp_parallelism=-1 per_device_batch_size=B [mesh and pipeline keys]
prints: memory per chip, the bytes each chip sends across the slices and within its slice per
step (every collective of the compiled program at its loop trip counts, hlo_network.network_bytes), the
pipeline's bubble, and the step's FLOPs as traced over the model's (the bubble's idle work,
recomputation and the causal mask's half of attention included). Two tables: the slices joined
by data, FSDP or pipeline stages (one microbatch per stage, and circular with one layer per
stage as MaxText runs it by default); and GPipe against 1F1B, with and without
pipeline_keep_residuals, at 4, 8 and 16 microbatches of the same size (one row per chip each, so
the batch grows with them).
"""

import argparse
import re

from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance

STEP = ("model_name=llama3-70b", "compile_topology=v5p-128", "compile_topology_num_slices=2", "dataset_type=synthetic",
        "max_target_length=8192", "num_vocab_tiling=8", "remat_policy=full", "attention=flash",
        "ici_fsdp_parallelism=-1")
PIPELINE = ("dcn_pipeline_parallelism=2",)
KEPT = ("pipeline_schedule=1f1b", "pipeline_keep_residuals=true")
# name -> (overrides, MaxText 0.2.5's GiB per chip for the same cell, from its own train_compile)
SLICES = {
    "dcn_data_parallelism=2": (("dcn_data_parallelism=2", "per_device_batch_size=1"), 40.84),
    "dcn_fsdp_parallelism=2": (("dcn_fsdp_parallelism=2", "per_device_batch_size=1"), None),
    "dcn_pipeline_parallelism=2, gpipe, 2 microbatches": ((*PIPELINE, "per_device_batch_size=1",
                                                          "pipeline_schedule=gpipe"), None),
    # No schedule named: 1F1B.
    "dcn_pipeline_parallelism=2, 1f1b (the default), 2 microbatches": ((*PIPELINE, "per_device_batch_size=1"), None),
    "dcn_pipeline_parallelism=2, 1f1b, residuals kept, 2 microbatches": ((*PIPELINE, "per_device_batch_size=1", *KEPT),
                                                                         None),
    "dcn_pipeline_parallelism=2, circular, 2 repeats, 2 microbatches": (
        (*PIPELINE, "per_device_batch_size=1", "num_pipeline_repeats=2"), None),
    "dcn_pipeline_parallelism=2, interleaved 1f1b, 2 repeats, 2 microbatches": (
        (*PIPELINE, "per_device_batch_size=1", "num_pipeline_repeats=2", "pipeline_schedule=1f1b"), None),
    # MaxText's defaults: one layer per stage (40 repeats), one microbatch per stage.
    "dcn_pipeline_parallelism=2, circular, 1 layer per stage, 2 microbatches": (
        (*PIPELINE, "per_device_batch_size=1", "num_layers_per_pipeline_stage=1"), 30.42),
}
# name -> overrides, at 4, 8 and 16 microbatches
LINES = {"gpipe": ("pipeline_schedule=gpipe",), "1f1b": ("pipeline_schedule=1f1b",), "1f1b, residuals kept": KEPT}
SCHEDULES = {f"{line}, {count} microbatches": (line, count) for line in LINES for count in (4, 8, 16)}
# MaxText 0.2.5's own train_compile with dcn_pipeline_parallelism=2 and these microbatches (its
# default schedule: circular, one layer per stage), GiB per chip or the temporaries its compiler
# refused.
MAXTEXT_MICROBATCHES = {2: "30.42", 4: "90.75", 8: "does not fit (compiler: temp 111.08G > 95.73G)",
                        16: "does not fit (compiler: temp 215.58G > 95.73G)"}


def _temp_gib(r: dict) -> float | None:
  """The temporaries in GiB, or what the compiler said it needed where it refused the step."""
  if "error" not in r:
    return r["temp_bytes"] / 2**30
  needed = re.search(r"temporaries \(([\d.]+)G\)", r["error"])
  return float(needed[1]) if needed else None


def _row(name: str, r: dict) -> list:
  if "error" in r:
    return [name, "", "", common.gib_or_refusal(r, "total_bytes"), "", "", "", ""]
  network = r["network_bytes_per_device"]
  return [name, reports.gib(r["argument_bytes"]), reports.gib(r["temp_bytes"]), reports.gib(r["total_bytes"]),
          f"{network['dcn'] / 2**30:.3f}", f"{network['ici'] / 2**30:.1f}",
          f"{r['pipeline_bubble']:.1%}" if "pipeline_bubble" in r else "",
          f"{r['traced_flops_per_step'] / r['model_flops_per_step']:.2f}"]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--only", nargs="*", help="cells to compile, by a word of their name (default: every cell)")
  args = parser.parse_args()
  wanted = lambda name: not args.only or any(word in name for word in args.only)
  header = ["cell", "params+opt GiB", "temp GiB", "total GiB/chip", "GiB/chip/step across slices",
            "GiB/chip/step within a slice", "bubble", "traced FLOPs / model FLOPs"]
  results, slice_rows, schedule_rows = {}, [], []
  for name, (overrides, maxtext) in SLICES.items():
    if wanted(name):
      r = results[name] = common.compiled_memory_on(None, *STEP, *overrides)
      slice_rows.append([*_row(name, r), f"{maxtext:.2f}" if maxtext else ""])
      print(slice_rows[-1], flush=True)
  for name, (line, count) in SCHEDULES.items():
    if wanted(name):
      r = results[name] = common.compiled_memory_on(None, *STEP, *PIPELINE, *LINES[line],
                                                    f"num_pipeline_microbatches={count}",
                                                    f"per_device_batch_size={count // 2}")
      schedule_rows.append([*_row(name, r), MAXTEXT_MICROBATCHES[count]])
      print(schedule_rows[-1], flush=True)
  markdown = ("## llama3-70b over 2 x v5p-128: the slices joined by data, FSDP or pipeline stages (TPU compiler, "
              "compile only, 8,192 tokens per chip)\n\n"
              + reports.markdown_table([*header, "MaxText 0.2.5 GiB/chip"], slice_rows)
              + "\n\n## dcn_pipeline_parallelism=2: GPipe and 1F1B (and 1F1B keeping residuals) at 4, 8 and 16 "
                "microbatches of one row per chip (per_device_batch_size = microbatches / 2)\n\n"
              + reports.markdown_table([*header, "MaxText 0.2.5 GiB/chip (circular, 1 layer per stage)"],
                                       schedule_rows))
  print(markdown)
  figure = Figure(figsize=(12, 4.5))
  bars, lines = figure.subplots(1, 2)
  sliced = [n for n in SLICES if n in results]
  bars.barh(range(len(sliced)), [results[n].get("total_bytes", 0) / 2**30 for n in sliced], color="tab:blue")
  bars.set_yticks(range(len(sliced)), [n.replace(", ", "\n", 1) for n in sliced], fontsize=7)
  bars.invert_yaxis()
  bars.set_xlabel("compiled memory per chip, GiB (TPU compiler)")
  for line in LINES:
    points = [(count, _temp_gib(results[n])) for n, (s, count) in SCHEDULES.items() if s == line and n in results]
    points = [(c, t) for c, t in points if t is not None]
    lines.plot([c for c, _ in points], [t for _, t in points], marker="o", label=line)
  lines.set_xlabel("microbatches (one row per chip each)")
  lines.set_ylabel("temporaries per chip, GiB")
  lines.legend()
  figure.tight_layout()
  provenance.save(args.output_dir, "pipeline_tpu", markdown, results, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
