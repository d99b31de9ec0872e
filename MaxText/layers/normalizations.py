"""RMSNorm."""

import flax.linen as nn
import jax
import jax.numpy as jnp


class RMSNorm(nn.Module):
  """Root-mean-square normalisation with a learned per-feature scale (no bias, no centring)."""

  epsilon: float
  dtype: jnp.dtype
  weight_dtype: jnp.dtype

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],), self.weight_dtype)
    # Statistics in float32 whatever the activation dtype: bfloat16 sums of squares drift.
    x = x.astype(jnp.float32)
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
    return (y * scale.astype(jnp.float32)).astype(self.dtype)


def rms_norm(cfg, name: str) -> RMSNorm:
  return RMSNorm(cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype), name=name)
