"""Context parallelism: attention split over the `context` mesh axis, each shard computing
only its own queries' rows.

The sequence is sharded over `context` (C shards) everywhere in the model. Attention runs in
shard_map: every shard holds its queries, keys and values; a strategy (STRATEGIES) brings it
the other shards' keys and values, all at once (all_gather) or one block at a time around a
ring (ring), and a block kernel (SHARD_KERNELS, by `attention`) attends its queries to them
with the causal, document and window masks taken from the tokens' indices in the whole
sequence.

With load balancing the sequence is cut into 2C chunks and shard i holds chunks i and
2C-1-i: under a causal mask early chunks see few keys and late ones many, so this pairing
gives every shard the same work. The batch is permuted into that order once, before the model
(`load_balance`); the loss is a sum over tokens and the targets move with their tokens.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

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


def dot_block(q, k, v, q_index, k_index, q_segments, k_segments, window, scale, cap):
  """q [B, Tq, N, H] against one key/value block [B, Tk, K, H] (GQA: K divides N), its scores
  through `cap` (losses.soft_cap's, the identity without one), masked by
  token indices (causal, within `window`) and segment ids: (context normalised over the
  block [B, Tq, N, H] float32, logsumexp of its scores [B, Tq, N] float32). A row that sees
  no key of the block gets logsumexp ~ -1e30, so it weighs nothing in the merge."""
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  scores = cap(jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale)
  distance = q_index[:, None] - k_index[None, :]
  allowed = distance >= 0 if window is None else (distance >= 0) & (distance < window)
  allowed = allowed[None] & (q_segments[:, :, None] == k_segments[:, None, :])  # [B, Tq, Tk]
  scores = jnp.where(allowed[:, None, None], scores, _MASKED)
  lse = jax.nn.logsumexp(scores, axis=-1)
  probs = jnp.exp(scores - lse[..., None]).astype(v.dtype)
  out = jnp.einsum("bkgts,bskh->btkgh", probs, v, preferred_element_type=jnp.float32)
  lse = jnp.moveaxis(lse.reshape(batch, heads, length), 1, 2)
  return out.reshape(batch, length, heads, head_dim), lse


def _in_chunks(kernel, num_chunks):
  """kernel over the queries in num_chunks chunks, each recomputed in the backward: one
  chunk's [Tq / num_chunks, Tk] scores live at a time."""
  if num_chunks == 1:
    return kernel

  def chunked(q, k, v, q_index, k_index, q_segments, k_segments, window):
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], num_chunks, -1, *x.shape[2:]), 1, 0)
    step = jax.checkpoint(lambda args: kernel(args[0], k, v, args[1], k_index, args[2], k_segments, window))
    out, lse = jax.lax.map(step, (split(q), q_index.reshape(num_chunks, -1), split(q_segments)))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])
    return join(out), join(lse)

  return chunked


def _merge(out, lse, block_out, block_lse):
  """Two normalised partial attentions of the same queries -> their union's (online softmax)."""
  new_lse = jnp.logaddexp(lse, block_lse)
  out = out * jnp.exp(lse - new_lse)[..., None] + block_out * jnp.exp(block_lse - new_lse)[..., None]
  return out, new_lse


def _over_key_blocks(kernel, block_size):
  """kernel over the keys in blocks of block_size, merged by logsumexp, each block recomputed
  in the backward: one [Tq, block_size] score block live at a time, not [Tq, Tk] (Tk: the
  shard's own keys for the ring, the whole sequence's for the all-gather). Keys that are not
  a multiple of block_size (a chunk longer than a shard) are taken at once."""

  def blocked(q, k, v, q_index, k_index, q_segments, k_segments, window):
    num_blocks = k.shape[1] // block_size
    if num_blocks <= 1 or k.shape[1] % block_size:
      return kernel(q, k, v, q_index, k_index, q_segments, k_segments, window)
    split = lambda x: jnp.moveaxis(x.reshape(x.shape[0], num_blocks, -1, *x.shape[2:]), 1, 0)  # [B, Tk, ...]
    blocks = (split(k), split(v), k_index.reshape(num_blocks, -1), split(k_segments))
    attend = lambda block: kernel(q, block[0], block[1], q_index, block[2], q_segments, block[3], window)

    def step(carry, block):
      return _merge(*carry, *attend(block)), None

    first = attend(jax.tree.map(lambda x: x[0], blocks))
    return jax.lax.scan(jax.checkpoint(step), first, jax.tree.map(lambda x: x[1:], blocks))[0]

  return blocked


def all_gather_attention(block, q, k, v, q_index, segments, window, num_shards):
  """Each shard gathers every shard's keys, values, segment ids and token indices, then
  attends its own queries to them: simple, and the whole sequence's keys and values are on
  every chip for the layer."""
  gather = lambda x: jax.lax.all_gather(x, AXIS, axis=1 if x.ndim > 1 else 0, tiled=True)
  out, _ = block(q, gather(k), gather(v), q_index, gather(q_index), segments, gather(segments), window)
  return out.astype(q.dtype)


def ring_attention(block, q, k, v, q_index, segments, window, num_shards):
  """Key/value blocks travel around the ring of context shards (C steps, C - 1 ppermutes);
  each shard merges its queries' attention to every block by logsumexp. The backward runs the
  ring again, each block's key/value gradient travelling with it back to its shard, so no
  step's block is kept for it: only q, the own block, the output and its logsumexp are."""
  shift = [(i, (i + 1) % num_shards) for i in range(num_shards)]
  rotate = lambda xs: jax.tree.map(lambda x: jax.lax.ppermute(x, AXIS, shift), xs)

  def forward(q, k, v, q_index, segments, window):
    out, lse = block(q, k, v, q_index, q_index, segments, segments, window)

    def step(carry, _):
      out, lse, kv = carry
      kv = rotate(kv)
      out, lse = _merge(out, lse, *block(q, kv[0], kv[1], q_index, kv[3], segments, kv[2], window))
      return (out, lse, kv), None

    (out, lse, _), _ = jax.lax.scan(step, (out, lse, (k, v, segments, q_index)), length=num_shards - 1)
    return out, lse

  # The indices, segment ids and window are arguments, not closed over: custom_vjp may not
  # close over values traced in shard_map.
  @jax.custom_vjp
  def attend(q, k, v, q_index, segments, window):
    return forward(q, k, v, q_index, segments, window)[0].astype(q.dtype)

  def attend_fwd(q, k, v, q_index, segments, window):
    out, lse = forward(q, k, v, q_index, segments, window)
    return out.astype(q.dtype), (q, k, v, q_index, segments, window, out, lse)

  def attend_bwd(residuals, d_out):
    # out = sum over blocks b of exp(S_b - L) V_b with L the logsumexp of all scores: its
    # gradient through the block's (exp(S_b - L) V_b, rowsum exp(S_b - L)) with L held fixed
    # takes cotangents (d_out, -rowsum(d_out * out)), the second for L's dependence on S_b.
    q, k, v, q_index, segments, window, out, lse = residuals
    d_out = d_out.astype(jnp.float32)
    d_lse = -jnp.sum(d_out * out, axis=-1)

    def block_terms(q, k, v, k_index, k_segments):
      block_out, block_lse = block(q, k, v, q_index, k_index, segments, k_segments, window)
      weight = jnp.exp(block_lse - lse)
      return block_out * weight[..., None], weight

    def step(carry, _):
      dq, kv, dk, dv = carry
      _, vjp = jax.vjp(lambda q, k, v: block_terms(q, k, v, kv[3], kv[2]), q, kv[0], kv[1])
      dq_b, dk_b, dv_b = vjp((d_out, d_lse))
      dk, dv = dk + dk_b.astype(dk.dtype), dv + dv_b.astype(dv.dtype)
      kv, dk, dv = rotate((kv, dk, dv))
      return (dq + dq_b.astype(dq.dtype), kv, dk, dv), None

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
    (dq, _, dk, dv), _ = jax.lax.scan(step, (zeros(q), (k, v, segments, q_index), zeros(k), zeros(v)),
                                      length=num_shards)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None

  attend.defvjp(attend_fwd, attend_bwd)
  return attend(q, k, v, q_index, segments, window)


# attention= -> (config, this shard's tokens, scale=, cap=) -> its block kernel (q, k, v,
# q_index, k_index, q_segments, k_segments, window) -> (normalised context, logsumexp), on every
# platform. The ring merges blocks by their logsumexp, which neither Pallas kernel of
# attentions.FLASH_KERNELS returns with a gradient (splash's save_residuals has no VJP), and
# the Triton kernel takes no mask offsets; attention=flash is refused here until an entry has
# them (pyconfig takes the allowed values from these keys).
SHARD_KERNELS = {
    "dot_product": lambda cfg, local_length, **options: functools.partial(dot_block, **options),
    "chunked": lambda cfg, local_length, **options: _in_chunks(
        _over_key_blocks(functools.partial(dot_block, **options), cfg.attention_chunk_size),
        local_length // min(cfg.attention_chunk_size, local_length)),
}


# context_parallel_strategy= -> (block, q, k, v, q_index, segment ids, window, shards) -> this shard's
# context, run per shard inside shard_map. A new strategy is one entry; pyconfig checks against it.
STRATEGIES = {"all_gather": all_gather_attention, "ring": ring_attention}


def attention(q, k, v, segment_ids, cfg, scale, cap, window):
  """Self-attention [B, T, N, H] with the sequence sharded over `context`: each shard attends
  its own queries; batch and heads stay sharded as the logical rules say. `cap` maps scores
  (the soft cap); `window` is None or the layer's (maybe traced) window."""
  num_shards = shards()
  local_length = q.shape[1] // num_shards
  strategy = STRATEGIES[cfg.context_parallel_strategy]

  def per_shard(q, k, v, segment_ids, *window):  # a traced window (the layer's, in a scan) enters as an argument
    kernel = SHARD_KERNELS[cfg.attention](cfg, local_length, scale=scale, cap=cap)
    q_index = _token_index(q.shape[1] * num_shards, num_shards, cfg.context_parallel_load_balance)
    return strategy(kernel, q, k, v, q_index, segment_ids, window[0] if window else None, num_shards)

  batch, _, heads, _ = nn.logical_to_mesh_axes(("activation_batch", None, "activation_heads", None))
  kv_heads = nn.logical_to_mesh_axes((None, None, "activation_kv_heads", None))[2]
  rows = PartitionSpec(batch, AXIS, heads, None)
  kv = PartitionSpec(batch, AXIS, kv_heads, None)
  window = () if window is None else (jnp.asarray(window),)
  return jax.shard_map(per_shard, in_specs=(rows, kv, kv, PartitionSpec(batch, AXIS), *[PartitionSpec()] * len(window)),
                       out_specs=rows, check_vma=False)(q, k, v, segment_ids, *window)
