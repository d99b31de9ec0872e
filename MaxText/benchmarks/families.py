"""The newest families on TPU slices: python -m MaxText.benchmarks.families [--output_dir DIR] [--only NAME ...]

Compile only (TPU compiler, libtpu on this host), 8,192 tokens per chip, remat_policy=full,
attention=flash: each model on the slice it is sized for, with 8 vocabulary tiles and untiled
(the head's [tokens, vocabulary] logits whole: Gemma 3's 262,208-token vocabulary is the case
tiling exists for), and for the mixtures (DeepSeek's) with expert parallelism too, dropless and, for
deepseek3-671b, with the experts' kernels gathered a slice at a time (mlp_chunks=8) and with
capacity_factor=1.25, also with the layer inputs offloaded to the host (remat_policy=input_offloaded
in place of full); olmo3-32b with its MLP in slices and its layer inputs offloaded; kimi-k2-1t dropless
on a v5p-1024; llama4-17b-16e, gpt-oss-120b and qwen3-next-80b-a3b on a v5p-64, llama4-17b-128e on a v5p-256.
Each cell is what
  python -m MaxText.train_compile configs/base.yml model_name=M compile_topology=S dataset_type=synthetic \\
    per_device_batch_size=1 max_target_length=8192 attention=flash remat_policy=full num_vocab_tiling=T [mesh keys]
prints: the parameters and optimizer state per chip, the temporaries and their sum; a step the
compiler refuses is shown with what it needed.
"""

import argparse

from matplotlib.figure import Figure

from MaxText import reports, runtime
from MaxText.benchmarks import common, provenance

STEP = ("dataset_type=synthetic", "per_device_batch_size=1", "max_target_length=8192", "attention=flash",
        "remat_policy=full")
FSDP = ("ici_fsdp_parallelism=-1",)
EXPERT_8 = ("ici_expert_parallelism=8", "ici_fsdp_parallelism=-1")
# (model, slice, mesh name, mesh keys, vocabulary tiles)
CELLS = (
    ("gemma3-27b", "v5p-64", "fsdp", FSDP, 8),
    ("gemma3-27b", "v5p-64", "fsdp", FSDP, 1),
    ("deepseek2-16b", "v5p-32", "fsdp", FSDP, 8),
    ("deepseek2-16b", "v5p-32", "fsdp", FSDP, 1),
    ("deepseek2-16b", "v5p-32", "expert 8 x fsdp", EXPERT_8, 8),
    ("deepseek3-671b", "v5p-512", "fsdp", FSDP, 8),
    # The experts' kernels gathered an eighth of their hidden units at a time (7 GiB each whole).
    ("deepseek3-671b", "v5p-512", "fsdp, mlp_chunks=8", (*FSDP, "mlp_chunks=8"), 8),
    ("deepseek3-671b", "v5p-512", "expert 8 x fsdp", EXPERT_8, 8),
    # Dropless, its buffers sized for every copy landing on one device's experts, does not fit;
    # MaxText's capacity rule (a model setting: copies past it are dropped) does.
    ("deepseek3-671b", "v5p-512", "expert 8 x fsdp, capacity_factor=1.25", (*EXPERT_8, "capacity_factor=1.25"), 8),
    ("deepseek3-671b", "v5p-512", "expert 8 x fsdp, capacity_factor=1.25, mlp_chunks=8",
     (*EXPERT_8, "capacity_factor=1.25", "mlp_chunks=8"), 8),
    # The same with the layer inputs, the one stack remat_policy=full keeps, in host memory.
    ("deepseek3-671b", "v5p-512", "expert 8 x fsdp, capacity_factor=1.25, remat_policy=input_offloaded",
     (*EXPERT_8, "capacity_factor=1.25", "remat_policy=input_offloaded"), 8),
    # OLMo 3 (MaxText 0.2.5's figure for the plain setting: docs/results/families_tpu.md), its MLP in
    # slices, its layer inputs on the host, and both.
    ("olmo3-32b", "v5p-64", "fsdp", FSDP, 8),
    ("olmo3-32b", "v5p-64", "fsdp, mlp_chunks=4", (*FSDP, "mlp_chunks=4"), 8),
    ("olmo3-32b", "v5p-64", "fsdp, remat_policy=input_offloaded", (*FSDP, "remat_policy=input_offloaded"), 8),
    ("olmo3-32b", "v5p-64", "fsdp, mlp_chunks=4, remat_policy=input_offloaded",
     (*FSDP, "mlp_chunks=4", "remat_policy=input_offloaded"), 8),
    # Kimi K2, a trillion parameters: DeepSeek-V3's layout with 384 experts, dropless on 512 chips,
    # the experts' kernels in slices, and the layer inputs on the host.
    ("kimi-k2-1t", "v5p-1024", "fsdp, mlp_chunks=8", (*FSDP, "mlp_chunks=8"), 8),
    ("kimi-k2-1t", "v5p-1024", "fsdp, mlp_chunks=8, remat_policy=input_offloaded",
     (*FSDP, "mlp_chunks=8", "remat_policy=input_offloaded"), 8),
    ("kimi-k2-1t", "v5p-1024", "fsdp, mlp_chunks=16, remat_policy=input_offloaded",
     (*FSDP, "mlp_chunks=16", "remat_policy=input_offloaded"), 8),
    # Llama 4 Scout on the slice MaxText's figure is for; Maverick, whose 128 experts FSDP gathers
    # whole in each layer unless in slices or spread over expert parallelism.
    ("llama4-17b-16e", "v5p-64", "fsdp", FSDP, 8),
    ("llama4-17b-128e", "v5p-256", "fsdp", FSDP, 8),
    ("llama4-17b-128e", "v5p-256", "fsdp, mlp_chunks=8", (*FSDP, "mlp_chunks=8"), 8),
    ("llama4-17b-128e", "v5p-256", "expert 8 x fsdp", ("ici_expert_parallelism=8", "ici_fsdp_parallelism=-1"), 8),
    # GPT-OSS 120B; its experts in slices gather less but keep more.
    ("gpt-oss-120b", "v5p-64", "fsdp", FSDP, 8),
    ("gpt-oss-120b", "v5p-64", "fsdp, mlp_chunks=4", (*FSDP, "mlp_chunks=4"), 8),
    # Qwen3-Next: three Gated DeltaNet layers to one attention layer, 512 experts a layer.
    ("qwen3-next-80b-a3b", "v5p-64", "fsdp", FSDP, 8),
)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--output_dir", default="outputs/benchmarks")
  parser.add_argument("--only", nargs="*", help="models to compile (default: every cell)")
  args = parser.parse_args()
  results, rows = {}, []
  for model, topology, mesh, mesh_keys, tiles in CELLS:
    if args.only and model not in args.only:
      continue
    name = f"{model} {topology} {mesh} num_vocab_tiling={tiles}"
    r = results[name] = common.compiled_memory_on(None, f"model_name={model}", f"compile_topology={topology}", *STEP,
                                                  *mesh_keys, f"num_vocab_tiling={tiles}")
    cell = ([reports.gib(r["argument_bytes"]), reports.gib(r["temp_bytes"])] if "error" not in r else ["", ""])
    rows.append([model, topology, mesh, tiles, *cell, common.gib_or_refusal(r, "total_bytes")])
    print(f"{name}: {rows[-1][-1]}", flush=True)
  markdown = ("## 8,192 tokens per chip, remat_policy=full, flash attention (TPU compiler, compile only)\n\n"
              + reports.markdown_table(["model", "slice", "mesh", "num_vocab_tiling", "params+opt GiB", "temp GiB",
                                        "total GiB/chip"], rows))
  print(markdown)
  figure = Figure(figsize=(9, 1 + 0.4 * len(results)))
  axis = figure.subplots()
  axis.barh(range(len(results)), [r.get("total_bytes", 0) / 2**30 for r in results.values()], color="tab:blue")
  axis.set_yticks(range(len(results)), list(results), fontsize=7)
  axis.invert_yaxis()
  axis.set_xlabel("compiled memory per chip, GiB (TPU compiler)")
  provenance.save(args.output_dir, "families_tpu", markdown, results, figure)


if __name__ == "__main__":
  runtime.setup()
  main()
