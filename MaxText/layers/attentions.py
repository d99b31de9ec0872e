"""Grouped-query causal self-attention with RoPE and document (segment) masking."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText.layers.embeddings import apply_rope, rope_timescales
from MaxText.layers.linears import dense
from MaxText.layers.normalizations import rms_norm

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


FLASH_BLOCK = 512  # query and key block of the splash kernel, or the whole row when shorter


def _splash_attention(q, k, v, segment_ids, interpret):
  """TPU: Pallas splash attention on one device's whole rows, [B, T, N, H] in and out."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU kernels)
  length, block = q.shape[1], min(FLASH_BLOCK, q.shape[1])
  mask = splash.MultiHeadMask([splash.CausalMask((length, length))] * q.shape[2])
  kernel = splash.make_splash_mha(
      mask=mask, head_shards=1, q_seq_shards=1, interpret=interpret,
      block_sizes=splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                                    block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block,
                                    block_kv_dq=block))
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q * q.shape[3]**-0.5, k, v))  # the kernel's [N, T, H] per row
  out = jax.vmap(kernel)(q, k, v, segment_ids=splash.SegmentIds(segment_ids, segment_ids))
  return jnp.swapaxes(out, 1, 2)


def _triton_attention(q, k, v, segment_ids, interpret):
  """GPU: JAX's Pallas (Triton) flash attention, the one fused kernel in JAX that takes
  segment ids (cuDNN's wants packed documents as offsets). It has no GQA, so each device
  repeats its key and value heads; their gradients sum back over the repeats."""
  from jax.experimental.pallas.ops.gpu import attention as triton  # noqa: PLC0415 (GPU kernels)
  groups = q.shape[2] // k.shape[2]
  k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
  return triton.mha(q, k, v, segment_ids, sm_scale=q.shape[3]**-0.5, causal=True, interpret=interpret)


# attention=flash: per platform, a kernel over one device's whole rows [B, T, N, H]
FLASH_KERNELS = {"tpu": _splash_attention, "gpu": _triton_attention}


def flash_attention(q, k, v, segment_ids, platform, interpret=False):
  """Fused attention, causal within each packed document: blocks of queries against blocks
  of keys, never a whole [T, T] score matrix; blocks the causal mask empties are skipped.
  Under a mesh the platform's kernel runs per device in shard_map, on its rows (batch over
  data/fsdp) and heads (tensor). Queries, keys and values are whole rows there: under
  sequence parallelism the queries are gathered too and every sequence shard computes its
  rows' whole attention (correct, but that work is repeated; chunked attention splits it).
  `interpret` runs the kernel in Pallas's interpreter (any backend, slowly: for tests)."""
  attend = functools.partial(FLASH_KERNELS[platform], interpret=interpret)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend(q, k, v, segment_ids)
  batch, _, heads, _ = nn.logical_to_mesh_axes(BATCH_LENGTH_HEADS)
  kv_heads = nn.logical_to_mesh_axes(BATCH_FULL_LENGTH_KV_HEADS)[2]
  rows = jax.sharding.PartitionSpec(batch, None, heads, None)
  return jax.shard_map(attend, in_specs=(rows, jax.sharding.PartitionSpec(batch, None, kv_heads, None),
                                         jax.sharding.PartitionSpec(batch, None, kv_heads, None),
                                         jax.sharding.PartitionSpec(batch, None)),
                       out_specs=rows, check_vma=False)(q, k, v, segment_ids)


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
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's features, before RoPE
      q, k = rms_norm(cfg, "query_norm")(q), rms_norm(cfg, "key_norm")(k)
    timescale = rope_timescales(cfg, head_dim)
    q, k = apply_rope(q, positions, timescale), apply_rope(k, positions, timescale)
    q = nn.with_logical_constraint(q, BATCH_LENGTH_HEADS)
    k = nn.with_logical_constraint(k, BATCH_FULL_LENGTH_KV_HEADS)
    v = nn.with_logical_constraint(v, BATCH_FULL_LENGTH_KV_HEADS)
    if cfg.attention == "chunked":
      context = chunked_attention(q, k, v, segment_ids, cfg.max_target_length // cfg.attention_chunk_size)
    elif cfg.attention == "flash":
      context = flash_attention(q, k, v, segment_ids, cfg.platform)
    else:
      context = dot_product_attention(q, k, v, segment_ids)
    context = checkpoint_name(nn.with_logical_constraint(context, BATCH_LENGTH_HEADS), "attention_out")
    out = dense(cfg.base_emb_dim, ("heads", "kv", "embed"), cfg, "out", num_in_axes=2)(context)
    return checkpoint_name(out, "out_proj")
