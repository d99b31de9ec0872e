"""Shared test helpers: a tiny model config, the CLI runner, and this process's devices.

This process has 8 simulated CPU devices, and a run in it (a config resolved, a mesh built) uses
the first of them unless a test asks for more with `on_devices`.
"""

import atexit
import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

# The suite is dominated by XLA:CPU compile time; LLVM's optimisation passes triple it for
# tiny models and change no result's IEEE semantics. Set before JAX starts, inherited by
# the subprocesses the tests launch.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")
# And it compiles the same programs again and again: a run and its resume, a mesh's training
# run and its HLO, one tiny model in many tests. One persistent compilation cache for the run,
# fresh each time, serves the repeats (an executable from it has the same HLO, stack-frame
# metadata aside).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # subprocesses that import this file share it
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax_compilation_cache_")
  atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax

from MaxText import pyconfig, runtime, sharding

# Before JAX starts a backend (importing the package starts none). A device count is fixed from
# then on, so every test's devices exist from the start; unlike JAX_NUM_CPU_DEVICES the setting
# is not inherited by the subprocesses tests start, which see one device as a user's command does.
jax.config.update("jax_num_cpu_devices", 8)
runtime.setup()  # as every command does, before JAX starts a backend

_all_run_devices = sharding.run_devices
_devices_in_use = 1


def _first_run_devices(compile_topology, num_slices):
  """sharding.run_devices here: JAX's first `_devices_in_use` devices, so that whatever resolves a
  config or builds a mesh in-process (tiny_config, train.main, the planner) runs on one device, as
  on a user's one-device machine; compile_topology's devices as they are."""
  devices = _all_run_devices(compile_topology, num_slices)
  return devices if compile_topology else devices[:_devices_in_use]


sharding.run_devices = _first_run_devices


@contextlib.contextmanager
def on_devices(count):
  """Within it, configs resolve for and meshes span the first `count` of this process's devices."""
  global _devices_in_use
  previous, _devices_in_use = _devices_in_use, count
  try:
    yield
  finally:
    _devices_in_use = previous


ROOT = Path(__file__).resolve().parents[1]
BASE_YML = str(ROOT / "configs" / "base.yml")

# Small enough to compile in a few seconds on 2 cores, with GQA and more than one layer.
TINY = (
    "vocab_size=128", "base_emb_dim=32", "base_num_query_heads=4", "base_num_kv_heads=2",
    "base_mlp_dim=64", "base_num_decoder_layers=2", "max_target_length=16",
    "per_device_batch_size=4", "steps=5", "enable_tensorboard=false", "warmup_steps_fraction=0.0",
    "dataset_type=synthetic", "eval_interval=0", "enable_checkpointing=false",
)
# TINY on real text: the smallest BPE over bytes has 257 tokens.
TINY_TEXT = ("dataset_type=text", "vocab_size=320")


def tiny_config(*overrides, num_devices=None, memory_kinds=None):
  return pyconfig.initialize([BASE_YML, *TINY, *overrides], num_devices=num_devices,
                             memory_kinds=memory_kinds)


@pytest.fixture(scope="session")
def text_cache(tmp_path_factory):
  """One dataset_cache_dir for the whole session: the corpus is tokenized once."""
  return f"dataset_cache_dir={tmp_path_factory.mktemp('cache')}"


def run_command(module, *args):
  """MaxText.<module>'s main(argv) for configs/base.yml and args, in this process: the command
  without runtime.run, which turns the UserError it raises into one line and its exit code."""
  return importlib.import_module(f"MaxText.{module}").main([module, BASE_YML, *args])


def run_cli(module, *args, env=None, cwd=None, timeout=600):
  """python -m MaxText.<module> configs/base.yml args...; returns the CompletedProcess."""
  full_env = {**os.environ, **(env or {})}
  return subprocess.run([sys.executable, "-m", f"MaxText.{module}", BASE_YML, *args],
                        capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout)


def model_inputs(config, seed=0, batch=None):
  """Random tokens with two packed documents per row: (tokens, positions, segment_ids)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  batch = batch or config.micro_batch_size
  length = config.max_target_length
  tokens = rng.integers(0, config.vocab_size, (batch, length), dtype=np.int32)
  split = length // 3
  segments = np.where(np.arange(length) < split, 1, 2).astype(np.int32)
  positions = np.where(np.arange(length) < split, np.arange(length), np.arange(length) - split)
  return (tokens, np.broadcast_to(positions, (batch, length)).astype(np.int32),
          np.broadcast_to(segments, (batch, length)).copy())


def assert_trees_close(actual, desired, rtol, what=""):
  """Leaf by leaf: |a - d| <= rtol * max|d| + rtol * |d|, i.e. relative to each leaf's scale,
  so near-zero entries of a large gradient are not held to a tighter bound than its bulk.
  `what` (the variant under test) starts every failure message."""
  import jax
  import numpy as np

  def check(path, a, d):
    a, d = np.asarray(a, np.float64), np.asarray(d, np.float64)
    np.testing.assert_allclose(a, d, rtol=rtol, atol=rtol * np.max(np.abs(d)),
                               err_msg=f"{what} {jax.tree_util.keystr(path)}".strip())

  assert jax.tree.structure(actual) == jax.tree.structure(desired), what
  jax.tree_util.tree_map_with_path(check, actual, desired)


def trainer_and_state(config):
  """(Trainer, initialised sharded TrainState) on this process's devices."""
  import jax

  from MaxText import sharding, train_step
  trainer = train_step.build(config, sharding.create_mesh(config))
  with sharding.activate(trainer.mesh, config):
    state = trainer.init(jax.random.key(config.init_weights_seed))
  return trainer, state


def trainer_and_params(config, params=None):
  """(Trainer, its params): initialised on config's mesh, or `params` (in layer order) laid out on
  it as the run keeps them (no initialisation compiled)."""
  import jax

  from MaxText import sharding, train_step
  if params is None:
    trainer, state = trainer_and_state(config)
    return trainer, state.params
  trainer = train_step.build(config, sharding.create_mesh(config))
  return trainer, trainer.relayout(jax.device_put(params, trainer.state_sharding.params), True)


def fixed_batch(config, seed=0):
  """A global batch of model_inputs rows with next-token targets, as the pipeline yields."""
  import numpy as np
  tokens, positions, segments = model_inputs(config, seed, config.global_batch_size_to_train_on)
  targets = np.roll(tokens, -1, axis=1)
  mask = segments * (np.arange(tokens.shape[1]) < tokens.shape[1] - 1)
  return {"inputs": tokens, "targets": targets, "inputs_position": positions,
          "inputs_segmentation": segments, "targets_segmentation": mask.astype(np.int32)}


# A model every test mesh of 8 devices divides: 8 query / 4 kv heads and MLP 128 over
# tensor=4, 16 positions over context=4, width 48 over fsdp. Vocabulary 1000 is a size no
# other dimension has, so logits are recognisable in compiled HLO.
SHARDED = (
    "vocab_size=1000", "base_emb_dim=48", "base_num_query_heads=8", "base_num_kv_heads=4",
    "head_dim=6", "base_mlp_dim=128", "base_num_decoder_layers=2", "max_target_length=16",
    "steps=5", "enable_tensorboard=false", "warmup_steps_fraction=0.0", "dataset_type=synthetic",
    "eval_interval=0", "enable_checkpointing=false", "log_period=100", "remat_policy=full",
)


def metrics_losses(path):
  """{step: loss} of a metrics file, the last line written for each step."""
  import json
  with open(path) as f:
    return {r["step"]: r["learning/loss"] for r in map(json.loads, f)}


def loss_gradients(config, batch=None, params=None, hlo=None):
  """{parameter path: gradient, and "loss": the summed training loss} at config's initial
  parameters (or at `params`, laid out on config's mesh: no initialisation compiled) on `batch`
  (default fixed_batch), computed on config's mesh and gathered; the compiled HLO's text is
  appended to the list `hlo` where one is given."""
  import jax
  import numpy as np

  from MaxText import objective, sharding, train_step
  trainer, params = trainer_and_params(config, params)
  loss = lambda params, batch: objective.batch_sums(trainer.model, config, params, batch)[0]
  batch = fixed_batch(config) if batch is None else batch
  with sharding.activate(trainer.mesh, config):
    batch = train_step.device_batch(trainer, batch)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, batch).compile()
    value, grads = compiled(params, batch)
  if hlo is not None:
    hlo.append(compiled.as_text())
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(trainer.relayout(grads, False)))
  return {"loss": np.asarray(value), **{jax.tree_util.keystr(path): np.asarray(g) for path, g in leaves}}


def sown_statistics(block, params, x) -> dict:
  """A lone MoE layer's router statistics as it reports them on x: its Term's metrics (its own
  per-token means) and the load per expert it sows for the routed bias, as numpy arrays."""
  import jax

  from MaxText.layers import moe, terms
  apply = jax.jit(lambda p, x: block.apply({"params": p}, x, mutable=["intermediates", terms.TERMS])[1])
  state = jax.device_get(apply(params, x))
  (term,) = state[terms.TERMS]["term"]
  return {**term.metrics, moe.EXPERT_LOAD: state["intermediates"][moe.EXPERT_LOAD][0]}


def with_slow_decays(params, seed=0):
  """params with every Gated DeltaNet layer's A_log drawn for decays of exp(-0.05) to exp(-0.5) a
  token. At the initialisation's (down to exp(-16 softplus(...))) a head's output can be near zero,
  and its gated norm multiplies float32 rounding by up to epsilon^-1/2: a model's gradients then
  differ from float64's, and a mesh's from one device's, by 1e-4 of their scale; slow decays also
  carry the state across chunks and shards, which the tests exist to see."""
  import jax
  import numpy as np
  rng = np.random.default_rng(seed)
  return jax.tree_util.tree_map_with_path(
      lambda path, p: np.log(rng.uniform(0.05, 0.5, p.shape)).astype(p.dtype)
      if jax.tree_util.keystr(path).endswith("['A_log']") else p, params)


def loss_and_gradients_of(config, params, batch):
  """(the summed training loss, its gradients) at `params` on `batch`, computed on config's mesh
  and gathered: no initialisation compiled."""
  import jax

  from MaxText import objective, sharding, train_step
  trainer = train_step.build(config, sharding.create_mesh(config))
  fn = jax.jit(jax.value_and_grad(lambda p, b: objective.batch_sums(trainer.model, config, p, b)[0]))
  with sharding.activate(trainer.mesh, config):
    loss, grads = fn(jax.device_put(params, trainer.state_sharding.params), train_step.device_batch(trainer, batch))
  return float(loss), jax.device_get(grads)


def assert_mesh_gradients_equal_one_device(meshes, *overrides, model=()):
  """SHARDED's loss and gradients with `overrides` on 8 devices under each of `meshes` ({name:
  overrides}) equal one device's without them, rtol 1e-5; `model`'s overrides apply to both."""
  want = loss_gradients(tiny_config(*SHARDED, *model, "per_device_batch_size=8"))
  for name, mesh in meshes.items():
    with on_devices(8):
      got = loss_gradients(tiny_config(*SHARDED, *model, "per_device_batch_size=1", *mesh, *overrides))
    assert_trees_close(got, want, rtol=1e-5, what=name)


# Every file, longest first (each file's summed test durations in a full run, --durations=0).
# pytest-xdist (with --no-loadscope-reorder, see pyproject.toml) hands each free worker the next
# file in collection order, so the longest first and the shortest last leave neither worker idle
# long at the end: as the alphabet leaves them, test_sharding and test_tpu_compile would run alone
# at the end. A file not named here runs after these: name it where its time puts it.
LONGEST_FIRST = ("test_hf_checkpoint.py", "test_checkpointing.py", "test_plan.py", "test_pipeline.py",
                 "test_model.py", "test_tpu_compile.py", "test_quantization.py", "test_moe.py",
                 "test_multiprocess.py", "test_context_parallel.py", "test_gated_delta_net.py",
                 "test_attention_chunks.py", "test_remat.py", "test_sharding.py", "test_prepare_data.py",
                 "test_vocab_tiling.py", "test_mtp.py",
                 "test_run_faults.py", "test_pyconfig.py", "test_train.py", "test_families.py", "test_mlp_chunks.py",
                 "test_mixture.py", "test_deepseek_moe.py", "test_context_flash.py", "test_mla.py",
                 "test_input_pipeline.py", "test_blocks.py", "test_launch_xpk.py", "test_masks.py", "test_imports.py",
                 "test_hlo_collectives.py", "test_setup.py", "test_docs.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order
