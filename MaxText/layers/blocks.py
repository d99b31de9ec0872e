"""What each layer of the model is, and the stacks its layers are stored in: the layer stack as a
repeating block of layer kinds. Plain Python over the config, so the cost model, the converter and
the layers read one description."""

import math
from typing import NamedTuple


class LayerKind(NamedTuple):
  """What a layer is, where layers differ in their parameters: its MLP a mixture of experts or
  dense, and its token mixer (a decoders.MIXERS name: attention, or a linear attention)."""

  moe: bool
  mixer: str = "attention"


def layer_kind(cfg, index: int) -> LayerKind:
  """The model's layer `index` (multi-token prediction's after the last): in a mixture-of-experts
  family a mixture after the first first_num_dense_layers, and of those every
  interleave_moe_layer_step-th (layers N-1, 2N-1, ...: Llama 4, Qwen3-MoE's decoder_sparse_step).
  Its mixer is attention, but in a family with Gated DeltaNet on all but the last of every
  inhomogeneous_layer_cycle_interval layers (Qwen3-Next: layers 3, 7, 11, ... attend), where it
  is Gated DeltaNet; the prediction layers attend."""
  linear = (cfg.gated_delta_net and index < cfg.base_num_decoder_layers
            and (index + 1) % cfg.inhomogeneous_layer_cycle_interval != 0)
  return LayerKind(moe=bool(cfg.moe) and index >= cfg.first_num_dense_layers
                   and (index + 1) % cfg.interleave_moe_layer_step == 0,
                   mixer="gated_delta_net" if linear else "attention")


def moe_layers(cfg) -> int:
  """The model's mixture-of-experts layers, multi-token prediction's included."""
  return sum(layer_kind(cfg, i).moe for i in range(cfg.base_num_decoder_layers + cfg.mtp_num_layers))


def period(cfg) -> int:
  """Layers after which the kinds repeat (from the first routed layer on); cfg: the config, or
  its dict of values."""
  value = cfg.get if isinstance(cfg, dict) else lambda key: getattr(cfg, key)
  return math.lcm(value("interleave_moe_layer_step") if value("moe") else 1,
                  value("inhomogeneous_layer_cycle_interval") if value("gated_delta_net") else 1)


class Stack(NamedTuple):
  """Consecutive layers stored as one stack, decoder/<name>, made of a repeating block of layer
  kinds (layer i of the stack is block[i % len(block)]). A block of one kind stores each parameter
  [depth, ...]; a block of K > 1 stores position j's as layer_j/..., each [depth / K, ...] (block b's
  layer j at b)."""

  name: str
  first: int  # the model's index of its first layer
  depth: int
  block: tuple  # LayerKind per position

  def kind(self, i: int) -> LayerKind:
    return self.block[i % len(self.block)]

  def moe_layers(self) -> int:
    return sum(self.kind(i).moe for i in range(self.depth))


def stacks(cfg) -> tuple[Stack, ...]:
  """The model's layers as stored: one stack `layers` (MaxText's scanned layout), or with
  first_num_dense_layers N > 0 two (MaxText's names), `dense_layers` (layers 0..N-1, a dense MLP)
  and `moe_layers` (the rest). A stack's block is the shortest period of its layers' kinds."""
  depth, dense = cfg.base_num_decoder_layers, cfg.first_num_dense_layers

  def stack(name, first, depth):
    block = tuple(layer_kind(cfg, first + j) for j in range(period(cfg)))
    return Stack(name, first, depth, block[:1] if len(set(block)) == 1 else block)

  if not dense:
    return (stack("layers", 0, depth),)
  return stack("dense_layers", 0, dense), stack("moe_layers", dense, depth - dense)
