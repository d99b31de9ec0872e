"""Token embedding and rotary position embedding (RoPE)."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText import sharding

# std 1/sqrt(emb_dim): with the table tied to the output head, logits of a unit-RMS
# hidden state then start with unit scale.
embedding_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=1, out_axis=0)


class Embed(nn.Module):
  """A [vocab, embed] table: `__call__` looks tokens up; `.embedding` is also the tied head."""

  num_embeddings: int
  features: int
  dtype: jnp.dtype
  weight_dtype: jnp.dtype

  def setup(self):
    self.embedding = self.param(
        "embedding", nn.with_logical_partitioning(embedding_init, ("vocab", "embed")),
        (self.num_embeddings, self.features), self.weight_dtype)

  def __call__(self, tokens):
    return lookup(self.embedding, tokens).astype(self.dtype)


def lookup(table, tokens):
  """table [V, D] rows for tokens [B, T]: [B, T, D], laid out as the activations (batch, length).

  Under a mesh the table stays sharded, its rows over the `vocab` axes and its columns over the
  `embed` axes: a gather the partitioner is left to place would make the whole table (and, in
  the backward, its whole gradient) on every chip. Here the token ids (4 bytes a token) are
  gathered over the embed axes that shard the tokens, each device reads its own table block for
  all of them (rows outside its vocabulary shard read as zero, summed over the vocab axes), and
  an all-to-all returns each device its own tokens with every column. The backward is the
  transpose: the table's gradient is a scatter-add into the device's own block."""
  mesh = jax.sharding.get_abstract_mesh()
  vocab, embed, batch, length, act_embed = map(
      sharding.axes_of, ("vocab", "embed", "activation_batch", "activation_length", "activation_embed"))
  if mesh.empty or act_embed or not (vocab or embed) or set(vocab) & set(batch + length):
    return jnp.take(table, tokens, axis=0)
  token_dim = {**{a: 0 for a in batch}, **{a: 1 for a in length}}  # the token dimension each axis shards
  vocab_size = table.shape[0]

  def local(block, ids):
    for axis in embed:  # major to minor, as the table's columns are laid out
      if axis in token_dim:
        ids = jax.lax.all_gather(ids, axis, axis=token_dim[axis], tiled=True)
    rows = block.shape[0]
    start = jax.lax.axis_index(vocab) * rows if vocab else 0
    local_ids = ids - start
    inside = (local_ids >= 0) & (local_ids < rows)
    x = jnp.where(inside[..., None], jnp.take(block, jnp.clip(local_ids, 0, rows - 1), axis=0), 0)
    if vocab:
      x = jax.lax.psum(x, vocab)
    # An id outside the vocabulary reads NaN, as jnp.take does without a mesh: a bad batch
    # shows as a non-finite loss, the same under every layout, not as a silent zero row.
    x = jnp.where(((ids >= 0) & (ids < vocab_size))[..., None], x, jnp.nan)
    for axis in reversed(embed):  # minor first: each step joins whole runs of columns
      if axis in token_dim:
        x = jax.lax.all_to_all(x, axis, split_axis=token_dim[axis], concat_axis=2, tiled=True)
      else:
        x = jax.lax.all_gather(x, axis, axis=2, tiled=True)
    return x

  spec = lambda *axes: PartitionSpec(*(a or None for a in axes))
  return jax.shard_map(local, in_specs=(spec(vocab, embed), spec(batch, length)), out_specs=spec(batch, length, ()),
                       check_vma=True)(table, tokens)


def rope_timescales(cfg, head_dim: int, sliding=False):
  """[head_dim / 2] wavelengths / 2pi of the rotated feature pairs: rope_max_timescale^(i / half),
  rescaled as rope_type says (ROPE_TYPES), all slowed by rope_linear_scaling_factor. Where
  local_rope_max_timescale is set, the sliding-window layers have their own, plain
  local_rope_max_timescale^(i / half), as Gemma 3's; `sliding` is traced inside a scan, so both
  are formed and it picks one."""
  half = head_dim // 2
  exponent = jnp.arange(half, dtype=jnp.float32) / half
  timescale = ROPE_TYPES[cfg.rope_type](cfg, cfg.rope_max_timescale ** exponent) * cfg.rope_linear_scaling_factor
  if not cfg.local_rope_max_timescale:
    return timescale
  return jnp.where(sliding, cfg.local_rope_max_timescale ** exponent, timescale)


def _llama31(cfg, timescale):
  """Llama 3.1: pairs whose wavelength exceeds rope_original_max_position / rope_low_freq_factor
  slowed by rope_scaling_factor, those below rope_original_max_position / rope_high_freq_factor
  kept, a linear blend in wavelength between (none where the two factors are equal: Llama 4 Scout)."""
  factor, low, high, original = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                 cfg.rope_original_max_position)
  wavelength = 2 * jnp.pi * timescale
  if high == low:
    blend = (original / wavelength >= low).astype(timescale.dtype)
  else:
    blend = jnp.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: slowed, 1: kept
  return timescale / ((1 - blend) / factor + blend)


def _yarn(cfg, timescale):
  """YaRN (Hugging Face's _compute_yarn_parameters): pair i is kept while it turns more than
  beta_fast times over rope_original_max_position tokens, slowed by rope_scaling_factor below
  beta_slow turns, blended linearly in i between; the bounds are rounded outwards to whole pairs
  unless rope_truncate is off (GPT-OSS)."""
  dim, base, original = 2 * timescale.shape[0], cfg.rope_max_timescale, cfg.rope_original_max_position
  # The feature index d whose wavelength base^(d / dim) * 2pi makes `turns` turns over the context.
  index = lambda turns: dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))
  low, high = index(cfg.beta_fast), index(cfg.beta_slow)
  if cfg.rope_truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  slowed = jnp.clip((jnp.arange(timescale.shape[0], dtype=jnp.float32) - low) / ((high - low) or 1e-3), 0.0, 1.0)
  return 1 / ((1 - slowed) / timescale + slowed / (cfg.rope_scaling_factor * timescale))


# rope_type= -> (config, the plain wavelengths / 2pi [half]) -> the rescaled ones. A new rescaling
# is one entry; config_schema takes rope_type's choices from these keys.
ROPE_TYPES = {"default": lambda cfg, timescale: timescale, "llama3.1": _llama31, "yarn": _yarn}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature for a context `factor` times longer: 0.1 mscale ln(factor) + 1."""
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(cfg) -> float:
  """What RoPE's cos and sin are multiplied by (Hugging Face's attention_factor): for yarn
  mscale(mscale) / mscale(mscale_all_dim) where both are set (DeepSeek's, 1 at equal values),
  else mscale(1); 1 for the other types."""
  if cfg.rope_type != "yarn":
    return 1.0
  factor = cfg.rope_scaling_factor
  if cfg.mscale and cfg.mscale_all_dim:
    return yarn_mscale(factor, cfg.mscale) / yarn_mscale(factor, cfg.mscale_all_dim)
  return yarn_mscale(factor)


def apply_rope(x, positions, timescale, factor=1.0):
  """Rotates feature pairs (i, i + d/2) of x [B, T, heads, d] by positions [B, T] / timescale [d/2]
  and multiplies them by `factor` (rope_attention_factor).

  Positions come from the batch, not from the row index, so packed documents each start
  at 0 and a sequence shard uses its global positions.
  """
  angles = positions[:, :, None, None].astype(jnp.float32) / timescale  # [B, T, 1, half]
  sin, cos = factor * jnp.sin(angles), factor * jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
