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


def apply_rope(x, positions, max_timescale: float):
  """Rotates feature pairs (i, i + d/2) of x [B, T, heads, d] by angles set by `positions` [B, T].

  Positions come from the batch, not from the row index, so packed documents each start
  at 0 and a sequence shard uses its global positions.
  """
  half = x.shape[-1] // 2
  timescale = max_timescale ** (jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions[:, :, None, None].astype(jnp.float32) / timescale  # [B, T, 1, half]
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
