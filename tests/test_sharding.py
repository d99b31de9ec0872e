"""Meshes of 8 simulated devices give the single-device losses, with and without vocab tiling."""

import json

import numpy as np
import pytest
from conftest import (
  MESHES,
  SHARDED,
  assert_trees_close,
  loss_gradients,
  metrics_losses,
  run_on_eight_devices,
  tiny_config,
)

from MaxText import train


@pytest.fixture(scope="module")
def mesh_results(tmp_path_factory):
  out = run_on_eight_devices("mesh_runs.py", tmp_path_factory.mktemp("meshes"))
  with open(out / "results.json") as f:
    return {**json.load(f), "dir": out}


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
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("tiles", [1, 4])
def test_mesh_losses_equal_one_device(mesh_results, one_device, mesh, tiles):
  got = mesh_results["losses"][f"{mesh} tiles={tiles}"]
  want = one_device[tiles]
  assert sorted(int(s) for s in got) == [1, 2, 3, 4, 5]
  np.testing.assert_allclose([got[str(s)] for s in range(1, 6)], [want[s] for s in range(1, 6)], rtol=1e-5)


def test_tiling_equals_no_tiling_on_one_device(one_device):
  np.testing.assert_allclose(list(one_device[4].values()), list(one_device[1].values()), rtol=1e-5)


def test_checkpoint_saved_under_one_mesh_restores_under_another(mesh_results, one_device):
  resumed = mesh_results["cross_mesh"]
  np.testing.assert_allclose([resumed[str(s)] for s in range(1, 6)], [one_device[1][s] for s in range(1, 6)],
                             rtol=1e-5)


@pytest.mark.parametrize("mesh, tokens_per_device_tile", [("data=2 fsdp=2 tensor=2", 8), ("fsdp=2 context=4", 4)])
def test_no_device_ever_holds_more_than_its_share_of_a_tile(mesh_results, mesh, tokens_per_device_tile):
  # 8 rows x 16 positions in 4 tiles: a tile is 32 tokens, spread over the batch-like axes.
  assert mesh_results["logits_tokens"][f"{mesh} tiles=4"] == tokens_per_device_tile
  assert mesh_results["logits_tokens"][f"{mesh} tiles=1"] >= 4 * tokens_per_device_tile  # the check can see logits


@pytest.fixture(scope="module")
def one_device_gradients():
  return {(tiles, tied): loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=8", f"num_vocab_tiling={tiles}",
                                                    f"logits_via_embedding={tied}"))
          for tiles in (1, 4) for tied in (False, True)}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("tiles", [1, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_mesh_gradients_equal_one_device(mesh_results, one_device_gradients, mesh, tiles, tied):
  got = np.load(mesh_results["dir"] / f"grads_{mesh.replace(' ', '_')}_tiles={tiles}_tied={tied}.npz")
  want = one_device_gradients[tiles, tied]
  assert sorted(got.files) == sorted(want)
  assert_trees_close({k: got[k] for k in want}, want, rtol=1e-5)


# The [D, V] = [48, 1000] head kernel and [V, D] embedding are split over this many devices.
KERNEL_SHARDS = {"fsdp=8": 8, "data=2 fsdp=2 tensor=2": 4, "fsdp=2 context=4": 8, "tensor=4 data=2": 4}


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("tiles", [1, 4])
def test_no_device_forms_more_than_its_share_of_the_head_or_embedding_gradient(mesh_results, mesh, tiles):
  share = 48 * 1000 // KERNEL_SHARDS[mesh]
  # The head's kernel gradient is contracted over tokens sharded like the kernel's rows: a
  # plain contraction would form all 48 x 1000 partial sums on every device.
  assert 0 < mesh_results["kernel_grad_elements"][f"{mesh} tiles={tiles}"] <= share
  assert 0 < mesh_results["embedding_grad_elements"][f"{mesh} tiles={tiles}"] <= share
