"""Training: python -m MaxText.train configs/base.yml [key=value ...]

A batch goes: input pipeline -> sharded global arrays -> train_step (Transformer -> losses ->
gradients summed over microbatches -> optax update); this module runs the steps: it starts or
resumes the run, keeps the device busy, evaluates, logs and saves.
"""

import contextlib
import math

import jax
import jax.numpy as jnp
from absl import logging

from MaxText import checkpointing, costs, errors, launch, metrics, run_control, runtime, sharding, train_step
from MaxText.input_pipeline import input_pipeline
from MaxText.train_step import Trainer, device_batch


def _evaluate_rows(trainer: Trainer, config, params, rows) -> dict:
  """loss (the cross entropy, no z-loss or auxiliary terms), perplexity, accuracy and what the
  model's terms report (objective.Sums.metrics) of eval_steps batches of `rows`."""
  batches = input_pipeline.create_eval_iterator(config, rows)
  total = None
  for _ in range(config.eval_steps):
    sums = trainer.eval_step(params, device_batch(trainer, next(batches)))
    total = sums if total is None else jax.tree.map(jnp.add, total, sums)
  loss, sums = jax.tree.map(float, jax.device_get(total))
  weights = max(sums.weights, 1.0)
  cross_entropy = (loss - sums.z_loss) / weights
  return {"loss": cross_entropy, "perplexity": math.exp(min(cross_entropy, 50.0)),
          "accuracy": sums.correct / weights, **{name: value / weights for name, value in sums.metrics.items()}}


def evaluate(trainer: Trainer, config, params, data) -> dict:
  """eval/loss, eval/perplexity, eval/accuracy of the held-out rows. Several eval sources are each
  evaluated alone on eval_steps batches (eval/<source>/...), so a source's figures are those it
  would have as the only one, and eval/loss and eval/accuracy are their means by the sources' weights."""
  if not data.eval_weights:
    return {f"eval/{k}": v for k, v in _evaluate_rows(trainer, config, params, data.eval).items()}
  metrics, total = {}, sum(data.eval_weights.values())
  for name, rows in data.eval.items():
    metrics.update({f"eval/{name}/{k}": v for k, v in _evaluate_rows(trainer, config, params, rows).items()})
  loss, accuracy = (sum(w * metrics[f"eval/{name}/{k}"] for name, w in data.eval_weights.items()) / total
                    for k in ("loss", "accuracy"))
  return {**metrics, "eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "eval/accuracy": accuracy}


def initial_state(trainer: Trainer, config, managers, data, loaded=None):
  """(state, training iterator) from the latest checkpoint of this run (`managers`: its tiers,
  checkpointing.restore_latest), else a fresh state
  with parameters from load_parameters_path when given (`loaded`: already read). Where the
  batches depend on the step alone the iterator starts at the restored step, whatever number of
  processes saved it; streamed data restores the iterator state its checkpoint saved."""
  by_step = input_pipeline.resumes_by_step(data)
  iterator = None if by_step else input_pipeline.create_train_iterator(config, data)
  restored = checkpointing.restore_latest(managers, trainer.abstract_state, trainer.state_sharding, iterator)
  if restored and config.load_parameters_path:
    raise errors.ConfigError(f"load_parameters_path={config.load_parameters_path!r}: run {config.run_dir} already "
                             f"has checkpoints (latest step {restored[1]}); use a new run_name to start from it")
  if restored:
    logging.info("resuming from checkpoint step %d in %s", restored[1], restored[2].directory)
    state = trainer.relayout(restored[0], True)
  else:
    state = trainer.init(jax.random.key(config.init_weights_seed))
    if config.load_parameters_path:
      params = loaded if loaded is not None else _load_parameters(trainer, config)
      state = state.replace(params=trainer.relayout(params, True))
  return state, input_pipeline.create_train_iterator(config, data, int(state.step)) if by_step else iterator


def _load_parameters(trainer: Trainer, config):
  params = checkpointing.load_parameters(config.load_parameters_path, trainer.abstract_state.params,
                                         trainer.state_sharding.params)
  logging.info("parameters loaded from %s", config.load_parameters_path)
  return params


def save_if_finite(trainer: Trainer, manager, step: int, state, train_iterator, params_finite) -> None:
  """Saves checkpoint `step`, in layer order, only from finite parameters: a non-finite checkpoint
  would become the one every resume starts from, and max_to_keep would delete good ones for it."""
  if not bool(params_finite(state.params)):
    raise run_control.Diverged(f"step {step}: the parameters are not finite; not saved (latest checkpoint: "
                               f"{manager.latest_step()})")
  checkpointing.save(manager, step, trainer.relayout(state, False), train_iterator)


def train(config) -> None:
  run_control.check_run_paths(config)
  config = run_control.keep_global_batch(config)
  # Reading and tokenizing first: a bad dataset or tokenizer stops the run before it writes.
  data = input_pipeline.load(config)
  mesh = sharding.create_mesh(config)
  trainer = train_step.build(config, mesh)
  if config.load_parameters_path:  # another model's parameters: one line before the run directory is made
    checkpointing.check_parameter_shapes(config.load_parameters_path, trainer.abstract_state.params)
  compiled, stats = _compile_to_fit(trainer, config)
  with run_control.run_lock(config.run_dir):
    trained = checkpointing.latest_checkpoint(config) is not None
    run_control.check_resume(config, data.tokenizer, trained=trained)
    data.save_caches()
    loaded = None
    if config.load_parameters_path and not trained:  # read and verified before the run's checkpoints are made
      with sharding.activate(mesh, config):
        loaded = _load_parameters(trainer, config)
    manager = checkpointing.create_manager(config)
    local = checkpointing.create_manager(config, local=True)
    logging.info("train step memory per device:\n%s", costs.format_memory_stats(stats))
    try:
      with sharding.activate(mesh, config):
        state, train_iterator = initial_state(trainer, config, (manager, local), data, loaded)
      run_control.record_run_files(config, data.tokenizer)
      # Only the loop stops cleanly on a signal: before it there is nothing to save.
      with run_control.stop_signals() as signals:
        _train_steps(trainer, config, compiled, state, data, train_iterator, manager, local, signals)
    finally:
      _close(manager, local)


def _close(*managers) -> None:
  """Whatever stopped the run, the saves under way in each tier are good: they commit, and every
  tier closes whichever of them fails."""
  with contextlib.ExitStack() as closing:
    for manager in filter(None, managers):
      closing.callback(manager.close)
    for manager in filter(None, managers):
      checkpointing.wait_for_saves(manager)


def _compile_to_fit(trainer: Trainer, config):
  """(The compiled train step, its memory stats), before anything is allocated: a step that
  cannot fit fails now, with one line, not in its first allocation."""
  compiled = train_step.compile_train_step(trainer, config)
  stats = costs.memory_stats(compiled)
  report, problem = costs.memory_report(stats, trainer.mesh)
  if config.memory_stats_file:
    metrics.write_json(config.memory_stats_file, report)
  if problem:
    raise errors.UserError(problem)
  return compiled, stats


def _train_steps(trainer, config, compiled, state, data, train_iterator, manager, local, signals) -> None:
  params_finite = jax.jit(lambda params: jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)])))
  logger = metrics.MetricLogger(config)
  clock = metrics.StepClock(config, jax.devices()[0].device_kind)
  streak = run_control.NonfiniteStreak(config.max_nonfinite_steps)
  latest_checkpoint = lambda: max((m.latest_step() for m in (manager, local) if m and m.latest_step() is not None),
                                  default=None)
  if int(state.step) >= config.steps:
    logging.info("run %s is already at step %d, steps=%d: nothing to train", config.run_dir, int(state.step),
                 config.steps)

  def fetch(step_metrics) -> dict:
    """A dispatched step's metrics as floats, with its perf/* metrics; waits for that step only."""
    fetched = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
    return {**fetched, **clock.lap()}

  def log(step: int, fetched: dict) -> None:
    progress = data.progress(step * config.global_batch_size_to_train_on)  # the rows steps 1..step drew
    logger.write(step, {**fetched, **progress}, force_log=step == config.steps)
    streak.update(step, fetched["learning/nonfinite"], latest_checkpoint)

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
      # The local tier between the persistent saves, and first on a signal: it is the faster.
      local_saving = local and (signum or (step % config.local_checkpoint_period == 0 and not saving))
      if evaluating or saving or local_saving or signum or step == config.steps:
        fetched, pending = fetch(step_metrics), None
        if evaluating:
          with sharding.activate(trainer.mesh, config):
            fetched.update(evaluate(trainer, config, state.params, data))
          clock.restart()  # evaluation time is not step time
        log(step, fetched)
        # Mid-streak the state is the one from before it; saving that again would only let
        # max_to_keep prune older checkpoints for a copy.
        if local_saving and not streak.count:
          save_if_finite(trainer, local, step, state, train_iterator, params_finite)
        if saving and not streak.count:
          save_if_finite(trainer, manager, step, state, train_iterator, params_finite)
        if signum:
          saved = f"checkpoint {step} saved" if manager and not streak.count else "no checkpoint saved"
          raise run_control.Preempted(signum, f"{run_control.SIGNALS[signum]} at step {step}: {saved}; rerun to resume")
      if step < config.steps:  # the iterator moves past batch N+1 only after checkpoint N saved it at N
        batch = device_batch(trainer, next(train_iterator))
    streak.finish(config.steps, latest_checkpoint)
  finally:
    logger.close()


def main(argv):
  config = launch.config(argv[1:], plans=True)
  if config.compile_topology:
    raise errors.ConfigError(f"compile_topology={config.compile_topology!r}: only MaxText.train_compile "
                             "compiles for a topology; train runs on the devices it sees (set it to \"\")")
  train(config)


if __name__ == "__main__":
  runtime.run(main)
