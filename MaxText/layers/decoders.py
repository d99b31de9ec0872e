"""The decoder layer and the layer stack (scanned or looped, with every-N-th-layer remat)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import BATCH_LENGTH_EMBED, MlpBlock
from MaxText.layers.moe import MoeBlock
from MaxText.layers.normalizations import rms_norm


class DecoderLayer(nn.Module):
  """Pre-norm layer: x + attn(norm(x)), then h + mlp(norm(h)); with sandwich_norms (Gemma 2)
  the attention's and the MLP's outputs are normed too before they join the residual.
  The norms keep MaxText's (and Hugging Face's) names: post_self_attention_norm is the MLP's
  input norm in Llama and the attention's output norm in Gemma 2. layer_index (a Python int,
  or traced in a scan) picks the layer's attention window."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids, layer_index):
    cfg = self.config
    x = checkpoint_name(nn.with_logical_constraint(x, BATCH_LENGTH_EMBED), "decoder_layer_input")
    attn = Attention(cfg, name="self_attention")(rms_norm(cfg, "pre_self_attention_norm")(x),
                                                 positions, segment_ids, layer_index)
    if cfg.sandwich_norms:
      attn = rms_norm(cfg, "post_self_attention_norm")(attn)
    h = nn.with_logical_constraint(x + attn, BATCH_LENGTH_EMBED)
    mlp = mlp_sublayer(cfg, h)
    return nn.with_logical_constraint(h + mlp, BATCH_LENGTH_EMBED)


def mlp_sublayer(cfg, h):
  """The MLP's input norm, the MLP (or the mixture of experts), and with sandwich_norms its
  output norm."""
  mlp_norm = "pre_ffw_norm" if cfg.sandwich_norms else "post_self_attention_norm"
  block = MoeBlock(cfg, name="moe_block") if cfg.moe else MlpBlock(cfg, name="mlp")
  mlp = block(rms_norm(cfg, mlp_norm)(h))
  return rms_norm(cfg, "post_ffw_norm")(mlp) if cfg.sandwich_norms else mlp


class ScannedDecoderLayer(DecoderLayer):
  """DecoderLayer with the (carry, per-step output) signature nn.scan expects."""

  def __call__(self, x, positions, segment_ids, layer_index):
    return super().__call__(x, positions, segment_ids, layer_index), None


def layer_class(cfg, checkpointed: bool, in_scan: bool):
  """DecoderLayer, wrapped in nn.remat with the configured policy when `checkpointed`."""
  if not checkpointed or cfg.remat_policy == "none":
    return DecoderLayer
  # Inside a scan the loop already stops XLA from merging recomputation into the forward
  # pass, and prevent_cse=True would only block optimisations.
  return nn.remat(DecoderLayer, policy=remat.checkpoint_policy(cfg), prevent_cse=not in_scan)


class DecoderBlock(nn.Module):
  """`num_layers` consecutive layers, layer_0 .. layer_{n-1}: the first applies the remat
  policy, the rest keep everything. With remat_layer_interval=N the stack is made of blocks
  of N layers, so the policy applies to layers 0, N, 2N, ... exactly as with a Python loop.
  first_index is the stack index of layer_0."""

  config: object
  num_layers: int
  in_scan: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids, first_index):
    for i in range(self.num_layers):
      x = layer_class(self.config, i == 0, self.in_scan)(self.config, name=f"layer_{i}")(
          x, positions, segment_ids, first_index + i)
    return x, None  # (carry, per-step output) as nn.scan expects


def scanned(module, cfg, length: int, *args, name: str):
  """nn.scan of module(cfg, *args) over `length` steps: parameters stacked on a `layers`
  axis, the carry x, positions and segment ids broadcast, one index per step scanned. What the
  layers sow (the MoE router's statistics) is stacked the same way."""
  return nn.scan(module, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                 in_axes=(nn.broadcast, nn.broadcast, 0), length=length,
                 metadata_params={nn.PARTITION_NAME: "layers"})(cfg, *args, name=name)


class LayerStack(nn.Module):
  """The layers as the memory settings run them, over parameters grouped to match: with
  scan_layers, nn.scan over blocks of remat_layer_interval layers (one compiled body; the
  depth % interval layers left over form one more, unscanned block); without, a Python loop."""

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    depth, interval = cfg.base_num_decoder_layers, cfg.remat_layer_interval
    if not cfg.scan_layers:
      for i in range(depth):
        x = layer_class(cfg, i % interval == 0, False)(cfg, name=f"layer_{i}")(x, positions, segment_ids, i)
      return x
    groups, rest = divmod(depth, interval)
    x, _ = scanned(DecoderBlock, cfg, groups, interval, True, name="blocks")(
        x, positions, segment_ids, jnp.arange(groups) * interval)
    if rest:
      x, _ = DecoderBlock(cfg, rest, False, name="rest")(x, positions, segment_ids, groups * interval)
    return x


def regroup(cfg, layers):
  """The stored layout, every parameter stacked [depth, ...] in layer order, as LayerStack
  reads it: block j of the scan holds layers j*N .. j*N+N-1. At interval 1 with scan_layers
  this is the stored tree itself (no copy)."""
  depth, interval = cfg.base_num_decoder_layers, cfg.remat_layer_interval
  layer = lambda i: jax.tree.map(lambda p: p[i], layers)
  if not cfg.scan_layers:
    return {f"layer_{i}": layer(i) for i in range(depth)}
  groups, rest = divmod(depth, interval)
  grouped = {"blocks": {f"layer_{i}": jax.tree.map(lambda p, i=i: p[i:groups * interval:interval], layers)
                        for i in range(interval)}}
  if rest:
    grouped["rest"] = {f"layer_{i}": layer(groups * interval + i) for i in range(rest)}
  return grouped


class Decoder(nn.Module):
  """The layer stack and the final norm.

  The parameters are stored one way whatever the memory settings: each layer parameter
  stacked on a leading `layers` axis in layer order (MaxText's scanned layout), created by
  one scan over every layer, so their values depend only on the shape keys and the seed.
  Applying regroups them for the stack remat_layer_interval and scan_layers ask for, so a
  checkpoint saved under any of these settings resumes under any other.
  """

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    if self.is_initializing():
      depth = cfg.base_num_decoder_layers
      x, _ = scanned(ScannedDecoderLayer, cfg, depth, name="layers")(x, positions, segment_ids, jnp.arange(depth))
    else:
      stack = nn.map_variables(LayerStack, "params", trans_in_fn=lambda v: {"params": regroup(cfg, v["params"])})
      x = stack(cfg, name="layers")(x, positions, segment_ids)
    return rms_norm(cfg, "decoder_norm")(x)
