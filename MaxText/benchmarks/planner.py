"""Planner check: python -m MaxText.benchmarks.planner [--output_dir DIR] [--warmup W] [--steps S]

For the default model and a head-dominated one (32k vocabulary, width 64) on this machine's
CPU, runs the planner's search (remat_policy none / save_qkv_proj / full, batch 2 / 4 / 8,
num_vocab_tiling 1 / 4 / 16) under a budget of what full remat needs untiled at batch 8 (default
model) or 4 (head-dominated: the budget makes it tile), takes the five candidates it predicts
fastest that fit, measures their median step times in one run (round-robin, common.measure),
and reports the Spearman correlation between predicted and measured tokens/s.
"""


from matplotlib.figure import Figure
from scipy import stats

from MaxText import plan, pyconfig, reports, runtime, sharding
from MaxText.benchmarks import common, provenance

RUN = ("dataset_type=synthetic", "enable_checkpointing=false", "eval_interval=0", "enable_tensorboard=false")
# name -> (overrides, the batch at which untiled full remat sets the budget)
MODELS = {
    "default model": ((), 8),
    "head-dominated": (("vocab_size=32768", "base_emb_dim=64", "base_mlp_dim=192", "max_target_length=128"), 4),
}
SEARCH = ("plan_remat_policies=[none,save_qkv_proj,full]", "plan_remat_layer_intervals=[1]",
          "plan_per_device_batch_sizes=[2,4,8]", "plan_num_vocab_tiling=[1,4,16]")
TOP = 5


def check(model: tuple, budget_batch: int, warmup: int, steps: int) -> dict:
  argv = [common.BASE_YML, *RUN, *model]
  config = pyconfig.initialize([*argv, *SEARCH])
  rates = plan.roofline_rates(sharding.run_devices("", 1)[0])
  budget = plan.evaluate(config, {"remat_policy": "full", "per_device_batch_size": budget_batch, "num_vocab_tiling": 1},
                         rates)["total_bytes"]
  records = plan.search(config, plan.search_space(config, plan.SEARCH_KEYS), budget, rates, workers=1)
  top = sorted((r for r in records if r["fits"]), key=lambda r: -r["tokens_per_second_per_chip"])[:TOP]
  names = [plan.describe({k: r["settings"][k] for k in ("remat_policy", "per_device_batch_size", "num_vocab_tiling")})
           for r in top]
  measured = common.measure({n: common.config(*RUN, *model, *plan._assignments(r["settings"]))
                             for n, r in zip(names, top)}, warmup, steps)
  rows = []
  for name, r in zip(names, top):
    measured[name]["tokens_per_second"] = r["tokens_per_step"] / measured[name]["step_seconds"]
    rows.append({"candidate": name, "predicted": r["tokens_per_second_per_chip"],
                 "measured": measured[name]["tokens_per_second"], "total_bytes": r["total_bytes"],
                 "measured_total_bytes": measured[name]["total_bytes"], "bound": r["bound"]})
  rho = stats.spearmanr([r["predicted"] for r in rows], [r["measured"] for r in rows]).statistic
  return {"budget_bytes": budget, "compiles": len(records), "rows": rows, "spearman": rho, "candidates": records,
          "roofline": rates}


def main():
  args = common.parse_args(__doc__, 9)
  results = {name: check(*model, args.warmup, args.steps) for name, model in MODELS.items()}
  sections = []
  figure = Figure(figsize=(12, 5))
  axes = figure.subplots(1, len(results))
  for axis, (name, result) in zip(axes, results.items()):
    table = reports.markdown_table(
        ["candidate", "GiB (plan = measured)", "bound", "predicted tokens/s", "measured tokens/s"],
        [[r["candidate"], f"{reports.gib(r['total_bytes'])} = {reports.gib(r['measured_total_bytes'])}", r["bound"],
          f"{r['predicted']:,.0f}", f"{r['measured']:,.0f}"] for r in result["rows"]])
    sections.append(f"## {name}: budget {reports.gib(result['budget_bytes'])} GiB, {result['compiles']} compiles, "
                    f"top {TOP} predicted; Spearman {result['spearman']:.2f}\n\n{table}")
    axis.scatter([r["predicted"] for r in result["rows"]], [r["measured"] for r in result["rows"]])
    for r in result["rows"]:
      axis.annotate(r["candidate"], (r["predicted"], r["measured"]), fontsize=6)
    axis.set_title(f"{name}: Spearman {result['spearman']:.2f}")
    axis.set_xlabel("predicted tokens/s (roofline)")
    axis.set_ylabel("measured tokens/s (median step)")
  markdown = f"{args.steps} timed steps after {args.warmup} warm-up, XLA:CPU\n\n" + "\n\n".join(sections)
  print(markdown)
  provenance.save(args.output_dir, "planner", markdown, results, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
