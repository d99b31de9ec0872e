"""Causal self-attention with RoPE and document (segment) masking: grouped-query attention
(attention_type=global) and DeepSeek's multi-head latent attention (mla)."""

import functools
import json
import math
from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from MaxText import costs, head, remat, sharding
from MaxText.errors import ConfigError
from MaxText.layers import context_parallel, masks
from MaxText.layers.embeddings import apply_rope, rope_attention_factor, rope_timescales, yarn_mscale
from MaxText.layers.linears import kernel, kernel_run, matmul, sum_of_slices, weights_as
from MaxText.layers.normalizations import norm_scale, rms_norm_with

BATCH_LENGTH_HEADS = ("activation_batch", "activation_length", "activation_heads", None)
BATCH_LENGTH_KV_HEADS = ("activation_batch", "activation_length", "activation_kv_heads", None)
# Without context parallelism keys and values are whole rows (no `activation_length`).
BATCH_FULL_LENGTH_KV_HEADS = ("activation_batch", None, "activation_kv_heads", None)


def attention_mask(query_index, segment_ids, window=None, chunk_window=None):
  """[B, 1, Tq, T] bool for queries at positions query_index [Tq] of rows with segment_ids
  [B, T]: what masks.visible lets them see, within one packed document (same segment id)."""
  allowed = masks.visible(query_index[:, None], jnp.arange(segment_ids.shape[1])[None, :], window, chunk_window)
  same_doc = jnp.take(segment_ids, query_index, axis=1)[:, :, None] == segment_ids[:, None, :]
  return (allowed[None] & same_doc)[:, None]


def attend(q, k, v, mask, scale, soft_cap, sinks=None):
  """softmax(soft_cap(scale * q.k) where mask) . v over [B, T, N, H] rows, GQA, values [B, T, K, Hv];
  with sinks [N], each head's softmax has one more score, its sink, whose value is nothing (GPT-OSS).
  Without a cap or sinks and with Hv = H, jax.nn.dot_product_attention (which can pick a fused
  implementation); with a cap (Gemma 2), sinks or values of another width (MLA), none of which it
  takes, the scores are formed here."""
  if not soft_cap and sinks is None and v.shape[3] == q.shape[3]:
    return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale)
  batch, length, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(batch, length, kv_heads, heads // kv_heads, head_dim)
  scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
  if soft_cap:
    scores = head.soft_cap(scores, soft_cap)
  scores = jnp.where(mask[:, :, None], scores, jnp.finfo(jnp.float32).min)
  if sinks is None:
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  else:  # head n = kv_head * groups + group, as q's reshape
    sink = sinks.astype(jnp.float32).reshape(kv_heads, -1)[None, :, :, None, None]
    top = jax.lax.stop_gradient(jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink))
    exp = jnp.exp(scores - top)
    probs = (exp / (jnp.sum(exp, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(v.dtype)
  return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(batch, length, heads, v.shape[3])


def dot_product_attention(q, k, v, segment_ids, scale=None, soft_cap=0.0, window=None, chunk_window=None,
                          sinks=None):
  """All T x T scores at once: fastest, with memory quadratic in the sequence length."""
  mask = attention_mask(jnp.arange(q.shape[1]), segment_ids, window, chunk_window)
  return attend(q, k, v, mask, q.shape[3]**-0.5 if scale is None else scale, soft_cap, sinks)


def chunked_attention(q, k, v, segment_ids, num_chunks, scale=None, soft_cap=0.0, window=None, chunk_window=None,
                      sinks=None):
  """The same attention, its queries in num_chunks chunks, each checkpointed: forward and
  backward hold one chunk's [T / num_chunks, T] scores instead of [T, T]. Chunk j takes
  positions t with t % num_chunks == j, so under sequence sharding every device works on
  every chunk (as vocabulary tiles do)."""
  length = q.shape[1]
  scale = q.shape[3]**-0.5 if scale is None else scale
  index = jnp.arange(length).reshape(-1, num_chunks).T  # [chunks, T / chunks]
  chunks = jnp.moveaxis(q.reshape(q.shape[0], -1, num_chunks, *q.shape[2:]), 2, 0)

  @jax.checkpoint
  def attend_chunk(q_chunk, q_index):
    return attend(q_chunk, k, v, attention_mask(q_index, segment_ids, window, chunk_window), scale, soft_cap, sinks)

  out = jax.lax.map(lambda args: attend_chunk(*args), (chunks, index))  # [chunks, B, T / chunks, N, Hv]
  return jnp.moveaxis(out, 0, 2).reshape(*q.shape[:3], v.shape[3])


FLASH_BLOCK = 512  # query and key block of the splash kernel, or the whole row when shorter


@functools.cache
def _token_mask_type():
  """splash_mask's class, made once (its kernels import lazily): masks of equal tokens, window
  and chunk are equal, so splash's cache of processed masks (keyed by the mask) finds them."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask  # noqa: PLC0415

  class TokenMask(splash_attention_mask._ComputableMask):
    def __init__(self, token_index, window, chunk_window):
      self.window, self.chunk_window = window, chunk_window
      super().__init__((len(token_index),) * 2, lambda q, kv: masks.visible(q, kv, window, chunk_window))
      self.q_sequence = np.asarray(token_index, np.int32)

    def __getitem__(self, idx):
      """A block of the mask, as splash asks for it block by block: one all seen or all unseen
      (most of a causal mask's) from its extreme tokens alone, without evaluating each pair."""
      q_slice, kv_slice = idx
      rows = self.q_sequence[q_slice]
      start, stop, _ = kv_slice.indices(self.shape[1])
      shape = (len(rows), stop - start)
      nearest, farthest = rows.min() - (stop - 1), rows.max() - start  # of the query-key distances
      window, chunk = self.window, self.chunk_window
      # The chunks of the first and last query, and of the first and last key.
      chunks = (rows.min() // chunk, rows.max() // chunk, start // chunk, (stop - 1) // chunk) if chunk else None
      apart = chunks and (chunks[1] < chunks[2] or chunks[3] < chunks[0])
      if farthest < 0 or (window and nearest >= window) or apart:
        return np.zeros(shape, bool)
      if nearest >= 0 and (not window or farthest < window) and (not chunks or len(set(chunks)) == 1):
        return np.ones(shape, bool)
      return super().__getitem__(idx)

    def __eq__(self, other):
      return isinstance(other, TokenMask) and self._key() == other._key()

    def __hash__(self):
      return hash(self._key())

    def _key(self):
      return self.shape, self.window, self.chunk_window, self.q_sequence.tobytes()

  return TokenMask


def splash_mask(token_index, window=None, chunk_window=None):
  """Splash's mask over [T] queries whose tokens are token_index [T] (arange for a whole row
  in order, or a context-parallel order) against keys in sequence order: masks.visible's, with
  `window` and `chunk_window`. A computable mask: the kernel evaluates it per
  block from the queries' token indices (its q_sequence, split with the queries over
  q_seq_shards) and the keys' positions, and the block lists skip the blocks it empties,
  so no [T, T] array exists on the device. Splash builds the block lists on the host one block
  at a time; a block all seen or all unseen costs two comparisons, the others (along the diagonal,
  a window's edge, a chunk's) each pair's."""
  return _token_mask_type()(token_index, window, chunk_window)


def splash_kernel(token_index, soft_cap, window, num_shards=1, chunk=None, interpret=False, chunk_window=None,
                  fused_backward=False, dkv_block=None):
  """Splash attention's kernel for the queries at token_index [T] (see splash_mask) in
  num_shards q_seq_shards, each against all T keys. Query blocks divide `chunk`, the longest
  run of consecutive tokens of a shard (its queries by default), so each is a block of the
  whole row's causal mask and skipped as it would be there; key blocks are FLASH_BLOCK or the
  row (pyconfig: it divides the row). The backward is a dq kernel and a dk/dv kernel, or with
  fused_backward one kernel computing all three (5 products a block pair, not 7), which holds a
  partial dq of the queries per key block of its own (dkv_block keys; the key block by default)
  until it sums them."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU kernels)
  length = len(token_index)
  q_block, kv_block = math.gcd(FLASH_BLOCK, chunk or length // num_shards), min(FLASH_BLOCK, length)
  dq_blocks = {} if fused_backward else {"block_q_dq": q_block, "block_kv_dq": kv_block}
  return splash.make_splash_mha(
      mask=splash.MultiHeadMask([splash_mask(token_index, window, chunk_window)]), head_shards=1,
      q_seq_shards=num_shards,
      interpret=interpret, attn_logits_soft_cap=soft_cap or None, residual_checkpoint_name=remat.KERNEL_RESIDUALS,
      block_sizes=splash.BlockSizes(block_q=q_block, block_kv=kv_block, block_kv_compute=kv_block,
                                    block_q_dkv=q_block, block_kv_dkv=dkv_block or kv_block,
                                    block_kv_dkv_compute=kv_block, use_fused_bwd_kernel=fused_backward, **dq_blocks))


# splash_kernel's options: config key (MaxText's) -> its keyword argument.
SPLASH_OPTIONS = {"sa_use_fused_bwd_kernel": "fused_backward", "sa_block_kv_dkv": "dkv_block"}


def kernel_options(options: dict, cfg) -> dict:
  """A kernel's keyword arguments from the config, `options` naming them by config key."""
  return {argument: getattr(cfg, key) for key, argument in options.items()}


def _one_width(q, k, v):
  """q, k, v of one head width, as the fused kernels take them: values of another (MLA's) are
  padded with zero features, which add nothing to the scores (queries and keys) and are cut
  from the context (values)."""
  width = max(q.shape[3], v.shape[3])
  return (jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[3])]) for x in (q, k, v))


def splash_rows(kernel, q, k, v, q_segments, k_segments, scale, sinks=None):
  """A splash kernel over rows [B, Tq, N, H] of queries and [B, T, K, H] of keys and values
  [B, T, K, Hv], their segment ids [B, Tq] and [B, T], and the heads' sinks [N] or None."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash  # noqa: PLC0415 (TPU kernels)
  v_width = v.shape[3]
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in _one_width(q * scale, k, v))  # the kernel's [N, T, H] per row
  out = jax.vmap(lambda q, k, v, ids: kernel(q, k, v, segment_ids=ids, sinks=sinks))(
      q, k, v, splash.SegmentIds(q_segments, k_segments))
  return jnp.swapaxes(out, 1, 2)[..., :v_width]


def _splash_attention(q, k, v, segment_ids, scale, soft_cap, window, chunk_window, interpret, max_segments, sinks,
                      fused_backward=False, dkv_block=None):
  """TPU: Pallas splash attention on one device's whole rows, [B, T, N, H] in and out; the
  blocks a window or a chunk empties are skipped like those above the diagonal; sinks its own."""
  kernel = splash_kernel(np.arange(q.shape[1]), soft_cap, window, interpret=interpret, chunk_window=chunk_window,
                         fused_backward=fused_backward, dkv_block=dkv_block)
  return splash_rows(kernel, q, k, v, segment_ids, segment_ids, scale, sinks)


def _triton_attention(q, k, v, segment_ids, scale, soft_cap, window, chunk_window, interpret, max_segments, sinks):
  """GPU: JAX's Pallas (Triton) flash attention, which takes segment ids as they are. It has no
  GQA, so each device repeats its key and value heads; their gradients sum back over the
  repeats. It has no soft cap and no window either (FLASH_KERNELS says so: pyconfig refuses
  them, flash_attention too)."""
  from jax.experimental.pallas.ops.gpu import attention as triton  # noqa: PLC0415 (GPU kernels)
  groups, v_width = q.shape[2] // k.shape[2], v.shape[3]
  q, k, v = _one_width(q, *(jnp.repeat(x, groups, axis=2) for x in (k, v)))
  # JAX's default backward blocks (32 x 32) ran at about half these blocks' speed on an H200
  # (docs/design/throughput.md). The fused backward needs block_q_dq == block_kv_dkv.
  blocks = triton.BlockSizes(block_q=128, block_k=128, block_q_dkv=128, block_kv_dkv=64, block_q_dq=64,
                             block_kv_dq=128)
  return triton.mha(q, k, v, segment_ids, sm_scale=scale, causal=True, block_sizes=blocks,
                    interpret=interpret)[..., :v_width]


def document_offsets(segment_ids, max_segments: int):
  """Packed documents as cuDNN takes them: each row's runs of equal segment ids (its documents,
  and padding as one more) as (lengths [B, max_segments], starts [B, max_segments + 1]), the
  entries past a row's last run -1. A row of more runs than max_segments would lose its last
  ones: batches are checked on the host first (check_documents)."""
  length = segment_ids.shape[1]
  boundary = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
  starts = jax.vmap(lambda row: jnp.nonzero(row, size=max_segments, fill_value=length)[0])(boundary)
  starts = starts.astype(jnp.int32)
  ends = jnp.concatenate([starts[:, 1:], jnp.full_like(starts[:, :1], length)], axis=1)
  present = starts < length
  lengths = jnp.where(present, ends - starts, -1)
  offsets = jnp.concatenate([jnp.where(present, starts, -1), jnp.full_like(starts[:, :1], -1)], axis=1)
  return lengths, offsets


def documents_per_row(segment_ids: np.ndarray) -> np.ndarray:
  """Runs of equal segment ids in each row of a host batch [B, T]: what document_offsets takes."""
  return 1 + np.count_nonzero(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1)


def _cudnn_attention(q, k, v, segment_ids, scale, soft_cap, window, chunk_window, interpret, max_segments, sinks):
  """GPU: cuDNN's fused flash attention (about twice the Triton kernel's speed on an H200), with
  GQA, values of another width (MLA) and a sliding window of its own. Packed documents go in as
  offsets and lengths (document_offsets): each document is its own causal sequence, which is
  the segment-id mask of the other kernels."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn  # noqa: PLC0415 (GPU kernels; jax.nn's
  # dot_product_attention does not take the offsets)
  lengths, offsets = document_offsets(segment_ids, max_segments)
  return cudnn.dot_product_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets,
                                     kv_offsets=offsets, scale=scale, mask_type=cudnn.MaskType.CAUSAL,
                                     sliding_window_length=window)


# How the cost model counts a flash kernel's calls, which are custom calls, not dot_generals:
# (matmuls per (query, key) pair and head feature, or a function of the call giving them, the
# axis of the queries holding the sequence, the kernel metadata's keys of its (query, key) block
# sizes, or None where the metadata has none: then the exact causal half is counted, at most a
# block's share of the row below what the kernel runs). Splash's backward is a dq kernel (scores,
# dP, dQ) and a dk/dv kernel (scores, dV, dP, dK), or that kernel alone computing dQ too
# (fused_backward: a third output, one more product); the Triton backward is one kernel doing
# both, 7 matmuls; cuDNN's attention is two primitives of JAX's, its forward (2) and its backward
# (scores, dP, dV, dQ, dK: 5), on [B, T, N, H] rows, whose skipped blocks the trace does not show
# (they depend on the documents): each counts the row's exact causal half, as for one document.
SPLASH_MATMULS = {"splash_mha_fwd": (2, -2, ("block_q", "block_kv")),
                  "splash_mha_dq": (3, -2, ("block_q_dq", "block_kv_dq")),
                  "splash_mha_dkv": (lambda eqn: 2 + len(eqn.outvars), -2, ("block_q_dkv", "block_kv_dkv"))}


class FlashKernel(NamedTuple):
  """A fused kernel over one device's whole rows [B, T, N, H]: (q, k, v, segment_ids, scale,
  soft_cap, window, chunk_window, interpret, max_segments, sinks, **options) -> context; the platform it runs on,
  the masks.FEATURES it takes (what else a config asks of it is refused naming the key), its FLOPs
  as the cost model counts them (pallas kernel name prefix, or for a primitive of its own the
  primitive's name -> its FLASH matmuls entry: flash_kernel_flops), whether its forward names its
  residuals (the context and its logsumexp) remat.KERNEL_RESIDUALS, and its own options (config
  key -> keyword argument of run: kernel_options; pyconfig refuses them for another kernel)."""

  platform: str
  run: Callable
  takes: frozenset
  pallas_flops: dict
  primitive_flops: dict = {}
  names_residuals: bool = False
  options: dict = {}


# flash_kernel= -> its FlashKernel; unset, each platform's fastest (DEFAULT_FLASH_KERNEL).
FLASH_KERNELS = {
    "splash": FlashKernel("tpu", _splash_attention, frozenset({"soft_cap", "window", "chunk", "sink"}), SPLASH_MATMULS,
                          names_residuals=True, options=SPLASH_OPTIONS),
    "cudnn": FlashKernel("gpu", _cudnn_attention, frozenset({"window"}), {},
                         {"dot_product_attention_fwd_wrapper": (2, 1, None),
                          "dot_product_attention_bwd_wrapper": (5, 1, None)}),
    "triton": FlashKernel("gpu", _triton_attention, frozenset(), {"mha_forward": (2, 1, None),
                                                                  "mha_backward": (7, 1, None)})}
DEFAULT_FLASH_KERNEL = {"tpu": "splash", "gpu": "cudnn"}
# ... and under context parallelism, per context shard (its q_seq_shards part of the mask).
context_parallel.ROW_KERNELS["flash"] = {"tpu": context_parallel.RowKernel(
    splash_kernel, lambda kernel: kernel.manual_sharding_spec(jax.sharding.NamedSharding(
        jax.sharding.get_abstract_mesh(), jax.sharding.PartitionSpec(None, context_parallel.AXIS))),
    splash_rows, functools.partial(kernel_options, SPLASH_OPTIONS))}


def check_documents(cfg, segment_ids: np.ndarray) -> None:
  """A host batch's rows against the configured kernel's static bound on documents per row."""
  if cfg.attention == "flash" and cfg.flash_kernel == "cudnn":
    most = int(documents_per_row(segment_ids).max(initial=0))
    if most > cfg.max_segments_per_seq:
      raise ConfigError(f"max_segments_per_seq={cfg.max_segments_per_seq}: a batch has a row of {most} documents "
                        "(flash_kernel=cudnn takes at most this many: raise it, or use flash_kernel=triton)")


def flash_attention(q, k, v, segment_ids, kernel_name, scale=None, soft_cap=0.0, window=None, sliding=True,
                    interpret=False, max_segments=1, chunk_window=None, sinks=None, options=None):
  """Fused attention, causal within each packed document: blocks of queries against blocks
  of keys, never a whole [T, T] score matrix; blocks the causal mask empties are skipped.
  Under a mesh the kernel (a FLASH_KERNELS name) runs per device in shard_map, on its rows (batch over
  data/fsdp) and heads (tensor). Queries, keys and values are whole rows there: under
  sequence parallelism the queries are gathered too and every sequence shard computes its
  rows' whole attention (correct, but that work is repeated; chunked attention splits it).
  A kernel's mask is static, so with a window or a chunk and `sliding` a traced flag (whether
  the layer is local, in a scan) both kernels are built and lax.cond picks one.
  `interpret` runs a Pallas kernel in Pallas's interpreter (any backend, slowly: for tests);
  `max_segments` bounds the documents of a row for cuDNN (document_offsets); `options` are the
  kernel's own keyword arguments (kernel_options of its FlashKernel.options)."""
  flash = FLASH_KERNELS[kernel_name]
  refusal = masks.refused({"attn_logits_soft_cap": soft_cap, "sliding_window_size": window,
                           "chunk_attn_window_size": chunk_window, "attention_sink": sinks is not None},
                          kernel_name, flash.takes)
  if refusal:
    raise ValueError(refusal)

  def attend_rows(q, k, v, segment_ids, sinks):
    kernel = functools.partial(flash.run, scale=q.shape[3]**-0.5 if scale is None else scale, soft_cap=soft_cap,
                               interpret=interpret, max_segments=max_segments, sinks=sinks, **(options or {}))
    whole = functools.partial(kernel, window=None, chunk_window=None)
    if not (window or chunk_window):
      return whole(q, k, v, segment_ids)
    return jax.lax.cond(sliding, functools.partial(kernel, window=window, chunk_window=chunk_window), whole,
                        q, k, v, segment_ids)

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return attend_rows(q, k, v, segment_ids, sinks)
  batch, _, heads, _ = nn.logical_to_mesh_axes(BATCH_LENGTH_HEADS)
  kv_heads = nn.logical_to_mesh_axes(BATCH_FULL_LENGTH_KV_HEADS)[2]
  rows = jax.sharding.PartitionSpec(batch, None, heads, None)
  return jax.shard_map(attend_rows, in_specs=(rows, jax.sharding.PartitionSpec(batch, None, kv_heads, None),
                                         jax.sharding.PartitionSpec(batch, None, kv_heads, None),
                                         jax.sharding.PartitionSpec(batch, None),
                                         None if sinks is None else jax.sharding.PartitionSpec(heads)),
                       out_specs=rows, check_vma=False)(q, k, v, segment_ids, sinks)


def causal_pairs(length: int, block_q: int, block_k: int) -> int:
  """(query, key) pairs a causal flash kernel computes per row and head: every key block that
  starts at or before a query block's last query, whole (masked inside, not skipped)."""
  pairs = 0
  for start in range(0, length, block_q):
    last = min(start + block_q, length) - 1
    pairs += (min(start + block_q, length) - start) * min((last // block_k + 1) * block_k, length)
  return pairs


def flash_kernel_flops(kind: tuple, eqn) -> float:
  """FLOPs of a call of the flash kernel `kind` (a FlashKernel's flops value), every
  kernel causal (a sliding window's skipped blocks are counted). A context shard's splash call
  has a part of the queries and all the keys: its query blocks tile the runs of consecutive
  tokens (splash_kernel), so the shards together compute the whole row's causal blocks, and
  each is counted an equal share of them."""
  matmuls, axis, block_keys = kind
  matmuls = matmuls(eqn) if callable(matmuls) else matmuls
  q, k = [v.aval for v in eqn.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)][:2]
  length, head_dim = k.shape[axis], q.shape[-1]
  rows = q.size // (q.shape[axis] * head_dim)  # batch x heads
  if block_keys:
    meta = json.loads(eqn.params["metadata"]["xprof_metadata"])
    pairs = causal_pairs(length, meta[block_keys[0]], meta[block_keys[1]])
  else:
    pairs = causal_pairs(length, 1, 1)
  return 2.0 * matmuls * rows * head_dim * pairs * q.shape[axis] / length


# The cost model lies below the model: every flash kernel's record registers its own count there.
for _flash in FLASH_KERNELS.values():
  costs.KERNEL_FLOPS.update({name: functools.partial(flash_kernel_flops, kind) for name, kind in
                             _flash.pallas_flops.items()})
  costs.PRIMITIVE_FLOPS.update({name: functools.partial(flash_kernel_flops, kind) for name, kind in
                                _flash.primitive_flops.items()})




def _layer_value(value, local, length):
  """layer_index is traced inside a scan, so a local layer's window or chunk is a value: the row
  length on a layer that is not local."""
  return jnp.where(local, value, length) if value else None


# attention= -> (q, k, v, segment_ids, config, scale, soft_cap, window, chunk_window, local, sinks) ->
# context [B, T, N, H] (local: whether the layer takes its window or chunk, traced in a scan; sinks
# [N] or None). A new kernel is one entry here; pyconfig takes its choices from these keys.
ATTENTIONS = {
    "dot_product": lambda q, k, v, segment_ids, cfg, scale, soft_cap, window, chunk_window, local, sinks:
        dot_product_attention(q, k, v, segment_ids, scale, soft_cap, _layer_value(window, local, q.shape[1]),
                              _layer_value(chunk_window, local, q.shape[1]), sinks),
    "chunked": lambda q, k, v, segment_ids, cfg, scale, soft_cap, window, chunk_window, local, sinks:
        chunked_attention(q, k, v, segment_ids, cfg.max_target_length // cfg.attention_chunk_size, scale, soft_cap,
                          _layer_value(window, local, q.shape[1]), _layer_value(chunk_window, local, q.shape[1]),
                          sinks),
    "flash": lambda q, k, v, segment_ids, cfg, scale, soft_cap, window, chunk_window, local, sinks: flash_attention(
        q, k, v, segment_ids, cfg.flash_kernel, scale, soft_cap, window, local,
        max_segments=cfg.max_segments_per_seq, chunk_window=chunk_window, sinks=sinks,
        options=kernel_options(FLASH_KERNELS[cfg.flash_kernel].options, cfg)),
}


def _nope(cfg, layer_index):
  """Whether the layer has no RoPE: the last of every nope_layer_interval (traced in a scan)."""
  return bool(cfg.nope_layer_interval) and (layer_index + 1) % cfg.nope_layer_interval == 0


def _local(cfg, layer_index):
  """(window or None, chunk or None, whether this layer takes them; traced in a scan): with a
  window the family's pattern makes the last of every sliding_window_pattern layers attend to the
  whole row and the others slide (with their own RoPE base where set); with chunks every layer but
  the NoPE ones attends within its chunk (Llama 4)."""
  window, chunk = cfg.sliding_window_size or None, cfg.chunk_attn_window_size or None
  if window:
    return window, None, (layer_index + 1) % cfg.sliding_window_pattern != 0
  return None, chunk, chunk is not None and jnp.logical_not(_nope(cfg, layer_index))


def rotate(cfg, x, positions, layer_index):
  """RoPE, as the configuration and the layer say, over x's last axis [B, T, heads, d], or its
  first d * partial_rotary_factor features (Qwen3-Next's partial RoPE): a sliding layer with a
  RoPE of its own (local_rope_max_timescale) has it plain, its cos and sin unscaled (OLMo 3's YaRN
  is its global layers'); a NoPE layer has none."""
  local = _local(cfg, layer_index)[2]
  width = round(x.shape[3] * cfg.partial_rotary_factor)
  timescale = rope_timescales(cfg, width, local)
  factor = rope_attention_factor(cfg)
  if cfg.local_rope_max_timescale and factor != 1:
    factor = jnp.where(local, 1.0, factor)
  rotated = apply_rope(x[..., :width], positions, timescale, factor)
  if width < x.shape[3]:
    rotated = jnp.concatenate([rotated, x[..., width:]], axis=-1)
  return jnp.where(_nope(cfg, layer_index), x, rotated) if cfg.nope_layer_interval else rotated


def tuned_temperature(cfg, q, positions, layer_index):
  """With temperature_tuning, a NoPE layer's queries [B, T, N, H] times 1 + scale * log(1 +
  floor((position + 1) / floor)), Llama 4's, which keeps long-range scores from flattening; the
  positions are each document's own, as RoPE's."""
  if not cfg.temperature_tuning:
    return q
  steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / cfg.temperature_tuning_floor)
  tuned = (jnp.log1p(steps) * cfg.temperature_tuning_scale + 1.0)[:, :, None, None]
  return (q * jnp.where(_nope(cfg, layer_index), tuned, 1.0)).astype(q.dtype)


def unit_rms(cfg, x, layer_index):
  """use_qk_norm: each head's rotated queries or keys x [B, T, n, H] over their root mean square,
  in float32 with no scale, on the RoPE layers (Llama 4 Scout); the NoPE layers' as they are."""
  if not cfg.use_qk_norm:
    return x
  x32 = x.astype(jnp.float32)
  normed = (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
                                + cfg.normalization_layer_epsilon)).astype(x.dtype)
  return jnp.where(_nope(cfg, layer_index), x, normed) if cfg.nope_layer_interval else normed


def qk_normed(cfg, scale, x):
  """Queries' or keys' RMSNorm over x [B, T, n, H]: each head's features (Qwen3), or with
  qk_norm_over_heads all of the projection's together (OLMo 2/3), its scale [n * H]."""
  if not cfg.qk_norm_over_heads:
    return rms_norm_with(cfg, scale, x)
  return rms_norm_with(cfg, scale, x.reshape(*x.shape[:2], -1)).reshape(x.shape)


def global_attention(cfg, x, positions, segment_ids, layer_index, sinks):
  """attention_type=global: q, k and v projected from x, RoPE over each whole head; base_num_kv_heads
  divides base_num_query_heads (GQA, MQA at 1). With attention_output_gate (Qwen3-Next) the query
  kernel holds each head's queries, then its gates: the context times their sigmoid goes to the
  output projection. With attention_head_chunks > 1, projections
  included, in that many slices of its key/value heads, each with the query heads that share them
  (linears.sum_of_slices); slice k is the k-th run of every tensor shard's own heads
  (linears.kernel_run), so no head moves between devices."""
  dim, heads, kv_heads, head_dim = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
  query_width = head_dim * (2 if cfg.attention_output_gate else 1)
  projections = (kernel(cfg, "query", (dim, heads, query_width), ("embed", "q_heads", "kv"), bias=cfg.attention_bias),
                 kernel(cfg, "key", (dim, kv_heads, head_dim), ("embed", "kv_heads", "kv"), bias=cfg.attention_bias),
                 kernel(cfg, "value", (dim, kv_heads, head_dim), ("embed", "kv_heads", "kv"), bias=cfg.attention_bias))
  out = kernel(cfg, "out", (heads, head_dim, dim), ("heads", "kv", "embed"), num_in_axes=2, bias=cfg.attention_bias)
  if cfg.attention_bias:  # each projection's kernel and bias: kernel_run slices both by heads
    projections, (out, out_bias) = tuple(zip(*projections)), out
  if cfg.qk_norm:  # before RoPE
    heads_normed = (heads, kv_heads) if cfg.qk_norm_over_heads else (1, 1)
    q_scale = norm_scale(cfg, "query_norm", heads_normed[0] * head_dim)
    k_scale = norm_scale(cfg, "key_norm", heads_normed[1] * head_dim)
  chunks, dtype = cfg.attention_head_chunks, jnp.dtype(cfg.dtype)
  shards = sharding.logical_shards(cfg.to_dict(), "kv_heads")
  scale = (cfg.query_pre_attn_scalar or head_dim)**-0.5

  def project(x, k, kernels, biases=None):
    """x's projections by this slice's kernels [D, n, H], plus its biases [n, H] where given."""
    y = matmul(cfg, "btd,dnh->btnh", x, kernel_run(kernels, 1, shards, chunks, k, dtype))
    return y if biases is None else y + kernel_run(biases, 0, shards, chunks, k, dtype)

  def attention_slice(x, k, out_dtype):
    q, kk, v = (checkpoint_name(project(x, k, *w), name) for w, name in zip(
        zip(*projections) if cfg.attention_bias else ((w,) for w in projections),
        ("query_proj", "key_proj", "value_proj")))
    if cfg.attention_output_gate:
      q, gate = q[..., :head_dim], q[..., head_dim:]
    if cfg.qk_norm:
      q, kk = qk_normed(cfg, q_scale, q), qk_normed(cfg, k_scale, kk)
    q, kk = (unit_rms(cfg, rotate(cfg, y, positions, layer_index), layer_index) for y in (q, kk))
    q = tuned_temperature(cfg, q, positions, layer_index)
    head_sinks = None if sinks is None else kernel_run(sinks, 0, shards, chunks, k, jnp.float32)
    context = attend_heads(cfg, q, kk, v, segment_ids, layer_index, scale, head_sinks)
    if cfg.attention_output_gate:
      context = (context * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(context.dtype)
    wo = kernel_run(out, 0, shards, chunks, k, dtype)  # [n, H, D]
    return matmul(cfg, "btnh,nhd->btd", context, wo, out_dtype)

  out_proj = sum_of_slices(cfg, x, chunks, attention_slice)
  if cfg.attention_bias:  # once, not once per slice
    out_proj = out_proj + weights_as(out_bias, dtype)
  return checkpoint_name(out_proj, "out_proj")


def mla_scale(cfg) -> float:
  """MLA's softmax scale: (qk_nope_head_dim + qk_rope_head_dim)^-0.5 (query_pre_attn_scalar^-0.5
  where set), times DeepSeek's YaRN temperature mscale(rope_scaling_factor, mscale_all_dim)^2
  with rope_type=yarn and mscale_all_dim set."""
  scale = (cfg.query_pre_attn_scalar or cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)**-0.5
  if cfg.rope_type == "yarn" and cfg.mscale_all_dim:
    scale *= yarn_mscale(cfg.rope_scaling_factor, cfg.mscale_all_dim)**2
  return scale


def mla_attention(cfg, x, positions, segment_ids, layer_index, sinks):
  """attention_type=mla, DeepSeek-V2/V3's multi-head latent attention (MaxText's parameter names).

  Queries: x query, or with q_lora_rank > 0 rmsnorm(x wq_a) wq_b, each head's [qk_nope_head_dim]
  features then [qk_rope_head_dim]. Keys and values: x wkv_a is [kv_lora_rank] latent features,
  then one [qk_rope_head_dim] RoPE key k_pe that every head shares; rmsnorm(latent) wkv_b gives
  each head's [qk_nope_head_dim] key features, then its [v_head_dim] value. A head's key is its
  own features then k_pe. RoPE rotates the pairs (i, i + qk_rope_head_dim / 2) of q_pe and k_pe
  (the half-split layout of the other families; a checkpoint in DeepSeek's interleaved layout has
  those output features permuted on import, which leaves every q_pe . k_pe unchanged)."""
  dim, heads = cfg.base_emb_dim, cfg.base_num_query_heads
  nope, rope, latent, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
  dtype = jnp.dtype(cfg.dtype)
  x = x.astype(dtype)
  if cfg.q_lora_rank:
    wq_a = kernel(cfg, "wq_a", (dim, cfg.q_lora_rank), ("embed", "q_lora_up_proj"))
    q_norm = norm_scale(cfg, "q_norm", cfg.q_lora_rank)
    wq_b = kernel(cfg, "wq_b", (cfg.q_lora_rank, heads, nope + rope), ("q_lora", "q_heads", "kv"))
    low_rank = rms_norm_with(cfg, q_norm, matmul(cfg, "btd,dr->btr", x, weights_as(wq_a, dtype)))
    q = matmul(cfg, "btr,rnh->btnh", low_rank, weights_as(wq_b, dtype))
  else:
    q = matmul(cfg, "btd,dnh->btnh", x, weights_as(kernel(cfg, "query", (dim, heads, nope + rope),
                                                          ("embed", "q_heads", "kv")), dtype))
  q = checkpoint_name(q, "query_proj")
  kv_a = matmul(cfg, "btd,dr->btr", x, weights_as(kernel(cfg, "wkv_a", (dim, latent + rope),
                                                            ("embed", "kv_lora_up_proj")), dtype))
  compressed = rms_norm_with(cfg, norm_scale(cfg, "kv_norm", latent), kv_a[..., :latent])
  wkv_b = kernel(cfg, "wkv_b", (latent, heads, nope + v_dim), ("kv_lora", "kv_heads", "kv_head_dim"))
  kv = matmul(cfg, "btr,rnh->btnh", compressed, weights_as(wkv_b, dtype))
  k_pe = rotate(cfg, kv_a[..., None, latent:], positions, layer_index)  # [B, T, 1, rope]
  q = jnp.concatenate([q[..., :nope], rotate(cfg, q[..., nope:], positions, layer_index)], axis=-1)
  k = checkpoint_name(jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_pe, (*kv.shape[:3], rope))], axis=-1),
                      "key_proj")
  v = checkpoint_name(kv[..., nope:], "value_proj")
  context = attend_heads(cfg, q, k, v, segment_ids, layer_index, mla_scale(cfg), sinks)
  wo = weights_as(kernel(cfg, "out", (heads, v_dim, dim), ("heads", "kv", "embed"), num_in_axes=2), dtype)
  return checkpoint_name(matmul(cfg, "btnh,nhd->btd", context, wo), "out_proj")


def global_macs(cfg) -> tuple[int, int]:
  d, heads, kv_heads, head_dim = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.base_num_kv_heads, cfg.head_dim
  queries = heads * head_dim * (2 if cfg.attention_output_gate else 1)
  return d * queries + 2 * d * kv_heads * head_dim + heads * head_dim * d, 2 * heads * head_dim


def mla_macs(cfg) -> tuple[int, int]:
  d, heads, rank = cfg.base_emb_dim, cfg.base_num_query_heads, cfg.q_lora_rank
  qk, latent, v_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.v_head_dim
  query = rank * (d + heads * qk) if rank else d * heads * qk
  keys_values = d * (latent + cfg.qk_rope_head_dim) + latent * heads * (cfg.qk_nope_head_dim + v_dim)
  return query + keys_values + heads * v_dim * d, heads * (qk + v_dim)


class AttentionType(NamedTuple):
  """layer: (config, x [B, T, D], positions, segment ids, layer index, the heads' sinks [N] or
  None) -> the attention's output [B, T, D], its parameters made in the calling module; macs:
  config -> (multiply-adds per token of its projections, per (query, key) pair of its scores and
  context, all heads), the cost model's count (costs.ATTENTION_MACS)."""
  layer: Callable
  macs: Callable


# attention_type= -> its AttentionType. A new attention is one entry; config_schema takes the
# choices from these keys.
ATTENTION_TYPES = {"global": AttentionType(global_attention, global_macs),
                   "mla": AttentionType(mla_attention, mla_macs)}
costs.ATTENTION_MACS.update({name: kind.macs for name, kind in ATTENTION_TYPES.items()})


class Attention(nn.Module):
  """Self-attention of the configured attention_type (ATTENTION_TYPES), its parameters under
  this module's name."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids, layer_index):
    cfg = self.config
    # float32 whatever weight_dtype, as the router: a logit among scores, not a weight to cast.
    sinks = self.param("sinks", nn.with_logical_partitioning(nn.initializers.zeros_init(), ("heads",)),
                       (cfg.base_num_query_heads,), jnp.float32) if cfg.attention_sink else None
    return ATTENTION_TYPES[cfg.attention_type].layer(cfg, x, positions, segment_ids, layer_index, sinks)


def attend_heads(cfg, q, k, v, segment_ids, layer_index, scale, sinks=None):
  """The attention of rotated queries q [B, T, N, H] to keys k [B, T, K, H] and values
  v [B, T, K, Hv] (K divides N; Hv may differ from H), with the heads' sinks [N] where given: the
  layout, the configured kernel or context parallelism, the layer's window or chunk; the context
  [B, T, N, Hv]."""
  window, chunk_window, local = _local(cfg, layer_index)
  split = context_parallel.shards() > 1  # each context shard attends its own queries
  q = nn.with_logical_constraint(q, BATCH_LENGTH_HEADS)
  k = nn.with_logical_constraint(k, BATCH_LENGTH_KV_HEADS if split else BATCH_FULL_LENGTH_KV_HEADS)
  v = nn.with_logical_constraint(v, BATCH_LENGTH_KV_HEADS if split else BATCH_FULL_LENGTH_KV_HEADS)
  soft_cap = cfg.attn_logits_soft_cap
  if split:
    context = context_parallel.attention(q, k, v, segment_ids, cfg, scale,
                                         functools.partial(head.soft_cap, cap=soft_cap),
                                         _layer_value(window, local, q.shape[1]), sinks=sinks)
  else:
    context = ATTENTIONS[cfg.attention](q, k, v, segment_ids, cfg, scale, soft_cap, window, chunk_window, local,
                                        sinks)
  context = nn.with_logical_constraint(context, BATCH_LENGTH_HEADS)
  # Where the kernel names its residuals (every context-parallel kernel), a policy that keeps
  # attention_out keeps those (remat.checkpoint_policy): the context once, in the kernel's layout,
  # with the logsumexp its backward needs. Naming this copy too would keep the context twice.
  if split or (cfg.attention == "flash" and FLASH_KERNELS[cfg.flash_kernel].names_residuals):
    return context
  return checkpoint_name(context, "attention_out")
