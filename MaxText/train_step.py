"""The train step and everything around it that train, train_compile and the planner share:
the gradients of the training objective (objective.py) summed over microbatches, the optax
update and the model's own, and the jitted steps with explicit shardings (Trainer), compiled
ahead of time or traced for FLOPs.
"""

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from MaxText import objective, optimizers, sharding
from MaxText.errors import UserError, first_line
from MaxText.layers import attentions, decoders, models, pipeline
from MaxText.layers.models import Transformer

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")


def _per_token(loss, sums: objective.Sums):
  """Token-weighted means, the same however the tokens were split into microbatches."""
  total = jnp.maximum(sums.weights, 1.0)
  return {"loss": loss / total, "z_loss": sums.z_loss / total, "accuracy": sums.correct / total,
          "total_weights": sums.weights, **{name: value / total for name, value in sums.metrics.items()}}


def gradients(model, config, params, batch):
  """((loss sum, sums), gradient of the loss per scored token) of the global batch, summed over
  its gradient_accumulation_steps microbatches."""
  if config.pipeline_stages > 1 and config.pipeline_schedule == "1f1b":
    grad_fn = functools.partial(objective.one_f_one_b, model, config)
  else:
    grad_fn = jax.value_and_grad(functools.partial(objective.batch_sums, model, config), has_aux=True)
  if config.gradient_accumulation_steps > 1:

    def accumulate(total, microbatch):
      return jax.tree.map(jnp.add, total, grad_fn(params, microbatch)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grad_fn, params, batch))
    (loss, sums), grads = jax.lax.scan(accumulate, zeros,
                                       pipeline.microbatches(batch, config.gradient_accumulation_steps))[0]
  else:
    (loss, sums), grads = grad_fn(params, batch)
  # The loss is a sum over tokens; dividing once by the global token count makes every
  # split of the batch (microbatches, devices, vocab tiles) give the same gradient.
  return (loss, sums), jax.tree.map(lambda g: g / jnp.maximum(sums.weights, 1.0), grads)


def _apply(config, state, grads, updates):
  """The optimizer's update, then the model's own (models.update_parameters)."""
  state = state.apply_gradients(grads=grads)
  return state.replace(params=models.update_parameters(config, state.params, updates))


def train_step(model, config, state, batch):
  """One optimizer step on the global batch (gradient_accumulation_steps microbatches)."""
  (loss, sums), grads = gradients(model, config, state.params, batch)
  step_metrics = {f"learning/{k}": v for k, v in _per_token(loss, sums).items()}
  step_metrics["learning/grad_norm"] = optax.tree.norm(grads)
  step_metrics["learning/current_learning_rate"] = optimizers.learning_rate_schedule(config)(state.step)
  # A non-finite loss or gradient leaves parameters and optimizer state as they were (the step
  # still counts), so divergence never reaches the state; the host stops after a streak of them.
  finite = jnp.isfinite(loss) & jnp.isfinite(step_metrics["learning/grad_norm"])
  step_metrics["learning/nonfinite"] = 1.0 - finite.astype(jnp.float32)
  # A cond, not a select: a select would hold the new and the old state at once.
  state = jax.lax.cond(finite, lambda s: _apply(config, s, grads, sums.updates), lambda s: s.replace(step=s.step + 1),
                       state)
  return state, step_metrics


def eval_step(model, config, params, batch):
  """(the cross entropy and z-loss summed, Sums) of one batch without gradients; the caller sums
  batches then divides."""
  loss, sums = objective.batch_sums(model, config, params, batch, train=False)
  return loss, sums._replace(updates=None)


class Trainer(NamedTuple):
  """Everything `train` and `train_compile` share: the model and the jitted, sharded steps."""

  model: Transformer
  mesh: jax.sharding.Mesh
  abstract_state: TrainState  # ShapeDtypeStructs
  state_sharding: TrainState  # NamedShardings
  batch_sharding: dict
  init: Callable  # rng -> sharded TrainState
  # (a TrainState, parameters or gradients laid out on the mesh, to_stages) -> in the order the run
  # keeps the pipelined layers (True) or in layer order, as checkpoints hold them (decoders.relayout)
  relayout: Callable
  train_step: Callable  # (state, batch) -> (state, metrics); donates state
  eval_step: Callable  # (params, batch) -> loss sums


def _abstract_batch(config, rows):
  return {k: jax.ShapeDtypeStruct((rows, config.max_target_length), jnp.int32) for k in BATCH_KEYS}


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
  # Initialised in layer order, so that the values are one device's whatever the stages.
  init = jax.jit(lambda rng: decoders.relayout(config, nn.meta.unbox(init_boxed(rng)), True),
                 out_shardings=state_sharding)

  @functools.cache  # one compile per direction and layout, not one per save
  def relayouts(to_stages: bool, treedef, shardings: tuple):
    return jax.jit(functools.partial(decoders.relayout, config, to_stages=to_stages),
                   out_shardings=jax.tree.unflatten(treedef, shardings))

  def relayout(tree, to_stages: bool):
    if not pipeline.reorders(config):
      return tree
    leaves, treedef = jax.tree.flatten(tree)
    return relayouts(to_stages, treedef, tuple(x.sharding for x in leaves))(tree)

  p_train = jax.jit(functools.partial(train_step, model, config),
                    in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                    donate_argnums=0)
  p_eval = jax.jit(functools.partial(eval_step, model, config),
                   in_shardings=(state_sharding.params, batch_sharding))
  return Trainer(model, mesh, abstract_state, state_sharding, batch_sharding, init, relayout, p_train, p_eval)


def compile_train_step(trainer: Trainer, config):
  """AOT-compiles the train step for the global batch; runs nothing."""
  with sharding.activate(trainer.mesh, config):
    batch = _abstract_batch(config, config.global_batch_size_to_train_on)
    lowered = trainer.train_step.lower(trainer.abstract_state, batch)
  try:
    return lowered.compile()
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program larger than HBM
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    raise UserError(f"does not fit: {first_line(e)}") from None


def trace_train_step(trainer: Trainer, config):
  """The train step's jaxpr for the global batch (what compile_train_step compiles)."""
  with sharding.activate(trainer.mesh, config):
    batch = _abstract_batch(config, config.global_batch_size_to_train_on)
    return jax.make_jaxpr(trainer.train_step)(trainer.abstract_state, batch)


def device_batch(trainer: Trainer, local_batch: dict) -> dict:
  """This process's rows -> global arrays laid out by the batch sharding, once the attention
  kernel has seen that it takes their documents."""
  attentions.check_documents(trainer.model.config, local_batch["inputs_segmentation"])
  return {k: jax.make_array_from_process_local_data(trainer.batch_sharding[k], local_batch[k])
          for k in BATCH_KEYS}
