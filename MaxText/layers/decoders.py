"""The decoder layer and the layer stack (scanned or looped, with every-N-th-layer remat)."""

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat
from MaxText.layers import moe, pipeline
from MaxText.layers.attentions import Attention
from MaxText.layers.linears import BATCH_LENGTH_EMBED, MlpBlock
from MaxText.layers.normalizations import rms_norm


class DecoderLayer(nn.Module):
  """Pre-norm layer: x + attn(norm(x)), then h + mlp(norm(h)); with sandwich_norms (Gemma 2)
  the attention's and the MLP's outputs are normed too before they join the residual.
  The norms keep MaxText's (and Hugging Face's) names: post_self_attention_norm is the MLP's
  input norm in Llama and the attention's output norm in Gemma 2. layer_index (a Python int,
  or traced in a scan) picks the layer's attention window. `moe`: its MLP is a mixture of
  experts (a model's stacks say which of its layers are; see `stacks`)."""

  config: object
  moe: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids, layer_index):
    cfg = self.config
    x = checkpoint_name(nn.with_logical_constraint(x, BATCH_LENGTH_EMBED), "decoder_layer_input")
    attn = Attention(cfg, name="self_attention")(rms_norm(cfg, "pre_self_attention_norm")(x),
                                                 positions, segment_ids, layer_index)
    if cfg.sandwich_norms:
      attn = rms_norm(cfg, "post_self_attention_norm")(attn)
    h = nn.with_logical_constraint(x + attn, BATCH_LENGTH_EMBED)
    mlp = mlp_sublayer(cfg, h, self.moe)
    return nn.with_logical_constraint(h + mlp, BATCH_LENGTH_EMBED)


def mlp_sublayer(cfg, h, moe_layer: bool):
  """The MLP's input norm, the MLP (or the mixture of experts), and with sandwich_norms its
  output norm."""
  mlp_norm = "pre_ffw_norm" if cfg.sandwich_norms else "post_self_attention_norm"
  block = moe.MoeBlock(cfg, name="moe_block") if moe_layer else MlpBlock(cfg, name="mlp")
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
  first_index is the model's index of layer_0."""

  config: object
  moe: bool
  num_layers: int
  in_scan: bool

  @nn.compact
  def __call__(self, x, positions, segment_ids, first_index):
    for i in range(self.num_layers):
      x = layer_class(self.config, i == 0, self.in_scan)(self.config, self.moe, name=f"layer_{i}")(
          x, positions, segment_ids, first_index + i)
    return x, None  # (carry, per-step output) as nn.scan expects


def scanned(module, cfg, length: int, *args, name: str, axis: str = "layers"):
  """nn.scan of module(cfg, *args) over `length` steps: parameters stacked on an axis with the
  logical name `axis`, the carry x, positions and segment ids broadcast, one index per step
  scanned. What the layers sow (the MoE router's statistics) is stacked the same way."""
  return nn.scan(module, variable_axes={"params": 0, "intermediates": 0}, split_rngs={"params": True},
                 in_axes=(nn.broadcast, nn.broadcast, 0), length=length,
                 metadata_params={nn.PARTITION_NAME: axis})(cfg, *args, name=name)


class Stack(NamedTuple):
  """Consecutive layers stored as one stack: decoder/<name>, each parameter [depth, ...]."""

  name: str
  first: int  # the model's index of its first layer
  depth: int
  moe: bool


def stacks(cfg) -> tuple[Stack, ...]:
  """The model's layers as stored: one stack `layers` (MaxText's scanned layout), or with
  first_num_dense_layers N > 0 two (MaxText's names), `dense_layers` (layers 0..N-1, a dense MLP)
  and `moe_layers` (the rest)."""
  depth, dense = cfg.base_num_decoder_layers, cfg.first_num_dense_layers
  if not dense:
    return (Stack("layers", 0, depth, cfg.moe),)
  return Stack("dense_layers", 0, dense, False), Stack("moe_layers", dense, depth - dense, True)


class LayerStack(nn.Module):
  """A stack's layers as the memory settings run them, over parameters grouped to match: with
  scan_layers, nn.scan over blocks of remat_layer_interval layers (one compiled body; the
  depth % interval layers left over form one more, unscanned block); without, a Python loop.
  The interval counts from the stack's first layer, whose model index is `first` (traced in a
  pipeline stage)."""

  config: object
  stack: Stack

  @nn.compact
  def __call__(self, x, positions, segment_ids, first):
    cfg, stack = self.config, self.stack
    interval = cfg.remat_layer_interval
    if not cfg.scan_layers:
      for i in range(stack.depth):
        x = layer_class(cfg, i % interval == 0, False)(cfg, stack.moe, name=f"layer_{i}")(
            x, positions, segment_ids, first + i)
      return x
    groups, rest = divmod(stack.depth, interval)
    if groups:
      x, _ = scanned(DecoderBlock, cfg, groups, stack.moe, interval, True, name="blocks")(
          x, positions, segment_ids, first + jnp.arange(groups) * interval)
    if rest:
      x, _ = DecoderBlock(cfg, stack.moe, rest, False, name="rest")(x, positions, segment_ids,
                                                                    first + groups * interval)
    return x


def _layer_order(cfg, depth: int) -> list:
  """Where LayerStack keeps each layer of a stack of `depth`, in layer order: (path, index in the
  scan's steps or None)."""
  if not cfg.scan_layers:
    return [((f"layer_{i}",), None) for i in range(depth)]
  interval = cfg.remat_layer_interval
  groups, rest = divmod(depth, interval)
  return ([(("blocks", f"layer_{i}"), j) for j in range(groups) for i in range(interval)]
          + [(("rest", f"layer_{i}"), None) for i in range(rest)])


def regroup(cfg, depth: int, layers):
  """A stack's stored layout, every parameter stacked [depth, ...] in layer order, as LayerStack
  reads it: block j of the scan holds layers j*N .. j*N+N-1. At interval 1 with scan_layers
  this is the stored tree itself (no copy)."""
  layer = lambda i: jax.tree.map(lambda p: p[i], layers)
  if not cfg.scan_layers:
    return {f"layer_{i}": layer(i) for i in range(depth)}
  interval = cfg.remat_layer_interval
  groups, rest = divmod(depth, interval)
  grouped = {"blocks": {f"layer_{i}": jax.tree.map(lambda p, i=i: p[i:groups * interval:interval], layers)
                        for i in range(interval)}} if groups else {}
  if rest:
    grouped["rest"] = {f"layer_{i}": layer(groups * interval + i) for i in range(rest)}
  return grouped


def apply_stack(cfg, stack: Stack, layers, x, positions, segment_ids):
  """A stack's layers from its stored parameters, outside the Decoder (1F1B's first stage input)."""
  return LayerStack(cfg, stack, parent=None).apply({"params": regroup(cfg, stack.depth, layers)}, x, positions,
                                                   segment_ids, stack.first)


def pipeline_stage(cfg, stack: Stack) -> pipeline.Stage:
  """The stack's layers as a pipeline stage runs them: L / (S R) consecutive layers, regrouped
  and run as LayerStack runs a stack of that depth, with their MoE layers' router statistics
  ({name: [L / (S R), ...]}, `layer_stats`)."""
  depth = stack.depth // (cfg.pipeline_stages * cfg.num_pipeline_repeats)
  part = stack._replace(depth=depth)

  def apply(layers, x, positions, segment_ids, first):
    y, state = LayerStack(cfg, part, parent=None).apply({"params": layers}, x, positions, segment_ids, first,
                                                        mutable="intermediates")
    return y, layer_stats(cfg, part, state.get("intermediates", {}))

  return pipeline.Stage(functools.partial(regroup, cfg, depth), apply, depth, stack.first)


def layer_stats(cfg, stack: Stack, grouped) -> dict:
  """{name: [depth, ...]} what each of the stack's MoE layers sowed (the router's statistics,
  moe.AUX_NAMES, and its load per expert, moe.EXPERT_LOAD, those the intermediates hold), back in
  the stored layer order (regroup's inverse), from a LayerStack's intermediates; {} for dense
  layers."""
  if not stack.moe:
    return {}
  sown = [(functools.reduce(lambda tree, key: tree[key], path, grouped)["moe_block"], step)
          for path, step in _layer_order(cfg, stack.depth)]
  return {name: jnp.stack([values[name][0] if step is None else values[name][0][step] for values, step in sown])
          for name in sown[0][0]}


def expert_loads(cfg, intermediates) -> dict:
  """{stack name: [depth, E]} the load per expert of each MoE layer (moe.EXPERT_LOAD) in the
  stored layer order, from model.apply's intermediates (pipelined: summed over the microbatches)."""
  if cfg.pipeline_stages > 1:  # the pipelined stack is the one MoE stack
    return {stacks(cfg)[-1].name: jnp.sum(intermediates["decoder"][PIPELINE_STATS][0][moe.EXPERT_LOAD], axis=0)}
  return {stack.name: layer_stats(cfg, stack, intermediates["decoder"][stack.name])[moe.EXPERT_LOAD]
          for stack in stacks(cfg) if stack.moe}


# Where a pipelined decoder sows its MoE layers' statistics: {name: [microbatch, layer, ...]}.
PIPELINE_STATS = "pipeline_stats"


class Decoder(nn.Module):
  """The layer stacks and the final norm.

  The parameters are stored one way whatever the memory settings: each layer parameter
  stacked on a leading `layers` axis in layer order (MaxText's scanned layout), one stack per
  entry of `stacks`, created by one scan over its layers, so their values depend only on the
  shape keys and the seed. Applying regroups them for the stack remat_layer_interval and
  scan_layers ask for, so a checkpoint saved under any of these settings resumes under any other.
  With pipeline stages the last stack runs pipelined (GPipe's forward, `pipeline.forward`) from
  the same stored parameters, whose layers axis the stages shard; a stack before it (DeepSeek's
  dense first layers) runs on every device before the stages.

  Returns the final-normed hidden states and those before the final norm (multi-token
  prediction's input).
  """

  config: object

  @nn.compact
  def __call__(self, x, positions, segment_ids):
    cfg = self.config
    *before, last = every = stacks(cfg)
    for stack in every:
      if self.is_initializing():
        # The stages split the last stack's layers; the layers before it run on every device.
        x, _ = scanned(ScannedDecoderLayer, cfg, stack.depth, stack.moe, name=stack.name,
                       axis="layers" if stack is last else "unstaged_layers")(
            x, positions, segment_ids, stack.first + jnp.arange(stack.depth))
      elif cfg.pipeline_stages > 1 and stack is last:
        x, stats = pipeline.forward(cfg, pipeline_stage(cfg, stack), self.variables["params"][stack.name], x,
                                    positions, segment_ids)
        if stats:
          self.sow("intermediates", PIPELINE_STATS, stats)
      else:
        regrouped = nn.map_variables(LayerStack, "params", trans_in_fn=lambda v, depth=stack.depth: {
            "params": regroup(cfg, depth, v["params"])})
        x = regrouped(cfg, stack, name=stack.name)(x, positions, segment_ids, stack.first)
    return rms_norm(cfg, "decoder_norm")(x), x
