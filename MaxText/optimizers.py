"""optax AdamW with linear warmup and cosine decay, after global-norm clipping."""

import optax


def learning_rate_schedule(config) -> optax.Schedule:
  steps = config.learning_rate_schedule_steps
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate,
      warmup_steps=int(config.warmup_steps_fraction * steps), decay_steps=steps,
      end_value=config.learning_rate * config.cosine_learning_rate_final_fraction)


def create_optimizer(config) -> optax.GradientTransformation:
  adamw = optax.adamw(learning_rate_schedule(config), b1=config.adam_b1, b2=config.adam_b2,
                      eps=config.adam_eps, weight_decay=config.adam_weight_decay)
  if config.gradient_clipping_threshold > 0:
    return optax.chain(optax.clip_by_global_norm(config.gradient_clipping_threshold), adamw)
  return adamw
