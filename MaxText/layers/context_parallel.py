"""Context parallelism: attention split over the `context` mesh axis, each shard computing
only its own queries' rows.

The sequence is sharded over `context` (C shards) everywhere in the model. Attention runs in
shard_map: every shard holds its queries, keys and values; a strategy (STRATEGIES) brings it
the other shards' keys and values, all at once (all_gather) or one block at a time around a
ring (ring), and a block kernel (SHARD_KERNELS, by `attention`) attends its queries to them
with the causal, document and window masks taken from the tokens' indices in the whole
sequence. A strategy that brings each shard every key (all_gather) may instead run a
whole-row kernel (ROW_KERNELS: attention=flash's splash attention on TPU), which takes the
shard's queries against the whole sequence's keys and has its own backward.

With load balancing the sequence is cut into 2C chunks and shard i holds chunks i and
2C-1-i: under a causal mask early chunks see few keys and late ones many, so this pairing
gives every shard the same work. The batch is permuted into that order once, before the model
(`load_balance`); the loss is a sum over tokens and the targets move with their tokens.
"""

import functools
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText import remat, sharding
from MaxText.layers import masks

AXIS = "context"
_MASKED = -1e30  # finite, so a block whose keys a row cannot see gives weight 0, not NaN


def shards() -> int:
  """Context shards of the mesh being traced under (1 outside a mesh, e.g. in decode)."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else dict(mesh.shape).get(AXIS, 1)


def balanced_order(length: int, num_shards: int) -> np.ndarray:
  """Stored position -> token index in the sequence: shard i holds chunks i and 2C-1-i."""
  chunks = np.arange(length).reshape(2 * num_shards, -1)
  return np.concatenate([chunks[j] for i in range(num_shards) for j in (i, 2 * num_shards - 1 - i)])


def load_balance(config, batch: dict) -> dict:
  """The batch's [B, T] arrays in load-balanced order, when context parallelism is on; the
  model then sees tokens, positions and segment ids and the loss targets in the same order."""
  if not config.context_parallel_load_balance or shards() == 1:
    return batch
  order = balanced_order(config.max_target_length, shards())
  return {k: jnp.take(x, order, axis=1) for k, x in batch.items()}


def _token_index(length: int, num_shards: int, balanced: bool):
  """[length / num_shards] indices in the whole sequence of this shard's tokens."""
  order = balanced_order(length, num_shards) if balanced else np.arange(length)
  return jnp.asarray(order.reshape(num_shards, -1), jnp.int32)[jax.lax.axis_index(AXIS)]


def _in_token_order(x, num_shards: int, balanced: bool):
  """[B, T, ...] gathered from the shards (their stored order) -> in sequence order:
  balanced_order's inverse, chunk moves only (shard i's second chunk is chunk 2C-1-i)."""
  if not balanced:
    return x
  pairs = x.reshape(x.shape[0], num_shards, 2, -1, *x.shape[2:])
  return jnp.concatenate([pairs[:, :, 0], pairs[:, ::-1, 1]], axis=1).reshape(x.shape)


def _scores(q, k, q_index, k_index, q_segments, k_segments, window, scale, cap):
  """Masked scores [B, K, G, Tq, Tk] float32 of q [B, Tq, N, H] (N = K x G query heads, GQA)
  against keys [B, Tk, K, H], through `cap`, masked by token indices (masks.visible) and
  segment ids."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  scores = cap(jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale)
  allowed = masks.visible(q_index[:, None], k_index[None, :], window)
  allowed = allowed[None] & (q_segments[:, :, None] == k_segments[:, None, :])  # [B, Tq, Tk]
  return jnp.where(allowed[:, None, None], scores, _MASKED)


def _by_kv_head(x, kv_heads):
  """[B, Tq, N, ...] -> [B, K, G, Tq, ...], the scores' layout."""
  x = x.reshape(x.shape[0], x.shape[1], kv_heads, -1, *x.shape[3:])
  return jnp.moveaxis(x, 1, 3)


def dot_block(q, k, v, q_index, k_index, q_segments, k_segments, window, scale, cap):
  """q [B, Tq, N, H] against one key/value block [B, Tk, K, H] and [B, Tk, K, Hv] (GQA: K
  divides N), scored as _scores does: (context normalised over the block [B, Tq, N, Hv] float32, logsumexp of its
  scores [B, Tq, N] float32). A row that sees no key of the block gets logsumexp ~ -1e30, so
  it weighs nothing in the merge."""
  batch, length, heads, _ = q.shape
  scores = _scores(q, k, q_index, k_index, q_segments, k_segments, window, scale, cap)
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
  lse = jnp.moveaxis(lse.reshape(batch, heads, length), 1, 2)
  return out.reshape(batch, length, heads, v.shape[3]), lse


def dot_block_grads(q, k, v, q_index, k_index, q_segments, k_segments, window, lse, d_out, d_lse, scale, cap):
  """The gradients (dq, dk, dv, float32) of one block's share of the whole attention,
  sum over its keys s of exp(S_s - lse) v_s, for the cotangents d_out [B, Tq, N, H] of the
  whole context and d_lse [B, Tq, N] of its logsumexp `lse` [B, Tq, N], lse held fixed. As
  flash attention's backward: the probabilities come from the final logsumexp, so the block's
  scores are computed once (not its forward and then again under autodiff)."""
  kv_heads = k.shape[2]
  scores, scores_vjp = jax.vjp(
      lambda q, k: _scores(q, k, q_index, k_index, q_segments, k_segments, window, scale, cap), q, k)
  probs = jnp.exp(scores - _by_kv_head(lse, kv_heads)[..., None])  # 0 where masked
  d_out = _by_kv_head(d_out, kv_heads).astype(v.dtype)  # [B, K, G, Tq, H]
  dv = jnp.einsum("bkgts,bkgth->bskh", probs.astype(v.dtype), d_out, preferred_element_type=jnp.float32)
  d_probs = jnp.einsum("bkgth,bskh->bkgts", d_out, v, preferred_element_type=jnp.float32)
  dq, dk = scores_vjp(probs * (d_probs + _by_kv_head(d_lse, kv_heads)[..., None]))
  return dq.astype(jnp.float32), dk.astype(jnp.float32), dv


def _split(x, n):
  """[B, T, ...] -> [n, B, T / n, ...]: n contiguous pieces of the sequence."""
  return jnp.moveaxis(x.reshape(x.shape[0], n, -1, *x.shape[2:]), 1, 0)


def _join(x):
  """_split's inverse."""
  return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])


def _zeros(x):
  """A float32 gradient accumulator shaped as x."""
  return jnp.zeros(x.shape, jnp.float32)


def _in_chunks(kernel, chunk_size):
  """kernel over the queries in chunks of chunk_size (_blocks), one at a time: one chunk's
  [chunk_size, Tk] scores live at a time. Forward only (the strategies' backward is
  ShardKernel.grads), yet each chunk is a jax.checkpoint, as each key block in
  _over_key_blocks: its optimization barrier keeps XLA from moving work across the loops, which
  would keep more than one chunk's scores live at once and undo the chunking."""
  def chunked(q, k, v, q_index, k_index, q_segments, k_segments, window):
    num_chunks = _blocks(q, chunk_size)
    if num_chunks == 1:
      return kernel(q, k, v, q_index, k_index, q_segments, k_segments, window)
    step = jax.checkpoint(lambda args: kernel(args[0], k, v, args[1], k_index, args[2], k_segments, window))
    chunks = (_split(q, num_chunks), q_index.reshape(num_chunks, -1), _split(q_segments, num_chunks))
    out, lse = jax.lax.map(step, chunks)
    return _join(out), _join(lse)

  return chunked


def _merge(out, lse, block_out, block_lse):
  """Two normalised partial attentions of the same queries -> their union's (online softmax)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  out = out * jnp.exp(lse - new_lse)[..., None] + block_out * jnp.exp(block_lse - new_lse)[..., None]
  return out, new_lse


def _blocks(x, block_size) -> int:
  """How many blocks of block_size the queries or keys x [B, T, ...] are taken in: 1 (at once)
  where block_size does not divide T (a chunk longer than a shard, or than half of one)."""
  return x.shape[1] // block_size if x.shape[1] % block_size == 0 else 1


def _over_key_blocks(kernel, block_size):
  """kernel over the keys in blocks of block_size, merged by logsumexp: one [Tq, block_size]
  score block live at a time, not [Tq, Tk] (Tk: the shard's own keys for the ring, the whole
  sequence's for the all-gather). Forward only, as _in_chunks, and checkpointed as it is."""

  def blocked(q, k, v, q_index, k_index, q_segments, k_segments, window):
    num_blocks = _blocks(k, block_size)
    if num_blocks == 1:
      return kernel(q, k, v, q_index, k_index, q_segments, k_segments, window)
    blocks = (_split(k, num_blocks), _split(v, num_blocks), k_index.reshape(num_blocks, -1),
              _split(k_segments, num_blocks))
    attend = lambda block: kernel(q, block[0], block[1], q_index, block[2], q_segments, block[3], window)

    def step(carry, block):
      return _merge(*carry, *attend(block)), None

    first = attend(jax.tree.map(lambda x: x[0], blocks))
    return jax.lax.scan(jax.checkpoint(step), first, jax.tree.map(lambda x: x[1:], blocks))[0]

  return blocked


def _with_sinks(out, lse, sinks):
  """(context, logsumexp) of the scores with each head's sink [N] one more score of value zero:
  the logsumexp takes it in, the context shrinks by what it takes."""
  if sinks is None:
    return out, lse
  with_sink = jnp.logaddexp(lse, sinks.astype(jnp.float32))
  return out * jnp.exp(lse - with_sink)[..., None], with_sink


def _with_flash_backward(forward, backward):
  """Attention (q, k, v, q_index, segments, window, sinks) -> context in q's dtype, whose
  forward (the same arguments but sinks -> (context, logsumexp), float32) keeps only its inputs,
  the context and its logsumexp L, and whose backward is backward(the same arguments, L, d_out,
  d_lse) -> (dq, dk, dv). The context is sum over blocks b of exp(S_b - L) V_b: its gradient is
  each block's with L held fixed, for the cotangents (d_out, -rowsum(d_out * out)), the second for
  L's dependence on S_b (ShardKernel.grads), so no block's scores are kept or computed twice.
  The heads' sinks [N] (or None) are terms of L and of nothing else: L with them in drives the
  same backward, and each sink's gradient is the sum of exp(sink - L) times that second cotangent."""

  # The indices, segment ids and window are arguments, not closed over: custom_vjp may not
  # close over values traced in shard_map.
  @jax.custom_vjp
  def attend(q, k, v, q_index, segments, window, sinks):
    return _with_sinks(*forward(q, k, v, q_index, segments, window), sinks)[0].astype(q.dtype)

  # The context is kept as returned, in q's dtype, as flash attention keeps it: one copy serves
  # as the output and the residual, half a float32 one where activations are bfloat16.
  def attend_fwd(q, k, v, q_index, segments, window, sinks):
    out, lse = _with_sinks(*forward(q, k, v, q_index, segments, window), sinks)
    out, lse = (checkpoint_name(x, remat.KERNEL_RESIDUALS) for x in (out.astype(q.dtype), lse))
    return out, (q, k, v, q_index, segments, window, sinks, out, lse)

  def attend_bwd(residuals, d_out):
    q, k, v, q_index, segments, window, sinks, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    d_lse = -jnp.sum(d_out * out.astype(jnp.float32), axis=-1)
    dq, dk, dv = backward(q, k, v, q_index, segments, window, lse, d_out, d_lse)
    d_sinks = None
    if sinks is not None:  # summed over the batch and the positions, this shard's and the others'
      d_sinks = jnp.sum(jnp.exp(sinks.astype(jnp.float32) - lse) * d_lse, axis=(0, 1))
      d_sinks = sharding.as_cotangent_of(d_sinks, sinks)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, d_sinks

  attend.defvjp(attend_fwd, attend_bwd)
  return attend


def all_gather_attention(block, q, k, v, q_index, segments, window, num_shards, balanced, sinks=None):
  """Each shard gathers every shard's keys, values, segment ids and token indices, then
  attends its own queries to them: simple, and the whole sequence's keys and values are on
  every chip for the layer. The backward gathers them again and reduce-scatters their
  gradients back to their shards."""
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1 if x.ndim > 1 else 0, tiled=True)

  def forward(q, k, v, q_index, segments, window):
    return block.attend(q, gather(k), gather(v), q_index, gather(q_index), segments, gather(segments), window)

  def backward(q, k, v, q_index, segments, window, lse, d_out, d_lse):
    dq, dk, dv = block.grads(q, gather(k), gather(v), q_index, gather(q_index), segments, gather(segments), window,
                             lse, d_out, d_lse)
    scatter = lambda x: jax.lax.psum_scatter(x, AXIS, scatter_dimension=1, tiled=True)
    return dq, scatter(dk), scatter(dv)

  return _with_flash_backward(forward, backward)(q, k, v, q_index, segments, window, sinks)


def all_gather_rows(attend, q, k, v, segments, num_shards, balanced):
  """all_gather for a whole-row kernel: attend(q, k, v, q segment ids, k segment ids) of the
  shard's queries against every shard's keys, values and segment ids, gathered in sequence
  order. all_gather's transpose is the reduce-scatter, so the kernel's own backward is the
  strategy's."""
  gather = lambda x: _in_token_order(jax.lax.all_gather(x, AXIS, axis=1, tiled=True), num_shards, balanced)
  return attend(q, gather(k), gather(v), segments, gather(segments))


def _halves(x):
  """[B, T, ...] (or [T]) -> its two halves along the sequence: a load-balanced shard's chunks i
  and 2C - 1 - i."""
  axis = 1 if x.ndim > 1 else 0
  return jnp.split(x, 2, axis=axis)


def ring_attention(block, q, k, v, q_index, segments, window, num_shards, balanced, sinks=None):
  """Key/value blocks travel around the ring of context shards (C steps, C - 1 ppermutes);
  each shard merges its queries' attention to every block by logsumexp. The backward runs the
  ring again, each block's key/value gradient travelling with it back to its shard, so no
  step's block is kept for it: only q, the own block, the output and its logsumexp are.

  Load-balanced, shard i holds chunks i and 2C - 1 - i of the sequence, its halves 1 and 2.
  Its own block's half 2 of the queries sees both halves of the keys and its half 1 the keys'
  half 1 (half 1 against half 2 is above the diagonal). An earlier shard's block is seen only
  in its half 1, by both halves of the queries; a later shard's whole, by the queries' half 2.
  So every other block is two quarters: the queries' half 2 against the keys' half 1, always,
  and half 1 against half 1 (earlier) or half 2 against half 2 (later), picked by the shard
  index with selects, not a branch, so each step's work is static. The ring's attention is the
  causal half plus the diagonal chunks. Contiguous shards compute every block whole, masked."""
  shift = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  rotate = lambda xs: jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, shift), xs)
  first = lambda xs: jax.tree.map(lambda x: _halves(x)[0], xs)
  second = lambda xs: jax.tree.map(lambda x: _halves(x)[1], xs)
  pick = lambda flag, xs, ys: jax.tree.map(lambda x, y: jnp.where(flag, x, y), xs, ys)
  join = lambda x_1, x_2: jnp.concatenate([x_1, x_2], axis=1)
  # Whether the block this shard holds at step s comes from an earlier shard. Everything traced
  # is an argument of forward and backward: custom_vjp may not close over shard_map's values.
  earlier = lambda s: (jax.lax.axis_index(AXIS) - s) % num_shards < jax.lax.axis_index(AXIS)

  def forward(q, k, v, q_index, segments, window):
    attend = lambda rows, kv: block.attend(rows[0], kv[0], kv[1], rows[1], kv[3], rows[2], kv[2], window)
    rows = (q, q_index, segments)

    def own(kv):
      (out_1, lse_1), (out_2, lse_2) = attend(first(rows), first(kv)), attend(second(rows), kv)
      return join(out_1, out_2), join(lse_1, lse_2)

    def other(kv, s):
      flag = earlier(s)
      out_a, lse_a = attend(pick(flag, first(rows), second(rows)), pick(flag, first(kv), second(kv)))
      out_b, lse_b = attend(second(rows), first(kv))
      out_2, lse_2 = _merge(out_b, lse_b, out_a, jnp.where(flag, _MASKED, lse_a))
      return join(out_a, out_2), join(jnp.where(flag, lse_a, _MASKED), lse_2)

    kv = (k, v, segments, q_index)
    out, lse = own(kv) if balanced else attend(rows, kv)

    def step(carry, s):
      out, lse, kv = carry
      kv = rotate(kv)
      block_out, block_lse = other(kv, s) if balanced else attend(rows, kv)
      return (*_merge(out, lse, block_out, block_lse), kv), None

    (out, lse, _), _ = jax.lax.scan(step, (out, lse, kv), jnp.arange(1, num_shards))
    return out, lse

  def backward(q, k, v, q_index, segments, window, lse, d_out, d_lse):
    grads = lambda rows, kv: block.grads(rows[0], kv[0], kv[1], rows[1], kv[3], rows[2], kv[2], window, *rows[3:])
    rows = (q, q_index, segments, lse, d_out, d_lse)
    zero = lambda x: jnp.zeros_like(x)

    def own(kv):
      dq_1, dk_1, dv_1 = grads(first(rows), first(kv))
      dq_2, dk, dv = grads(second(rows), kv)
      return join(dq_1, dq_2), dk + join(dk_1, zero(dk_1)), dv + join(dv_1, zero(dv_1))

    def other(kv, s):
      flag = earlier(s)
      dq_a, dk_a, dv_a = grads(pick(flag, first(rows), second(rows)), pick(flag, first(kv), second(kv)))
      dq_b, dk_b, dv_b = grads(second(rows), first(kv))
      only = lambda when, x: jnp.where(when, x, 0.0)
      return (join(only(flag, dq_a), dq_b + only(~flag, dq_a)), join(dk_b + only(flag, dk_a), only(~flag, dk_a)),
              join(dv_b + only(flag, dv_a), only(~flag, dv_a)))

    kv = (k, v, segments, q_index)
    dq, dk, dv = own(kv) if balanced else grads(rows, kv)
    kv, dk, dv = rotate((kv, dk, dv))

    def step(carry, s):
      dq, kv, dk, dv = carry
      dq_b, dk_b, dv_b = other(kv, s) if balanced else grads(rows, kv)
      kv, dk, dv = rotate((kv, dk + dk_b, dv + dv_b))
      return (dq + dq_b, kv, dk, dv), None

    (dq, _, dk, dv), _ = jax.lax.scan(step, (dq, kv, dk, dv), jnp.arange(1, num_shards))
    return dq, dk, dv

  return _with_flash_backward(forward, backward)(q, k, v, q_index, segments, window, sinks)


def _grads_in_blocks(grads, chunk_size, block_size):
  """grads (dot_block_grads') over the queries in chunks of chunk_size and the keys in blocks of
  block_size, as _in_chunks(_over_key_blocks(...)) splits the forward: one
  [chunk_size, block_size] score block live at a time."""

  def blocked(q, k, v, q_index, k_index, q_segments, k_segments, window, lse, d_out, d_lse):
    num_chunks, num_blocks = _blocks(q, chunk_size), _blocks(k, block_size)
    blocks = (_split(k, num_blocks), _split(v, num_blocks), k_index.reshape(num_blocks, -1),
              _split(k_segments, num_blocks))
    chunks = (_split(q, num_chunks), q_index.reshape(num_chunks, -1), _split(q_segments, num_chunks),
              _split(lse, num_chunks), _split(d_out, num_chunks), _split(d_lse, num_chunks))

    def per_chunk(dkv, chunk):
      q, q_index, q_segments, lse, d_out, d_lse = chunk

      def per_block(dq, block):
        k, v, k_index, k_segments = block
        dq_b, dk, dv = grads(q, k, v, q_index, k_index, q_segments, k_segments, window, lse, d_out, d_lse)
        return dq + dq_b, (dk, dv)

      dq, (dk, dv) = jax.lax.scan(per_block, _zeros(q), blocks)
      return (dkv[0] + _join(dk), dkv[1] + _join(dv)), dq

    (dk, dv), dq = jax.lax.scan(per_chunk, (_zeros(k), _zeros(v)), chunks)
    return _join(dq), dk, dv

  return blocked


class ShardKernel(NamedTuple):
  """A block kernel: attend (q, k, v, q_index, k_index, q_segments, k_segments, window) ->
  (normalised context, logsumexp); grads (the same, then lse, d_out, d_lse) -> (dq, dk, dv),
  dot_block_grads' contract, for the strategies' backward (_with_flash_backward)."""
  attend: Callable
  grads: Callable


def _chunked(cfg, **options) -> ShardKernel:
  """attention=chunked: dot_block over attention_chunk_size queries and keys at a time."""
  size = cfg.attention_chunk_size
  return ShardKernel(_in_chunks(_over_key_blocks(functools.partial(dot_block, **options), size), size),
                     _grads_in_blocks(functools.partial(dot_block_grads, **options), size, size))


# attention= -> (config, scale=, cap=) -> its ShardKernel, on every
# platform. Both strategies need each block's logsumexp and a backward from the final one,
# which neither Pallas kernel of attentions.FLASH_KERNELS gives (splash's save_residuals has
# no VJP, and the Triton kernel takes no mask offsets): attention=flash is a whole-row kernel
# (ROW_KERNELS) instead, for the strategies that take one.
SHARD_KERNELS = {
    "dot_product": lambda cfg, **options: ShardKernel(
        functools.partial(dot_block, **options), functools.partial(dot_block_grads, **options)),
    "chunked": _chunked,
}


class RowKernel(NamedTuple):
  """A kernel of a shard's queries against the whole row's keys, with its own backward.
  make(token_index [T] of the stored queries, soft cap, window, num_shards, chunk, interpret) -> kernel, a
  pytree built outside shard_map, since its mask (a static one, whose empty blocks the kernel
  skips) is known only for all shards together; specs(kernel) -> its shard_map in_specs,
  which give each shard its queries' part; attend(kernel, q, k, v, q segment ids, k segment
  ids, scale) -> context, per shard, keys in sequence order; options(cfg) -> make's keyword
  arguments of the kernel's own."""
  make: Callable
  specs: Callable
  attend: Callable
  options: Callable = lambda cfg: {}


# attention= -> {platform: its RowKernel}; the module holding a kernel registers it
# (layers/attentions: flash on TPU). pyconfig takes the allowed values from these keys.
ROW_KERNELS: dict[str, dict[str, RowKernel]] = {}


class Strategy(NamedTuple):
  """blocks(ShardKernel, q, k, v, q_index, segment ids, window, shards, balanced, sinks) -> this shard's context;
  rows(attend, q, k, v, segment ids, shards, balanced) -> the same through a whole-row kernel
  (all_gather_rows), or None where the strategy cannot run one."""
  blocks: Callable
  rows: Callable | None = None


# context_parallel_strategy= -> its Strategy, run per shard inside shard_map. A new strategy is
# one entry; pyconfig checks against it.
STRATEGIES = {"all_gather": Strategy(all_gather_attention, all_gather_rows), "ring": Strategy(ring_attention)}


def kernels_for(strategy: str, platform: str) -> list[str]:
  """The attention= values context_parallel_strategy=strategy runs on platform."""
  rows = [name for name, kernels in ROW_KERNELS.items() if platform in kernels] if STRATEGIES[strategy].rows else []
  return [*SHARD_KERNELS, *rows]


def _rows_per_shard(cfg, length, scale, window, interpret):
  """attention()'s per-shard function through the strategy's whole-row kernel, and the
  kernels it takes: one per static window (the family's, and none for its global layers), a
  traced window (the layer's, in a scan) choosing between them, since a kernel's mask is
  static."""
  num_shards, balanced = shards(), cfg.context_parallel_load_balance
  order = balanced_order(length, num_shards) if balanced else np.arange(length)
  row = ROW_KERNELS[cfg.attention][cfg.platform]
  windows = (None,) if window is None else (cfg.sliding_window_size, None)
  chunk = length // num_shards // (2 if balanced else 1)  # a shard's runs of consecutive tokens
  kernels = [row.make(order, cfg.attn_logits_soft_cap, w, num_shards, chunk, interpret, **row.options(cfg))
             for w in windows]
  strategy = STRATEGIES[cfg.context_parallel_strategy].rows

  def per_shard(kernels, q, k, v, segment_ids, sinks, *window):
    attends = [functools.partial(row.attend, kernel, scale=scale, sinks=sinks) for kernel in kernels]
    attend = attends[0] if not window else lambda *args: jax.lax.cond(window[0] < length, *attends, *args)
    return strategy(attend, q, k, v, segment_ids, num_shards, balanced)

  return per_shard, kernels, [row.specs(kernel) for kernel in kernels]


def _blocks_per_shard(cfg, length, scale, cap):
  """attention()'s per-shard function through the strategy's block kernel (no operands)."""
  num_shards = shards()
  strategy = STRATEGIES[cfg.context_parallel_strategy].blocks

  def per_shard(_, q, k, v, segment_ids, sinks, *window):
    kernel = SHARD_KERNELS[cfg.attention](cfg, scale=scale, cap=cap)
    balanced = cfg.context_parallel_load_balance
    q_index = _token_index(length, num_shards, balanced)
    return strategy(kernel, q, k, v, q_index, segment_ids, window[0] if window else None, num_shards, balanced,
                    sinks)

  return per_shard, (), ()


def attention(q, k, v, segment_ids, cfg, scale, cap, window, interpret=False, sinks=None):
  """Self-attention [B, T, N, H] with the sequence sharded over `context`: each shard attends
  its own queries; batch and heads stay sharded as the logical rules say. `cap` maps scores
  (the soft cap); `window` is None or the layer's (maybe traced) window; `sinks` the heads'
  sinks [N] or None. `interpret` runs a whole-row kernel in Pallas's interpreter (tests)."""
  if cfg.attention in ROW_KERNELS:
    per_shard, kernels, kernel_specs = _rows_per_shard(cfg, q.shape[1], scale, window, interpret)
  else:
    per_shard, kernels, kernel_specs = _blocks_per_shard(cfg, q.shape[1], scale, cap)
  batch, _, heads, _ = nn.logical_to_mesh_axes(("activation_batch", None, "activation_heads", None))
  kv_heads = nn.logical_to_mesh_axes((None, None, "activation_kv_heads", None))[2]
  rows = PartitionSpec(batch, AXIS, heads, None)
  kv = PartitionSpec(batch, AXIS, kv_heads, None)
  # a traced window (the layer's, in a scan) enters as an argument
  window = () if window is None else (jnp.asarray(window),)
  return jax.shard_map(per_shard, in_specs=(kernel_specs, rows, kv, kv, PartitionSpec(batch, AXIS),
                                            None if sinks is None else PartitionSpec(heads),
                                            *[PartitionSpec()] * len(window)),
                       out_specs=rows, check_vma=False)(kernels, q, k, v, segment_ids, sinks, *window)
