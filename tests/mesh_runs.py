"""Trains the SHARDED model under every test mesh; run with JAX_NUM_CPU_DEVICES=8.

python tests/mesh_runs.py OUT_DIR writes OUT_DIR/results.json with
  losses: {"<mesh> tiles=<n>": {step: loss}} for 5 steps of each mesh, with and without tiling;
  cross_mesh: {step: loss} of a run saved at step 3 under fsdp=8 and resumed under tensor=4 data=2;
  logits_tokens: {"<mesh> tiles=<n>": most tokens any one device holds logits for}.
"""

import json
import os
import sys

from conftest import MESHES, SHARDED, logits_tokens, metrics_losses, tiny_config
from MaxText import sharding, train


def run(out, name, *overrides):
  metrics_file = os.path.join(out, f"{name.replace(' ', '_')}.jsonl")
  train.train(tiny_config(*SHARDED, "per_device_batch_size=1", f"base_output_directory={out}",
                          f"run_name={name.replace(' ', '_')}", f"metrics_file={metrics_file}", *overrides))
  return metrics_losses(metrics_file)


def main(out):
  results = {"losses": {}, "logits_tokens": {}}
  for mesh, overrides in MESHES.items():
    for tiles in (1, 4):
      results["losses"][f"{mesh} tiles={tiles}"] = run(out, f"{mesh} tiles={tiles}", *overrides,
                                                       f"num_vocab_tiling={tiles}")
  for mesh in ("data=2 fsdp=2 tensor=2", "fsdp=2 sequence=4"):
    for tiles in (1, 4):
      config = tiny_config(*SHARDED, "per_device_batch_size=1", *MESHES[mesh], f"num_vocab_tiling={tiles}")
      hlo = train.compile_train_step(train.build(config, sharding.create_mesh(config)), config).as_text()
      results["logits_tokens"][f"{mesh} tiles={tiles}"] = logits_tokens(hlo, {1000, 500}, {48, 24, 12, 6})
  checkpointed = ("enable_checkpointing=true", "checkpoint_period=3", "learning_rate_schedule_steps=5")
  run(out, "cross mesh", *MESHES["fsdp=8"], *checkpointed, "steps=3")
  results["cross_mesh"] = run(out, "cross mesh", *MESHES["tensor=4 data=2"], *checkpointed)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f)


if __name__ == "__main__":
  main(sys.argv[1])
