"""Vocabulary tiling benchmark: python -m MaxText.benchmarks.vocab_tiling [--output_dir DIR]

Table 1 (measured): a head-dominated model (D=256, V=32768, 4096 tokens per step, 2 layers,
MLP 2 x D, float32, synthetic data) trained with full logits, then fused and recompute
tiling at 2, 4, 8 and 16 tiles: compiled temp memory of the whole train step and median
step time, both as ratios to full logits, all in one run.
Table 2 (compile only): what the rest of the step costs. Tiling leaves the layers' own peak
and the [D, V] gradients; the same body with V=512 is the floor no loss head can go below.
Table 3 (compile only): llama3-8b at 8192 tokens per device on 8 simulated devices (fsdp=8),
num_vocab_tiling 1 and 8.
"""



from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance

HEAD_DOMINATED = ("dataset_type=synthetic", "base_emb_dim=256", "vocab_size=32768", "base_num_decoder_layers=2",
                  "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=512", "max_target_length=256",
                  "per_device_batch_size=16", "enable_checkpointing=false", "eval_interval=0")
LLAMA3_8B = ("model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=8192",
             "ici_fsdp_parallelism=8")
TILES = (2, 4, 8, 16)
MODES = ("fused", "recompute")


def head_dominated_table(warmup: int, steps: int):
  variants = {"full logits": common.config(*HEAD_DOMINATED)}
  for mode in MODES:
    for tiles in TILES:
      variants[f"{mode} x{tiles}"] = common.config(*HEAD_DOMINATED, f"num_vocab_tiling={tiles}",
                                                   f"vocab_tiling_mode={mode}")
  results = common.measure(variants, warmup, steps)
  base = results["full logits"]
  rows = []
  for name, r in results.items():
    r["memory_ratio"] = r["temp_bytes"] / base["temp_bytes"]
    r["time_ratio"] = r["step_seconds"] / base["step_seconds"]
    rows.append([name, reports.mib(r["temp_bytes"]), f"{r['memory_ratio']:.3f}",
                 f"{r['step_seconds']:.3f}", f"{r['time_ratio']:.3f}"])
  table = reports.markdown_table(["loss head", "temp MiB", "temp / full", "median step s", "time / full"], rows)
  return table, results


def body_table(full_temp_bytes: int):
  variants = {
      "same body, V=512 (floor)": ("vocab_size=512",),
      "MLP 4 x D, full logits": ("base_mlp_dim=1024",),
      "MLP 4 x D, fused x8": ("base_mlp_dim=1024", "num_vocab_tiling=8"),
  }
  results = {name: common.compiled_memory(common.config(*HEAD_DOMINATED, *o)) for name, o in variants.items()}
  rows = [[name, reports.mib(r["temp_bytes"]), f"{r['temp_bytes'] / full_temp_bytes:.3f}"]
          for name, r in results.items()]
  return reports.markdown_table(["variant (compile only)", "temp MiB", "temp / table 1 full"], rows), results


def llama3_8b_table():
  variants = {"full logits": ("num_vocab_tiling=1",),
              "fused x8": ("num_vocab_tiling=8",),
              "recompute x8": ("num_vocab_tiling=8", "vocab_tiling_mode=recompute")}
  results = {name: common.compiled_memory_on(8, *LLAMA3_8B, *o) for name, o in variants.items()}
  rows = [[name, reports.gib(r["temp_bytes"]), reports.gib(r["total_bytes"])] for name, r in results.items()]
  return reports.markdown_table(["llama3-8b, 8192 tokens/device, fsdp=8", "temp GiB/device", "total GiB/device"],
                               rows), results


def plot(results):
  figure = Figure(figsize=(10, 4))
  (memory, time) = figure.subplots(1, 2)
  for mode in MODES:
    names = [f"{mode} x{t}" for t in TILES]
    memory.plot(TILES, [results[n]["memory_ratio"] for n in names], "o-", label=mode)
    time.plot(TILES, [results[n]["time_ratio"] for n in names], "o-", label=mode)
  for axis, title in ((memory, "compiled temp memory / full logits"), (time, "median step time / full logits")):
    axis.axhline(1.0, color="gray", linestyle="--", label="full logits")
    axis.set_xscale("log", base=2)
    axis.set_xticks(TILES, [str(t) for t in TILES])
    axis.set_xlabel("num_vocab_tiling")
    axis.set_title(title)
    axis.legend()
  figure.suptitle("Vocabulary tiling: D=256, V=32768, 4096 tokens/step, 2 layers, float32, CPU")
  return figure


def main():
  args = common.parse_args(__doc__, 7)
  head_table, head_results = head_dominated_table(args.warmup, args.steps)
  rest_table, rest_results = body_table(head_results["full logits"]["temp_bytes"])
  llama_table, llama_results = llama3_8b_table()
  markdown = (f"## Head-dominated model, {args.steps} timed steps after {args.warmup} warm-up\n\n{head_table}\n\n"
              f"## What the rest of the step costs\n\n{rest_table}\n\n## llama3-8b (compile only)\n\n{llama_table}")
  print(markdown)
  provenance.save(args.output_dir, "vocab_tiling", markdown,
              {"head_dominated": head_results, "rest_of_step": rest_results, "llama3_8b": llama_results},
              plot(head_results))


if __name__ == "__main__":
  runtime.setup()
  main()
