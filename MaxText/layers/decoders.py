"""The decoder layer and the layer stack (scanned or looped, with every-N-th-layer remat): a
repeating block of layers whose kinds may differ (a dense MLP beside a mixture of experts)."""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from MaxText import remat
from MaxText.layers import moe, pipeline, quantizations, terms
from MaxText.layers.attentions import Attention
from MaxText.layers.blocks import Stack, stacks
from MaxText.layers.gated_delta_net import GatedDeltaNet
from MaxText.layers.linears import BATCH_LENGTH_EMBED, MlpBlock
from MaxText.layers.normalizations import rms_norm


class DecoderLayer(nn.Module):
  """Pre-norm layer: x + attn(norm(x)), then h + mlp(norm(h)); with sandwich_norms (Gemma 2)
  the attention's and the MLP's outputs are normed too before they join the residual, with
  post_norms (OLMo 2/3) only they: x + norm(attn(x)), then h + norm(mlp(h)).
  The norms keep MaxText's (and Hugging Face's) names: post_self_attention_norm is the MLP's
  input norm in Llama and the attention's output norm in Gemma 2 and OLMo. layer_index (a Python int,
  or traced in a scan) picks the layer's attention window. `moe`: its MLP is a mixture of
  experts; `mixer`: its token mixer (a MIXERS name; blocks.layer_kind says which layers are which)."""

  config: object
  moe: bool
  mixer: str = "attention"

  @nn.compact
  def __call__(self, x, positions, segment_ids, layer_index):
    cfg = self.config
    x = checkpoint_name(nn.with_logical_constraint(x, BATCH_LENGTH_EMBED), "decoder_layer_input")
    with quantizations.in_layer(cfg, layer_index):
      normed = x if cfg.post_norms else rms_norm(cfg, "pre_self_attention_norm")(x)
      mixer, name = MIXERS[self.mixer]
      attn = mixer(cfg, name=name)(normed, positions, segment_ids, layer_index)
      if cfg.sandwich_norms or cfg.post_norms:
        attn = rms_norm(cfg, "post_self_attention_norm")(attn)
      h = nn.with_logical_constraint(x + attn, BATCH_LENGTH_EMBED)
      mlp = mlp_sublayer(cfg, h, self.moe)
    return nn.with_logical_constraint(h + mlp, BATCH_LENGTH_EMBED)


def mlp_sublayer(cfg, h, moe_layer: bool):
  """The MLP's input norm (none with post_norms), the MLP (or the mixture of experts), and with
  sandwich_norms or post_norms its output norm."""
  mlp_norm = "pre_ffw_norm" if cfg.sandwich_norms else "post_self_attention_norm"
  block = moe.MoeBlock(cfg, name="moe_block") if moe_layer else MlpBlock(cfg, name="mlp")
  mlp = block(h if cfg.post_norms else rms_norm(cfg, mlp_norm)(h))
  return rms_norm(cfg, "post_ffw_norm")(mlp) if cfg.sandwich_norms or cfg.post_norms else mlp


# A layer's token mixer -> (its module, the name its parameters are stored under): attention, or
# Gated DeltaNet's linear attention. A new mixer is one entry (and its layer kinds, blocks.layer_kind).
MIXERS = {"attention": (Attention, "self_attention"), "gated_delta_net": (GatedDeltaNet, "linear_attention")}


class ScannedDecoderLayer(DecoderLayer):
  """DecoderLayer with the (carry, per-step output) signature nn.scan expects."""

  def __call__(self, x, positions, segment_ids, layer_index):
    return super().__call__(x, positions, segment_ids, layer_index), None


def layer_class(cfg, checkpointed: bool, alone_in_scan: bool):
  """DecoderLayer, wrapped in nn.remat with the configured policy when `checkpointed`;
  alone_in_scan: the only checkpointed layer of a scan's step."""
  if not checkpointed or cfg.remat_policy == "none":
    return DecoderLayer
  # A scan's step of one checkpointed layer already stops XLA from merging its recomputation into
  # the forward pass, and prevent_cse=True would only block optimisations. A step of several
  # (a block of layer kinds: Qwen3-Next's four) is unrolled, and without it XLA merged their
  # recomputation and kept more (docs/design/linear_attention.md).
  return nn.remat(DecoderLayer, policy=remat.checkpoint_policy(cfg), prevent_cse=not alone_in_scan)


class DecoderBlock(nn.Module):
  """Consecutive layers of the given kinds, layer_0 .. layer_{n-1}: every interval-th applies the
  remat policy, the rest keep everything. With remat_layer_interval=N the stack is
  made of blocks of N layers (a whole number of its kinds' block), so the policy applies to layers
  0, N, 2N, ... exactly as with a Python loop. first_index is the model's index of layer_0."""

  config: object
  kinds: tuple  # each layer's LayerKind
  in_scan: bool
  interval: int  # layers i % interval == 0 apply the policy

  @nn.compact
  def __call__(self, x, positions, segment_ids, first_index):
    alone = self.in_scan and len(self.kinds) <= self.interval  # layer_0 the step's only checkpointed one
    for i, kind in enumerate(self.kinds):
      x = layer_class(self.config, i % self.interval == 0, alone)(self.config, *kind, name=f"layer_{i}")(
          x, positions, segment_ids, first_index + i)
    return x, None  # (carry, per-step output) as nn.scan expects


def scanned(module, cfg, length: int, *args, name: str, axis: str = "layers"):
  """nn.scan of module(cfg, *args) over `length` steps: parameters stacked on an axis with the
  logical name `axis`, the carry x, positions and segment ids broadcast, one index per step
  scanned. What the layers sow (their terms, the MoE layers' loads) is stacked the same way."""
  return nn.scan(module, variable_axes={"params": 0, "intermediates": 0, terms.TERMS: 0}, split_rngs={"params": True},
                 in_axes=(nn.broadcast, nn.broadcast, 0), length=length,
                 metadata_params={nn.PARTITION_NAME: axis})(cfg, *args, name=name)


def _unit(cfg, stack: Stack) -> int:
  """Layers per step of a stack's scan: remat_layer_interval, made a whole number of blocks."""
  return math.lcm(cfg.remat_layer_interval, len(stack.block))


def _stored(stack: Stack, layers, index: int):
  """(the stored tree holding the stack's layer `index`, its index on that tree's leading axis)."""
  period = len(stack.block)
  return (layers, index) if period == 1 else (layers[f"layer_{index % period}"], index // period)


class LayerStack(nn.Module):
  """A stack's layers as the memory settings run them, over parameters grouped to match: with
  scan_layers, nn.scan over blocks of remat_layer_interval layers (times what makes them whole
  blocks of the stack's kinds; one compiled body; the layers left over form one more, unscanned
  block); without, a Python loop. The interval counts from the stack's first layer, whose model
  index is `first` (traced in a pipeline stage)."""

  config: object
  stack: Stack

  @nn.compact
  def __call__(self, x, positions, segment_ids, first):
    cfg, stack = self.config, self.stack
    interval = cfg.remat_layer_interval
    if not cfg.scan_layers:
      for i in range(stack.depth):
        x = layer_class(cfg, i % interval == 0, False)(cfg, *stack.kind(i), name=f"layer_{i}")(
            x, positions, segment_ids, first + i)
      return x
    unit = _unit(cfg, stack)
    groups, rest = divmod(stack.depth, unit)
    if groups:
      kinds = tuple(map(stack.kind, range(unit)))
      x, _ = scanned(DecoderBlock, cfg, groups, kinds, True, interval, name="blocks")(
          x, positions, segment_ids, first + jnp.arange(groups) * unit)
    if rest:
      x, _ = DecoderBlock(cfg, tuple(map(stack.kind, range(rest))), False, interval, name="rest")(
          x, positions, segment_ids, first + groups * unit)
    return x


def _layer_order(cfg, stack: Stack) -> list:
  """Where LayerStack keeps each layer of a stack, in layer order: (path, index in the scan's
  steps or None)."""
  if not cfg.scan_layers:
    return [((f"layer_{i}",), None) for i in range(stack.depth)]
  unit = _unit(cfg, stack)
  groups, rest = divmod(stack.depth, unit)
  return ([(("blocks", f"layer_{i}"), j) for j in range(groups) for i in range(unit)]
          + [(("rest", f"layer_{i}"), None) for i in range(rest)])


def regroup(cfg, stack: Stack, layers):
  """A stack's stored layout (Stack) as LayerStack reads it: step j of the scan holds layers
  j*U .. j*U+U-1 (U layers a step). With scan_layers and U the stack's block this is the stored
  tree itself (no copy)."""
  def layer(index):
    tree, i = _stored(stack, layers, index)
    return jax.tree.map(lambda p: p[i], tree)

  if not cfg.scan_layers:
    return {f"layer_{i}": layer(i) for i in range(stack.depth)}
  unit = _unit(cfg, stack)
  groups, rest = divmod(stack.depth, unit)
  stride = unit // len(stack.block)  # a position's stored layers per step
  grouped = {}
  if groups:
    grouped["blocks"] = {}
    for i in range(unit):
      tree, start = _stored(stack, layers, i)
      grouped["blocks"][f"layer_{i}"] = jax.tree.map(lambda p, start=start: p[start:start + groups * stride:stride],
                                                     tree)
  if rest:
    grouped["rest"] = {f"layer_{i}": layer(groups * unit + i) for i in range(rest)}
  return grouped


def apply_stack(cfg, stack: Stack, layers, x, positions, segment_ids):
  """A stack's layers from its stored parameters, outside the Decoder (1F1B's first stage input)."""
  return LayerStack(cfg, stack, parent=None).apply({"params": regroup(cfg, stack, layers)}, x, positions,
                                                   segment_ids, stack.first)


def pipeline_stage(cfg, stack: Stack) -> pipeline.Stage:
  """The stack's layers as a pipeline stage runs them: L / (S R) consecutive layers (whole
  blocks), regrouped and run as LayerStack runs a stack of that depth, with what their layers
  report: {terms.TERMS: their Terms collected into one, and their MoE layers' loads
  (`layer_stats`)}."""
  depth = stack.depth // (cfg.pipeline_stages * cfg.num_pipeline_repeats)
  part = stack._replace(depth=depth)

  def apply(layers, x, positions, segment_ids, first):
    y, state = LayerStack(cfg, part, parent=None).apply({"params": layers}, x, positions, segment_ids, first,
                                                        mutable=["intermediates", terms.TERMS])
    return y, {terms.TERMS: terms.collect(state.get(terms.TERMS, {})),
               **layer_stats(cfg, part, state.get("intermediates", {}))}

  return pipeline.Stage(functools.partial(regroup, cfg, part), apply, depth, stack.first)


def layer_stats(cfg, stack: Stack, grouped) -> dict:
  """{name: [MoE layers, ...]} what each of the stack's MoE layers sowed into its intermediates (its
  load per expert, moe.EXPERT_LOAD), in layer order, from a LayerStack's intermediates; {} for a
  stack of dense layers."""
  sown = [(functools.reduce(lambda tree, key: tree[key], path, grouped)["moe_block"], step)
          for i, (path, step) in enumerate(_layer_order(cfg, stack)) if stack.kind(i).moe]
  if not sown:
    return {}
  return {name: jnp.stack([values[name][0] if step is None else values[name][0][step] for values, step in sown])
          for name in sown[0][0]}


def stored_loads(stack: Stack, loads):
  """Per-layer values of the stack's MoE layers [MoE layers, ...] in layer order, shaped as the
  stack stores its layers: as they are for a block of one kind, {layer_j: [depth / K, ...]} for each
  MoE position j of a block of K."""
  period = len(stack.block)
  if period == 1:
    return loads
  positions = [j for j, kind in enumerate(stack.block) if kind.moe]
  per_block = loads.reshape(stack.depth // period, len(positions), *loads.shape[1:])
  return {f"layer_{j}": per_block[:, n] for n, j in enumerate(positions)}


def expert_loads(cfg, intermediates) -> dict:
  """{stack name: loads as stored_loads shapes them} the load per expert [E] of each MoE layer
  (moe.EXPERT_LOAD), from model.apply's intermediates (pipelined: summed over the microbatches)."""
  decoder = intermediates["decoder"]
  if cfg.pipeline_stages > 1:  # the pipelined stack is the last, its loads in layer order
    stack = stacks(cfg)[-1]
    loads = stored_loads(stack, jnp.sum(decoder[PIPELINE_STATS][0][moe.EXPERT_LOAD], axis=0))
    return {stack.name: jax.tree.map(lambda x: pipeline.to_stage_order(cfg, x), loads)}
  return {stack.name: stored_loads(stack, layer_stats(cfg, stack, decoder[stack.name])[moe.EXPERT_LOAD])
          for stack in stacks(cfg) if stack.moe_layers()}


def relayout(cfg, tree, to_stages: bool):
  """tree (a TrainState, parameters or their gradients) with the pipelined stack's stored axis in
  the order the run keeps it (to_stages: pipeline.to_stage_order) or in layer order, as
  checkpoints hold it (pipeline.to_layer_order); tree itself where the two are one."""
  if not pipeline.reorders(cfg):
    return tree
  name, move = stacks(cfg)[-1].name, pipeline.to_stage_order if to_stages else pipeline.to_layer_order

  def leaf(path, x):
    keys = [getattr(k, "key", None) for k in path]
    return move(cfg, x) if ("decoder", name) in zip(keys, keys[1:]) else x

  return jax.tree_util.tree_map_with_path(leaf, tree)


# Where a pipelined decoder sows its MoE layers' loads: {name: [microbatch, layer, ...]}.
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
        axis, period = "layers" if stack is last else "unstaged_layers", len(stack.block)
        if period == 1:
          x, _ = scanned(ScannedDecoderLayer, cfg, stack.depth, *stack.block[0], name=stack.name, axis=axis)(
              x, positions, segment_ids, stack.first + jnp.arange(stack.depth))
        else:
          x, _ = scanned(DecoderBlock, cfg, stack.depth // period, stack.block, True, period, name=stack.name,
                         axis=axis)(
              x, positions, segment_ids, stack.first + jnp.arange(stack.depth // period) * period)
      elif cfg.pipeline_stages > 1 and stack is last:
        x, stats = pipeline.forward(cfg, pipeline_stage(cfg, stack), self.variables["params"][stack.name], x,
                                    positions, segment_ids)
        self.sow(terms.TERMS, terms.PER_MICROBATCH, stats.pop(terms.TERMS))
        if stats:
          self.sow("intermediates", PIPELINE_STATS, stats)
      else:
        regrouped = nn.map_variables(LayerStack, "params", trans_in_fn=lambda v, stack=stack: {
            "params": regroup(cfg, stack, v["params"])})
        x = regrouped(cfg, stack, name=stack.name)(x, positions, segment_ids, stack.first)
    return rms_norm(cfg, "decoder_norm")(x), x
