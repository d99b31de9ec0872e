"""The train step, the CLI run, its metrics file, and the AOT memory report."""

import json
import logging
import os

import jax
import numpy as np
import pytest
from conftest import TINY, assert_trees_close, fixed_batch, run_command, tiny_config, trainer_and_state

from MaxText import costs, metrics, objective, sharding, train, train_step


def run_steps(config, batch, steps):
  trainer, state = trainer_and_state(config)
  step_losses = []
  with sharding.activate(trainer.mesh, config):
    for _ in range(steps):
      state, step_metrics = trainer.train_step(state, train_step.device_batch(trainer, batch))
      step_losses.append(float(step_metrics["learning/loss"]))
  return state, step_losses


def test_train_step_lowers_the_loss_on_a_fixed_batch():
  config = tiny_config()
  _, step_losses = run_steps(config, fixed_batch(config), 15)
  assert step_losses[-1] < 0.6 * step_losses[0], step_losses


def test_gradient_accumulation_gives_the_gradient_of_one_big_batch():
  """train_step.gradients over 2 microbatches against jax.grad of the whole batch's loss, per
  scored token; no optimizer in between. docs/guides/training.md states the tolerance."""
  whole = tiny_config("per_device_batch_size=4")
  accumulated = tiny_config("per_device_batch_size=2", "gradient_accumulation_steps=2")
  batch = fixed_batch(whole)
  batch["targets_segmentation"][0, :7] = 0  # uneven token counts across microbatches
  tokens = np.sum(batch["targets_segmentation"] != 0)
  trainer, state = trainer_and_state(whole)
  model = train_step.build(accumulated, trainer.mesh).model
  with sharding.activate(trainer.mesh, whole):
    batch = train_step.device_batch(trainer, batch)
    want_loss, want_grads = jax.jit(jax.value_and_grad(
        lambda p: objective.batch_sums(trainer.model, whole, p, batch)[0]))(state.params)
    (loss, sums), grads = jax.jit(lambda p: train_step.gradients(model, accumulated, p, batch))(state.params)
  assert float(sums.weights) == tokens
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_trees_close(jax.device_get(grads), jax.device_get(jax.tree.map(lambda g: g / tokens, want_grads)), rtol=1e-5)


def test_training_is_deterministic_for_given_seeds():
  config = tiny_config()
  state_a, losses_a = run_steps(config, fixed_batch(config), 2)
  state_b, losses_b = run_steps(config, fixed_batch(config), 2)
  assert losses_a == losses_b
  jax.tree.map(np.testing.assert_array_equal, state_a.params, state_b.params)


def test_flops_match_a_hand_count():
  config = tiny_config("base_num_decoder_layers=2", "vocab_size=100", "base_emb_dim=32",
                       "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=8",
                       "base_mlp_dim=64", "max_target_length=16", "per_device_batch_size=3",
                       num_devices=1)
  tokens = 3 * 16
  per_token_macs = {  # multiply-adds per token, per weight matrix
      "q": 32 * 4 * 8, "k": 32 * 2 * 8, "v": 32 * 2 * 8, "o": 4 * 8 * 32,
      "wi_0": 32 * 64, "wi_1": 32 * 64, "wo": 64 * 32}
  layer_flops = 2 * tokens * sum(per_token_macs.values())
  head_flops = 2 * tokens * 32 * 100
  # QK^T and PV over the causal half of the 16 x 16 score matrix, 4 heads of width 8.
  attention_flops = 2 * 2 * 3 * (16 * 16 / 2) * 4 * 8
  forward = 2 * (layer_flops + attention_flops) + head_flops
  assert costs.training_flops_per_step(config) == pytest.approx(3 * forward)


@pytest.mark.parametrize("overrides", [(), ("scan_layers=false", "gradient_accumulation_steps=2")])
def test_traced_matmul_flops_count_loops_and_recomputation(overrides):
  def traced(*more):
    config = tiny_config(*overrides, *more)
    return costs.matmul_flops(train_step.trace_train_step(train_step.build(config, sharding.create_mesh(config)),
                                                       config).jaxpr), config
  untiled, config = traced("remat_policy=none")
  # Without remat the backward is twice the forward for every product, and attention's scores
  # and context are computed for the whole T x T (the model FLOPs count the causal half).
  b, t, h, hd, layers = (config.global_batch_size_to_train_on, config.max_target_length,
                         config.base_num_query_heads, config.head_dim, config.base_num_decoder_layers)
  causal_half = 2 * 2 * b * t * t * h * hd * layers / 2
  assert untiled == costs.training_flops_per_step(config) + 3 * causal_half
  assert traced("remat_policy=none", "num_vocab_tiling=4")[0] == untiled
  full = traced("remat_policy=full", "num_vocab_tiling=4")[0]
  assert full > untiled
  # Each recomputed tile's logits: one more [tokens, D] x [D, V] product.
  head_forward = 2 * b * t * config.base_emb_dim * config.vocab_size
  assert traced("remat_policy=full", "num_vocab_tiling=4", "vocab_tiling_mode=recompute")[0] == full + head_forward


def test_the_train_command_writes_metrics_file_and_tensorboard(tmp_path, caplog):
  metrics_file = tmp_path / "m.jsonl"
  with caplog.at_level(logging.INFO):
    run_command("train", *TINY, f"base_output_directory={tmp_path}", "run_name=cli", "steps=4", "log_period=2",
                "dataset_type=synthetic", "enable_tensorboard=true", f"metrics_file={metrics_file}")
  rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for row in rows:
    for key in ("learning/loss", "learning/grad_norm", "learning/current_learning_rate",
                "perf/step_time_seconds", "perf/per_device_tokens_per_sec",
                "perf/per_device_tflops_per_sec", "learning/accuracy"):
      assert np.isfinite(row[key]), key
    assert row["perf/step_time_seconds"] > 0
  assert "step 4/4 | loss" in caplog.text and "temp_bytes" in caplog.text
  assert list((tmp_path / "cli" / "tensorboard").glob("events.out.tfevents.*"))


def test_train_compile_reports_the_train_step_memory(tmp_path, capsys):
  stats_file = tmp_path / "new" / "mem.json"  # a folder that does not exist yet is made
  run_command("train_compile", *TINY, f"memory_stats_file={stats_file}")
  stdout = capsys.readouterr().out
  stats = json.loads(stats_file.read_text())
  vocab_arrays = stats.pop("largest_vocab_arrays")
  # XLA:CPU: a device's share of the host's memory to fit into, and no chip peak for an MFU bound.
  host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  assert stats.pop("fits") is True and stats.pop("device_memory_bytes") == host
  assert stats.pop("model_flops_per_step") == costs.training_flops_per_step(tiny_config())
  traced = stats.pop("traced_flops_per_step")
  assert traced > 0 and "MFU" not in stdout and stats.pop("traced_flops_by_precision") == {"bf16": traced}
  # One device: the shard_maps' collectives run over axes of size 1 and send nothing; none printed.
  assert stats.pop("collective_bytes_per_device") == {} and "collectives called" not in stdout
  # Nor does the compiled step, whose count is printed all the same.
  assert stats.pop("network_bytes_per_device") == {"dcn": 0.0, "ici": 0.0, "by_axes": {}, "by_type": {},
                                                   "unknown_trip_counts": 0}
  assert "across slices (dcn) 0.000 GiB, within a slice (ici) 0.000 GiB" in stdout
  assert stats["temp_bytes"] > 0 and stats["total_bytes"] > 0
  config = tiny_config()
  trainer, _ = trainer_and_state(config)
  assert costs.memory_stats(train_step.compile_train_step(trainer, config)) == stats
  # Untiled, the largest array with a vocabulary dimension is the float32 [batch, length, vocab] logits.
  batch, length, vocab = config.global_batch_size_to_train_on, config.max_target_length, config.vocab_size
  assert vocab_arrays[0][0].startswith("f32[") and vocab_arrays[0][1] == batch * length * vocab * 4
  assert "largest arrays with a vocabulary dimension" in stdout
  assert "temp_bytes" in stdout and "GiB" in stdout


def test_a_nonfinite_step_is_not_applied_and_the_next_one_is():
  config = tiny_config()
  trainer, state = trainer_and_state(config)
  batch = fixed_batch(config)
  # Token ids past the vocabulary look up NaN embeddings: the loss and gradients are NaN.
  poisoned = {**batch, "inputs": np.full_like(batch["inputs"], config.vocab_size)}
  before = jax.device_get(state)  # the step donates its input state
  with sharding.activate(trainer.mesh, config):
    state, bad = trainer.train_step(state, train_step.device_batch(trainer, poisoned))
    after_bad = jax.device_get(state)
    state, good = trainer.train_step(state, train_step.device_batch(trainer, batch))
  assert float(bad["learning/nonfinite"]) == 1.0 and not np.isfinite(float(bad["learning/loss"]))
  assert int(after_bad.step) == int(before.step) + 1
  jax.tree.map(np.testing.assert_array_equal, (after_bad.params, after_bad.opt_state),
               (before.params, before.opt_state))
  assert float(good["learning/nonfinite"]) == 0.0 and np.isfinite(float(good["learning/loss"]))
  changed = jax.tree.map(lambda a, b: not np.array_equal(a, b), jax.device_get(state.params), before.params)
  assert all(jax.tree.leaves(changed))


def test_the_host_fetches_metrics_a_step_late_and_prepares_the_next_batch_while_a_step_runs(tmp_path, monkeypatch):
  events = []
  compile_train_step, device_get = train_step.compile_train_step, jax.device_get
  create_train_iterator = train.input_pipeline.create_train_iterator

  class Recording:
    def __init__(self, compiled):
      self.compiled = compiled

    def __call__(self, state, batch):
      events.append("dispatch")
      return self.compiled(state, batch)

    def __getattr__(self, name):  # memory_analysis and the rest
      return getattr(self.compiled, name)

  def recording_compile(trainer, config):
    return Recording(compile_train_step(trainer, config))

  def recording_iterator(*args):
    for batch in create_train_iterator(*args):
      events.append("batch")
      yield batch

  monkeypatch.setattr(train_step, "compile_train_step", recording_compile)
  monkeypatch.setattr(train.input_pipeline, "create_train_iterator", recording_iterator)
  monkeypatch.setattr(jax, "device_get", lambda x: events.append("fetch") or device_get(x))
  train.train(tiny_config(f"base_output_directory={tmp_path}", "steps=4"))
  # Step N+1 is dispatched before step N's metrics are fetched, and batch N+2 is made while N+1
  # runs; only the last step waits for itself.
  assert events == ["batch", "dispatch", "batch", "dispatch", "fetch", "batch", "dispatch", "fetch", "batch",
                    "dispatch", "fetch", "fetch"]


def test_mfu_is_reported_against_the_chip_peak_where_it_is_known(tmp_path, monkeypatch):
  assert costs.peak_tflops("TPU v5 lite") == 197 and costs.peak_tflops("TPU v5p") == 459
  assert costs.peak_tflops("TPU v4") == 275 and costs.peak_tflops("NVIDIA H100 80GB HBM3") == 989
  assert costs.peak_tflops("cpu") is None
  metrics_file = tmp_path / "m.jsonl"
  monkeypatch.setattr(metrics, "peak_tflops", lambda kind: 0.5)  # pretend this CPU peaks at 0.5 TFLOP/s
  train.train(tiny_config(f"base_output_directory={tmp_path}", "steps=2", f"metrics_file={metrics_file}"))
  for row in map(json.loads, metrics_file.read_text().splitlines()):
    assert row["perf/mfu"] == pytest.approx(row["perf/per_device_tflops_per_sec"] / 0.5)
