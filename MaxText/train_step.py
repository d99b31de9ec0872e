"""The train step and everything around it that train, train_compile and the planner share:
the training objective (the model applied to a batch: the loss plus the MoE router's losses),
its gradients summed over microbatches, the optax update, and the jitted steps with
explicit shardings (Trainer), compiled ahead of time or traced for FLOPs.
"""

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState

from MaxText import head, losses, optimizers, sharding
from MaxText.errors import UserError, first_line
from MaxText.layers import attentions, context_parallel, decoders, moe, multi_token_prediction, pipeline
from MaxText.layers.models import Transformer
from MaxText.layers.multi_token_prediction import shifted
from MaxText.layers.normalizations import rms_norm_with

BATCH_KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")


def _head_sums(config, hidden, kernel, targets, weights, z_loss_multiplier):
  """[loss, z_loss, correct] summed over the scored tokens of the head's logits from hidden
  states, from the whole logits or, with num_vocab_tiling > 1, tile by tile."""
  if config.num_vocab_tiling > 1:
    return losses.tiled_token_sums(hidden, kernel, targets, weights, config.num_vocab_tiling, z_loss_multiplier,
                                   config.vocab_tiling_mode, config.final_logits_soft_cap)
  return losses.token_sums(head.logits(hidden, kernel, config.final_logits_soft_cap), targets, weights,
                           z_loss_multiplier)


def _scored_sums(config, hidden, kernel, batch):
  """(the loss summed over the batch's scored tokens, {weights, z_loss, correct}) of the head on
  hidden states: batch_sums' main terms, and each 1F1B microbatch's."""
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  loss, z_loss, correct = _head_sums(config, hidden, kernel, batch["targets"], weights, config.z_loss_multiplier)
  return loss, {"weights": jnp.sum(weights), "z_loss": z_loss, "correct": correct}


def mtp_weights(batch, k: int):
  """Which positions i multi-token prediction's k-th layer is scored at: those whose target
  t[i + k + 1] (targets[i + k]) is scored, within the row and in position i's document."""
  segments = batch["inputs_segmentation"]
  inside = jnp.arange(segments.shape[1]) < segments.shape[1] - k
  same_document = shifted(segments, k) == segments
  return (inside & same_document & (shifted(batch["targets_segmentation"], k) != 0)).astype(jnp.float32)


def _router_sums(config, means, total):
  """(the MoE router's losses, its sums): `means` {name: mean over the MoE layers} of the
  router's statistics for `total` scored tokens, or one of each per microbatch. The router's
  losses are means over tokens and layers; as sums they weigh each microbatch by its scored
  tokens, like the cross entropy."""
  aux = jnp.sum(total * (config.load_balance_loss_weight * means["moe_lb_loss"]
                         + config.router_z_loss_weight * means["moe_z_loss"]))
  return aux, {"moe_aux_loss": jax.lax.stop_gradient(aux),
               **{name: jnp.sum(total * jax.lax.stop_gradient(value)) for name, value in means.items()}}


def batch_sums(model, config, params, batch, train=True):
  """Sums over the batch's scored tokens: (loss incl. z-loss and the MoE router's losses,
  {weights, z_loss, correct}, and for MoE models moe_aux_loss (the router's share of the loss)
  and the router's statistics, each times the scored tokens; with routed_bias, expert_load, each
  MoE layer's copies per expert (moe.update_routed_bias's loads)), from the whole logits or, with
  num_vocab_tiling > 1, tile by tile. Under load-balanced context parallelism the batch is
  reordered first, targets with their tokens: sums are unchanged.

  With mtp_num_layers D > 0, mtp_loss is the mean over the D layers of their cross entropies
  (each a mean over its scored tokens), and mtp_loss_{k} each one's where D > 1, times the
  scored tokens; the loss adds mtp_loss_scaling_factor times mtp_loss when `train` (evaluation
  reports the main loss)."""
  batch = context_parallel.load_balance(config, batch)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  (hidden, kernel, mtp_hidden), state = model.apply({"params": params}, *inputs, return_hidden=True,
                                                    mutable="intermediates")
  loss, sums = _scored_sums(config, hidden, kernel, batch)
  total = sums["weights"]
  intermediates = state.get("intermediates", {})
  if config.pipeline_stages > 1 and config.moe:
    # Each pipeline microbatch's statistics, as gradient accumulation's microbatches have theirs.
    stats = intermediates["decoder"][decoders.PIPELINE_STATS][0]
    router = {name: jnp.mean(stats[name], axis=1) for name in moe.AUX_NAMES}
    scored = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    totals = jnp.sum(pipeline.microbatches(scored, config.num_pipeline_microbatches), axis=(1, 2))
  else:
    router, totals = moe.aux_means(intermediates), total
  if router:
    aux, router_sums = _router_sums(config, router, totals)
    loss = loss + aux
    sums.update(router_sums)
  if mtp_hidden:
    # Like the router's losses: a mean per layer over its tokens, as a sum weighing the
    # microbatch by its scored tokens.
    means = []
    for k, h in enumerate(mtp_hidden, 1):
      mtp_weight = mtp_weights(batch, k)
      cross_entropy = _head_sums(config, h, kernel, shifted(batch["targets"], k), mtp_weight, 0.0)[0]
      means.append(cross_entropy / jnp.maximum(jnp.sum(mtp_weight), 1.0))
    mtp_loss = total * sum(means) / len(means)
    if train:
      loss = loss + config.mtp_loss_scaling_factor * mtp_loss
    sums["mtp_loss"] = jax.lax.stop_gradient(mtp_loss)
    if len(means) > 1:
      sums.update({f"mtp_loss_{k}": total * jax.lax.stop_gradient(m) for k, m in enumerate(means, 1)})
  if config.routed_bias:
    loads = {"decoder": decoders.expert_loads(config, state["intermediates"])}
    if config.mtp_num_layers:
      loads["mtp"] = multi_token_prediction.expert_loads(config, state["intermediates"])
    sums[moe.EXPERT_LOAD] = jax.lax.stop_gradient(loads)
  return loss, sums


def _per_token(loss, sums):
  """Token-weighted means, the same however the tokens were split into microbatches."""
  total = jnp.maximum(sums["weights"], 1.0)
  router = {name: sums[name] / total for name in sums if name.startswith(("moe_", "mtp_"))}
  return {"loss": loss / total, "z_loss": sums["z_loss"] / total, "accuracy": sums["correct"] / total,
          "total_weights": sums["weights"], **router}


def one_f_one_b(model, config, params, batch):
  """((loss, sums), gradient of the loss) as value_and_grad of batch_sums gives them, from the
  1F1B pipeline (pipeline_schedule=1f1b): the stack's layers in stages, the embedding and the
  head, its final norm and the loss of each microbatch inside the loop."""
  batch = context_parallel.load_balance(config, batch)
  *before, stack = decoders.stacks(config)
  rest = {**params, "decoder": {k: v for k, v in params["decoder"].items() if k != stack.name}}

  def embed(rest, microbatch):
    """The first stage's input: the embedding, then the layers before the stages."""
    x = model.apply({"params": rest}, microbatch["inputs"], method="embed")
    for dense in before:
      x = decoders.apply_stack(config, dense, rest["decoder"][dense.name], x, microbatch["inputs_position"],
                               microbatch["inputs_segmentation"])
    return x

  def head_sums(rest, y, microbatch):
    hidden = rms_norm_with(config, rest["decoder"]["decoder_norm"]["scale"], y)
    return _scored_sums(config, hidden, model.apply({"params": rest}, method="output_kernel"), microbatch)

  def router(microbatch, stats):
    """A stage's share of batch_sums' router terms: its layers' statistics over all the layers."""
    if not stats:
      return jnp.zeros(()), {}
    total = jnp.sum(microbatch["targets_segmentation"] != 0).astype(jnp.float32)
    return _router_sums(config, {name: jnp.sum(stats[name]) / stack.moe_layers() for name in moe.AUX_NAMES}, total)

  (loss, sums), (layer_grads, grads), stats = pipeline.gradients(
      config, decoders.pipeline_stage(config, stack), params["decoder"][stack.name], rest, embed, head_sums, batch,
      router)
  grads["decoder"] = {**grads["decoder"], stack.name: layer_grads}
  if config.routed_bias:
    sums[moe.EXPERT_LOAD] = {"decoder": {stack.name: decoders.stored_loads(stack, stats[moe.EXPERT_LOAD])}}
  return (loss, sums), grads


def gradients(model, config, params, batch):
  """((loss sum, sums), gradient of the loss per scored token) of the global batch, summed over
  its gradient_accumulation_steps microbatches."""
  if config.pipeline_stages > 1 and config.pipeline_schedule == "1f1b":
    grad_fn = functools.partial(one_f_one_b, model, config)
  else:
    grad_fn = jax.value_and_grad(functools.partial(batch_sums, model, config), has_aux=True)
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
  return (loss, sums), jax.tree.map(lambda g: g / jnp.maximum(sums["weights"], 1.0), grads)


def _apply(config, state, grads, loads):
  """The optimizer's update, then (routed_bias) the routers' biases moved by the step's load."""
  state = state.apply_gradients(grads=grads)
  if loads is None:
    return state
  return state.replace(params=moe.update_routed_bias(state.params, loads, config.routed_bias_update_rate))


def train_step(model, config, state, batch):
  """One optimizer step on the global batch (gradient_accumulation_steps microbatches)."""
  (loss, sums), grads = gradients(model, config, state.params, batch)
  loads = sums.pop(moe.EXPERT_LOAD, None)
  step_metrics = {f"learning/{k}": v for k, v in _per_token(loss, sums).items()}
  step_metrics["learning/grad_norm"] = optax.tree.norm(grads)
  step_metrics["learning/current_learning_rate"] = optimizers.learning_rate_schedule(config)(state.step)
  # A non-finite loss or gradient leaves parameters and optimizer state as they were (the step
  # still counts), so divergence never reaches the state; the host stops after a streak of them.
  finite = jnp.isfinite(loss) & jnp.isfinite(step_metrics["learning/grad_norm"])
  step_metrics["learning/nonfinite"] = 1.0 - finite.astype(jnp.float32)
  # A cond, not a select: a select would hold the new and the old state at once.
  state = jax.lax.cond(finite, lambda s: _apply(config, s, grads, loads), lambda s: s.replace(step=s.step + 1),
                       state)
  return state, step_metrics


def eval_step(model, config, params, batch):
  """Loss sums of one batch without gradients; the caller sums batches then divides."""
  loss, sums = batch_sums(model, config, params, batch, train=False)
  sums.pop(moe.EXPERT_LOAD, None)
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
