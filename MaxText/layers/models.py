"""The decoder-only language model: embedding, decoder stack, output head."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from MaxText import head
from MaxText.layers import decoders, moe, multi_token_prediction, pipeline
from MaxText.layers.decoders import Decoder
from MaxText.layers.embeddings import Embed
from MaxText.layers.linears import kernel_init
from MaxText.layers.multi_token_prediction import MultiTokenPrediction


class Transformer(nn.Module):
  """tokens, positions, segment ids [B, T] -> logits [B, T, V] in float32 (soft-capped when
  final_logits_soft_cap is set).

  With return_hidden=True it returns (final-normed hidden states [B, T, D], output kernel
  [D, V], the decoder's output before its final norm [B, T, D]) instead, before the cap, so that
  the loss can be tiled and the full logits never exist. The kernel is the head's own parameter,
  or the embedding table transposed when logits_via_embedding=true, cast to the activation dtype
  in both cases. Multi-token prediction's layers follow the decoder (`predict`): init creates
  them, and the training objective runs them on each (micro)batch (objective.py).
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

  def predict(self, pre_norm, tokens, positions, segment_ids):
    """Multi-token prediction's final-normed hidden states from the decoder's output before its
    final norm: a tuple of mtp_num_layers [B, T, D], the k-th at position i predicting token
    i + k + 1; () without them."""
    return self.mtp(pre_norm, self.embed(tokens), positions, segment_ids) if self.mtp is not None else ()

  def __call__(self, tokens, positions, segment_ids, return_hidden=False):
    hidden, pre_norm = self.decoder(self.embed(tokens), positions, segment_ids)
    if self.is_initializing():
      self.predict(pre_norm, tokens, positions, segment_ids)
    kernel = self.output_kernel()
    if return_hidden:
      return hidden, kernel, pre_norm
    return head.logits(hidden, kernel, self.config.final_logits_soft_cap)


def updates(cfg, intermediates, staged=None):
  """What update_parameters needs from a forward pass: None, or with routed_bias the MoE layers'
  loads per expert shaped as the parameters store them (moe.update_routed_bias's), for the parts
  that `intermediates` (what model.apply sowed there) hold; `staged`: what a 1F1B pipeline's
  stages reported for the last stack, summed over the microbatches (objective.one_f_one_b)."""
  if not cfg.routed_bias:
    return None
  loads = {}
  if "decoder" in intermediates:
    loads["decoder"] = decoders.expert_loads(cfg, intermediates)
  if staged is not None:
    stack = decoders.stacks(cfg)[-1]
    loads["decoder"] = {stack.name: jax.tree.map(lambda x: pipeline.to_stage_order(cfg, x),
                                                 decoders.stored_loads(stack, staged[moe.EXPERT_LOAD]))}
  if "mtp" in intermediates:
    loads["mtp"] = multi_token_prediction.expert_loads(cfg, intermediates)
  return loads


def update_parameters(cfg, params, updates):
  """params after the optimizer's update moved by what `updates` says (routed_bias: each router's
  correction bias by its experts' loads)."""
  return params if updates is None else moe.update_routed_bias(params, updates, cfg.routed_bias_update_rate)
