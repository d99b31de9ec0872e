"""The decoder layer and the layer stack (scanned or looped, with every-N-th-layer remat)."""

import flax.linen as nn
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import MlpBlock
from MaxText.layers.normalizations import RMSNorm

BATCH_LENGTH_EMBED = ("activation_batch", "activation_length", "activation_embed")


def rms_norm(cfg, name):
  return RMSNorm(cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype),
                 name=name)


class DecoderLayer(nn.Module):
  """Pre-norm Llama layer: x + attn(norm(x)), then h + mlp(norm(h))."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    x = checkpoint_name(nn.with_logical_constraint(x, BATCH_LENGTH_EMBED), "decoder_layer_input")
    attn = Attention(cfg, name="self_attention")(rms_norm(cfg, "pre_self_attention_norm")(x),
                                                 positions, segment_ids)
    h = nn.with_logical_constraint(x + attn, BATCH_LENGTH_EMBED)
    mlp = MlpBlock(cfg, name="mlp")(rms_norm(cfg, "post_self_attention_norm")(h))
    return nn.with_logical_constraint(h + mlp, BATCH_LENGTH_EMBED)


def layer_class(cfg, checkpointed: bool, in_scan: bool):
  """DecoderLayer, wrapped in nn.remat with the configured policy when `checkpointed`."""
  if not checkpointed or cfg.remat_policy == "none":
    return DecoderLayer
  # Inside a scan the loop already stops XLA from merging recomputation into the forward
  # pass, and prevent_cse=True would only block optimisations.
  return nn.remat(DecoderLayer, policy=remat.checkpoint_policy(cfg), prevent_cse=not in_scan)


class DecoderBlock(nn.Module):
  """`num_layers` consecutive layers: the first applies the remat policy, the rest keep everything.

  With remat_layer_interval=N the stack is made of blocks of N layers, so the policy
  applies to layers 0, N, 2N, ... exactly as with a Python loop.
  """

  config: object
  num_layers: int
  in_scan: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    for i in range(self.num_layers):
      x = layer_class(self.config, i == 0, self.in_scan)(self.config, name=f"layer_{i}")(
          x, positions, segment_ids)
    return x, None  # (carry, per-step output) as nn.scan expects


class Decoder(nn.Module):
  """The layer stack and the final norm.

  scan_layers=true: nn.scan over blocks of remat_layer_interval layers, parameters stacked
  on a leading `layers` axis (one compiled body); the depth % interval layers left over
  form one more, unscanned block. scan_layers=false: a Python loop of layers_0..layers_{L-1}.
  """

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    depth, interval = cfg.base_num_decoder_layers, cfg.remat_layer_interval
    if cfg.scan_layers:
      groups, rest = divmod(depth, interval)
      stack = nn.scan(DecoderBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                      in_axes=(nn.broadcast, nn.broadcast), length=groups,
                      metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(cfg, interval, True, name="layers")(x, positions, segment_ids)
      if rest:
        x, _ = DecoderBlock(cfg, rest, False, name="layers_rest")(x, positions, segment_ids)
    else:
      for i in range(depth):
        x = layer_class(cfg, i % interval == 0, False)(cfg, name=f"layers_{i}")(
            x, positions, segment_ids)
    return rms_norm(cfg, "decoder_norm")(x)
