"""The training objective, assembled once for every schedule: the model's loss on a batch and its
sums over the batch's scored tokens (Sums), for the plain step, gradient accumulation, GPipe's
stages (run inside the model) and the 1F1B loop. `assemble` adds the head's cross entropy (from
the whole logits or vocabulary tiles) and z-loss, the further predictions' term, and every Term
the layers sowed (layers/terms.py); what the model's updates after the optimizer's need
(models.updates) rides along.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from MaxText import head, losses
from MaxText.layers import context_parallel, decoders, models, multi_token_prediction, pipeline, terms
from MaxText.layers.normalizations import rms_norm_with


class Sums(NamedTuple):
  """A batch's sums over its scored tokens, which microbatches, stages and batches add up."""

  weights: jax.Array  # the scored tokens
  z_loss: jax.Array
  correct: jax.Array  # scored tokens whose target has the largest logit
  metrics: dict  # {name: what the terms report (terms.Term.metrics), times the scored tokens}
  updates: Any  # what models.update_parameters needs, summed (None: nothing)


def head_sums(config, hidden, kernel, targets, weights, z_loss_multiplier):
  """[loss, z_loss, correct] summed over the scored tokens of the head's logits from hidden
  states, from the whole logits or, with num_vocab_tiling > 1, tile by tile."""
  if config.num_vocab_tiling > 1:
    return losses.tiled_token_sums(hidden, kernel, targets, weights, config.num_vocab_tiling, z_loss_multiplier,
                                   config.vocab_tiling_mode, config.final_logits_soft_cap)
  return losses.token_sums(head.logits(hidden, kernel, config.final_logits_soft_cap), targets, weights,
                           z_loss_multiplier)


def _scored(batch):
  return (batch["targets_segmentation"] != 0).astype(jnp.float32)


def _add(metrics, more):
  return {k: metrics.get(k, 0.0) + more.get(k, 0.0) for k in {**metrics, **more}}


def _following(model, config, params, y, batch, kernel) -> tuple:
  """(loss, metrics, updates) of what follows the stack besides the head on one (micro)batch from
  the stack's output y: the further predictions' term (multi-token prediction's, through the
  model's head) and the Terms their layers sow, weighed by the batch's scored tokens."""
  predictions, sown = model.apply({"params": params}, y, *_forward_inputs(batch), method="predict",
                                  mutable=["intermediates", terms.TERMS])
  tokens = jnp.sum(_scored(batch))
  loss, metrics = terms.sums(sown.get(terms.TERMS, {}), tokens)
  if predictions:
    cross_entropy = lambda h, targets, w: head_sums(config, h, kernel, targets, w, 0.0)[0]
    more, reported = terms.sums(multi_token_prediction.term(config, predictions, batch, cross_entropy), tokens)
    loss, metrics = loss + more, _add(metrics, reported)
  return loss, metrics, models.updates(config, sown.get("intermediates", {}))


def assemble(config, batch, hidden, kernel, sown, following, train: bool, microbatches: int):
  """(loss, Sums) of a batch from the model's final-normed hidden states [B, T, D], its head's
  kernel, what its decoder's layers sowed ({terms.TERMS, "intermediates"}) and `following`'s
  (loss, metrics, updates). The training loss adds the terms' losses; evaluation's (`train`
  False) is the cross entropy and z-loss. With `microbatches` M > 1 the batch ran through
  pipeline stages as M microbatches, whose layers' terms weigh by each one's scored tokens."""
  weights = _scored(batch)
  tokens = jnp.sum(weights)
  loss, z_loss, correct = head_sums(config, hidden, kernel, batch["targets"], weights, config.z_loss_multiplier)
  per_microbatch = jnp.sum(pipeline.microbatches(weights, microbatches), axis=(1, 2))
  aux, metrics = terms.sums(sown.get(terms.TERMS, {}), tokens, per_microbatch)
  more, reported, updates = following
  if train:
    loss = loss + aux + more
  updates = _merge(models.updates(config, sown.get("intermediates", {})), updates)
  return loss, Sums(tokens, z_loss, correct, *jax.lax.stop_gradient((_add(metrics, reported), updates)))


def _merge(updates, more):
  """Two parts' models.updates (each None without any)."""
  return None if updates is None else {**updates, **more}


def _forward_inputs(batch):
  return batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]


def batch_sums(model, config, params, batch, train=True):
  """(loss, Sums) of the model on the batch: the plain step's, gradient accumulation's and
  GPipe's (whose stages run inside the model; what follows them runs on each microbatch, as on
  1F1B's last stage). Under load-balanced context parallelism the batch is reordered first,
  targets with their tokens: sums are unchanged."""
  batch = context_parallel.load_balance(config, batch)
  (hidden, kernel, pre_norm), sown = model.apply({"params": params}, *_forward_inputs(batch), return_hidden=True,
                                                 mutable=["intermediates", terms.TERMS])
  microbatches = config.num_pipeline_microbatches if config.pipeline_stages > 1 else 1
  follow = lambda part: _following(model, config, params, *part, kernel)
  if microbatches == 1:
    following = follow((pre_norm, batch))
  else:  # each microbatch's, summed: one compiled body however many there are
    split = pipeline.microbatches((pre_norm, batch), microbatches)
    zero = jax.tree.map(jnp.zeros_like, jax.eval_shape(follow, jax.tree.map(lambda a: a[0], split)))
    following = jax.lax.scan(lambda total, part: (jax.tree.map(jnp.add, total, follow(part)), None), zero, split)[0]
  return assemble(config, batch, hidden, kernel, sown, following, train, microbatches)


def one_f_one_b(model, config, params, batch):
  """((loss, Sums), gradient of the loss) as value_and_grad of batch_sums gives them, from the
  1F1B pipeline (pipeline_schedule=1f1b): the stack's layers in stages, the embedding before
  them, and on the last stage what follows them (the final norm, multi-token prediction, and the
  assembly of each microbatch's loss) inside the loop."""
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

  def after(rest, y, microbatch):
    hidden = rms_norm_with(config, rest["decoder"]["decoder_norm"]["scale"], y)
    kernel = model.apply({"params": rest}, method="output_kernel")
    following = _following(model, config, rest, y, microbatch, kernel)
    return assemble(config, microbatch, hidden, kernel, {}, following, True, 1)

  def report(microbatch, reported):
    """A stage's share of the terms: its layers' Term, weighed by the microbatch's scored tokens."""
    return terms.sums(reported[terms.TERMS], jnp.sum(_scored(microbatch)))

  (loss, sums, metrics), (layer_grads, grads), staged = pipeline.gradients(
      config, decoders.pipeline_stage(config, stack), params["decoder"][stack.name], rest, embed, after, batch, report)
  grads["decoder"] = {**grads["decoder"], stack.name: layer_grads}
  sums = sums._replace(metrics=_add(sums.metrics, jax.lax.stop_gradient(metrics)),
                       updates=_merge(sums.updates, models.updates(config, {}, staged)))
  return (loss, sums), grads
