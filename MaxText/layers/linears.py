"""Projections and the gated MLP (SwiGLU, GeGLU)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# mlp_activation -> the gate's nonlinearity: SwiGLU (Llama, Qwen) or GeGLU with tanh GELU (Gemma)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def kernel_init(num_in_axes: int, in_last: bool = False):
  """Truncated normal with std 1/sqrt(fan_in), fan_in = product of the num_in_axes input dims:
  the first ones, or the last ones with in_last."""

  def init(key, shape, dtype):
    axes = tuple(range(len(shape)))
    if in_last:
      inputs, outputs = axes[-num_in_axes:], axes[:-num_in_axes]
    else:
      inputs, outputs = axes[:num_in_axes], axes[num_in_axes:]
    return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=inputs,
                                            out_axis=outputs)(key, shape, dtype)

  return init


def _bfloat16_bits(x):
  """float32 -> bfloat16 rounded to nearest even, as integer arithmetic on the bits."""
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  rounded = bits + (jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1)))
  rounded = jnp.where(jnp.isnan(x), bits | jnp.uint32(0x400000), rounded)  # a NaN stays a (quiet) NaN
  return jax.lax.bitcast_convert_type((rounded >> 16).astype(jnp.uint16), jnp.bfloat16)


@jax.custom_vjp
def _float32_to_bfloat16(x):
  return _bfloat16_bits(x)


_float32_to_bfloat16.defvjp(lambda x: (_bfloat16_bits(x), None), lambda _, g: (g.astype(jnp.float32),))


def weights_as(kernel, dtype):
  """kernel.astype(dtype), bit for bit, gradient included. From float32 to bfloat16 the cast
  is integer arithmetic that XLA does not take for a convert: it hoists a convert of a scanned
  layer's kernel out of the layer loop, which keeps a bfloat16 copy of every layer's weights
  through the forward (llama3-8b at 8192 tokens on a v5p-64, full: 11.24 GiB per chip with
  astype, 10.83 with this). MoE experts use it where FSDP shards the experts, not D (moe.py)."""
  if kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
    return _float32_to_bfloat16(kernel)
  return kernel.astype(dtype)


def kernel_run(kernel, axis, shards, runs, k, dtype):
  """The k-th of `runs` runs of each of `shards` equal shards of kernel's `axis`, joined in shard
  order and cast (weights_as): a slice of the units (hidden units, heads) on that axis in which
  every tensor shard keeps its own, indexed in place, with no transposed copy of the kernel."""
  split = kernel.reshape(*kernel.shape[:axis], shards, runs, -1, *kernel.shape[axis + 1:])
  run = jax.lax.dynamic_index_in_dim(split, k, axis=axis + 1, keepdims=False)
  return weights_as(run.reshape(*kernel.shape[:axis], -1, *kernel.shape[axis + 1:]), dtype)


class DenseGeneral(nn.Module):
  """x contracted over its trailing `num_in_axes` dims with a kernel [*in, *features], or
  [*features, *in] with in_last, no bias.

  (flax's own DenseGeneral initialises a flattened 2-D kernel, which cannot carry the
  per-dimension logical axis names that sharding needs.)
  """

  features: tuple
  kernel_axes: tuple
  dtype: jnp.dtype
  weight_dtype: jnp.dtype
  num_in_axes: int = 1
  in_last: bool = False

  @nn.compact
  def __call__(self, x):
    n, features = self.num_in_axes, tuple(self.features)
    shape = features + x.shape[-n:] if self.in_last else x.shape[-n:] + features
    kernel = self.param("kernel", nn.with_logical_partitioning(kernel_init(n, self.in_last), self.kernel_axes),
                        shape, self.weight_dtype)
    kernel_in = range(len(features), len(shape)) if self.in_last else range(n)
    contract = (tuple(range(x.ndim - n, x.ndim)), tuple(kernel_in))
    return jax.lax.dot_general(x.astype(self.dtype), weights_as(kernel, self.dtype), (contract, ((), ())))


def dense(features, kernel_axes, config, name, num_in_axes=1, in_last=False):
  features = features if isinstance(features, tuple) else (features,)
  return DenseGeneral(features, kernel_axes, jnp.dtype(config.dtype), jnp.dtype(config.weight_dtype),
                      num_in_axes, in_last, name=name)


class MlpBlock(nn.Module):
  """wo(act(wi_0 x) * wi_1 x), act from mlp_activation."""

  config: object

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    gate = checkpoint_name(dense(cfg.base_mlp_dim, ("embed", "mlp"), cfg, "wi_0")(x), "mlpwi_0")
    up = checkpoint_name(dense(cfg.base_mlp_dim, ("embed", "mlp"), cfg, "wi_1")(x), "mlpwi_1")
    h = nn.with_logical_constraint(ACTIVATIONS[cfg.mlp_activation](gate) * up,
                                   ("activation_batch", "activation_length", "activation_mlp"))
    out = dense(cfg.base_emb_dim, ("embed", "mlp"), cfg, "wo", in_last=True)(h)
    return checkpoint_name(out, "mlpwo")
