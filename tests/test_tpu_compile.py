"""The train step compiled by libtpu for TPU slices that this machine does not have.

libtpu (installed by setup.sh) compiles for any slice on any machine: these tests build the
trainer over a v5p-8's devices (4 chips, one JAX device per megacore chip) and read the TPU
compiler's memory figures. Nothing runs on a TPU.
"""

import json
import math
import re

import pytest
from conftest import TINY, run_cli, run_command, tiny_config

from MaxText import accelerators, costs, errors, sharding, train_step

# A head-dominated model: float32 logits [4 x 512, 32768] per chip are 256 MiB, the layers little.
HEAD_HEAVY = ("vocab_size=32768", "base_emb_dim=64", "max_target_length=512", "per_device_batch_size=4",
              "compile_topology=v5p-8")


@pytest.mark.parametrize("name, topology, chips", [
    # From Cloud TPU's documentation of slice shapes.
    ("v4-8", "v4:2x2x1", 4), ("v4-16", "v4:2x2x2", 8), ("v5p-64", "v5p:2x4x4", 32),
    ("v5p-256", "v5p:4x4x8", 128), ("v5e-8", "v5e:2x4", 8), ("v5litepod-16", "v5e:4x4", 16),
    ("v6e-256", "v6e:16x16", 256),
])
def test_slice_names_give_the_documented_topologies(name, topology, chips):
  assert accelerators.parse_slice(name).topology == topology
  assert len(accelerators.slice_devices(name, 1)) == chips


@pytest.fixture(scope="module")
def tpu_memory():
  """{variant: memory stats} of the HEAD_HEAVY train step compiled for a v5p-8."""
  variants = {"untiled": (), "tiles8": ("num_vocab_tiling=8",)}
  stats = {}
  for name, overrides in variants.items():
    config = tiny_config(*HEAD_HEAVY, *overrides)
    trainer = train_step.build(config, sharding.create_mesh(config))
    assert {d.platform for d in trainer.mesh.devices.flat} == {"tpu"} and config.num_devices == 4
    stats[name] = costs.memory_stats(train_step.compile_train_step(trainer, config))
  return stats


@pytest.mark.slow
def test_vocab_tiling_lowers_tpu_temp_memory_of_a_head_heavy_model(tpu_memory):
  logits = 4 * 512 * 32768 * 4
  assert tpu_memory["untiled"]["temp_bytes"] > logits
  assert tpu_memory["tiles8"]["temp_bytes"] < tpu_memory["untiled"]["temp_bytes"] - logits / 2


@pytest.fixture(scope="module")
def offloaded_memory():
  """{policy: memory stats} of an 8-layer model with a small vocabulary compiled for a v5p-8:
  the saved layer inputs and projections are a large part of its step."""
  stats = {}
  for policy in ("full", "input_offloaded", "minimal_offloaded"):
    config = tiny_config("base_emb_dim=64", "max_target_length=512", "per_device_batch_size=4",
                         "base_num_decoder_layers=8", "compile_topology=v5p-8", f"remat_policy={policy}")
    stats[policy] = costs.memory_stats(train_step.compile_train_step(
        train_step.build(config, sharding.create_mesh(config)), config))
  return stats


def test_offloading_the_layer_inputs_moves_them_off_the_device(offloaded_memory):
  assert offloaded_memory["full"]["host_bytes"] == 0 and offloaded_memory["input_offloaded"]["host_bytes"] > 0
  assert offloaded_memory["input_offloaded"]["total_bytes"] < offloaded_memory["full"]["total_bytes"]


def test_offloading_every_projection_holds_more_host_memory_than_the_layer_inputs(offloaded_memory):
  """minimal_offloaded's host copies are 7 projections per layer (the layer input stays on the
  device, the checkpoint's own input), input_offloaded's one layer input."""
  assert offloaded_memory["minimal_offloaded"]["host_bytes"] > offloaded_memory["input_offloaded"]["host_bytes"]


@pytest.mark.parametrize("policy", [("remat_policy=attention_out_input_offloaded",),
                                    ("remat_policy=custom", "attention_out=offload")])
def test_splash_attention_slices_with_an_offloaded_context_are_refused_on_tpu(policy):
  """libtpu fails with an internal error placing splash's residuals from the slices in host
  memory: a config error naming the key instead. Kept on the device, with the chunked kernel,
  or on CPU, the two go together."""
  flash = ("compile_topology=v5p-8", "attention=flash", "max_target_length=128", "attention_head_chunks=2")
  with pytest.raises(errors.ConfigError, match="attention_head_chunks=2: must be 1 for attention=flash on TPU"):
    tiny_config(*flash, *policy)
  assert tiny_config(*flash, "remat_policy=custom", "attention_out=device")
  assert tiny_config("compile_topology=v5p-8", "attention=chunked", "attention_chunk_size=8", "attention_head_chunks=2",
                     *policy)
  assert tiny_config("attention_head_chunks=2", *policy)


GEMMA2_ATTENTION = ("decoder_block=gemma2", "sliding_window_size=512", "attn_logits_soft_cap=50",
                    "query_pre_attn_scalar=16")


@pytest.mark.slow
def test_flash_attention_compiles_for_tpu_without_the_score_matrix():
  """With Gemma 2's attention on fsdp x tensor: global layers and sliding ones, the soft cap in the
  kernel, and the window picked by the layer index traced through the scan (lax.cond between two
  kernels, inside shard_map)."""
  # Attention-dominated: float32 scores of 4 heads x 2048^2 per row are 64 MiB.
  long_rows = ("compile_topology=v5p-8", "max_target_length=2048", "per_device_batch_size=1",
               "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", *GEMMA2_ATTENTION)
  temp = {}
  for attention in ("dot_product", "flash"):
    config = tiny_config(*long_rows, f"attention={attention}")
    compiled = train_step.compile_train_step(train_step.build(config, sharding.create_mesh(config)), config)
    temp[attention] = costs.memory_stats(compiled)["temp_bytes"]
  assert temp["flash"] < temp["dot_product"] - 4 * 2048**2 * 4 // math.prod(config.mesh_shape[3:])


@pytest.mark.parametrize("mesh", [(), ("ici_fsdp_parallelism=1", "ici_context_parallelism=4")],
                         ids=["fsdp", "context"])
@pytest.mark.parametrize("policy, forwards", [("full", 2), ("attention_out_input_offloaded", 1)])
def test_the_flash_kernels_flops_are_counted_by_hand(mesh, policy, forwards):
  """Splash attention's pallas_calls are custom calls, not dots: counted from the kernels' shapes.
  Per context shard (load-balanced) a kernel of 256 queries, chunks i and 7 - i of 128 tokens,
  in 128 x 512 blocks: 1 + 2 blocks are not skipped, 4 shards together the whole row's 3 x 512^2.
  The forward kernel runs twice under `full` (the step's, and the recomputation in the backward),
  once where the policy keeps its residuals with attention_out."""
  config = tiny_config("attention=flash", "compile_topology=v5p-8", "max_target_length=1024",
                       "per_device_batch_size=1", f"remat_policy={policy}", *mesh)
  jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
  # Per layer, row and head: the forward kernel (2 matmuls each run), the dq kernel (3) and the
  # dk/dv kernel (4); of the 2 x 2 (query, key) blocks of 512 the causal mask keeps 3 whole, 2
  # FLOPs per multiply-add.
  per_kernel_matmul = 2 * 3 * 512 * 512 * config.head_dim
  hand = config.base_num_decoder_layers * 4 * config.base_num_query_heads * per_kernel_matmul * (2 * forwards + 3 + 4)
  assert costs.kernel_flops(jaxpr) == hand
  assert costs.matmul_flops(jaxpr) > hand


def test_splashs_fused_backward_runs_on_the_context_shards_in_its_own_key_blocks():
  """sa_use_fused_bwd_kernel with sa_block_kv_dkv=1024 under context 4: each shard's backward is
  one kernel of 5 products a (query, key) pair, over 1024-key blocks (the whole row: 4 x 512^2
  pairs of the 4 shards together, where 512-key blocks skip one of 4); the forward as before."""
  config = tiny_config("attention=flash", "compile_topology=v5p-8", "max_target_length=1024", "per_device_batch_size=1",
                       "remat_policy=full", "ici_fsdp_parallelism=1", "ici_context_parallelism=4",
                       "sa_use_fused_bwd_kernel=true", "sa_block_kv_dkv=1024")
  jaxpr = train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)), config).jaxpr
  per_pair = 2 * 512 * 512 * config.head_dim
  hand = config.base_num_decoder_layers * 4 * config.base_num_query_heads * per_pair * (3 * 2 * 2 + 4 * 5)
  assert costs.kernel_flops(jaxpr) == hand


@pytest.mark.parametrize("overrides, message", [
    (("attention=chunked", "sa_use_fused_bwd_kernel=true"), "sa_use_fused_bwd_kernel=True: splash attention's "
     "(attention=flash, flash_kernel=splash): attention=chunked has no such kernel"),
    (("attention=flash", "compile_topology=v5p-8", "max_target_length=2048", "sa_block_kv_dkv=768"),
     "sa_block_kv_dkv=768: must be a multiple of 512 that divides max_target_length=2048"),
    (("attention=flash", "compile_topology=v5p-8", "max_target_length=2048", "sa_block_kv_dkv=4096"),
     "sa_block_kv_dkv=4096: must be a multiple of 512 that divides max_target_length=2048"),
])
def test_splash_options_it_cannot_take_are_one_line_naming_the_key(overrides, message):
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    tiny_config(*overrides)
  assert "\n" not in str(error.value)


def test_dcn_axes_span_the_slices_of_a_multi_slice_compile():
  config = tiny_config("compile_topology=v5p-8", "compile_topology_num_slices=2", "dcn_data_parallelism=2")
  mesh = sharding.create_mesh(config)
  assert config.mesh_shape == (1, 1, 4, 1, 1, 1) and config.dcn_mesh_shape == (2, 1, 1, 1, 1, 1)
  # The data axis crosses slices; every other axis stays inside one.
  assert [{d.slice_index for d in mesh.devices[i].flat} for i in range(2)] == [{0}, {1}]
  stats = costs.memory_stats(train_step.compile_train_step(train_step.build(config, mesh), config))
  assert stats["total_bytes"] > 0


def test_a_mesh_axis_no_product_of_the_physical_axes_splits_one():
  """expert 8 x fsdp 8 on a v5p-128, whose chips are a 4 x 4 x 4 torus: 8 is no product of the
  torus's axes, so one is split; every chip is in the mesh once."""
  config = tiny_config("compile_topology=v5p-128", "ici_fsdp_parallelism=-1", "ici_expert_parallelism=8",
                       "decoder_block=qwen3_moe", "num_experts=8", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
                       "base_emb_dim=64")
  mesh = sharding.create_mesh(config)
  assert dict(mesh.shape) == {"data": 1, "pipeline": 1, "fsdp": 8, "tensor": 1, "context": 1, "expert": 8}
  assert len({d.id for d in mesh.devices.flat}) == 64


def test_train_compile_reports_against_the_chip_and_exits_1_when_it_does_not_fit(tmp_path):
  stats_file = tmp_path / "fits.json"
  result = run_cli("train_compile", *TINY, "compile_topology=v5p-8", f"memory_stats_file={stats_file}")
  assert result.returncode == 0, result.stderr[-3000:]
  stats = json.loads(stats_file.read_text())
  assert stats["fits"] is True and stats["device_memory_bytes"] == 95 * 2**30
  assert "MFU at most" in result.stdout and "TPU v5" in result.stdout
  # float32 logits of 64 x 2048 tokens x 32768 are 16 GiB: more than a v5e chip's 16 GiB HBM.
  stats_file = tmp_path / "too_big.json"
  result = run_cli("train_compile", *TINY, "vocab_size=32768", "max_target_length=2048",
                   "per_device_batch_size=64", "compile_topology=v5e-1", f"memory_stats_file={stats_file}")
  assert result.returncode == 1, result.stderr[-3000:]
  assert result.stderr.strip().splitlines() == [result.stderr.strip()]
  assert result.stderr.startswith("error: does not fit")
  assert json.loads(stats_file.read_text())["fits"] is False


def test_slices_joined_by_no_dcn_axis_are_a_config_error():
  with pytest.raises(errors.ConfigError, match=re.escape("2 TPU slices, which only dcn_* axes join")):
    tiny_config("compile_topology=v5p-8", "compile_topology_num_slices=2")


@pytest.mark.parametrize("module, args, message", [
    ("train_compile", ("compile_topology=v9-8",), "expected <generation>-<count>"),
    ("train_compile", ("compile_topology=v5p-6",), "a v5p slice has one of 8, 16"),
    ("train_compile", ("compile_topology=v5p-8", "ici_fsdp_parallelism=8"), "must equal the 4 devices"),
    ("train_compile", ("compile_topology=v5p-8", "dcn_data_parallelism=2"), "slices/processes"),
    ("train", ("compile_topology=v5p-8",), "only MaxText.train_compile compiles for a topology"),
    ("train", ("attention=flash", "max_target_length=128"), "kernels run on gpu and tpu, not on cpu"),
    ("train_compile", ("attention=flash", "flash_kernel=cudnn", "compile_topology=v5p-8", "max_target_length=128"),
     "flash_kernel='cudnn': runs on gpu, not on tpu"),
    ("train_compile", ("attention=flash", "compile_topology=v5p-8", "max_target_length=200"),
     "must be a multiple of 128"),
])
def test_bad_topologies_are_config_errors(module, args, message, tmp_path):
  with pytest.raises(errors.ConfigError, match=re.escape(message)) as error:
    run_command(module, *TINY, f"base_output_directory={tmp_path}", *args)
  assert "\n" not in str(error.value)
  assert not list(tmp_path.iterdir())
