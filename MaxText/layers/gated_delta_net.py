"""Gated DeltaNet (Qwen3-Next's linear attention): a layer whose memory of the row is a state
[key features, value features] per value head, updated token by token by the gated delta rule,
so its cost is linear in the sequence length.

Per token t and value head: the state decays by exp(g_t), then moves its prediction for the
key k_t towards the value v_t by beta_t (S <- exp(g_t) S; S <- S + beta_t k_t (v_t - S^T k_t)^T),
and the output reads it with the query (o_t = S^T q_t). The queries, keys and values come from a
short causal depthwise convolution of their projections (SiLU after), the queries and keys
L2-normalised and the queries scaled by their width^-1/2; beta = sigmoid(b) and
g = -exp(A_log) * softplus(a + dt_bias) are per head. Each group of gdn_num_value_heads /
gdn_num_key_heads value heads shares a query and key head. The output is RMS-normalised per value
head, times silu(z), and projected back.

The rule runs in chunks of gdn_chunk_size tokens (delta_rule): within a chunk, as matmuls (the
UT transform's triangular solve), and from chunk to chunk, a scan carrying the state. Packed
documents reset the state and the convolution's window where a document starts, as attention's
document mask separates them. Under context parallelism (context_parallel_rule) each context
shard runs its pieces of the row from a zero state, tracking how their outputs and final state
depend on the state they start from (an affine map: the state's columns are the value
features, so the rule applied to the identity gives the map); the shards exchange those maps,
and each composes the maps of the pieces before its own to find the state it starts from.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText import costs
from MaxText.layers import context_parallel
from MaxText.layers.linears import kernel, matmul, weights_as
from MaxText.layers.normalizations import NormScale, normalize

KEY_HEADS = ("activation_batch", "activation_length", "activation_kv_heads", None)
VALUE_HEADS = ("activation_batch", "activation_length", "activation_heads", None)
GATES = ("activation_batch", "activation_length", "activation_heads")
# The segment id of "no token": before a row's first token, nothing is carried in.
_NONE = -1


def l2_normalized(x, eps=1e-6):
  """x / sqrt(sum x^2 + eps) over the last axis (Qwen3-Next's, the FLA library's l2norm)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x, w, segments, halo=None, halo_segments=None):
  """Depthwise causal convolution of x [B, T, n, d] by w [K, n, d] (w[K-1] weighs the token
  itself, w[K-1-j] the token j before it), each token seeing only tokens of its own document.
  `halo` [B, K-1, n, d] holds the K-1 tokens before the row (a context shard's: the previous
  piece's last ones), `halo_segments` [B, K-1] their segment ids; None: nothing before it."""
  width = w.shape[0]
  if halo is None:
    halo = jnp.zeros((x.shape[0], width - 1, *x.shape[2:]), x.dtype)
    halo_segments = jnp.full((x.shape[0], width - 1), _NONE, segments.dtype)
  padded, padded_segments = jnp.concatenate([halo, x], axis=1), jnp.concatenate([halo_segments, segments], axis=1)
  length = x.shape[1]
  out = 0.0
  for j in range(width):  # K shifted products: K is 4, and a shift keeps the documents' mask exact
    same = (padded_segments[:, j:j + length] == segments)[..., None, None]
    out = out + jnp.where(same, padded[:, j:j + length], 0.0) * w[j]
  return out


def delta_rule(q, k, v, g, beta, starts, chunk: int, state=None):
  """The gated delta rule over rows: q, k [B, T, H, dk] (normalised and scaled), v [B, T, H, dv],
  g (the log of each token's decay, <= 0) and beta [B, T, H], starts [B, T] (a document starts at
  the token: the state before it is dropped), all float32, from `state` [B, H, dk, dv] (None:
  zero). Returns (outputs [B, T, H, dv], final state). Chunks of `chunk` tokens: within one, the
  delta rule's updates are a unit lower-triangular system (the UT transform), solved at once; a
  scan carries the state from chunk to chunk, so memory is linear in T. A row not a whole number
  of chunks is padded with tokens of rate and decay zero, which leave the state as it is."""
  batch, length, heads, dk = k.shape
  dv = v.shape[-1]
  pad = -length % chunk
  if pad:
    q, k, v, g, beta, starts = (jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
                                for x in (q, k, v, g, beta, starts))
    out, state = delta_rule(q, k, v, g, beta, starts, chunk, state)
    return out[:, :length], state
  n = length // chunk

  def chunked(x):  # [B, T, H, ...] -> [n, B, H, C, ...]: the scan's axis first
    return jnp.moveaxis(x.reshape(batch, n, chunk, heads, *x.shape[3:]), (1, 3), (0, 2))

  q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
  # Documents begun within the chunk so far, per token: equal counts share a document, and a
  # token reads the state carried in only where none has begun.
  begun = jnp.cumsum(starts.reshape(batch, n, chunk).astype(jnp.int32), axis=-1)
  begun = jnp.moveaxis(begun, 1, 0)[:, :, None]  # [n, B, 1, C]
  cum = jnp.cumsum(g, axis=-1)  # [n, B, H, C]
  causal = np.tril(np.ones((chunk, chunk), bool))
  pairs = causal & (begun[..., :, None] == begun[..., None, :])
  # exp of the decay between tokens j <= i of one document, 0 elsewhere (exp of a masked 0, so
  # no infinity reaches the backward)
  decay = jnp.where(pairs, jnp.exp(jnp.where(pairs, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
  reads = (begun == 0).astype(jnp.float32)
  k_beta = k * beta[..., None]
  strict = decay * (~np.eye(chunk, dtype=bool))
  system = jnp.einsum("nbhid,nbhjd->nbhij", k_beta, k) * strict + np.eye(chunk, dtype=np.float32)
  solve = lambda rhs: jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
  new_values = solve(v * beta[..., None])
  state_keys = solve(k_beta * (jnp.exp(cum) * reads)[..., None])  # what reads the state carried in
  inner = jnp.einsum("nbhid,nbhjd->nbhij", q, k) * decay
  q_read = q * (jnp.exp(cum) * reads)[..., None]
  last = begun[..., -1:]
  k_write = k * (jnp.exp(cum[..., -1:] - cum) * (begun == last))[..., None]
  carried = jnp.exp(cum[..., -1]) * (last[..., 0] == 0)  # [n, B, H]

  def step(s, chunk_args):
    new_values, state_keys, inner, q_read, k_write, carried = chunk_args
    corrected = new_values - state_keys @ s
    out = q_read @ s + inner @ corrected
    return s * carried[..., None, None] + jnp.swapaxes(k_write, -1, -2) @ corrected, out

  if state is None:
    state = jnp.zeros((batch, heads, dk, dv), v.dtype)
  state, out = jax.lax.scan(step, state, (new_values, state_keys, inner, q_read, k_write, carried))
  return jnp.moveaxis(out, (0, 2), (1, 3)).reshape(batch, length, heads, dv), state


def document_starts(segments, before):
  """[B, T] whether a document starts at each token: its segment id differs from the token's
  before it (`before` [B], the segment id of the token before the row, _NONE for none)."""
  previous = jnp.concatenate([before[:, None], segments[:, :-1]], axis=1)
  return segments != previous


def _mixed(q, k, v, b, a, convs, a_log, dt_bias, segments, halos=None, halo_segments=None):
  """Convolved, activated and normalised queries, keys (repeated to the value heads) and values,
  the decays g and rates beta of one row piece (halos: the tokens before it), in float32 (or the
  inputs' wider type)."""
  dtype = jnp.promote_types(q.dtype, jnp.float32)
  halos = halos or (None,) * 3
  q, k, v = (jax.nn.silu(causal_conv(x.astype(dtype), w.astype(dtype), segments, halo, halo_segments))
             for x, w, halo in zip((q, k, v), convs, halos))
  groups = v.shape[2] // q.shape[2]
  q = jnp.repeat(l2_normalized(q), groups, axis=2) * q.shape[-1]**-0.5
  k = jnp.repeat(l2_normalized(k), groups, axis=2)
  beta = jax.nn.sigmoid(b.astype(dtype))
  g = -jnp.exp(a_log.astype(dtype)) * jax.nn.softplus(a.astype(dtype) + dt_bias.astype(dtype))
  return q, k, v, g, beta


def local_rule(cfg, q, k, v, b, a, convs, a_log, dt_bias, segments):
  """The layer's recurrence on whole rows: [B, T, ...] in, outputs [B, T, Hv, dv] float32."""
  mixed = _mixed(q, k, v, b, a, convs, a_log, dt_bias, segments)
  starts = document_starts(segments, jnp.full(segments.shape[:1], _NONE, segments.dtype))
  return delta_rule(*mixed, starts, cfg.gdn_chunk_size)[0]


def _pieces(x, pieces: int):
  """[B, P * L, ...] -> [P, B, L, ...]."""
  return jnp.moveaxis(x.reshape(x.shape[0], pieces, -1, *x.shape[2:]), 1, 0)


def context_parallel_rule(cfg, q, k, v, b, a, convs, a_log, dt_bias, segments):
  """local_rule on a context shard's tokens, in shard_map over the context axis: the shard holds
  runs of consecutive tokens, its pieces (two with load balancing, context_parallel.balanced_order;
  one without), piece p of shard s being the row's piece order[s, p]."""
  shards, axis = context_parallel.shards(), context_parallel.AXIS
  pieces = 2 if cfg.context_parallel_load_balance else 1
  # balanced_order of a row of 2C tokens: the chunks each shard holds
  order = (context_parallel.balanced_order(2 * shards, shards) if pieces == 2 else np.arange(shards)).reshape(
      shards, pieces)
  held_at = np.argsort(order.reshape(-1))  # row piece -> its index in the shards' pieces, flattened
  me = jax.lax.axis_index(axis)
  # Every piece's last K-1 tokens and their segment ids: the convolution's halo of the piece after it.
  width = cfg.gdn_conv_kernel_dim - 1
  tails = [jax.lax.all_gather(_pieces(x, pieces)[:, :, -width:], axis, tiled=True) for x in (q, k, v, segments)]
  outs, maps = [], []
  for p in range(pieces):
    row_piece = jnp.asarray(order)[me, p]
    before = jnp.asarray(held_at)[jnp.maximum(row_piece - 1, 0)]
    first = row_piece == 0
    halo = [jnp.where(first, jnp.zeros_like(t[0]), t[before]) for t in tails[:3]]
    halo_segments = jnp.where(first, _NONE, tails[3][before])
    piece_segments = _pieces(segments, pieces)[p]
    qq, kk, vv, g, beta = _mixed(*(_pieces(x, pieces)[p] for x in (q, k, v, b, a)), convs, a_log, dt_bias,
                                 piece_segments, halo, halo_segments)
    starts = document_starts(piece_segments, halo_segments[:, -1])
    # The rule on [0 | values] from the state [I | 0]: the first dk columns of the outputs and of
    # the final state are how they depend on the state carried in, the rest what the piece adds.
    dk, dv = kk.shape[-1], vv.shape[-1]
    values = jnp.concatenate([jnp.zeros((*vv.shape[:3], dk), vv.dtype), vv], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(dk, dk + dv, dtype=jnp.float32), (vv.shape[0], vv.shape[2], dk, dk + dv))
    out, final = delta_rule(qq, kk, values, g, beta, starts, cfg.gdn_chunk_size, identity)
    outs.append(out)
    maps.append(final)
  # The state after row piece i is M_i S + C_i (S: the state before it): compose them in row order.
  gathered = jax.lax.all_gather(jnp.stack(maps), axis, tiled=True)[held_at]  # [row pieces, B, H, dk, dk + dv]
  state, states = jnp.zeros_like(gathered[0, ..., dk:]), []
  for m in gathered:  # a few small matmuls per piece, the same on every shard
    states.append(state)
    state = m[..., :dk] @ state + m[..., dk:]
  carried_in = jnp.stack(states)[jnp.asarray(order)[me]]  # the state each of this shard's pieces starts from
  return jnp.concatenate([out[..., dk:] + jnp.einsum("bthk,bhkv->bthv", out[..., :dk], carried_in[p])
                          for p, out in enumerate(outs)], axis=1)


def gdn_macs(cfg) -> float:
  """Multiply-adds per token of a layer, as delta_rule runs it: the projections, and per value
  head the chunk's UT system and scores (C dk each, the whole C x C), its context (C dv), the
  state's two reads and one write (dk dv each), and the triangular solves for the corrected values
  and the state-reading keys (C (dk + dv) / 2)."""
  d, kh, vh, dk, dv = (cfg.base_emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim,
                       cfg.gdn_value_head_dim)
  projections = d * (2 * kh * dk + 2 * vh * dv + 2 * vh) + vh * dv * d
  c = cfg.gdn_chunk_size
  return projections + vh * (c * (2 * dk + dv) + 3 * dk * dv + c * (dk + dv) / 2)


class GatedDeltaNet(nn.Module):
  """Qwen3-Next's linear attention (module docstring). Parameters (MaxText's names):
  in_proj_qkvz [D, Kh, 2 dk + 2 (Hv / Kh) dv] (per key head: its query, key, its value heads'
  values and output gates), in_proj_ba [D, Kh, 2 Hv / Kh] (per key head: its value heads' b,
  then a), conv1d [K, 2 Kh dk + Hv dv] (the queries', keys', values' channels), A_log and dt_bias
  [Hv], norm [dv] (the output norm's scale), out_proj [Hv, dv, D]: Hugging Face's layouts."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids, layer_index):
    del positions, layer_index  # the recurrence has no positions
    cfg = self.config
    dim, kh, vh, dk, dv = (cfg.base_emb_dim, cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim,
                           cfg.gdn_value_head_dim)
    groups, dtype = vh // kh, jnp.dtype(cfg.dtype)
    qkvz = kernel(cfg, "in_proj_qkvz", (dim, kh, 2 * dk + 2 * groups * dv), ("embed", "kv_heads", None))
    ba = kernel(cfg, "in_proj_ba", (dim, kh, 2 * groups), ("embed", "kv_heads", None))
    conv = self.param("conv1d", nn.with_logical_partitioning(nn.initializers.lecun_normal(), (None, None)),
                      (cfg.gdn_conv_kernel_dim, 2 * kh * dk + vh * dv), jnp.dtype(cfg.weight_dtype))
    a_log = self.param("A_log", nn.with_logical_partitioning(
        lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0)), ("heads",)), (vh,),
        jnp.float32)
    dt_bias = self.param("dt_bias", nn.with_logical_partitioning(nn.initializers.ones_init(), ("heads",)), (vh,),
                         jnp.float32)
    norm = NormScale(dv, jnp.dtype(cfg.weight_dtype), name="norm")()
    out_kernel = kernel(cfg, "out_proj", (vh, dv, dim), ("heads", "kv", "embed"), num_in_axes=2)

    x = x.astype(dtype)
    mixed = matmul(cfg, "btd,dnf->btnf", x, weights_as(qkvz, dtype))
    q = checkpoint_name(nn.with_logical_constraint(mixed[..., :dk], KEY_HEADS), "query_proj")
    k = checkpoint_name(nn.with_logical_constraint(mixed[..., dk:2 * dk], KEY_HEADS), "key_proj")
    per_value = lambda y: nn.with_logical_constraint(y.reshape(*y.shape[:2], vh, dv), VALUE_HEADS)
    v = checkpoint_name(per_value(mixed[..., 2 * dk:2 * dk + groups * dv]), "value_proj")
    z = per_value(mixed[..., 2 * dk + groups * dv:])
    gates = matmul(cfg, "btd,dnf->btnf", x, weights_as(ba, dtype))
    b, a = (nn.with_logical_constraint(y.reshape(*y.shape[:2], vh), GATES)
            for y in (gates[..., :groups], gates[..., groups:]))
    convs = (conv[:, :kh * dk].reshape(-1, kh, dk), conv[:, kh * dk:2 * kh * dk].reshape(-1, kh, dk),
             conv[:, 2 * kh * dk:].reshape(-1, vh, dv))
    if context_parallel.shards() > 1:
      batch, length, heads = (nn.logical_to_mesh_axes(VALUE_HEADS)[i] for i in range(3))
      key_heads = nn.logical_to_mesh_axes(KEY_HEADS)[2]
      by_key, by_value = PartitionSpec(batch, length, key_heads, None), PartitionSpec(batch, length, heads, None)
      gate_spec = PartitionSpec(batch, length, heads)
      core = jax.shard_map(
          lambda *args: context_parallel_rule(cfg, *args),
          in_specs=(by_key, by_key, by_value, gate_spec, gate_spec,
                    (PartitionSpec(None, key_heads, None),) * 2 + (PartitionSpec(None, heads, None),),
                    PartitionSpec(heads), PartitionSpec(heads), PartitionSpec(batch, length)),
          out_specs=by_value, check_vma=False)(q, k, v, b, a, convs, a_log, dt_bias, segment_ids)
    else:
      core = local_rule(cfg, q, k, v, b, a, convs, a_log, dt_bias, segment_ids)
    core = checkpoint_name(nn.with_logical_constraint(core, VALUE_HEADS), "attention_out")
    # The gated norm: the norm's scale as stored (not zero-centred), times silu of the gate.
    normed = normalize(core, norm, cfg.normalization_layer_epsilon, False, jnp.float32)
    gated = (normed * jax.nn.silu(z.astype(jnp.float32))).astype(dtype)
    return checkpoint_name(matmul(cfg, "btnh,nhd->btd", gated, weights_as(out_kernel, dtype)), "out_proj")


costs.MIXER_MACS["gated_delta_net"] = gdn_macs
