"""Shared test helpers: a tiny model config and the CLI runner.

This process sees one CPU device; tests that need a device mesh start subprocesses with
JAX_NUM_CPU_DEVICES set.
"""

import atexit
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

from MaxText import pyconfig, runtime

runtime.setup()  # as every command does, before JAX starts a backend

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


def run_cli(module, *args, env=None, cwd=None, timeout=600):
  """python -m MaxText.<module> configs/base.yml args...; returns the CompletedProcess."""
  full_env = {**os.environ, **(env or {})}
  return subprocess.run([sys.executable, "-m", f"MaxText.{module}", BASE_YML, *args],
                        capture_output=True, text=True, env=full_env, cwd=cwd or ROOT, timeout=timeout)


def run_on_eight_devices(script, out, timeout=900):
  """python tests/<script> OUT with 8 simulated CPU devices (a device count is fixed when JAX
  starts, so in a process of its own); returns OUT, where the script wrote its results."""
  result = subprocess.run([sys.executable, str(ROOT / "tests" / script), str(out)],
                          env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"}, capture_output=True, text=True,
                          timeout=timeout)
  assert result.returncode == 0, result.stderr[-4000:]
  return out


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
MESHES = {
    "fsdp=8": ("ici_fsdp_parallelism=8",),
    "data=2 fsdp=2 tensor=2": ("ici_data_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    "fsdp=2 context=4": ("ici_fsdp_parallelism=2", "ici_context_parallelism=4"),
    "tensor=4 data=2": ("ici_tensor_parallelism=4", "ici_data_parallelism=2", "ici_fsdp_parallelism=1"),
}


def metrics_losses(path):
  """{step: loss} of a metrics file, the last line written for each step."""
  import json
  with open(path) as f:
    return {r["step"]: r["learning/loss"] for r in map(json.loads, f)}


def logits_tokens(hlo_text, vocab_sizes, hidden_sizes):
  """For every array in compiled HLO with a vocabulary-sized dimension (other than [hidden,
  vocab] weights), how many tokens it holds: the largest such count."""
  import re

  import numpy as np
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
  import re
  arrays = []
  for dims, opcode, rest in re.findall(r"= \w+\[([\d,]*)\]\S* ([\w-]+)\((.*)", hlo_text):
    name = re.search(r'op_name="([^"]*)"', rest)
    arrays.append((tuple(int(d) for d in dims.split(",") if d), opcode, name.group(1) if name else ""))
  return arrays


def loss_gradients(config, batch=None):
  """{parameter path: gradient, and "loss": the summed training loss} at config's initial
  parameters on `batch` (default fixed_batch), computed on config's mesh and gathered."""
  import jax
  import numpy as np

  from MaxText import sharding, train_step
  trainer, state = trainer_and_state(config)
  loss = lambda params, batch: train_step.batch_sums(trainer.model, config, params, batch)[0]
  batch = fixed_batch(config) if batch is None else batch
  with sharding.activate(trainer.mesh, config):
    value, grads = jax.jit(jax.value_and_grad(loss))(state.params, train_step.device_batch(trainer, batch))
  leaves = jax.tree_util.tree_leaves_with_path(jax.device_get(grads))
  return {"loss": np.asarray(value), **{jax.tree_util.keystr(path): np.asarray(g) for path, g in leaves}}


_MESH_GRADIENTS_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
from conftest import SHARDED, loss_gradients, tiny_config
for name, mesh in {meshes!r}.items():
  np.savez(f"{{name}}.npz", **loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=1", *mesh, *{overrides!r})))
"""


def assert_mesh_gradients_equal_one_device(out, meshes, *overrides):
  """SHARDED's loss and gradients with `overrides` on 8 simulated devices under each of `meshes`
  ({name: overrides}) equal one device's without them, rtol 1e-5; the runs write to `out`."""
  import numpy as np
  script = _MESH_GRADIENTS_SCRIPT.format(tests=str(ROOT / "tests"), meshes=meshes, overrides=overrides)
  result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "JAX_NUM_CPU_DEVICES": "8"},
                          capture_output=True, text=True, timeout=600, cwd=out)
  assert result.returncode == 0, result.stderr[-4000:]
  want = loss_gradients(tiny_config(*SHARDED, "per_device_batch_size=8"))
  for name in meshes:
    got = np.load(out / f"{name}.npz")
    assert sorted(got.files) == sorted(want)
    assert_trees_close({k: got[k] for k in want}, want, rtol=1e-5, what=name)


def packed_batch(config, seed=0):
  """Two rows of packed documents: row 0's boundaries fall inside a context shard (5) and on
  one (16), row 1's inside (13), then two padding tokens; positions restart per document and
  each document's last token is not scored."""
  import numpy as np
  length = config.max_target_length
  rows = [[5, 11, length - 16], [13, length - 15, 2]]
  segments = np.stack([np.repeat(np.arange(1, 4), row) for row in rows]).astype(np.int32)
  segments[1, -2:] = 0
  positions = np.stack([np.concatenate([np.arange(n) for n in row]) for row in rows]).astype(np.int32)
  tokens = np.random.default_rng(seed).integers(0, config.vocab_size, segments.shape, dtype=np.int32)
  targets = np.roll(tokens, -1, axis=1)
  scored = (segments == np.roll(segments, -1, axis=1)) & (segments != 0)
  scored[:, -1] = False
  batch = {"inputs": tokens, "targets": targets, "inputs_position": positions, "inputs_segmentation": segments,
           "targets_segmentation": (segments * scored).astype(np.int32)}
  return {k: np.tile(x, (config.global_batch_size_to_train_on // 2, 1)) for k, x in batch.items()}


# Context parallelism's test models (TINY, GQA 4/2, at 32 tokens) and the meshes of 8 devices
# they run under, each against the model on one device (tests/context_runs.py).
CONTEXT_MODELS = {
    "llama": ("max_target_length=32",),
    "gemma2": ("max_target_length=32", "decoder_block=gemma2", "sliding_window_size=6",
               "attn_logits_soft_cap=50", "query_pre_attn_scalar=8"),
}
_RING, _UNBALANCED = "context_parallel_strategy=ring", "context_parallel_load_balance=false"
_C4F2 = ("ici_context_parallelism=4", "ici_fsdp_parallelism=2")
CONTEXT_VARIANTS = {  # name -> (model, overrides)
    "context=2 fsdp=2 tensor=2 all_gather": ("llama", ("ici_context_parallelism=2", "ici_fsdp_parallelism=2",
                                                       "ici_tensor_parallelism=2")),
    "context=4 tensor=2 ring": ("llama", ("ici_context_parallelism=4", "ici_fsdp_parallelism=1",
                                          "ici_tensor_parallelism=2", _RING)),
    "context=8 all_gather": ("llama", ("ici_context_parallelism=8", "ici_fsdp_parallelism=1")),
    "context=8 ring unbalanced": ("llama", ("ici_context_parallelism=8", "ici_fsdp_parallelism=1", _RING,
                                            _UNBALANCED)),
    "context=4 fsdp=2 ring": ("llama", (*_C4F2, _RING)),
    "context=4 fsdp=2 all_gather unbalanced": ("llama", (*_C4F2, _UNBALANCED)),
    "gemma2 context=4 fsdp=2 ring": ("gemma2", (*_C4F2, _RING)),
    "gemma2 context=4 fsdp=2 all_gather unbalanced chunked": ("gemma2", (*_C4F2, _UNBALANCED, "attention=chunked",
                                                                         "attention_chunk_size=4")),
    # 2 query chunks x 2 key blocks per ring step (8 tokens a shard).
    "context=4 fsdp=2 ring chunked": ("llama", (*_C4F2, _RING, "attention=chunked", "attention_chunk_size=4")),
}
