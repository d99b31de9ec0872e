"""The decoder-only language model: embedding, decoder stack, output head."""

import flax.linen as nn
import jax.numpy as jnp

from MaxText import head
from MaxText.layers.decoders import Decoder
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import kernel_init
from MaxText.layers.multi_token_prediction import MultiTokenPrediction


class Transformer(nn.Module):
  """tokens, positions, segment ids [B, T] -> logits [B, T, V] in float32 (soft-capped when
  final_logits_soft_cap is set).

  With return_hidden=True it returns (final-normed hidden states [B, T, D], output kernel
  [D, V], multi-token prediction's final-normed hidden states: a tuple of mtp_num_layers
  [B, T, D], the k-th at position i predicting token i + k + 1) instead, before the cap, so that
  the loss can be tiled and the full logits never exist. The kernel is the head's own parameter,
  or the embedding table transposed when logits_via_embedding=true, cast to the activation dtype
  in both cases. The multi-token prediction layers always exist (so init creates them); when
  only the logits are asked for, jit drops their unused computation.
  """

  config: object

  @nn.compact
  def __call__(self, tokens, positions, segment_ids, return_hidden=False):
    cfg = self.config
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    embed = Embed(cfg.vocab_size, cfg.base_emb_dim, dtype, weight_dtype, name="token_embedder")
    x = embed(tokens)
    if cfg.scale_embedding:
      x = x * jnp.asarray(cfg.base_emb_dim**0.5, x.dtype)
    hidden, pre_norm = Decoder(cfg, name="decoder")(x, positions, segment_ids)
    mtp_hidden = (MultiTokenPrediction(cfg, name="mtp")(pre_norm, x, positions, segment_ids) if cfg.mtp_num_layers
                  else ())
    if cfg.logits_via_embedding:
      kernel = embed.embedding.T
    else:
      kernel = self.param("logits_kernel", nn.with_logical_partitioning(kernel_init(1), ("embed", "vocab")),
                          (cfg.base_emb_dim, cfg.vocab_size), weight_dtype)
    kernel = kernel.astype(dtype)
    if return_hidden:
      return hidden, kernel, mtp_hidden
    return head.logits(hidden, kernel, cfg.final_logits_soft_cap)
