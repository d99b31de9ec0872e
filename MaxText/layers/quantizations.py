"""Low-precision matmuls (quantization=int8|fp8|fp8_full, MaxText's names) through qwix's
quantized training: every weight matmul of the layers goes through linears.matmul (grouped ones
through `ragged_dot`), and where a recipe is set its operands are quantized with per-channel
absmax scales (each output feature of the weight, each row of the activations), the product taken
in that type, and in the backward both products (the activations' gradient and the weight's) are
quantized too (qwix's dot_general_qt and ragged_dot_qt, custom VJPs). Master weights, optimizer
state and checkpoints stay as they are: only the matmuls change. The router, the head and the
attention's scores stay in the activation dtype, and so do the layers quantization_skip_layers
names (in_layer).
"""

import contextlib
import contextvars
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from MaxText import sharding


class Recipe(NamedTuple):
  """The types a recipe quantizes to: the forward's operands, the backward's incoming gradient."""

  forward: jnp.dtype
  backward: jnp.dtype


# quantization= -> its Recipe; "" none. int8 and fp8 quantize the backward in the forward's type;
# fp8_full takes e5m2, fp8 with a wider range, for the gradients (MaxText's, through qwix).
QUANTIZATIONS = {"": None, "int8": Recipe(jnp.int8, jnp.int8), "fp8": Recipe(jnp.float8_e4m3fn, jnp.float8_e4m3fn),
                 "fp8_full": Recipe(jnp.float8_e4m3fn, jnp.float8_e5m2)}


# Whether the decoder layer being traced quantizes its matmuls: True, or a traced flag where
# quantization_skip_layers keeps some layers in full precision and the layer index is traced (a scan).
_LAYER_QUANTIZED = contextvars.ContextVar("layer_quantized", default=True)


@contextlib.contextmanager
def in_layer(cfg, layer_index):
  """The matmuls traced inside are decoder layer `layer_index`'s (a Python int, or traced in a
  scan): unquantized where quantization_skip_layers names it."""
  skip = [i % cfg.base_num_decoder_layers for i in cfg.quantization_skip_layers]
  if isinstance(layer_index, int):
    quantized = layer_index not in skip
  else:
    quantized = jnp.all(layer_index != jnp.asarray(skip, jnp.int32)) if skip else True
  token = _LAYER_QUANTIZED.set(quantized)
  try:
    yield
  finally:
    _LAYER_QUANTIZED.reset(token)


def _per_layer(quantized, plain, *operands):
  """quantized(*operands), or plain(...) in a layer quantization_skip_layers names: picked by
  lax.cond where the layer is traced (both compiled, one run)."""
  on = _LAYER_QUANTIZED.get()
  if on is True:
    return quantized(*operands)
  if on is False:
    return plain(*operands)
  return jax.lax.cond(on, quantized, plain, *operands)


def local_shard_count(cfg) -> int:
  """quantization_local_shard_count, its default (-1) the devices of one host."""
  return cfg.quantization_local_shard_count if cfg.quantization_local_shard_count > 0 else jax.local_device_count()


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _per_shard(x, w, groups, product):
  """product(x, w, groups), one of qwix's quantized products (a custom VJP; groups: the experts'
  group sizes or None), whose backward may run inside a shard_map: there qwix returns the weight's
  cotangent varying over the axes that shard the tokens, where JAX's own transpose would sum it;
  this sums it (sharding.as_cotangent_of)."""
  return product(x, w, groups)


def _per_shard_fwd(x, w, groups, product):
  # Both operands marked varying over every manual axis either does (a type, not a copy), as the
  # cotangents qwix returns are; the empty slices keep the operands' own types for the backward.
  varying = lambda y: jax.typeof(y).manual_axis_type.varying
  both = varying(x) | varying(w)
  widen = lambda y: jax.lax.pcast(y, tuple(sorted(both - varying(y))), to="varying") if both - varying(y) else y
  out, vjp = jax.vjp(lambda x, w: product(x, w, groups), widen(x), widen(w))
  return out, (vjp, x.reshape(-1)[:0], w.reshape(-1)[:0])


def _per_shard_bwd(product, residuals, g):
  vjp, x, w = residuals
  d_x, d_w = vjp(g)
  return sharding.as_cotangent_of(d_x, x), sharding.as_cotangent_of(d_w, w), None


_per_shard.defvjp(_per_shard_fwd, _per_shard_bwd)


def _qwix():
  """qwix's quantized products, imported by the first quantized matmul: qwix brings flax.nnx,
  which every command's start would otherwise import for nothing."""
  from qwix._src.core import dot_general_qt, ragged_dot_qt  # noqa: PLC0415
  return dot_general_qt, ragged_dot_qt


def _quantized_dot(x, w, groups, dims, config):
  del groups
  return _qwix()[0].dot_general_qt(x, w, dims, config)


def _quantized_ragged_dot(rows, kernels, group_sizes, config):
  return _qwix()[1].ragged_dot_qt(rows, kernels, group_sizes, config)


def dot_general(cfg, x, w, dims, out_dtype):
  """x (activations) contracted with w (a weight) by dot_general's dimension numbers `dims`,
  quantized as cfg.quantization says, in out_dtype (None: x's)."""
  recipe = QUANTIZATIONS[cfg.quantization]
  plain = lambda x, w: jax.lax.dot_general(x, w, dims, preferred_element_type=out_dtype)
  if recipe is None:
    return plain(x, w)
  # The weight's gradient contracts over the tokens, which the data-like axes shard: one scale
  # per local shard's tokens (MaxText's quantization_local_shard_count) keeps its tiles local.
  config = _qwix()[0].DotGeneralQtConfig(
      lhs_qtype=recipe.forward, rhs_qtype=recipe.forward, dlhs_grad_qtype=recipe.backward,
      drhs_grad_qtype=recipe.backward, drhs_tile_size=1 / local_shard_count(cfg))
  quantized = lambda x, w: _per_shard(x, w, None, functools.partial(_quantized_dot, dims=dims, config=config)).astype(
      out_dtype or x.dtype)
  return _per_layer(quantized, lambda x, w: plain(x, w).astype(out_dtype or x.dtype), x, w)


def ragged_dot(cfg, rows, w, group_sizes, w_in_axis: int, out_dtype, plain):
  """rows [M, K] grouped by expert times each expert's kernel of w [E, ., .], whose input is axis
  w_in_axis, quantized as cfg.quantization says; without a recipe `plain(rows, w, group_sizes,
  dims, preferred_element_type)` (the platform's grouped matmul)."""
  recipe = QUANTIZATIONS[cfg.quantization]
  dims = jax.lax.RaggedDotDimensionNumbers((([1], [w_in_axis]), ([], [])), lhs_ragged_dimensions=[0],
                                           rhs_group_dimensions=[0])
  unquantized = lambda rows, w: plain(rows, w, group_sizes, dims, preferred_element_type=out_dtype).astype(
      out_dtype or rows.dtype)
  if recipe is None:
    return unquantized(rows, w)
  config = _qwix()[1].RaggedDotQtConfig(lhs_qtype=recipe.forward, rhs_qtype=recipe.forward,
                                           dlhs_grad_qtype=recipe.backward, drhs_grad_qtype=recipe.backward)
  # qwix's quantized grouped matmul takes the kernels [E, in, out].
  quantized = lambda rows, w: _per_shard(
      rows, w if w_in_axis == 1 else jnp.swapaxes(w, 1, 2), group_sizes,
      functools.partial(_quantized_ragged_dot, config=config)).astype(out_dtype or rows.dtype)
  return _per_layer(quantized, unquantized, rows, w)
