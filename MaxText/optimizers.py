"""optax AdamW with linear warmup and cosine decay, after global-norm clipping."""

import jax
import optax

from MaxText.layers import moe


def learning_rate_schedule(config) -> optax.Schedule:
  steps = config.learning_rate_schedule_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=int(config.warmup_steps_fraction * steps), decay_steps=steps,
      end_value=config.learning_rate * config.cosine_learning_rate_final_fraction)


def _routed_biases(params):
  """True for the MoE routers' correction biases, which the train step moves by the experts'
  load instead of a gradient (moe.update_routed_bias)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: moe.is_routed_bias(path), params)


def create_optimizer(config) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                      eps=config.adam_eps, weight_decay=config.adam_weight_decay)
  if config.routed_bias:
    # Zeroing AdamW's update, weight decay included, leaves the optimizer state a tree of the
    # parameters' own structure (a multi_transform's would hold optax.MaskedNodes, which the
    # logical sharding rules read as partition specs).
    adamw = optax.chain(adamw, optax.masked(optax.set_to_zero(), _routed_biases))
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  return adamw
