"""Training: python -m MaxText.train configs/base.yml [key=value ...]

A batch goes: input pipeline -> sharded global arrays -> Transformer -> loss (full logits,
or vocabulary-tiled; one loss head, vocab_tiling.loss_sums) -> gradients summed over
microbatches -> optax update.
"""

import functools
import math
import time
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax.training.train_state import TrainState

from MaxText import checkpointing, errors, metrics, optimizers, pyconfig, run_control, sharding, vocab_tiling
from MaxText.input_pipeline import input_pipeline
from MaxText.layers.models import Transformer

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")


def loss_sums(model, config, params, batch):
  """Sums over the batch's scored tokens: (loss incl. z-loss, {weights, z_loss, correct})."""
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  targets = batch["targets"]
  if config.num_vocab_tiling > 1:
    hidden, kernel = model.apply({"params": params}, *inputs, return_hidden=True)
    loss, z_loss, correct = vocab_tiling.tiled_loss_and_accuracy(
        hidden, kernel, targets, weights, config.num_vocab_tiling, config.z_loss_multiplier,
        config.vocab_tiling_mode, config.final_logits_soft_cap)
  else:
    logits = model.apply({"params": params}, *inputs)
    loss, z_loss, correct = vocab_tiling.loss_sums(logits, targets, weights, config.z_loss_multiplier)
  return loss, {"weights": jnp.sum(weights), "z_loss": z_loss, "correct": correct}


def _microbatches(batch, count):
  """[count * m, T] -> [count, m, T], microbatch k = rows k, k + count, ...: every
  microbatch is spread over the batch shards like the whole batch."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, count, *x.shape[1:]), 0, 1), batch)


def _per_token(loss, sums):
  """Token-weighted means, the same however the tokens were split into microbatches."""
  total = jnp.maximum(sums["weights"], 1.0)
  return {"loss": loss / total, "z_loss": sums["z_loss"] / total, "accuracy": sums["correct"] / total,
          "total_weights": sums["weights"]}


def train_step(model, config, state, batch):
  """One optimizer step on the global batch (gradient_accumulation_steps microbatches)."""
  grad_fn = jax.value_and_grad(functools.partial(loss_sums, model, config), has_aux=True)
  if config.gradient_accumulation_steps > 1:

    def accumulate(total, microbatch):
      return jax.tree.map(jnp.add, total, grad_fn(state.params, microbatch)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, state.params, batch))
    (loss, sums), grads = jax.lax.scan(accumulate, zeros,
                                       _microbatches(batch, config.gradient_accumulation_steps))[0]
  else:
    (loss, sums), grads = grad_fn(state.params, batch)
  # The loss is a sum over tokens; dividing once by the global token count makes every
  # split of the batch (microbatches, devices, vocab tiles) give the same gradient.
  grads = jax.tree.map(lambda g: g / jnp.maximum(sums["weights"], 1.0), grads)
  step_metrics = {f"learning/{k}": v for k, v in _per_token(loss, sums).items()}
  step_metrics["learning/grad_norm"] = optax.tree.norm(grads)
  step_metrics["learning/current_learning_rate"] = optimizers.learning_rate_schedule(config)(state.step)
  # A non-finite loss or gradient leaves parameters and optimizer state as they were (the step
  # still counts), so divergence never reaches the state; the host stops after a streak of them.
  finite = jnp.isfinite(loss) & jnp.isfinite(step_metrics["learning/grad_norm"])
  step_metrics["learning/nonfinite"] = 1.0 - finite.astype(jnp.float32)
  # A cond, not a select: a select would hold the new and the old state at once.
  state = jax.lax.cond(finite, lambda s: s.apply_gradients(grads=grads), lambda s: s.replace(step=s.step + 1), state)
  return state, step_metrics


def eval_step(model, config, params, batch):
  """Loss sums of one batch without gradients; the caller sums batches then divides."""
  loss, sums = loss_sums(model, config, params, batch)
  return {"loss": loss, **sums}


class Trainer(NamedTuple):
  """Everything `train` and `train_compile` share: the model and the jitted, sharded steps."""

  model: Transformer
  mesh: jax.sharding.Mesh
  abstract_state: TrainState  # ShapeDtypeStructs
  state_sharding: TrainState  # NamedShardings
  batch_sharding: dict
  init: Callable  # rng -> sharded TrainState
  train_step: Callable  # (state, batch) -> (state, metrics); donates state
  eval_step: Callable  # (params, batch) -> loss sums


def _abstract_batch(config, rows):
  return {k: jax.ShapeDtypeStruct((rows, config.max_target_length), jnp.int32) for k in BATCH_KEYS}


def compiler_options(config, mesh) -> dict:
  """XLA options for the train step. XLA:CPU's default, concurrency-optimized scheduler undoes
  remat in a Python-loop stack (jax 0.10.2's XLA; jax 0.12's does not): the default model's step
  with scan_layers=false remat_policy=full compiled to 184 MiB temp against 196 MiB with none.
  The memory-optimized scheduler keeps remat's savings (129 MiB, at the same step time). Only
  there: other settings and backends keep their schedulers."""
  if config.scan_layers or config.remat_policy == "none" or mesh.devices.flat[0].platform != "cpu":
    return {}
  return {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}


def build(config, mesh) -> Trainer:
  """Traces the model under the mesh's logical rules and jits its steps with explicit shardings."""
  model = Transformer(config)
  tx = optimizers.create_optimizer(config)

  def init_boxed(rng):
    batch = _abstract_batch(config, config.micro_batch_size)
    tokens = jnp.zeros(batch["inputs"].shape, jnp.int32)
    params = model.init(rng, tokens, tokens, tokens)["params"]
    return TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  with sharding.activate(mesh, config):
    # Parameters and optimizer state carry logical axis names; turn them into shardings
    # and create them sharded, never whole on one device.
    # The key too is abstract: nothing may run here, so this also works for devices that
    # exist only to be compiled for (a TPU topology on a CPU machine).
    boxed = jax.eval_shape(lambda: init_boxed(jax.random.key(0)))
    state_sharding = sharding.logical_to_sharding(nn.get_partition_spec(boxed), mesh, config)
  abstract_state = nn.meta.unbox(boxed)
  batch_sharding = {k: sharding.batch_sharding(mesh, config) for k in BATCH_KEYS}
  init = jax.jit(lambda rng: nn.meta.unbox(init_boxed(rng)), out_shardings=state_sharding)
  p_train = jax.jit(functools.partial(train_step, model, config),
                    in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                    donate_argnums=0)
  p_eval = jax.jit(functools.partial(eval_step, model, config),
                   in_shardings=(state_sharding.params, batch_sharding))
  return Trainer(model, mesh, abstract_state, state_sharding, batch_sharding, init, p_train, p_eval)


def compile_train_step(trainer: Trainer, config):
  """AOT-compiles the train step for the global batch; runs nothing."""
  with sharding.activate(trainer.mesh, config):
    batch = _abstract_batch(config, config.global_batch_size_to_train_on)
    lowered = trainer.train_step.lower(trainer.abstract_state, batch)
  try:
    return lowered.compile(compiler_options(config, trainer.mesh))
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program larger than HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise errors.UserError(f"does not fit: {errors.first_line(e)}") from None


def trace_train_step(trainer: Trainer, config):
  """The train step's jaxpr for the global batch (what compile_train_step compiles)."""
  with sharding.activate(trainer.mesh, config):
    batch = _abstract_batch(config, config.global_batch_size_to_train_on)
    return jax.make_jaxpr(trainer.train_step)(trainer.abstract_state, batch)


def device_batch(trainer: Trainer, local_batch: dict) -> dict:
  """This process's rows -> global arrays laid out by the batch sharding."""
  return {k: jax.make_array_from_process_local_data(trainer.batch_sharding[k], local_batch[k])
          for k in BATCH_KEYS}


def evaluate(trainer: Trainer, config, params, data) -> dict:
  """eval_steps held-out batches: eval/loss (cross entropy, no z-loss), perplexity, accuracy."""
  batches = input_pipeline.create_eval_iterator(config, data)
  sums = None
  for _ in range(config.eval_steps):
    batch_sums = trainer.eval_step(params, device_batch(trainer, next(batches)))
    sums = batch_sums if sums is None else jax.tree.map(jnp.add, sums, batch_sums)
  sums = {k: float(v) for k, v in jax.device_get(sums).items()}
  weights = max(sums["weights"], 1.0)
  cross_entropy = (sums["loss"] - sums["z_loss"]) / weights
  return {"eval/loss": cross_entropy, "eval/perplexity": math.exp(min(cross_entropy, 50.0)),
          "eval/accuracy": sums["correct"] / weights}


def initial_state(trainer: Trainer, config, manager, data):
  """(state, training iterator) from the latest checkpoint of this run, else a fresh state
  with parameters from load_parameters_path when given. Where the batches depend on the step
  alone the iterator starts at the restored step, whatever number of processes saved it;
  streamed data restores the iterator state its checkpoint saved."""
  by_step = input_pipeline.resumes_by_step(data)
  iterator = None if by_step else input_pipeline.create_train_iterator(config, data)
  restored = manager and checkpointing.restore_latest(manager, trainer.abstract_state,
                                                      trainer.state_sharding, iterator)
  if restored and config.load_parameters_path:
    raise errors.ConfigError(f"load_parameters_path={config.load_parameters_path!r}: run {config.run_dir} already "
                             f"has checkpoints (latest step {restored[1]}); use a new run_name to start from it")
  if restored:
    logging.info("resuming from checkpoint step %d in %s", restored[1], manager.directory)
    state = restored[0]
  else:
    state = trainer.init(jax.random.key(config.init_weights_seed))
    if config.load_parameters_path:
      params = checkpointing.load_parameters(config.load_parameters_path, trainer.abstract_state.params,
                                             trainer.state_sharding.params)
      logging.info("parameters loaded from %s", config.load_parameters_path)
      state = state.replace(params=params)
  return state, input_pipeline.create_train_iterator(config, data, int(state.step)) if by_step else iterator


def save_if_finite(manager, step: int, state, train_iterator, params_finite) -> None:
  """Saves checkpoint `step` only from finite parameters: a non-finite checkpoint would become
  the one every resume starts from, and max_to_keep would delete good ones for it."""
  if not bool(params_finite(state.params)):
    raise run_control.Diverged(f"step {step}: the parameters are not finite; not saved (latest checkpoint: "
                               f"{manager.latest_step()})")
  checkpointing.save(manager, step, state, train_iterator)


def train(config) -> None:
  run_control.check_writable("base_output_directory", config.run_dir)
  run_control.check_writable("dataset_cache_dir", config.dataset_cache_dir)
  if config.metrics_file:
    run_control.check_writable("metrics_file", config.metrics_file, is_file=True)
  # Reading and tokenizing first: a bad dataset or tokenizer stops the run before it writes.
  data = input_pipeline.load(config)
  mesh = sharding.create_mesh(config)
  trainer = build(config, mesh)
  with run_control.run_lock(config.run_dir), run_control.stop_signals() as signals:
    run_control.record_run_files(config, data.tokenizer)
    manager = checkpointing.create_manager(config)
    try:
      with sharding.activate(mesh, config):
        state, train_iterator = initial_state(trainer, config, manager, data)
      _train_steps(trainer, config, state, data, train_iterator, manager, signals)
    finally:
      if manager:  # whatever stopped the run, saves already under way are good: let them commit
        manager.wait_until_finished()
        manager.close()


def _train_steps(trainer, config, state, data, train_iterator, manager, signals) -> None:
  compiled = compile_train_step(trainer, config)
  stats = metrics.memory_stats(compiled)
  logging.info("train step memory per device:\n%s", metrics.format_memory_stats(stats))
  problem = metrics.fit_message(stats, trainer.mesh.devices.flat[0])
  if problem:  # fail now, not at the first allocation of a run that cannot fit
    raise errors.UserError(problem)
  params_finite = jax.jit(lambda params: jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)])))
  logger = metrics.MetricLogger(config)
  flops_per_device = metrics.training_flops_per_step(config) / config.num_devices
  tokens_per_device = config.global_batch_size_to_train_on * config.max_target_length / config.num_devices
  peak_tflops = metrics.peak_tflops(jax.devices()[0].device_kind)
  if int(state.step) >= config.steps:
    logging.info("run %s is already at step %d, steps=%d: nothing to train", config.run_dir, int(state.step),
                 config.steps)
  nonfinite_streak, last = 0, time.perf_counter()

  def fetch(step_metrics) -> dict:
    """A dispatched step's metrics as floats; waits for that step only."""
    nonlocal last
    fetched = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    now = time.perf_counter()
    seconds, last = now - last, now  # between completions: the step's time once the pipeline is full
    fetched.update({
        "perf/step_time_seconds": seconds,
        "perf/per_device_tokens_per_sec": tokens_per_device / seconds,
        "perf/per_device_tflops_per_sec": flops_per_device / seconds / 1e12,
    })
    if peak_tflops:  # model FLOPs utilisation: model FLOPs only, recomputation not counted
      fetched["perf/mfu"] = fetched["perf/per_device_tflops_per_sec"] / peak_tflops
    return fetched

  def log(step: int, fetched: dict) -> None:
    nonlocal nonfinite_streak
    logger.write(step, fetched, force_log=step == config.steps)
    nonfinite_streak = nonfinite_streak + 1 if fetched["learning/nonfinite"] else 0
    if nonfinite_streak >= config.max_nonfinite_steps:
      raise run_control.Diverged(
          f"step {step}: loss or gradient norm not finite for {nonfinite_streak} steps in a row "
          f"(max_nonfinite_steps={config.max_nonfinite_steps}); stopped, latest checkpoint: "
          f"{manager.latest_step() if manager else None}")

  # The host never makes the device wait: step N is dispatched before step N-1's metrics are
  # fetched (waiting for N-1 only), and batch N+1 is prepared while N runs. Evaluation, saves,
  # a stop and the last step need their step finished, so there the pipeline drains.
  pending = None
  batch = device_batch(trainer, next(train_iterator)) if int(state.step) < config.steps else None
  start = int(state.step)
  try:
    for step in range(start + 1, config.steps + 1):
      state, step_metrics = compiled(state, batch)
      if pending:
        log(pending[0], fetch(pending[1]))
      pending = (step, step_metrics)
      signum = run_control.stop_requested(signals, step - start - 1)
      evaluating = config.eval_interval and (step % config.eval_interval == 0 or step == config.steps)
      saving = manager and (step % config.checkpoint_period == 0 or step == config.steps or signum)
      if evaluating or saving or signum or step == config.steps:
        fetched, pending = fetch(step_metrics), None
        if evaluating:
          with sharding.activate(trainer.mesh, config):
            fetched.update(evaluate(trainer, config, state.params, data))
          last = time.perf_counter()  # evaluation time is not step time
        log(step, fetched)
        # Mid-streak the state is the one from before it; saving that again would only let
        # max_to_keep prune older checkpoints for a copy.
        if saving and not nonfinite_streak:
          save_if_finite(manager, step, state, train_iterator, params_finite)
        if signum:
          saved = f"checkpoint {step} saved" if manager and not nonfinite_streak else "no checkpoint saved"
          raise run_control.Preempted(signum, f"{run_control.SIGNALS[signum]} at step {step}: {saved}; rerun to resume")
      if step < config.steps:  # the iterator moves past batch N+1 only after checkpoint N saved it at N
        batch = device_batch(trainer, next(train_iterator))
  finally:
    logger.close()


def main(argv):
  from MaxText import plan  # noqa: PLC0415 (the planner compiles this module's train step)
  config = pyconfig.initialize(plan.resolve_auto(argv[1:]))
  if config.compile_topology:
    raise errors.ConfigError(f"compile_topology={config.compile_topology!r}: only MaxText.train_compile "
                             "compiles for a topology; train runs on the devices it sees (set it to \"\")")
  train(config)


if __name__ == "__main__":
  errors.run(main)
