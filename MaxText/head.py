"""The output head: float32 logits = soft_cap(hidden [B, T, D] @ kernel [D, V]), and the head
matmul's gradients. The model calls it for its logits; the vocabulary-tiled loss calls it one
tile of tokens at a time.

Under FSDP the logits and the kernel's gradient go one vocabulary chunk at a time (`_matmul`,
`_kernel_grad`), so no vocabulary-sized array is whole on a device.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText import sharding

HIDDEN = ("activation_batch", "activation_length", "activation_embed")
LOGITS = ("activation_batch", "activation_length", "activation_vocab")
KERNEL = ("embed", "vocab")


def soft_cap(logits, cap: float):
  """cap * tanh(logits / cap) (Gemma 2's final-logit soft cap); 0 leaves the logits as they are."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def _kernel_grad(hidden, d_logits):
  """sum over tokens of hidden^T d_logits: [D, V] in float32, laid out as the kernel.

  Under FSDP the tokens are sharded over the mesh axes that also shard the kernel's rows,
  so the plain contraction leaves every device a partial sum of the whole [D, V] matrix,
  the largest buffer of the loss (2 GiB at llama3-8b), before the partitioner reduces it.
  Here each device forms its partial one vocabulary chunk at a time and reduce-scatters
  that chunk at once: it never holds more than its own shard of the gradient plus one
  chunk of the same size. The sums are the same; only their order of reduction differs.
  """
  mesh = jax.sharding.get_abstract_mesh()
  batch, length, act_embed = sharding.mesh_axes(*HIDDEN)
  vocab = sharding.mesh_axes(*LOGITS)[2]
  rows, cols = sharding.mesh_axes(*KERNEL)
  tokens = batch + length
  shards = math.prod(mesh.shape[a] for a in rows) if not mesh.empty else 1
  if (shards == 1 or act_embed or cols != vocab or not set(rows) <= set(tokens) or set(vocab) & set(tokens)
      or hidden.shape[-1] % shards):
    # Nothing to gain (no sharded rows) or a layout this scheme does not cover.
    d_kernel = jnp.einsum("btd,btv->dv", hidden, d_logits, preferred_element_type=jnp.float32)
    return nn.with_logical_constraint(d_kernel, KERNEL)
  summed_only = tuple(a for a in tokens if a not in rows)  # e.g. `data`: parameters replicated there
  spec = lambda *axes: PartitionSpec(*(a or None for a in axes))

  def local(h, g):
    width = g.shape[-1]
    chunk = -(-width // shards)
    g = jnp.pad(g, [(0, 0), (0, 0), (0, chunk * shards - width)])

    def add_chunk(c, d_kernel):
      part = jnp.einsum("btd,btv->dv", h, jax.lax.dynamic_slice_in_dim(g, c * chunk, chunk, axis=2),
                        preferred_element_type=jnp.float32)
      part = jax.lax.psum_scatter(part, rows, scatter_dimension=0, tiled=True)
      return jax.lax.dynamic_update_slice_in_dim(d_kernel, part, c * chunk, axis=1)

    d_kernel = jax.lax.fori_loop(0, shards, add_chunk, jnp.zeros((h.shape[-1] // shards, chunk * shards), jnp.float32))
    d_kernel = d_kernel[:, :width]
    return jax.lax.psum(d_kernel, summed_only) if summed_only else d_kernel

  return jax.shard_map(local, in_specs=(spec(batch, length, ()), spec(batch, length, vocab)),
                       out_specs=spec(rows, cols), check_vma=False)(hidden, d_logits)


def _matmul(x, kernel, transpose: bool):
  """hidden [B, T, D] @ kernel [D, V] -> float32 logits [B, T, V], or with `transpose` the
  logits' gradient [B, T, V] @ kernel^T -> float32 [B, T, D].

  The kernel's rows are sharded (over the `embed` axes, FSDP's) and the tokens carry every
  feature, so the product needs whole kernel rows; gathering the kernel at once would put all
  of it, [D, V] (1 GiB in bfloat16 at llama3-8b), on every device. Here each device gathers its
  vocabulary columns one chunk (the size of its own shard) at a time, so no device holds more
  than its shard plus one chunk. The sums are the same; only their order may differ."""
  spec = "btv,dv->btd" if transpose else "btd,dv->btv"
  mesh = jax.sharding.get_abstract_mesh()
  batch, length, act_embed = sharding.mesh_axes(*HIDDEN)
  vocab = sharding.mesh_axes(*LOGITS)[2]
  rows, cols = sharding.mesh_axes(*KERNEL)
  shards = math.prod(mesh.shape[a] for a in rows) if not mesh.empty else 1
  if shards == 1 or act_embed or cols != vocab or set(vocab) & set(batch + length):
    return jnp.einsum(spec, x, kernel, preferred_element_type=jnp.float32)  # a layout this scheme does not cover
  spec_of = lambda *axes: PartitionSpec(*(a or None for a in axes))

  def local(x, k):
    width = k.shape[1]
    chunk = -(-width // shards)
    k = jnp.pad(k, [(0, 0), (0, chunk * shards - width)])
    gathered = lambda c: jax.lax.all_gather(jax.lax.dynamic_slice_in_dim(k, c * chunk, chunk, axis=1), rows,
                                            axis=0, tiled=True)  # [D, chunk]
    if not transpose:
      # Each chunk's logits written in place into the [B, T, V] result: stacking them as
      # [shards, B, T, chunk] and moving the axis made a second logits-sized float32 buffer.
      put = lambda c, out: jax.lax.dynamic_update_slice_in_dim(
          out, jnp.einsum(spec, x, gathered(c), preferred_element_type=jnp.float32), c * chunk, axis=2)
      out = jax.lax.fori_loop(0, shards, put, jnp.zeros((*x.shape[:2], chunk * shards), jnp.float32))
      return out[..., :width]
    x = jnp.pad(x, [(0, 0), (0, 0), (0, chunk * shards - width)])
    add = lambda c, acc: acc + jnp.einsum(
        spec, jax.lax.dynamic_slice_in_dim(x, c * chunk, chunk, axis=2), gathered(c),
        preferred_element_type=jnp.float32)
    out = jax.lax.fori_loop(0, shards, add, jnp.zeros((*x.shape[:2], k.shape[0] * shards), jnp.float32))
    return jax.lax.psum(out, vocab) if vocab else out

  out_spec = spec_of(batch, length, ()) if transpose else spec_of(batch, length, vocab)
  return jax.shard_map(local, in_specs=(spec_of(batch, length, vocab if transpose else ()), spec_of(rows, cols)),
                       out_specs=out_spec, check_vma=False)(x, kernel)


def raw_logits(hidden, kernel):
  """float32 logits hidden [B, T, D] @ kernel [D, V] before the soft cap, laid out as LOGITS."""
  return nn.with_logical_constraint(_matmul(hidden, kernel, transpose=False), LOGITS)


def grads(hidden, kernel, d_logits):
  """The head matmul's gradients for the logits' gradient d_logits [B, T, V]: d_hidden
  [B, T, D] and d_kernel [D, V], both float32, d_kernel laid out as the kernel."""
  d_logits = d_logits.astype(kernel.dtype)
  return _matmul(d_logits, kernel, transpose=True), _kernel_grad(hidden, d_logits)


def logits(hidden, kernel, cap: float):
  """The model's output: float32 logits soft_cap(hidden [B, T, D] @ kernel [D, V], cap)."""
  return soft_cap(_untiled_logits(hidden, kernel), cap)


@jax.custom_vjp
def _untiled_logits(hidden, kernel):
  """Untiled float32 logits hidden [B, T, D] @ kernel [D, V]. Differentiated like the
  tiles, so the kernel's gradient is reduced shard by shard (see _kernel_grad)."""
  return raw_logits(hidden, kernel)


def _untiled_logits_forward(hidden, kernel):
  return raw_logits(hidden, kernel), (hidden, kernel)


def _untiled_logits_backward(residuals, d_logits):
  hidden, kernel = residuals
  d_hidden, d_kernel = grads(hidden, kernel, d_logits)
  return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype)


_untiled_logits.defvjp(_untiled_logits_forward, _untiled_logits_backward)
