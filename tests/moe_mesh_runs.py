"""The MoE model's loss and gradients under every expert-parallel test mesh (and two with the
GPU's grouped matmul); run with JAX_NUM_CPU_DEVICES=8.

python tests/moe_mesh_runs.py OUT_DIR writes OUT_DIR/<mesh>.npz: the summed training loss
("loss"), its gradients (by parameter path) at the initial parameters on fixed_batch, and how
many ragged all-to-alls the model called ("ragged_all_to_alls").
"""

import os
import sys

import jax
import numpy as np
from conftest import fixed_batch, tiny_config, trainer_and_state

from MaxText import sharding, train_step
from MaxText.layers import moe

# 8 experts of width 24, top 2, over TINY: every mesh below divides it with one row per device.
# All but the last divide the experts over the expert and FSDP axes, so FSDP shards the experts;
# in the last FSDP shards D (moe.MoeBlock). Each name says how the tokens reach their experts:
# expert_exchange=auto picks the all-to-all where the expert axis is larger than top-k (2).
MOE = ("decoder_block=qwen3_moe", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=24",
       "load_balance_loss_weight=0.1", "router_z_loss_weight=0.01", "per_device_batch_size=1")
EXPERT_MESHES = {
    "expert=8, all-to-all": ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1"),
    "expert=8, all-gather": ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1", "expert_exchange=all_gather"),
    "expert=4 fsdp=2, all-to-all": ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    "expert=2 tensor=2 data=2, all-gather": ("ici_expert_parallelism=2", "ici_tensor_parallelism=2",
                                             "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
    "expert=2 context=2 fsdp=2, all-to-all": ("ici_expert_parallelism=2", "ici_context_parallelism=2",
                                              "ici_fsdp_parallelism=2", "expert_exchange=all_to_all"),
    # Dropping: the capacity is per sequence, and each device's experts see whole sequences.
    "expert=8, capacity 1, all-gather": ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1",
                                         "capacity_factor=1.0"),
    "fsdp=8, 4 experts": ("ici_fsdp_parallelism=8", "num_experts=4"),
}
# The GPU's grouped matmul (tokamax, its XLA fallback on CPU) under its own backward, on the mesh
# whose weight gradients are summed over most axes, with either exchange.
TOKAMAX_MESHES = {
    "expert=2 tensor=2 data=2, all-gather, tokamax": EXPERT_MESHES["expert=2 tensor=2 data=2, all-gather"],
    "expert=2 tensor=2 data=2, all-to-all, tokamax": (*EXPERT_MESHES["expert=2 tensor=2 data=2, all-gather"],
                                                      "expert_exchange=all_to_all"),
}


def loss_and_gradients(config):
  """(summed training loss, {parameter path: gradient}) at config's initial parameters on fixed_batch."""
  trainer, state = trainer_and_state(config)
  fn = jax.jit(jax.value_and_grad(lambda p, b: train_step.batch_sums(trainer.model, config, p, b)[0]))
  with sharding.activate(trainer.mesh, config):
    loss, grads = fn(state.params, train_step.device_batch(trainer, fixed_batch(config)))
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(grads))
  return float(loss), {jax.tree_util.keystr(path): np.asarray(g) for path, g in leaves}


def main(out):
  exchanges = []  # the ragged all-to-alls each mesh's model traced (XLA:CPU's stand-in)
  ragged_all_to_all = moe.RAGGED_ALL_TO_ALL["cpu"]
  moe.RAGGED_ALL_TO_ALL["cpu"] = lambda *args, **kwargs: exchanges.append(1) or ragged_all_to_all(*args, **kwargs)
  for name, overrides in {**EXPERT_MESHES, **TOKAMAX_MESHES}.items():
    if name in TOKAMAX_MESHES:
      moe.RAGGED_DOT_GENERAL["cpu"] = moe._tokamax_ragged_dot_general
    exchanges.clear()
    loss, grads = loss_and_gradients(tiny_config(*MOE, *overrides))
    np.savez(os.path.join(out, f"{name}.npz"), loss=loss, ragged_all_to_alls=len(exchanges), **grads)


if __name__ == "__main__":
  main(sys.argv[1])
