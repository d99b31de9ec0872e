"""RMSNorm."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
  """Root-mean-square normalisation with a learned per-feature scale (no bias, no centring).

  With plus_one (Gemma) the scale is 1 + w and w starts at 0, as Gemma's checkpoints store it.
  """

  epsilon: float
  dtype: jnp.dtype
  weight_dtype: jnp.dtype
  plus_one: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
    scale = self.param("scale", nn.with_logical_partitioning(init, ("norm",)), (x.shape[-1],), self.weight_dtype)
    # Statistics in float32 whatever the activation dtype: bfloat16 sums of squares drift.
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
    scale = scale.astype(jnp.float32)
    return (y * (scale + 1 if self.plus_one else scale)).astype(self.dtype)


def rms_norm(cfg, name: str) -> RMSNorm:
  return RMSNorm(cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype),
                 cfg.norm_plus_one, name=name)
