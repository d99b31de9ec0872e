"""Sizing llama3-8b before paying for it: python -m MaxText.benchmarks.sizing [--output_dir DIR]

Compiles (runs nothing) the llama3-8b train step at 8192 tokens per device for FSDP over
64 and 256 simulated CPU devices, num_vocab_tiling 1 and 8, remat_policy full and minimal,
and tabulates the compiled per-device memory; then, for FSDP over 8 devices, the loss side's
largest arrays (those with a vocabulary dimension) as the compiled HLO names them. Each cell is what
  JAX_NUM_CPU_DEVICES=N python -m MaxText.train_compile configs/base.yml model_name=llama3-8b \\
    per_device_batch_size=1 ici_fsdp_parallelism=N num_vocab_tiling=T remat_policy=P
prints.
"""

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from MaxText.benchmarks import common  # noqa: E402

DEVICES = (64, 256)
TILES = (1, 8)
POLICIES = ("full", "minimal")


def loss_side_table():
  """llama3-8b on fsdp=8, tiles 1 and 8: temp memory and the largest vocabulary-sized arrays."""
  results, rows = {}, []
  for tiles in TILES:
    r = results[f"num_vocab_tiling={tiles}"] = common.compiled_memory_on(
        8, "model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1", "ici_fsdp_parallelism=8",
        f"num_vocab_tiling={tiles}")
    arrays = ", ".join(f"{shape} {size / 2**20:,.0f} MiB" for shape, size in r["largest_vocab_arrays"])
    rows.append([tiles, common.gib(r["temp_bytes"]), arrays])
  return common.markdown_table(["num_vocab_tiling", "temp GiB", "largest arrays with a vocabulary dimension"],
                               rows), results


def main():
  args = common.parse_args(__doc__)
  results, rows = {}, []
  for devices, tiles, policy in itertools.product(DEVICES, TILES, POLICIES):
    name = f"fsdp={devices} num_vocab_tiling={tiles} remat_policy={policy}"
    results[name] = common.compiled_memory_on(
        devices, "model_name=llama3-8b", "dataset_type=synthetic", "per_device_batch_size=1",
        f"ici_fsdp_parallelism={devices}", f"num_vocab_tiling={tiles}", f"remat_policy={policy}")
    r = results[name]
    print(f"{name}: total {common.gib(r['total_bytes'])} GiB", flush=True)
    rows.append([f"fsdp={devices}", tiles, policy, common.gib(r["argument_bytes"]), common.gib(r["temp_bytes"]),
                 common.gib(r["total_bytes"])])
  table = common.markdown_table(["mesh", "num_vocab_tiling", "remat_policy", "params+opt GiB", "temp GiB",
                                 "total GiB/device"], rows)
  loss_table, loss_results = loss_side_table()
  markdown = (f"## llama3-8b, 8192 tokens per device, bfloat16 activations (compile only)\n\n{table}\n\n"
              f"## The loss side per device, fsdp=8 (compile only)\n\n{loss_table}")
  print(markdown)
  figure, axis = plt.subplots(figsize=(9, 4))
  axis.barh(range(len(results)), [r["total_bytes"] / 2**30 for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results), fontsize=8)
  axis.invert_yaxis()
  axis.set_xlabel("compiled memory per device, GiB")
  axis.set_title("llama3-8b train step, 8192 tokens/device")
  common.save(args.output_dir, "sizing", markdown, {**results, "loss_side_fsdp8": loss_results}, figure)


if __name__ == "__main__":
  main()
