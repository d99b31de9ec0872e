"""Meshes of 8 simulated devices give the single-device losses, with and without vocab tiling."""

import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from conftest import (
  SHARDED,
  assert_trees_close,
  loss_gradients,
  metrics_losses,
  on_devices,
  tiny_config,
  trainer_and_state,
)

from MaxText import costs, sharding, train

MESHES = {
    "fsdp=8": ("ici_fsdp_parallelism=8",),
    "data=2 fsdp=2 tensor=2": ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    "fsdp=2 context=4": ("ici_fsdp_parallelism=2", "ici_context_parallelism=4"),
    "tensor=4 data=2": ("ici_tensor_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
}


def logits_tokens(hlo_text, vocab_sizes, hidden_sizes):
  """For every array in compiled HLO with a vocabulary-sized dimension (other than [hidden,
  vocab] weights), how many tokens it holds: the largest such count."""
  counts = [0]
  for dims in re.findall(r"\[([\d,]+)\]", hlo_text):
    shape = [int(d) for d in dims.split(",")]
    vocab = [d for d in shape if d in vocab_sizes]
    if vocab:
      others = int(np.prod(shape)) // vocab[0]
      if not (len(shape) == 2 and others in hidden_sizes):
        counts.append(others)
  return max(counts)


def hlo_arrays(hlo_text):
  """(shape, opcode, op_name) of every array-valued instruction in compiled HLO text; op_name
  is the JAX operation it came from (e.g. ".../btd,btv->dv/dot_general")."""
  arrays = []
  for dims, opcode, rest in re.findall(r"= \w+\[([\d,]*)\]\S* ([\w-]+)\((.*)", hlo_text):
    name = re.search(r'op_name="([^"]*)"', rest)
    arrays.append((tuple(int(d) for d in dims.split(",") if d), opcode, name.group(1) if name else ""))
  return arrays


def largest(arrays, keep):
  return max([n for shape, op, name in arrays if keep(shape, op, name) for n in [int(np.prod(shape))]] or [0])


# Two meshes train, each with its own tiling. Every mesh's gradients are compared with one
# device's, each at a tile count and head (tied to the embedding or not): both tile counts where
# the logits' share per device is checked, and every (tiles, tied) pair on some mesh.
TRAINED_TILES = {"fsdp=8": 1, "data=2 fsdp=2 tensor=2": 4}
GRADIENTS = {("fsdp=8", 1): False, ("data=2 fsdp=2 tensor=2", 1): True, ("data=2 fsdp=2 tensor=2", 4): False,
             ("fsdp=2 context=4", 1): False, ("fsdp=2 context=4", 4): True, ("tensor=4 data=2", 4): True}


@pytest.fixture(scope="module")
def one_device_params():
  """{tied: the initial parameters of SHARDED on one device}, logits_via_embedding=tied."""
  return {tied: jax.device_get(trainer_and_state(tiny_config(*SHARDED, "per_device_batch_size=8",
                                                             f"logits_via_embedding={tied}"))[1].params)
          for tied in (False, True)}


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory, one_device_params):
  """The SHARDED model on 8 devices under every test mesh:
  losses: {mesh: {step: loss}} of 5 training steps with TRAINED_TILES[mesh] tiles (those meshes);
  cross_mesh: {step: loss} of a run saved at step 3 under fsdp=8 and resumed on 4 devices under
  tensor=2 data=2 (two microbatches a step: the run's global batch);
  grads: {"<mesh> tiles=<n>": the loss's gradients at one device's initial parameters, with the
  head tied or not as GRADIENTS says};
  and from those gradients' compiled HLO, for each "<mesh> tiles=<n>":
  logits_tokens: most tokens any one device holds logits for;
  kernel_grad_elements: largest array of the head's kernel-gradient contraction;
  embedding_grad_elements: largest scatter-add into the embedding table."""
  out = tmp_path_factory.mktemp("meshes")

  def run(name, *overrides):
    metrics_file = out / f"{name.replace(' ', '_')}.jsonl"
    train.train(tiny_config(*SHARDED, "per_device_batch_size=1", f"base_output_directory={out}",
                            f"run_name={name.replace(' ', '_')}", f"metrics_file={metrics_file}", *overrides))
    return metrics_losses(metrics_file)

  results = {"losses": {}, "logits_tokens": {}, "kernel_grad_elements": {}, "embedding_grad_elements": {},
             "grads": {}}
  checkpointed = ("enable_checkpointing=true", "checkpoint_period=3", "learning_rate_schedule_steps=5")
  with on_devices(8):
    for mesh, tiles in TRAINED_TILES.items():
      results["losses"][mesh] = run(mesh, *MESHES[mesh], f"num_vocab_tiling={tiles}",
                                    *(checkpointed if mesh == "fsdp=8" else ()))
    for (mesh, tiles), head_tied in GRADIENTS.items():
      key, hlo = f"{mesh} tiles={tiles}", []
      results["grads"][key] = loss_gradients(tiny_config(
          *SHARDED, "per_device_batch_size=1", *MESHES[mesh], f"num_vocab_tiling={tiles}",
          f"logits_via_embedding={head_tied}"), params=one_device_params[head_tied], hlo=hlo)
      results["logits_tokens"][key] = logits_tokens(hlo[0], {1000, 500}, {48, 24, 12, 6})
      arrays = hlo_arrays(hlo[0])
      results["kernel_grad_elements"][key] = largest(arrays, lambda s, op, name: "btd,btv->dv" in name)
      results["embedding_grad_elements"][key] = largest(
          arrays, lambda s, op, name: op == "scatter" and "token_embedder" in name)
  # The fsdp=8 run as it was at its step 3, as if it had stopped there.
  shutil.copytree(out / "fsdp=8", out / "cross_mesh")
  shutil.rmtree(out / "cross_mesh" / "checkpoints" / "5")
  logged = (out / "fsdp=8.jsonl").read_text().splitlines()
  (out / "cross_mesh.jsonl").write_text("".join(f"{line}\n" for line in logged if json.loads(line)["step"] <= 3))
  with on_devices(4):  # half the devices: each step takes the run's global batch of 8 in two microbatches
    results["cross_mesh"] = run("cross mesh", "ici_tensor_parallelism=2", "ici_data_parallelism=2",
                                "ici_fsdp_parallelism=1", *checkpointed)
  return results


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
  """{tiles: {step: loss}} on this process's single device, the same global batch of 8."""
  out = tmp_path_factory.mktemp("one_device")
  losses = {}
  for tiles in (1, 4):
    metrics_file = out / f"{tiles}.jsonl"
    train.train(tiny_config(*SHARDED, "per_device_batch_size=8", f"num_vocab_tiling={tiles}",
                            f"base_output_directory={out}", f"run_name=t{tiles}", f"metrics_file={metrics_file}"))
    losses[tiles] = metrics_losses(metrics_file)
  return losses


@pytest.mark.slow
@pytest.mark.parametrize("mesh", list(TRAINED_TILES))
def test_mesh_losses_equal_one_device(mesh_results, one_device, mesh):
  got = mesh_results["losses"][mesh]
  want = one_device[TRAINED_TILES[mesh]]
  assert sorted(got) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([got[s] for s in range(1, 6)], [want[s] for s in range(1, 6)], rtol=1e-5)


def test_tiling_equals_no_tiling_on_one_device(one_device):
  np.testing.assert_allclose(list(one_device[4].values()), list(one_device[1].values()), rtol=1e-5)


def test_checkpoint_saved_under_one_mesh_restores_under_another(mesh_results, one_device):
  resumed = mesh_results["cross_mesh"]
  np.testing.assert_allclose([resumed[s] for s in range(1, 6)], [one_device[1][s] for s in range(1, 6)],
                             rtol=1e-5)


@pytest.mark.parametrize("mesh, tokens_per_device_tile", [("data=2 fsdp=2 tensor=2", 8), ("fsdp=2 context=4", 4)])
def test_no_device_ever_holds_more_than_its_share_of_a_tile(mesh_results, mesh, tokens_per_device_tile):
  # 8 rows x 16 positions in 4 tiles: a tile is 32 tokens, spread over the batch-like axes.
  assert mesh_results["logits_tokens"][f"{mesh} tiles=4"] == tokens_per_device_tile
  assert mesh_results["logits_tokens"][f"{mesh} tiles=1"] >= 4 * tokens_per_device_tile  # the check can see logits


@pytest.fixture(scope="module")
def one_device_gradients(one_device_params):
  return {(tiles, tied): loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=8", f"num_vocab_tiling={tiles}",
                                                    f"logits_via_embedding={tied}"), params=one_device_params[tied])
          for tiles in (1, 4) for tied in (False, True)}


@pytest.mark.parametrize("mesh, tiles", list(GRADIENTS))
def test_mesh_gradients_equal_one_device(mesh_results, one_device_gradients, mesh, tiles):
  want = one_device_gradients[tiles, GRADIENTS[mesh, tiles]]
  assert_trees_close(mesh_results["grads"][f"{mesh} tiles={tiles}"], want, rtol=1e-5)


# The [D, V] = [48, 1000] head kernel and [V, D] embedding are split over this many devices.
KERNEL_SHARDS = {"fsdp=8": 8, "data=2 fsdp=2 tensor=2": 4, "fsdp=2 context=4": 8, "tensor=4 data=2": 4}


@pytest.mark.parametrize("mesh, tiles", list(GRADIENTS))
def test_no_device_forms_more_than_its_share_of_the_head_or_embedding_gradient(mesh_results, mesh, tiles):
  share = 48 * 1000 // KERNEL_SHARDS[mesh]
  # The head's kernel gradient is contracted over tokens sharded like the kernel's rows: a
  # plain contraction would form all 48 x 1000 partial sums on every device.
  assert 0 < mesh_results["kernel_grad_elements"][f"{mesh} tiles={tiles}"] <= share
  assert 0 < mesh_results["embedding_grad_elements"][f"{mesh} tiles={tiles}"] <= share


@pytest.mark.parametrize("count", [1, 8])
def test_a_runs_cpu_devices_share_the_hosts_memory(count):
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  with on_devices(count):
    config = tiny_config()
    assert config.num_devices == count and sharding.create_mesh(config).devices.size == count
    report, _ = costs.memory_report({"total_bytes": 0}, sharding.create_mesh(config))
    assert report["device_memory_bytes"] == host // count
