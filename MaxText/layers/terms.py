"""Auxiliary terms: what a layer adds to the training objective besides the head's cross entropy,
and what it reports beside the loss, in one typed structure (Term) that layers sow and the
objective (MaxText.objective) adds up for every schedule. A new term (a router's losses, an
indexer's) is a Term its layer sows: the train step, the pipelines and the metrics read it
without naming it.

A Term holds per-token means over the tokens of the batch its layer ran on. The model's term is
the sum over the sown instances of `share` times each (1 / the MoE layers for the router's
losses, a mean over layers), and as a sum over the batch's scored tokens each (micro)batch
weighs by its scored tokens, like the cross entropy: gradient accumulation, the pipelines'
microbatches and one whole batch train the same objective.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

# The collection layers sow their Terms into.
TERMS = "terms"
# Under this key of TERMS a pipelined stack sows its stages' Term with a leading microbatch axis
# [M, ...]: each microbatch's weighs by its own scored tokens.
PER_MICROBATCH = "per_microbatch"


class Term(NamedTuple):
  """One instance's term: per-token means over the tokens of the batch it ran on."""

  loss: jax.Array  # [] added to the training loss, its weight applied
  metrics: dict  # {name: []} reported (learning/<name>, eval/<name>)
  share: jax.Array  # [] this instance's share of the model's term


def sow(module, loss, metrics: dict, share: float = 1.0) -> None:
  """A Term from `module` (a linen module, inside its call)."""
  module.sow(TERMS, "term", Term(jnp.asarray(loss, jnp.float32),
                                 {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()},
                                 jnp.asarray(share, jnp.float32)))


def _terms(sown) -> list:
  """[(sown under PER_MICROBATCH, Term)] of a TERMS collection; a scan's Terms are stacked."""
  found = jax.tree_util.tree_flatten_with_path(sown, is_leaf=lambda x: isinstance(x, Term))[0]
  return [(any(getattr(key, "key", None) == PER_MICROBATCH for key in path), term) for path, term in found]


def collect(sown) -> Term:
  """The sum over a collection's Terms of share times each (one Term of share 1; zero where
  nothing was sown): a pipeline stage's, which its microbatch's tokens then weigh."""
  loss, metrics = sums(sown, 1.0)
  return Term(loss, metrics, jnp.ones((), jnp.float32))


def sums(sown, tokens, microbatch_tokens=None) -> tuple:
  """(loss, {name: metric}) summed over the scored tokens: every Term of a TERMS collection times
  its share and the scored tokens of its batch, `tokens` or, under PER_MICROBATCH, each
  microbatch's `microbatch_tokens` [M]."""
  loss, metrics = jnp.zeros((), jnp.float32), {}
  for per_microbatch, term in _terms(sown):
    weight = tokens
    if per_microbatch:
      weight = microbatch_tokens.reshape(-1, *(1,) * (term.loss.ndim - 1))
    weigh = lambda x, weight=weight, term=term: jnp.sum(weight * term.share * x)
    loss = loss + weigh(term.loss)
    for k, v in term.metrics.items():
      metrics[k] = metrics.get(k, 0.0) + weigh(v)
  return loss, metrics
