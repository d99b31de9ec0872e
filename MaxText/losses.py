"""The training loss: the weighted sums of cross entropy + z-loss, z-loss and correct
predictions over a batch's tokens, either from the whole logits or vocabulary-tiled
(num_vocab_tiling > 1) through the output head (`head`).

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

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText import head

TILE_TOKENS = (None, "activation_batch", "activation_length")
TILE_HIDDEN = (None, *head.HIDDEN)
MODES = ("fused", "recompute")  # vocab_tiling_mode: see the module doc


def to_tiles(x, num_tiles):
  """[B, T, ...] -> [num_tiles, B, ceil(T / num_tiles), ...], padding T with zeros; tile k
  holds positions t with t % num_tiles == k."""
  batch, length = x.shape[:2]
  pad = -length % num_tiles
  x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(batch, (length + pad) // num_tiles, num_tiles, *x.shape[2:])
  return jnp.moveaxis(x, 2, 0)


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


def _zeros_like_kernel(kernel):
  return nn.with_logical_constraint(jnp.zeros(kernel.shape, jnp.float32), head.KERNEL)


def _tile_sums(h, kernel, t, w, z_loss_multiplier, cap, with_grads):
  """One tile's [loss, z_loss, correct] and, when with_grads, the loss's gradients for the
  tile's hidden states and the kernel (float32), d_logits from jax.vjp of the loss head."""
  logits = head.raw_logits(h, kernel)
  loss_head = lambda raw: token_sums(head.soft_cap(raw, cap), t, w, z_loss_multiplier)
  if not with_grads:
    return loss_head(logits), None
  sums, vjp = jax.vjp(loss_head, logits)
  (d_logits,) = vjp(jnp.array([1.0, 0.0, 0.0], jnp.float32))
  return sums, head.grads(h, kernel, d_logits)


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

