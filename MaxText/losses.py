"""The output head and the training loss: logits = soft_cap(hidden @ kernel), and the weighted
sums of cross entropy + z-loss, z-loss and correct predictions over a batch's tokens, either from
the whole logits or vocabulary-tiled (num_vocab_tiling > 1).

Vocabulary tiling: cross entropy over [tokens, vocab] logits that never exist whole. The tokens
are split into `num_tiles` tiles and a `lax.scan` walks them, so at most one tile's logits
[B, T/num_tiles, V] are alive at a time. Gradients come from a `custom_vjp`:

- mode="fused" (default): while the forward has a tile's logits it also forms that tile's
  gradients for the hidden states and the kernel; the backward only scales them by the
  incoming cotangent. Three head matmuls per tile (logits, d_hidden, d_kernel), the same
  as untiled training, so tiling costs no extra compute. Residuals: d_hidden [B, T, D] and
  d_kernel [D, V] in float32.
- mode="recompute": the forward keeps only its inputs and the backward recomputes each
  tile's logits (four matmuls per tile, smaller residuals).

Tile k holds sequence positions t with t % num_tiles == k. Tiles are strided rather than
contiguous so every tile keeps the batch's own [batch, length] layout: under data, FSDP or
sequence sharding each device computes its share of every tile with no data movement,
where a contiguous split of the flattened tokens would leave most devices idle per tile.
A length not divisible by num_tiles is padded with zero-weight tokens.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText import sharding
from MaxText.layers import context_parallel, moe

TILE_TOKENS = (None, "activation_batch", "activation_length")
TILE_HIDDEN = TILE_TOKENS + ("activation_embed",)
TILE_LOGITS = ("activation_batch", "activation_length", "activation_vocab")
KERNEL = ("embed", "vocab")
MODES = ("fused", "recompute")  # vocab_tiling_mode: see the module doc


def to_tiles(x, num_tiles):
  """[B, T, ...] -> [num_tiles, B, ceil(T / num_tiles), ...], padding T with zeros; tile k
  holds positions t with t % num_tiles == k."""
  batch, length = x.shape[:2]
  pad = -length % num_tiles
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(batch, (length + pad) // num_tiles, num_tiles, *x.shape[2:])
  return jnp.moveaxis(x, 2, 0)


def _tile_logits(hidden, kernel):
  return nn.with_logical_constraint(_head_matmul(hidden, kernel, transpose=False), TILE_LOGITS)


def soft_cap(logits, cap: float):
  """cap * tanh(logits / cap) (Gemma 2's final-logit soft cap); 0 leaves the logits as they are."""
  return cap * jnp.tanh(logits / cap) if cap else logits


def token_sums(logits, targets, weights, z_loss_multiplier):
  """The loss head, defined once for the untiled loss and every tile: weighted sums over the
  tokens of [cross entropy + z-loss, z-loss, correct predictions]. The tiles' gradients come
  from autodiff through this function, so a new head needs no hand-written derivative."""
  lse = jax.nn.logsumexp(logits, axis=-1)
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  z_loss = jnp.sum(weights * z_loss_multiplier * jnp.square(lse))
  loss = jnp.sum(weights * (lse - target_logit)) + z_loss
  correct = jnp.sum(weights * (jnp.argmax(logits, axis=-1) == targets))
  return jnp.stack([loss, z_loss, correct])


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
  batch, length, act_embed = sharding.mesh_axes(*TILE_HIDDEN[1:])
  vocab = sharding.mesh_axes(*TILE_LOGITS)[2]
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


def _head_matmul(x, kernel, transpose: bool):
  """hidden [B, T, D] @ kernel [D, V] -> float32 logits [B, T, V], or with `transpose` the
  logits' gradient [B, T, V] @ kernel^T -> float32 [B, T, D].

  The kernel's rows are sharded (over the `embed` axes, FSDP's) and the tokens carry every
  feature, so the product needs whole kernel rows; gathering the kernel at once would put all
  of it, [D, V] (1 GiB in bfloat16 at llama3-8b), on every device. Here each device gathers its
  vocabulary columns one chunk (the size of its own shard) at a time, so no device holds more
  than its shard plus one chunk. The sums are the same; only their order may differ."""
  spec = "btv,dv->btd" if transpose else "btd,dv->btv"
  mesh = jax.sharding.get_abstract_mesh()
  batch, length, act_embed = sharding.mesh_axes(*TILE_HIDDEN[1:])
  vocab = sharding.mesh_axes(*TILE_LOGITS)[2]
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


def _head_grads(hidden, kernel, d_logits):
  """The head matmul's gradients for the logits' gradient d_logits [B, T, V]: d_hidden
  [B, T, D] and d_kernel [D, V], both float32, d_kernel laid out as the kernel."""
  d_logits = d_logits.astype(kernel.dtype)
  return _head_matmul(d_logits, kernel, transpose=True), _kernel_grad(hidden, d_logits)


def logits(hidden, kernel, cap: float):
  """The model's output: float32 logits soft_cap(hidden [B, T, D] @ kernel [D, V], cap)."""
  return soft_cap(_untiled_logits(hidden, kernel), cap)


@jax.custom_vjp
def _untiled_logits(hidden, kernel):
  """Untiled float32 logits hidden [B, T, D] @ kernel [D, V]. Differentiated like the
  tiles, so the kernel's gradient is reduced shard by shard (see _kernel_grad)."""
  return _tile_logits(hidden, kernel)


def _untiled_logits_forward(hidden, kernel):
  return _tile_logits(hidden, kernel), (hidden, kernel)


def _untiled_logits_backward(residuals, d_logits):
  hidden, kernel = residuals
  d_hidden, d_kernel = _head_grads(hidden, kernel, d_logits)
  return d_hidden.astype(hidden.dtype), d_kernel.astype(kernel.dtype)


_untiled_logits.defvjp(_untiled_logits_forward, _untiled_logits_backward)


def _zeros_like_kernel(kernel):
  return nn.with_logical_constraint(jnp.zeros(kernel.shape, jnp.float32), KERNEL)


def _tile_sums(h, kernel, t, w, z_loss_multiplier, cap, with_grads):
  """One tile's [loss, z_loss, correct] and, when with_grads, the loss's gradients for the
  tile's hidden states and the kernel (float32), d_logits from jax.vjp of the head."""
  logits = _tile_logits(h, kernel)
  head = lambda raw: token_sums(soft_cap(raw, cap), t, w, z_loss_multiplier)
  if not with_grads:
    return head(logits), None
  sums, vjp = jax.vjp(head, logits)
  (d_logits,) = vjp(jnp.array([1.0, 0.0, 0.0], jnp.float32))
  return sums, _head_grads(h, kernel, d_logits)


def _scan_tiles(hidden, kernel, targets, weights, z_loss_multiplier, cap, with_grads):
  """Walks the tiles: ([loss, z_loss, correct] summed, and when with_grads the loss's
  gradients: d_hidden in tiles and d_kernel accumulated in float32, in the inputs' dtypes)."""

  def step(carry, tile):
    sums, d_kernel = carry
    h, t, w = tile
    tile_sums, grads = _tile_sums(h, kernel, t, w, z_loss_multiplier, cap, with_grads)
    if not with_grads:
      return (sums + tile_sums, None), None
    d_h, d_k = grads
    return (sums + tile_sums, d_kernel + d_k), d_h.astype(h.dtype)

  init = (jnp.zeros(3, jnp.float32), _zeros_like_kernel(kernel) if with_grads else None)
  (sums, d_kernel), d_hidden = jax.lax.scan(step, init, (hidden, targets, weights))
  return sums, d_hidden, d_kernel.astype(kernel.dtype) if with_grads else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _tiled_sums(hidden, kernel, targets, weights, z_loss_multiplier, cap, mode):
  """Tiled inputs -> [loss, z_loss, correct], each summed over all tiles."""
  return _scan_tiles(hidden, kernel, targets, weights, z_loss_multiplier, cap, with_grads=False)[0]


def _tiled_forward(hidden, kernel, targets, weights, z_loss_multiplier, cap, mode):
  if mode == "fused":
    sums, d_hidden, d_kernel = _scan_tiles(hidden, kernel, targets, weights, z_loss_multiplier, cap, with_grads=True)
    return sums, (d_hidden, d_kernel)
  sums = _scan_tiles(hidden, kernel, targets, weights, z_loss_multiplier, cap, with_grads=False)[0]
  return sums, (hidden, kernel, targets, weights)


def _tiled_backward(z_loss_multiplier, cap, mode, residuals, cotangent):
  # Only the loss is differentiated: z-loss (already inside the loss) and the accuracy are
  # reported through stop_gradient, so their cotangents are always zero.
  if mode == "fused":
    d_hidden, d_kernel = residuals
  else:  # the same gradients, recomputed tile by tile from the inputs
    _, d_hidden, d_kernel = _scan_tiles(*residuals, z_loss_multiplier, cap, with_grads=True)
  scale = lambda x: (cotangent[0] * x.astype(jnp.float32)).astype(x.dtype)
  return scale(d_hidden), scale(d_kernel), None, None


_tiled_sums.defvjp(_tiled_forward, _tiled_backward)

def tiled_token_sums(hidden, kernel, targets, weights, num_tiles, z_loss_multiplier=0.0, mode="fused",
                     logits_soft_cap=0.0):
  """token_sums of logits = soft_cap(hidden @ kernel) without materialising the logits:
  (loss_sum, z_loss_sum, correct_sum), float32 scalars.

  hidden [B, T, D] (any float dtype), kernel [D, V], targets [B, T] int, weights [B, T]
  (0 for padding). Logits are computed in float32, one tile at a time:
    loss_sum = sum w * (logsumexp(z) - z[target]) + z_loss_multiplier * sum w * logsumexp(z)^2
  with z_loss_sum the second term alone and correct_sum the weights where argmax(z) == target,
  for logging. Only loss_sum is differentiable (in hidden and kernel, gradients in their dtypes).
  """
  if mode not in MODES:
    raise ValueError(f"mode={mode!r}: must be one of {', '.join(MODES)}")
  if num_tiles < 1:
    raise ValueError(f"num_tiles={num_tiles}: must be >= 1")
  h = nn.with_logical_constraint(to_tiles(hidden, num_tiles), TILE_HIDDEN)
  t = nn.with_logical_constraint(to_tiles(targets, num_tiles), TILE_TOKENS)
  w = nn.with_logical_constraint(to_tiles(weights.astype(jnp.float32), num_tiles), TILE_TOKENS)
  sums = _tiled_sums(h, kernel, t, w, float(z_loss_multiplier), float(logits_soft_cap), mode)
  return sums[0], jax.lax.stop_gradient(sums[1]), jax.lax.stop_gradient(sums[2])


def batch_sums(model, config, params, batch):
  """Sums over the batch's scored tokens: (loss incl. z-loss and the MoE router's losses,
  {weights, z_loss, correct}, and for MoE models moe_aux_loss (the router's share of the loss)
  and the router's statistics, each times the scored tokens), from the whole logits or, with
  num_vocab_tiling > 1, tile by tile. Under load-balanced context parallelism the batch is
  reordered first, targets with their tokens: sums are unchanged."""
  batch = context_parallel.load_balance(config, batch)
  weights = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  targets = batch["targets"]
  if config.num_vocab_tiling > 1:
    (hidden, kernel), state = model.apply({"params": params}, *inputs, return_hidden=True, mutable="intermediates")
    loss, z_loss, correct = tiled_token_sums(
        hidden, kernel, targets, weights, config.num_vocab_tiling, config.z_loss_multiplier,
        config.vocab_tiling_mode, config.final_logits_soft_cap)
  else:
    logits, state = model.apply({"params": params}, *inputs, mutable="intermediates")
    loss, z_loss, correct = token_sums(logits, targets, weights, config.z_loss_multiplier)
  total = jnp.sum(weights)
  sums = {"weights": total, "z_loss": z_loss, "correct": correct}
  router = moe.aux_means(state.get("intermediates", {}))
  if router:
    # The router's losses are means over tokens and layers; as sums they weigh each microbatch
    # by its scored tokens, like the cross entropy.
    aux = total * (config.load_balance_loss_weight * router["moe_lb_loss"]
                   + config.router_z_loss_weight * router["moe_z_loss"])
    loss = loss + aux
    sums["moe_aux_loss"] = jax.lax.stop_gradient(aux)
    sums.update({name: total * jax.lax.stop_gradient(value) for name, value in router.items()})
  return loss, sums
