"""Token embedding and rotary position embedding (RoPE)."""

import flax.linen as nn
import jax.numpy as jnp

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
    return jnp.take(self.embedding, tokens, axis=0).astype(self.dtype)


def rope_timescales(cfg, head_dim: int):
  """[head_dim / 2] wavelengths / 2pi of the rotated feature pairs: rope_max_timescale^(i / half),
  and with rope_type=llama3.1 Llama 3.1's rescaling: pairs whose wavelength exceeds
  rope_original_max_position / rope_low_freq_factor slowed by rope_scaling_factor, those
  below rope_original_max_position / rope_high_freq_factor kept, a linear blend between."""
  half = head_dim // 2
  timescale = cfg.rope_max_timescale ** (jnp.arange(half, dtype=jnp.float32) / half)
  if cfg.rope_type == "default":
    return timescale
  factor, low, high, original = (cfg.rope_scaling_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                                 cfg.rope_original_max_position)
  wavelength = 2 * jnp.pi * timescale
  blend = jnp.clip((original / wavelength - low) / (high - low), 0.0, 1.0)  # 0: slowed, 1: kept
  return timescale / ((1 - blend) / factor + blend)


def apply_rope(x, positions, timescale):
  """Rotates feature pairs (i, i + d/2) of x [B, T, heads, d] by positions [B, T] / timescale [d/2].

  Positions come from the batch, not from the row index, so packed documents each start
  at 0 and a sequence shard uses its global positions.
  """
  angles = positions[:, :, None, None].astype(jnp.float32) / timescale  # [B, T, 1, half]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
