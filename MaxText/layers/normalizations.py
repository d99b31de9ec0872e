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
    return normalize(x, _scale_param(self, x.shape[-1], self.weight_dtype, self.plus_one), self.epsilon,
                     self.plus_one, self.dtype)


def _scale_param(module, features, weight_dtype, plus_one):
  init = nn.initializers.zeros if plus_one else nn.initializers.ones
  return module.param("scale", nn.with_logical_partitioning(init, ("norm",)), (features,), weight_dtype)


class NormScale(nn.Module):
  """An RMSNorm's stored scale (the parameter `scale` under this module's name), for a layer that
  applies the norm itself, a slice of heads at a time (rms_norm_with)."""

  features: int
  weight_dtype: jnp.dtype
  plus_one: bool = False

  @nn.compact
  def __call__(self):
    return _scale_param(self, self.features, self.weight_dtype, self.plus_one)


def normalize(x, scale, epsilon, plus_one, dtype):
  """RMSNorm of x over its last axis with a stored `scale`, in `dtype`."""
  # Statistics in float32 whatever the activation dtype: bfloat16 sums of squares drift.
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + epsilon)
  scale = scale.astype(jnp.float32)
  return (y * (scale + 1 if plus_one else scale)).astype(dtype)


def rms_norm(cfg, name: str) -> RMSNorm:
  return RMSNorm(cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype),
                 cfg.norm_plus_one, name=name)


def norm_scale(cfg, name: str, features: int):
  return NormScale(features, jnp.dtype(cfg.weight_dtype), cfg.norm_plus_one, name=name)()


def rms_norm_with(cfg, scale, x):
  """rms_norm(cfg, ...) applied with its stored scale, outside a module."""
  return normalize(x, scale, cfg.normalization_layer_epsilon, cfg.norm_plus_one, jnp.dtype(cfg.dtype))
