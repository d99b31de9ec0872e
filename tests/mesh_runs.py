"""Trains the SHARDED model under every test mesh; run with JAX_NUM_CPU_DEVICES=8.

python tests/mesh_runs.py OUT_DIR writes OUT_DIR/results.json with
  losses: {"<mesh> tiles=<n>": {step: loss}} for 5 steps of each mesh, with and without tiling;
  cross_mesh: {step: loss} of a run saved at step 3 under fsdp=8 and resumed under tensor=4 data=2;
  logits_tokens: {"<mesh> tiles=<n>": most tokens any one device holds logits for};
  kernel_grad_elements: {"<mesh> tiles=<n>": largest array of the head's kernel-gradient contraction};
  embedding_grad_elements: {"<mesh> tiles=<n>": largest scatter-add into the embedding table};
and OUT_DIR/grads_<mesh>_tiles=<n>_tied=<b>.npz: the loss's gradients for the initial parameters.
"""

import json
import os
import sys

import numpy as np
from conftest import MESHES, SHARDED, hlo_arrays, logits_tokens, loss_gradients, metrics_losses, tiny_config

from MaxText import sharding, train, train_step


def run(out, name, *overrides):
  metrics_file = os.path.join(out, f"{name.replace(' ', '_')}.jsonl")
  train.train(tiny_config(*SHARDED, "per_device_batch_size=1", f"base_output_directory={out}",
                          f"run_name={name.replace(' ', '_')}", f"metrics_file={metrics_file}", *overrides))
  return metrics_losses(metrics_file)


def largest(arrays, keep):
  return max([n for shape, op, name in arrays if keep(shape, op, name) for n in [int(np.prod(shape))]] or [0])


def main(out):
  results = {"losses": {}, "logits_tokens": {}, "kernel_grad_elements": {}, "embedding_grad_elements": {}}
  for mesh, overrides in MESHES.items():
    for tiles in (1, 4):
      key = f"{mesh} tiles={tiles}"
      results["losses"][key] = run(out, key, *overrides, f"num_vocab_tiling={tiles}")
      config = tiny_config(*SHARDED, "per_device_batch_size=1", *overrides, f"num_vocab_tiling={tiles}")
      hlo = train_step.compile_train_step(train_step.build(config, sharding.create_mesh(config)), config).as_text()
      results["logits_tokens"][key] = logits_tokens(hlo, {1000, 500}, {48, 24, 12, 6})
      arrays = hlo_arrays(hlo)
      results["kernel_grad_elements"][key] = largest(arrays, lambda s, op, name: "btd,btv->dv" in name)
      results["embedding_grad_elements"][key] = largest(
          arrays, lambda s, op, name: op == "scatter" and "token_embedder" in name)
      for tied in (False, True):
        grads = loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=1", *overrides,
                                           f"num_vocab_tiling={tiles}", f"logits_via_embedding={tied}"))
        np.savez(os.path.join(out, f"grads_{key.replace(' ', '_')}_tied={tied}.npz"), **grads)
  checkpointed = ("enable_checkpointing=true", "checkpoint_period=3", "learning_rate_schedule_steps=5")
  run(out, "cross mesh", *MESHES["fsdp=8"], *checkpointed, "steps=3")
  results["cross_mesh"] = run(out, "cross mesh", *MESHES["tensor=4 data=2"], *checkpointed)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
