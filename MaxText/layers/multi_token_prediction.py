"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437, section 2.2): mtp_num_layers = D
layers after the decoder. Layer k (1 .. D) at position i reads its predecessor's hidden state
h_{k-1}[i] (h_0: the decoder's output before its final norm, as MaxText takes it) and the
embedding of token i + k, and its output, through its own final norm and the model's output
head, predicts token i + k + 1:

  h_k[i] = TRM_k(W_k [RMSNorm_e(Emb(t[i + k])) ; RMSNorm_h(h_{k-1}[i])])

The concatenation's order is DeepSeek's (its eh_proj reads [enorm(embedding) ; hnorm(hidden)]),
so the projection is a Hugging Face checkpoint's eh_proj transposed. TRM_k is one decoder layer
of the model's kind, attending causally within the rows' documents as the decoder does.
"""

import flax.linen as nn
import jax.numpy as jnp

from MaxText.layers import moe, terms
from MaxText.layers.blocks import layer_kind
from MaxText.layers.decoders import layer_class
from MaxText.layers.linears import BATCH_LENGTH_EMBED, kernel_init, matmul, weights_as
from MaxText.layers.normalizations import rms_norm

# The projection [2D, D] is sharded like an MLP's output projection [mlp, embed].
PROJECTION_AXES = ("mlp", "embed")


def shifted(x, k: int):
  """x[:, i + k] at position i ([B, T, ...]); the last k positions wrap around. Causal attention
  keeps them from every position whose prediction is scored (the loss's weights drop the rest)."""
  return jnp.roll(x, -k, axis=1)


def weights(batch, k: int):
  """Which positions i the k-th layer is scored at: those whose target t[i + k + 1] (targets[i + k])
  is scored, within the row and in position i's document."""
  segments = batch["inputs_segmentation"]
  inside = jnp.arange(segments.shape[1]) < segments.shape[1] - k
  same_document = shifted(segments, k) == segments
  return (inside & same_document & (shifted(batch["targets_segmentation"], k) != 0)).astype(jnp.float32)


def term(cfg, hidden_states, batch, cross_entropy) -> terms.Term:
  """The D layers' term of the training objective: the mean over the layers of their cross
  entropies, each a mean over its scored tokens (mtp_loss, and mtp_loss_{k} each one's where
  D > 1), the loss adding mtp_loss_scaling_factor times it. cross_entropy(hidden, targets,
  weights) is the model's head's, summed over the weighted tokens."""
  means = []
  for k, hidden in enumerate(hidden_states, 1):
    scored = weights(batch, k)
    means.append(cross_entropy(hidden, shifted(batch["targets"], k), scored) / jnp.maximum(jnp.sum(scored), 1.0))
  mean = sum(means) / len(means)
  each = {f"mtp_loss_{k}": m for k, m in enumerate(means, 1)} if len(means) > 1 else {}
  return terms.Term(cfg.mtp_loss_scaling_factor * mean, {"mtp_loss": mean, **each}, jnp.ones((), jnp.float32))


class MtpLayer(nn.Module):
  """One prediction depth: (h_{k-1}, embeddings of the tokens k ahead) -> (h_k, h_k through
  its final norm, for the output head). `layer_index` is the model's index of the layer
  (base_num_decoder_layers + k - 1, where DeepSeek's checkpoints keep it)."""

  config: object
  layer_index: int

  @nn.compact
  def __call__(self, hidden, embedded, positions, segment_ids):
    cfg = self.config
    dtype = jnp.dtype(cfg.dtype)
    joined = jnp.concatenate([rms_norm(cfg, "embedding_norm")(embedded), rms_norm(cfg, "hidden_state_norm")(hidden)],
                             axis=-1)
    kernel = self.param("projection", nn.with_logical_partitioning(kernel_init(1), PROJECTION_AXES),
                        (2 * cfg.base_emb_dim, cfg.base_emb_dim), jnp.dtype(cfg.weight_dtype))
    x = nn.with_logical_constraint(matmul(cfg, "btc,cd->btd", joined, weights_as(kernel, dtype)), BATCH_LENGTH_EMBED)
    x = layer_class(cfg, True, False)(cfg, *layer_kind(cfg, self.layer_index), name="transformer_layer")(
        x, positions, segment_ids, self.layer_index)
    return x, rms_norm(cfg, "shared_head_norm")(x)


class MultiTokenPrediction(nn.Module):
  """The D layers, mtp/layer_1 .. layer_D, in turn: the decoder's pre-norm hidden states and
  the (scaled) token embeddings [B, T, D] -> each layer's final-normed hidden states, the k-th
  at position i predicting token i + k + 1."""

  config: object

  @nn.compact
  def __call__(self, hidden, embedded, positions, segment_ids):
    cfg = self.config
    outputs = []
    for k in range(1, cfg.mtp_num_layers + 1):
      hidden, normed = MtpLayer(cfg, cfg.base_num_decoder_layers + k - 1, name=f"layer_{k}")(
          hidden, shifted(embedded, k), positions, segment_ids)
      outputs.append(normed)
    return tuple(outputs)


def expert_loads(cfg, intermediates) -> dict:
  """{layer_k: [E]} the load per expert that each MoE prediction layer sowed, from model.apply's
  intermediates (moe.update_routed_bias's loads["mtp"])."""
  return {f"layer_{k}": intermediates["mtp"][f"layer_{k}"]["transformer_layer"]["moe_block"][moe.EXPERT_LOAD][0]
          for k in range(1, cfg.mtp_num_layers + 1) if layer_kind(cfg, cfg.base_num_decoder_layers + k - 1).moe}
