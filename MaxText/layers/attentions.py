"""Grouped-query causal self-attention with RoPE and document (segment) masking."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.embeddings import apply_rope
from MaxText.layers.linears import dense

BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", None)
# Keys and values are gathered along the sequence (no `activation_length`): under sequence
# parallelism each query shard then attends over the whole row, exactly as unsharded.
BATCH_FULL_LENGTH_KV_HEADS = ("activation_batch", None, "activation_kv_heads", None)


def attention_mask(query_index, segment_ids):
  """[B, 1, Tq, T] bool for queries at positions query_index [Tq] of rows with segment_ids
  [B, T]: causal, and only within one packed document (same segment id)."""
  causal = query_index[:, None] >= jnp.arange(segment_ids.shape[1])[None, :]
  same_doc = jnp.take(segment_ids, query_index, axis=1)[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_doc)[:, None]


def dot_product_attention(q, k, v, segment_ids):
  """All T x T scores at once: fastest, with memory quadratic in the sequence length."""
  return jax.nn.dot_product_attention(q, k, v, mask=attention_mask(jnp.arange(q.shape[1]), segment_ids))


def chunked_attention(q, k, v, segment_ids, num_chunks):
  """The same attention, its queries in num_chunks chunks, each checkpointed: forward and
  backward hold one chunk's [T / num_chunks, T] scores instead of [T, T]. Chunk j takes
  positions t with t % num_chunks == j, so under sequence sharding every device works on
  every chunk (as vocabulary tiles do)."""
  length = q.shape[1]
  index = jnp.arange(length).reshape(-1, num_chunks).T  # [chunks, T / chunks]
  chunks = jnp.moveaxis(q.reshape(q.shape[0], -1, num_chunks, *q.shape[2:]), 2, 0)

  @jax.checkpoint
  def attend(q_chunk, q_index):
    return jax.nn.dot_product_attention(q_chunk, k, v, mask=attention_mask(q_index, segment_ids))

  out = jax.lax.map(lambda args: attend(*args), (chunks, index))  # [chunks, B, T / chunks, N, H]
  return jnp.moveaxis(out, 0, 2).reshape(q.shape)


class Attention(nn.Module):
  """Self-attention; base_num_kv_heads divides base_num_query_heads (GQA, MQA at 1)."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    heads, kv_heads, head_dim = cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
    q = dense((heads, head_dim), ("embed", "q_heads", "kv"), cfg, "query")(x)
    k = dense((kv_heads, head_dim), ("embed", "kv_heads", "kv"), cfg, "key")(x)
    v = dense((kv_heads, head_dim), ("embed", "kv_heads", "kv"), cfg, "value")(x)
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(k, "key_proj")
    v = checkpoint_name(v, "value_proj")
    q = apply_rope(q, positions, cfg.rope_max_timescale)
    k = apply_rope(k, positions, cfg.rope_max_timescale)
    q = nn.with_logical_constraint(q, BATCH_LENGTH_HEADS)
    k = nn.with_logical_constraint(k, BATCH_FULL_LENGTH_KV_HEADS)
    v = nn.with_logical_constraint(v, BATCH_FULL_LENGTH_KV_HEADS)
    if cfg.attention == "chunked":
      context = chunked_attention(q, k, v, segment_ids, cfg.max_target_length // cfg.attention_chunk_size)
    else:
      context = dot_product_attention(q, k, v, segment_ids)
    context = checkpoint_name(nn.with_logical_constraint(context, BATCH_LENGTH_HEADS), "attention_out")
    out = dense(cfg.base_emb_dim, ("heads", "kv", "embed"), cfg, "out", num_in_axes=2)(context)
    return checkpoint_name(out, "out_proj")
