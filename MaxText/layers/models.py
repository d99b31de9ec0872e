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

  def setup(self):
    cfg = self.config
    self.token_embedder = Embed(cfg.vocab_size, cfg.base_emb_dim, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype))
    self.decoder = Decoder(cfg)
    self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_num_layers else None
    if not cfg.logits_via_embedding:
      self.logits_kernel = self.param("logits_kernel", nn.with_logical_partitioning(kernel_init(1), ("embed", "vocab")),
                                      (cfg.base_emb_dim, cfg.vocab_size), jnp.dtype(cfg.weight_dtype))

  def embed(self, tokens):
    """tokens [B, T] -> the decoder's input [B, T, D] (scaled by sqrt(D) where the family does)."""
    x = self.token_embedder(tokens)
    if self.config.scale_embedding:
      x = x * jnp.asarray(self.config.base_emb_dim**0.5, x.dtype)
    return x

  def output_kernel(self):
    """The head's [D, V] kernel in the activation dtype."""
    kernel = self.token_embedder.embedding.T if self.config.logits_via_embedding else self.logits_kernel
    return kernel.astype(jnp.dtype(self.config.dtype))

  def __call__(self, tokens, positions, segment_ids, return_hidden=False):
    x = self.embed(tokens)
    hidden, pre_norm = self.decoder(x, positions, segment_ids)
    mtp_hidden = self.mtp(pre_norm, x, positions, segment_ids) if self.mtp is not None else ()
    kernel = self.output_kernel()
    if return_hidden:
      return hidden, kernel, mtp_hidden
    return head.logits(hidden, kernel, self.config.final_logits_soft_cap)
