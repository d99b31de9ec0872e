"""Remat benchmark: python -m MaxText.benchmarks.remat [--output_dir DIR]

Table 1 (measured): the default model (4 layers, D=256, float32, 1024 tokens per step) for
every remat_policy x remat_layer_interval in (1, 2, 4): compiled temp memory of the train
step and median step time, both as ratios to remat_policy=none, all in one run.
Table 2 (compile only): llama3-8b at 8192 tokens per device on 8 simulated devices
(fsdp=8, num_vocab_tiling=8), every policy at interval 1.
"""



from matplotlib.figure import Figure

from MaxText import remat, reports, runtime
from MaxText.benchmarks import common, provenance

MODEL = ("dataset_type=synthetic", "per_device_batch_size=4", "enable_checkpointing=false", "eval_interval=0")
LLAMA3_8B = ("model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=8192",
             "ici_fsdp_parallelism=8", "num_vocab_tiling=8")
POLICIES = list(remat.SEARCHABLE_POLICIES)
INTERVALS = (1, 2, 4)


def variants():
  names = {"none": ("remat_policy=none",)}
  for policy in POLICIES[1:]:
    for interval in INTERVALS:
      names[f"{policy} /{interval}"] = (f"remat_policy={policy}", f"remat_layer_interval={interval}")
  return names


def plot(results, front):
  figure = Figure(figsize=(9, 6))
  axis = figure.subplots()
  for name, r in results.items():
    on_front = name in front
    axis.scatter(r["time_ratio"], r["memory_ratio"], s=40 if on_front else 18,
                 color="tab:red" if on_front else "tab:blue", zorder=3)
    axis.annotate(name, (r["time_ratio"], r["memory_ratio"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
  axis.plot([results[n]["time_ratio"] for n in front], [results[n]["memory_ratio"] for n in front],
            color="tab:red", label="Pareto front")
  axis.set_xlabel("median step time / none")
  axis.set_ylabel("compiled temp memory / none")
  axis.set_title("remat_policy /remat_layer_interval: default model, float32, CPU")
  axis.legend()
  return figure


def main():
  args = common.parse_args(__doc__, 9)
  results = common.measure({n: common.config(*MODEL, *o) for n, o in variants().items()}, args.warmup, args.steps)
  base = results["none"]
  for r in results.values():
    r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
    r["time_ratio"] = r["step_seconds"] / base["step_seconds"]
  front = reports.pareto_front({n: (r["time_ratio"], r["memory_ratio"]) for n, r in results.items()})
  rows = [[n, reports.mib(r["temp_bytes"]), f"{r['memory_ratio']:.3f}", f"{r['step_seconds']:.3f}",
           f"{r['time_ratio']:.3f}", "yes" if n in front else ""] for n, r in results.items()]
  table = reports.markdown_table(["policy /interval", "temp MiB", "temp / none", "median step s", "time / none",
                                 "Pareto"], rows)
  llama = {p: common.compiled_memory_on(8, *LLAMA3_8B, f"remat_policy={p}") for p in POLICIES}
  llama_table = reports.markdown_table(
      ["llama3-8b policy", "temp GiB/device", "total GiB/device"],
      [[p, reports.gib(r["temp_bytes"]), reports.gib(r["total_bytes"])] for p, r in llama.items()])
  markdown = (f"## Default model, {args.steps} timed steps after {args.warmup} warm-up\n\n{table}\n\n"
              f"## llama3-8b, 8192 tokens/device, fsdp=8, num_vocab_tiling=8 (compile only)\n\n{llama_table}")
  print(markdown)
  provenance.save(args.output_dir, "remat", markdown,
               {"default_model": results, "pareto_front": front, "llama3_8b": llama}, plot(results, front))


if __name__ == "__main__":
  runtime.setup()
  main()
