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


def attention_mask(segment_ids):
  """[B, 1, T, T] bool: causal, and only within one packed document (same segment id)."""
  length = segment_ids.shape[1]
  causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
  same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
  return (causal[None] & same_doc)[:, None]


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
    context = jax.nn.dot_product_attention(q, k, v, mask=attention_mask(segment_ids))
    context = checkpoint_name(nn.with_logical_constraint(context, BATCH_LENGTH_HEADS), "attention_out")
    out = dense(cfg.base_emb_dim, ("heads", "kv", "embed"), cfg, "out", num_in_axes=2)(context)
    return checkpoint_name(out, "out_proj")
