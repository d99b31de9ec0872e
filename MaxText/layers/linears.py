"""Projections, the gated MLP (SwiGLU, GeGLU), and a layer's output as a sum over slices of its
units (mlp_chunks, attention_head_chunks): the MLP and the attention are each written once, over
the k-th slice of their kernels, the unsliced layer being the one slice. `matmul` is the one
seam every weight matmul of the layers goes through (quantization: layers/quantizations.py)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat, sharding
from MaxText.layers import quantizations

BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")

# mlp_activation -> the gate's nonlinearity: SwiGLU (Llama, Qwen), GeGLU with tanh GELU (Gemma),
# or x sigmoid(1.702 x) (GPT-OSS's, the sigmoid approximation of GELU)
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x)}


@functools.cache
def _dot_dims(spec: str):
  """An einsum "x,w->out" of two operands without repeated letters, as (dot_general's dimension
  numbers, the permutation of dot_general's output (batch, x's free, w's free axes) into out)."""
  inputs, out = spec.split("->")
  x, w = inputs.split(",")
  batch = [c for c in x if c in w and c in out]
  contract = [c for c in x if c in w and c not in out]
  result = batch + [c for c in x if c not in w] + [c for c in w if c not in x]
  dims = (([x.index(c) for c in contract], [w.index(c) for c in contract]),
          ([x.index(c) for c in batch], [w.index(c) for c in batch]))
  return dims, tuple(result.index(c) for c in out)


def matmul(cfg, spec: str, x, w, out_dtype=None):
  """jnp.einsum(spec, x, w) of activations x and a weight w (cast to the compute dtype), the
  result in out_dtype (None: x's): the seam of every weight matmul of the layers, quantized as
  cfg.quantization says."""
  dims, order = _dot_dims(spec)
  out = quantizations.dot_general(cfg, x, w, dims, out_dtype)
  return out if order == tuple(range(out.ndim)) else jnp.transpose(out, order)


def gated(cfg, gate, up):
  """The gated unit act(gate) * up; with mlp_activations_limit > 0 GPT-OSS's: the gate clamped
  above at the limit, the up projection within +-limit and plus one."""
  act, limit = ACTIVATIONS[cfg.mlp_activation], cfg.mlp_activations_limit
  if limit > 0:
    return act(jnp.minimum(gate, limit)) * (jnp.clip(up, -limit, limit) + 1)
  return act(gate) * up


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
  through the forward; this cast stays in the loop, one layer's copy at a time. MoE experts use
  it where FSDP shards the experts, not D (moe.py)."""
  if kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:
    return _float32_to_bfloat16(kernel)
  return kernel.astype(dtype)


def kernel_run(kernel, axis, shards, runs, k, dtype):
  """The k-th of `runs` runs of each of `shards` equal shards of kernel's `axis`, joined in shard
  order and cast (weights_as): a slice of the units (hidden units, heads) on that axis in which
  every tensor shard keeps its own, indexed in place, with no transposed copy of the kernel. One
  run is the kernel, cast."""
  if runs == 1:
    return weights_as(kernel, dtype)
  split = kernel.reshape(*kernel.shape[:axis], shards, runs, -1, *kernel.shape[axis + 1:])
  run = jax.lax.dynamic_index_in_dim(split, k, axis=axis + 1, keepdims=False)
  return weights_as(run.reshape(*kernel.shape[:axis], -1, *kernel.shape[axis + 1:]), dtype)


def sum_of_slices(cfg, x, chunks: int, out_of_slice, logical_axes=BATCH_LENGTH_EMBED, keep: tuple = ()):
  """A layer's output on x [B, T, D] (any shape, whose logical_axes are given; None inside a
  shard_map) as the sum over its `chunks` slices of out_of_slice(x in cfg.dtype, k, the output's
  dtype), which has x's shape. One chunk: slice 0 alone, the layer whole. More: one slice at a
  time in a scan, each checkpointed, so forward and backward hold one slice's intermediates
  (and the tensors named in `keep`, each slice's) and, under FSDP, one slice of each gathered
  kernel; the units of a slice act independently until the output projection sums over them,
  so the sum is the whole layer's up to its order, taken in float32."""
  dtype = jnp.dtype(cfg.dtype)
  if chunks == 1:
    return out_of_slice(x.astype(dtype), 0, dtype)

  def add_slice(total, k):
    return total + out_of_slice(x.astype(dtype), k, jnp.float32), None

  # Closed over in float32, cast per slice: the backward's scan then sums the slices' input
  # gradients in float32, not bfloat16 (whose sum over 64 MLP slices had 1.8x the untiled
  # MLP's error).
  x = x.astype(jnp.float32)
  total = jnp.zeros(x.shape, jnp.float32)
  if logical_axes:
    total = nn.with_logical_constraint(total, logical_axes)
  else:  # in a shard_map: the loop's sum varies over the manual axes a slice's output does
    varying = jax.eval_shape(lambda: out_of_slice(x.astype(dtype), 0, jnp.float32)).manual_axis_type.varying
    total = jax.lax.pcast(total, tuple(sorted(varying)), to="varying") if varying else total
  # Each slice keeps what remat_policy keeps of its named tensors (nothing under `none`, which
  # checkpoints no layer) and its attention kernel's residuals, the rest recomputed; inside a
  # loop, as in decoders.layer_class.
  policy = remat.checkpoint_policy(cfg, keep=(remat.KERNEL_RESIDUALS, *keep))
  add_slice = jax.checkpoint(add_slice, policy=policy, prevent_cse=False)
  total, _ = jax.lax.scan(add_slice, total, jnp.arange(chunks))
  return total.astype(dtype)


def _kernel_param(module, shape, axes, weight_dtype, num_in_axes, in_last):
  return module.param("kernel", nn.with_logical_partitioning(kernel_init(num_in_axes, in_last), axes), shape,
                      weight_dtype)


class Kernel(nn.Module):
  """A projection's kernel [*in, *out], or [*out, *in] with in_last, as the parameter `kernel`
  under this module's name: for layers that contract it themselves, a slice at a time. With
  `bias`, (kernel, bias [*out] beside it, zeros at first)."""

  shape: tuple
  axes: tuple
  weight_dtype: jnp.dtype
  num_in_axes: int = 1
  in_last: bool = False
  bias: bool = False

  @nn.compact
  def __call__(self):
    kernel = _kernel_param(self, self.shape, self.axes, self.weight_dtype, self.num_in_axes, self.in_last)
    if not self.bias:
      return kernel
    out = slice(None, -self.num_in_axes) if self.in_last else slice(self.num_in_axes, None)
    init = nn.with_logical_partitioning(nn.initializers.zeros_init(), self.axes[out])
    return kernel, self.param("bias", init, self.shape[out], self.weight_dtype)


def kernel(cfg, name, shape, axes, num_in_axes=1, in_last=False, bias=False):
  return Kernel(shape, axes, jnp.dtype(cfg.weight_dtype), num_in_axes, in_last, bias, name=name)()


class DenseGeneral(nn.Module):
  """x contracted over its trailing `num_in_axes` dims with a kernel [*in, *features], no bias.

  (flax's own DenseGeneral initialises a flattened 2-D kernel, which cannot carry the
  per-dimension logical axis names that sharding needs.)
  """

  features: tuple
  kernel_axes: tuple
  dtype: jnp.dtype
  weight_dtype: jnp.dtype
  num_in_axes: int = 1

  @nn.compact
  def __call__(self, x):
    n = self.num_in_axes
    kernel = _kernel_param(self, x.shape[-n:] + tuple(self.features), self.kernel_axes, self.weight_dtype, n, False)
    contract = (tuple(range(x.ndim - n, x.ndim)), tuple(range(n)))
    return jax.lax.dot_general(x.astype(self.dtype), weights_as(kernel, self.dtype), (contract, ((), ())))


class MlpBlock(nn.Module):
  """wo(gated(wi_0 x, wi_1 x)), act from mlp_activation; wo is stored [D, mlp], as wi_0 and wi_1.
  With mlp_chunks > 1, in that many slices of its hidden units (sum_of_slices); slice k is the
  k-th run of every tensor shard's own units (kernel_run), so no unit moves between devices.
  `units` is its hidden width, base_mlp_dim where None (a MoE's shared experts set their own)."""

  config: object
  units: int | None = None

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dim, units = cfg.base_emb_dim, self.units or cfg.base_mlp_dim
    kernels = (kernel(cfg, "wi_0", (dim, units), ("embed", "mlp")), kernel(cfg, "wi_1", (dim, units), ("embed", "mlp")),
               kernel(cfg, "wo", (dim, units), ("embed", "mlp"), in_last=True))
    chunks = cfg.mlp_chunks
    shards = sharding.logical_shards(cfg.to_dict(), "mlp")

    def mlp_slice(x, k, out_dtype):
      wi_0, wi_1, wo = (kernel_run(w, 1, shards, chunks, k, jnp.dtype(cfg.dtype)) for w in kernels)
      gate = checkpoint_name(matmul(cfg, "btd,dm->btm", x, wi_0), "mlpwi_0")
      up = checkpoint_name(matmul(cfg, "btd,dm->btm", x, wi_1), "mlpwi_1")
      h = nn.with_logical_constraint(gated(cfg, gate, up), ("activation_batch", "activation_length", "activation_mlp"))
      return matmul(cfg, "btm,dm->btd", h, wo, out_dtype)

    # Named once whole: a policy that keeps the MLP's output keeps it, not a partial sum per slice.
    return checkpoint_name(sum_of_slices(cfg, x, chunks, mlp_slice), "mlpwo")
