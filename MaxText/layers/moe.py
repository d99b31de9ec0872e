"""Mixture of experts: a float32 router picks num_experts_per_tok of num_experts SwiGLU experts
for each token, and the token's output is the router-weighted sum of theirs (see `route`:
softmax or sigmoid scores, DeepSeek-V3's correction bias and group-limited choice; a family with
routed_input_scaling weights its one expert's input instead, Llama 4's), plus a dense MLP of
shared experts run on every token where shared_experts > 0.

Dropless (capacity_factor null, the default): the token copies are sorted by expert and each
projection is one grouped matmul, `jax.lax.ragged_dot` with the experts' group sizes, so compute
and memory follow the tokens actually routed and no [tokens, experts, width] tensor exists.
capacity_factor > 0 (MaxText's dropping rule): per sequence, each expert keeps the first
C = int(max(ceil(T * k / E) * capacity_factor, capacity_factor)) copies routed to it, in order
of position and then of choice; the rest are dropped (they add nothing to the token's output).
The kept copies fill a fixed [E, rows * C, D] buffer, multiplied with the stacked weights.
Either way the experts' output rows are weighted and added into their tokens' rows where they
lie (`_combine`): no [tokens * k, D] buffer of every copy in token order exists, which under
capacity routing is the layer's largest value (DeepSeek-V3, capacity_factor=1.25 on 8 expert
devices: 8 rows per token where the slots are 1.25).

The routing runs inside a shard_map over the mesh axes that shard the tokens, so each device
sorts only its own tokens. The expert weights arrive gathered along `embed` (FSDP, as for the
dense MLP) and split along `exp` (expert parallelism: see _local_moe) and `mlp` (tensor
parallelism), whose partial outputs are summed. With mlp_chunks > 1 they arrive still sharded
by FSDP, and the experts run a slice of their hidden units at a time, each slice of the kernels
gathered inside its step (_swiglu). The router's statistics (load-balancing loss,
z-loss, load imbalance) are taken over all tokens of the batch; each layer sows them, with the
router's weighted losses (moe_aux_loss), as its share of a mean over the model's MoE layers
(a terms.Term). Each layer's load per expert is sown into `intermediates` (EXPERT_LOAD): the step
moves the correction bias by it (`update_routed_bias`).
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from MaxText import sharding
from MaxText.layers import quantizations, terms
from MaxText.layers.blocks import moe_layers
from MaxText.layers.linears import DenseGeneral, MlpBlock, gated, matmul, sum_of_slices, weights_as
from MaxText.layers.linears import kernel as linear_kernel

TOKENS = ("activation_batch", "activation_length", "activation_embed")
# A Term's metrics per MoE layer, averaged over layers: the Switch/MaxText load-balancing loss,
# the router z-loss, and max/mean of the copies routed to each expert (1 when perfectly balanced).
AUX_NAMES = ("moe_lb_loss", "moe_z_loss", "moe_imbalance")
# Sown per MoE layer: the copies routed to each expert [E] over the whole batch.
EXPERT_LOAD = "expert_load"
SCORE_FUNCS = {"softmax": jax.nn.softmax, "sigmoid": jax.nn.sigmoid}


def dropless(capacity_factor: float | None) -> bool:
  return capacity_factor is None


def capacity(length: int, k: int, num_experts: int, capacity_factor: float) -> int:
  """MaxText's expert capacity per sequence of `length` tokens (at least capacity_factor)."""
  return int(max(math.ceil(length * k / num_experts) * capacity_factor, capacity_factor))


def _in_best_groups(choice, groups: int, keep: int):
  """choice [..., E] with the experts outside each token's `keep` best of `groups` equal groups
  at -inf; a group scores the sum of its two best (DeepSeek-V3)."""
  grouped = choice.reshape(*choice.shape[:-1], groups, -1)
  _, best = jax.lax.top_k(jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1), keep)
  kept = jnp.any(best[..., None] == jnp.arange(groups), axis=-2)
  return jnp.where(kept[..., None], grouped, -jnp.inf).reshape(choice.shape)


def route(logits, bias, cfg):
  """float32 logits [..., E] and the correction bias [E] (None without routed_bias) ->
  (scores [..., E], combine weights [..., k], experts [..., k]).

  The experts are the top-k of scores + bias, among the topk_routing_group best groups where
  n_routing_groups is set; their combine weights are their unbiased scores, renormalised with
  norm_topk_prob, then times routed_scaling_factor (transformers' DeepseekV3MoE). A group left
  out is excluded outright (transformers zeroes its scores instead, which lets it in wherever a
  kept expert's biased score is negative)."""
  scores = SCORE_FUNCS[cfg.routed_score_func](logits.astype(jnp.float32))
  choice = scores if bias is None else scores + bias
  if cfg.n_routing_groups > 0:
    choice = _in_best_groups(choice, cfg.n_routing_groups, cfg.topk_routing_group)
  _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
  weights = jnp.take_along_axis(scores, experts, axis=-1)
  if cfg.norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return scores, weights * cfg.routed_scaling_factor, experts


def _gathered(kernel, gather: tuple):
  """A kernel shard all-gathered over gather[d]'s mesh axes along each dimension d."""
  for dim, axes in enumerate(gather):
    if axes:
      kernel = jax.lax.all_gather(kernel, axes, axis=dim, tiled=True)
  return kernel


def _experts_here(kernels, gather: tuple) -> int:
  """How many experts this device runs: its shard's, gathered."""
  return kernels[0].shape[0] * math.prod(jax.lax.axis_size(a) for a in gather[0])


def _swiglu(x, kernels, gather: tuple, product, cfg, biases=()):
  """wo(gated(wi_0 x, wi_1 x)) per expert; the kernels (wi_0, wi_1, wo) are [E, D, F] shards, whole
  once gathered over `gather` (see MoeBlock._routed), and `product(a, w, axis, out_dtype)`
  contracts a's last dimension with w's `axis`. With mlp_bias, biases are (wi_0's and wi_1's
  [E, F] shards, rows_of: such a bias -> each row's expert's, added to the projections). With
  mlp_chunks > 1, one slice of F at a time (linears.sum_of_slices), each slice of the kernels
  gathered inside its step: the gathered experts then take 1/mlp_chunks of their whole size
  (docs/design/moe.md)."""
  width = kernels[0].shape[2] // cfg.mlp_chunks

  def expert_slice(x, k, out_dtype):
    wi_0, wi_1, wo = (_gathered(jax.lax.dynamic_slice_in_dim(w, k * width, width, axis=2), gather) for w in kernels)
    gate, up = product(x, wi_0, 1, None), product(x, wi_1, 1, None)
    if biases:
      *in_biases, rows_of = biases
      b_0, b_1 = (rows_of(_gathered(jax.lax.dynamic_slice_in_dim(b, k * width, width, axis=1),
                                    (gather[0], gather[2]))).astype(gate.dtype) for b in in_biases)
      gate, up = gate + b_0, up + b_1
    gate, up = checkpoint_name(gate, "mlpwi_0"), checkpoint_name(up, "mlpwi_1")
    return product(gated(cfg, gate, up), wo, 2, out_dtype)

  # Each slice keeps its gate and up projections ([rows, F / mlp_chunks] each): the experts are
  # sliced to bound the gathered kernels, not these. Inside the shard_map the layer's recomputed
  # forward runs the slices whatever they keep, so a slice recomputing them in its own backward
  # would run the experts' forward a third time.
  return checkpoint_name(sum_of_slices(cfg, x, cfg.mlp_chunks, expert_slice, logical_axes=None,
                                       keep=("mlpwi_0", "mlpwi_1")), "mlpwo")


def _einsum(cfg):
  """(a [E, C, in], w [E, D, F], axis, out_dtype) -> a times each expert's kernel of w, whose
  input is `axis`."""
  return lambda a, w, axis, out_dtype: matmul(cfg, "eci,eio->eco" if axis == 1 else "eci,eoi->eco", a, w, out_dtype)


def _zero_past_groups(x, group_sizes):
  """Rows past the groups are 0, as jax.lax.ragged_dot defines them (under expert parallelism
  they are the copies for other devices' experts); a kernel need not write them."""
  return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(group_sizes))[:, None], x, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tokamax_ragged_dot(a, w, group_sizes, out_dtype):
  """[M, K] x [E, K, N] -> [M, N], row groups of group_sizes by expert, with tokamax's kernels.
  Their own backward returns a kernel contracted on its last axis transposed, and without the
  manual axes it varies over (tokamax 0.0.17, Mosaic GPU): this one calls the kernels forward
  only (dA = dOut . W^T grouped; dW = A^T . dOut per group) and makes them cotangents of A and W."""
  import tokamax  # noqa: PLC0415 (heavy, and only the GPU uses it)
  return _zero_past_groups(tokamax.ragged_dot(a, w, group_sizes, preferred_element_type=out_dtype), group_sizes)


def _tokamax_ragged_dot_fwd(a, w, group_sizes, out_dtype):
  return _tokamax_ragged_dot(a, w, group_sizes, out_dtype), (a, w, group_sizes)


def _tokamax_ragged_dot_bwd(out_dtype, residuals, d_out):
  import tokamax  # noqa: PLC0415 (heavy, and only the GPU uses it)
  a, w, group_sizes = residuals
  d_out = d_out.astype(a.dtype)
  rhs_transposed = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
                                                     rhs_group_dimensions=[0])
  per_group = jax.lax.RaggedDotDimensionNumbers((([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
                                                rhs_group_dimensions=[])
  d_a = _zero_past_groups(tokamax.ragged_dot_general(d_out, w, group_sizes, rhs_transposed), group_sizes)
  d_w = tokamax.ragged_dot_general(a, d_out, group_sizes, per_group)
  return sharding.as_cotangent_of(d_a, a), sharding.as_cotangent_of(d_w, w), None


_tokamax_ragged_dot.defvjp(_tokamax_ragged_dot_fwd, _tokamax_ragged_dot_bwd)


def _tokamax_ragged_dot_general(a, w, group_sizes, dims, preferred_element_type=None):
  """GPU: XLA:GPU (jax 0.11) expands a ragged dot into a dense matmul over every expert, whose
  memory grows with experts x tokens, all of them and not the k per token; tokamax's kernels
  (Mosaic GPU on Hopper, else Triton) multiply the groups alone. A kernel [E, out, in] is handed over as
  [E, in, out], its transpose differentiated by JAX."""
  (_, (w_in,)), _ = dims.dot_dimension_numbers
  return _tokamax_ragged_dot(a, jnp.swapaxes(w, 1, 2) if w_in == 2 else w, group_sizes, preferred_element_type)


# The grouped matmul per platform; elsewhere XLA's (libtpu: a grouped-matmul kernel; XLA:CPU, for
# tests, a dense product).
RAGGED_DOT_GENERAL = {"gpu": _tokamax_ragged_dot_general}


def _grouped_swiglu(rows, group_sizes, kernels, gather, cfg, in_biases=()):
  """The experts' SwiGLU on rows [M, D] grouped by expert, group_sizes[e] rows for expert e, each
  projection one grouped matmul, with the input projections' biases where given; rows past the
  groups give 0."""

  def grouped(a, w, axis, out_dtype):
    return quantizations.ragged_dot(cfg, a, w, group_sizes, axis, out_dtype,
                                    RAGGED_DOT_GENERAL.get(cfg.platform, jax.lax.ragged_dot_general))

  if in_biases:  # each row's expert: group e's rows are group_sizes[e] in a row (past them, the last's)
    row_experts = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes, total_repeat_length=rows.shape[0])
    in_biases = (*in_biases, lambda b: jnp.take(b, row_experts, axis=0))
  return _swiglu(rows, kernels, gather, grouped, cfg, in_biases)


def _dropless_copies(x, experts, kernels, gather, cfg, in_biases=()):
  """(rows [N * k, D], copies [N * k]): the expert outputs of every copy, sorted by expert, and
  each row's copy (its index in (token, choice) order). `experts` are this shard's expert
  indices; a copy outside [0, local experts) belongs to another shard's experts, sorts last and
  gets zero."""
  k, num_experts = experts.shape[-1], _experts_here(kernels, gather)
  flat = experts.reshape(-1)
  flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
  order = jnp.argsort(flat, stable=True)
  group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  return _grouped_swiglu(jnp.take(x, order // k, axis=0), group_sizes, kernels, gather, cfg, in_biases), order


def _ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                 axis_name):
  """jax.lax.ragged_all_to_all as its docstring defines it, for XLA:CPU, which does not implement
  it: every device gathers every operand and reads the slices sent to it (the axis size times
  the operand's memory: CPU meshes are for tests)."""
  del send_sizes  # each receiver's recv_sizes are the senders' send_sizes
  operands = jax.lax.all_gather(operand, axis_name)  # [devices, M, ...]
  at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # slice i, from device i // per
  start = jax.lax.all_to_all(input_offsets, axis_name, 0, 0, tiled=True)
  sender = jnp.arange(at.shape[0]) // (at.shape[0] // operands.shape[0])
  row = jnp.arange(output.shape[0])[:, None]
  inside = (row >= at) & (row < at + recv_sizes)  # [M', slices]: at most one slice per row
  received = operands[jnp.sum(jnp.where(inside, sender, 0), axis=1), jnp.sum(jnp.where(inside, start + row - at, 0),
                                                                             axis=1)]
  return jnp.where(jnp.any(inside, axis=1).reshape(-1, *[1] * (output.ndim - 1)), received, output)


# The ragged all-to-all per platform; elsewhere XLA's.
RAGGED_ALL_TO_ALL = {"cpu": _ragged_all_to_all_by_gather}


def _all_to_all_copies(x, experts, kernels, gather, cfg, axes: tuple, in_biases=()):
  """(rows [N * k, D], copies [N * k]) as _dropless_copies, from the devices holding the experts:
  this device's copies, sorted by (global) expert, go to their experts' devices in one ragged
  all-to-all over `axes`, each device runs its experts on the copies it received (grouped by
  expert, then by sender), and a second ragged all-to-all returns the outputs."""
  k, local = experts.shape[-1], _experts_here(kernels, gather)
  flat = experts.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  counts = jnp.bincount(flat, length=cfg.num_experts).astype(jnp.int32)  # this device's copies per expert
  every = jax.lax.all_gather(counts, axes)  # [devices, E]: every device's counts
  me = jax.lax.axis_index(axes)
  mine = lambda v: jax.lax.dynamic_slice_in_dim(v, me * local, local, axis=-1)  # this device's experts
  exclusive = lambda v, axis: jnp.cumsum(v, axis=axis) - v
  totals = jnp.sum(every, axis=0).reshape(-1, local)  # [devices, local]: copies per expert, all senders
  expert_start = exclusive(totals, 1).reshape(-1)  # on its device, where expert e's copies start
  sender_start = exclusive(every, 0)  # [devices, E]: where each sender's copies of e start within e's
  received_sizes = mine(every).reshape(-1)  # [devices * local]: from each sender, for each local expert
  exchange = functools.partial(RAGGED_ALL_TO_ALL.get(cfg.platform, jax.lax.ragged_all_to_all), axis_name=axes)
  # Dropless: the worst case is every device's every copy routed to this device's experts.
  buffer = jnp.zeros((every.shape[0] * flat.size, x.shape[-1]), x.dtype)
  received = exchange(jnp.take(x, order // k, axis=0), buffer, exclusive(counts, 0), counts,
                      expert_start + sender_start[me], received_sizes)
  out = _grouped_swiglu(received, totals[me], kernels, gather, cfg, in_biases)
  returned = exchange(out, jnp.zeros((flat.size, x.shape[-1]), out.dtype),
                      (mine(expert_start)[None] + mine(sender_start)).reshape(-1), received_sizes,
                      mine(exclusive(every, 1)).reshape(-1), counts)
  return returned, order


def _dropping_copies(x, experts, kernels, gather, cfg, rows: int, in_biases=()):
  """(rows [slots, D], copies [slots]) under capacity_factor > 0: each expert's capacity slots
  per row and the copy filling each (N * k, a zero row, for an empty slot). A dropped copy, and
  as in _dropless_copies a copy of another shard's experts, has no slot."""
  k, num_experts = experts.shape[-1], _experts_here(kernels, gather)
  copies = experts.size
  cap = capacity(copies // (rows * k), k, cfg.num_experts, cfg.capacity_factor)
  flat = experts.reshape(-1)
  local = (flat >= 0) & (flat < num_experts)
  flat = jnp.where(local, flat, num_experts)
  row = jnp.arange(copies) // (copies // rows)
  # Rank of each copy among its (row, expert)'s copies in (position, choice) order: a stable
  # sort groups them, and the rank is the distance from the group's start.
  group = row * (num_experts + 1) + flat
  order = jnp.argsort(group, stable=True)
  counts = jnp.bincount(group, length=rows * (num_experts + 1))
  starts = jnp.cumsum(counts) - counts
  rank = jnp.zeros(copies, jnp.int32).at[order].set(jnp.arange(copies, dtype=jnp.int32) - starts[group[order]])
  slots = num_experts * rows * cap
  slot = jnp.where(local & (rank < cap), (flat * rows + row) * cap + rank, slots)  # the last slot: dropped
  # Which copy fills each slot (`copies` where none): the slots read their tokens straight from
  # x, never from a [N * k, D] copy of it (8 times the tokens for DeepSeek-V3, where the slots
  # are 1.25 times them).
  source = jnp.full(slots + 1, copies, jnp.int32).at[slot].set(jnp.arange(copies, dtype=jnp.int32))[:slots]
  buffer = jnp.take(x, source // k, axis=0, mode="fill", fill_value=0).reshape(num_experts, rows * cap, -1)
  if in_biases:  # the buffer is [E, slots per expert, D]
    in_biases = (*in_biases, lambda b: b[:, None, :])
  return _swiglu(buffer, kernels, gather, _einsum(cfg), cfg, in_biases).reshape(slots, -1), source


def _combine(out, copies, weights, k: int):
  """Each token's output [N, D]: the sum of its copies' rows out [M, D] times their weights [N * k]
  (copies [M]: each row's copy, N * k for a row of none), added into the tokens' rows in float32.
  The rows stay in the experts' order: putting them back in (token, choice) order first would
  hold a [N * k, D] buffer, and its cotangent, that the capacity's slots need not have."""
  tokens = weights.shape[0] // k
  weight = jnp.take(weights, copies, mode="fill", fill_value=0)
  summed = jax.ops.segment_sum(out.astype(jnp.float32) * weight[:, None], copies // k, num_segments=tokens)
  return summed.astype(out.dtype)


def _router_stats(logits, bias, cfg, token_axes: tuple) -> dict:
  """The load-balancing loss, z-loss, imbalance and load per expert over every device's tokens
  (psum over token_axes) from this device's router logits [b, t, E]. The load is that of the
  experts chosen, bias included; the loss takes each token's scores normalised to sum to 1
  (softmax's already do; sigmoid's do not)."""
  num_experts = cfg.num_experts
  scores, _, experts = route(logits, bias, cfg)
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  total = lambda v: jax.lax.psum(v, token_axes) if token_axes else v
  tokens = total(jnp.float32(probs.size // num_experts))
  load = total(jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.float32))
  mean_probs = total(jnp.sum(probs.reshape(-1, num_experts), axis=0)) / tokens
  lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
  return {"moe_lb_loss": num_experts * jnp.sum(load / tokens * mean_probs),
          "moe_z_loss": total(jnp.sum(jnp.square(lse))) / tokens,
          "moe_imbalance": jnp.max(load) / jnp.mean(load), EXPERT_LOAD: load}


def _local_moe(x, logits, bias, kernels, in_biases, cfg, token_axes: tuple, expert_axes: tuple, mlp_axes: tuple,
               all_to_all: bool, gather: tuple = ((), (), ())):
  """One device's tokens x [b, t, D] and router logits [b, t, E], the correction bias (or None),
  and its experts' kernels (whole once gathered over `gather`: _swiglu) and their input
  projections' biases (mlp_bias; else ()) -> (outputs [b, t, D], the router's statistics over all
  devices' tokens).

  Expert parallelism (see MoeBlock._exchange): with all_to_all, each copy of a token travels to
  the device holding its expert and back (_all_to_all_copies). Otherwise the expert axes that
  also shard the tokens exchange them by all-gather, each device runs its own experts on the
  gathered tokens, and a reduce-scatter sums the experts' outputs and returns each device its
  own tokens."""
  stats = _router_stats(logits, bias, cfg, token_axes)
  exchanged = () if all_to_all else tuple(a for a in expert_axes if a in token_axes)
  if exchanged:
    x = jax.lax.all_gather(x, exchanged, axis=0, tiled=True)
    logits = jax.lax.all_gather(logits, exchanged, axis=0, tiled=True)
  rows, length, width = x.shape
  k = cfg.num_experts_per_tok
  _, weights, experts = route(logits, bias, cfg)
  if cfg.routed_input_scaling:  # top-1 (pyconfig): the token's one copy is its input times its weight
    x, weights = x * weights.astype(x.dtype), jnp.ones_like(weights)
  flat_x = x.reshape(-1, width)
  if all_to_all:
    out, copies = _all_to_all_copies(flat_x, experts, kernels, gather, cfg, expert_axes, in_biases)
  else:
    if expert_axes:  # this device's experts are [first, first + local experts)
      experts = experts - jax.lax.axis_index(expert_axes) * _experts_here(kernels, gather)
    if dropless(cfg.capacity_factor):
      out, copies = _dropless_copies(flat_x, experts, kernels, gather, cfg, in_biases)
    else:
      out, copies = _dropping_copies(flat_x, experts, kernels, gather, cfg, rows, in_biases)
  out = _combine(out, copies, weights.reshape(-1), k)
  out = out.reshape(rows, length, width)
  # Partial sums: over the experts held elsewhere, and over slices of every expert's hidden units.
  summed = (() if all_to_all else tuple(a for a in expert_axes if a not in exchanged)) + mlp_axes
  if summed:
    out = jax.lax.psum(out, summed)
  if exchanged:
    out = jax.lax.psum_scatter(out, exchanged, scatter_dimension=0, tiled=True)
  return out, stats


def expert_init(in_axis: int):
  """Initialiser of [experts, D, F] kernels whose input is axis `in_axis`: each expert's kernel
  truncated normal with std 1/sqrt(inputs)."""
  return nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=3 - in_axis,
                                          batch_axis=(0,))


class Gate(DenseGeneral):
  """The router: x -> (logits, its correction bias [E] or None). The bias, `bias` beside the
  kernel (Hugging Face's e_score_correction_bias), is float32 whatever weight_dtype: the update
  steps of routed_bias_update_rate (1e-3) would vanish in bfloat16 next to a bias near 1. No
  gradient reaches it (it only orders the scores for top-k); optimizers.create_optimizer leaves
  it alone and the train step moves it by the load (update_routed_bias). With logit_bias the
  logits add a trained bias, `logit_bias` (GPT-OSS's router bias, mlp_bias)."""

  routed_bias: bool = False
  logit_bias: bool = False

  @nn.compact
  def __call__(self, x):
    logits = super().__call__(x)
    if self.logit_bias:
      init = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,))
      logits = logits + self.param("logit_bias", init, tuple(self.features), self.weight_dtype).astype(logits.dtype)
    if not self.routed_bias:
      return logits, None
    init = nn.with_logical_partitioning(nn.initializers.zeros_init(), (None,))
    return logits, self.param("bias", init, tuple(self.features), jnp.float32)


def is_routed_bias(path) -> bool:
  """Whether a parameter's tree path (boxed or not) is a Gate's bias."""
  names = [entry.key for entry in path if isinstance(entry, jax.tree_util.DictKey)]
  return names[-2:] == ["gate", "bias"]


def update_routed_bias(params, loads: dict, rate: float):
  """params with each MoE layer's Gate bias moved by rate * sign(mean load - load), so the
  overloaded experts are chosen less (DeepSeek-V3's auxiliary-loss-free balancing). loads
  mirrors params down to each tree of MoE layers: {"decoder": {stack: [layers, E]}, or
  {stack: {layer_j: [layers / K, E]}} for a block of K kinds} (decoders.expert_loads), and
  {"mtp": {layer: [E]}} for multi-token prediction's MoE layers."""
  if isinstance(loads, dict):
    return {**params, **{name: update_routed_bias(params[name], part, rate) for name, part in loads.items()}}
  step = rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)
  return jax.tree_util.tree_map_with_path(
      lambda path, p: p + step.astype(p.dtype) if is_routed_bias(path) else p, params)


class MoeBlock(nn.Module):
  """x [B, T, D] -> sum over the token's top-k experts of weight * SwiGLU_expert(x), plus the
  shared experts' MLP of x.

  Parameters (MaxText's names): gate/kernel [D, E] (the router), with routed_bias gate/bias [E],
  shared_experts/{wi_0, wi_1, wo}/kernel [D, shared_experts * moe_mlp] (linears.MlpBlock) where
  shared_experts > 0 (with shared_expert_gate, their gate shared_expert_gate/kernel [D, 1]), wi_0
  and wi_1 [E, D, moe_mlp]
  (input D), wo [E, D, moe_mlp] (input moe_mlp; MaxText's is [E, moe_mlp, D]); with mlp_bias the
  gate's logit_bias [E], wi_0_bias and wi_1_bias [E, moe_mlp] and wo_bias [E, D]. All three keep D
  off the minor dimension: where FSDP shards D (below) and D/fsdp < 128 (2048 over 32), TPU
  layouts pad it to 128 lanes, and wo's gradient and optimizer buffers would take twice their
  size.
  """

  config: object

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    dtype, weight_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.weight_dtype)
    experts, width, hidden = cfg.num_experts, cfg.base_emb_dim, cfg.base_moe_mlp_dim
    x = nn.with_logical_constraint(x, TOKENS)
    # The router in float32 whatever the activation dtype: the top-k choice is a comparison of
    # nearby probabilities, which bfloat16 would blur.
    logits, bias = Gate((experts,), ("embed", None), jnp.float32, weight_dtype, routed_bias=cfg.routed_bias,
                        logit_bias=cfg.mlp_bias, name="gate")(x)

    # Where the experts divide over the expert and FSDP axes, FSDP shards the experts and D stays
    # whole: FSDP's gather then joins whole experts along a major axis, in the stored layout, and
    # linears.weights_as keeps each layer's bfloat16 cast in the layer loop. Otherwise (Mixtral's
    # 8 experts over 32 chips) D carries FSDP, with astype: there weights_as made XLA copy the
    # float32 stacks into the gather's layout. Rules of the user's own without `exp_fsdp` keep
    # the second layout, which their `exp` and `embed` rules shard, rather than replicate the
    # experts. With mlp_chunks > 1 the slices are gathered inside the layer, and there weights_as
    # made XLA copy the float32 stacks into the layout of the grouped matmul's other operand use,
    # where astype's copies are bfloat16. The memory each choice costs: docs/design/moe.md.
    fsdp_experts = (any(rule == "exp_fsdp" for rule, _ in cfg.logical_axis_rules)
                    and experts % sharding.logical_shards(cfg.to_dict(), "exp_fsdp") == 0)
    axes = ("exp_fsdp", None, "mlp") if fsdp_experts else ("exp", "embed", "mlp")
    cast = weights_as if fsdp_experts and cfg.mlp_chunks == 1 else jnp.asarray

    def kernel(name, in_axis):
      init = nn.with_logical_partitioning(expert_init(in_axis), axes)
      return cast(self.param(name, init, (experts, width, hidden), weight_dtype), dtype)

    kernels = kernel("wi_0", 1), kernel("wi_1", 1), kernel("wo", 2)
    in_biases = ()
    if cfg.mlp_bias:
      zeros = lambda name, shape, axes: self.param(
          name, nn.with_logical_partitioning(nn.initializers.zeros_init(), axes), shape, weight_dtype)
      in_biases = tuple(zeros(name, (experts, hidden), (axes[0], axes[2])) for name in ("wi_0_bias", "wi_1_bias"))
      wo_bias = zeros("wo_bias", (experts, width), (axes[0], None))
    out, stats = self._routed(x.astype(dtype), logits, bias, kernels, in_biases, axes)
    if cfg.mlp_bias:  # each copy's output bias, times its weight: at the tokens, where no expert is remote
      _, weights, chosen = route(logits, bias, cfg)
      combine = jnp.sum(jax.nn.one_hot(chosen, experts, dtype=jnp.float32) * weights[..., None], axis=-2)
      out = out + jnp.einsum("bte,ed->btd", combine, wo_bias.astype(jnp.float32)).astype(out.dtype)
    load = stats.pop(EXPERT_LOAD)
    self.sow("intermediates", EXPERT_LOAD, load)
    aux = cfg.load_balance_loss_weight * stats["moe_lb_loss"] + cfg.router_z_loss_weight * stats["moe_z_loss"]
    terms.sow(self, aux, {**stats, "moe_aux_loss": aux}, share=1 / moe_layers(cfg))
    if cfg.shared_experts:
      shared = MlpBlock(cfg, units=cfg.shared_experts * hidden, name="shared_experts")(x)
      if cfg.shared_expert_gate:  # per token, sigmoid(x . w) of a [D, 1] kernel
        gate = matmul(cfg, "btd,df->btf", x.astype(dtype), weights_as(
            linear_kernel(cfg, "shared_expert_gate", (width, 1), ("embed", None)), dtype))
        shared = (shared * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(shared.dtype)
      out = out + shared
    return nn.with_logical_constraint(out, TOKENS)

  def _routed(self, x, logits, bias, kernels, in_biases, kernel_axes: tuple):
    """The routed experts' output and statistics; `kernel_axes` are the kernels' logical axes.
    Each device runs its experts (`exp`) on its share of the hidden units (`mlp`). The rest of
    the kernels' sharding (FSDP's) is gathered: before the layer with one slice of hidden units,
    as XLA gathers any operand; with mlp_chunks > 1 inside it, a slice at a time (_swiglu)."""
    cfg = self.config
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return _local_moe(x, logits, bias, kernels, in_biases, cfg, (), (), (), all_to_all=False)
    batch, length, expert_axes, mlp = map(sharding.axes_of, (*TOKENS[:2], "exp", "mlp"))
    token_axes = batch + length
    mlp_axes = tuple(a for a in mlp if a not in token_axes + expert_axes)
    kept = (expert_axes, (), mlp_axes)
    gather = ((), (), ())
    if cfg.mlp_chunks > 1:
      gather = tuple(tuple(a for a in stored if a not in own and mesh.shape[a] > 1)
                     for stored, own in zip(sharding.mesh_axes(*kernel_axes), kept))
    tokens = PartitionSpec(batch or None, length or None, None)
    kernel_spec = PartitionSpec(*((*own, *more) or None for own, more in zip(kept, gather)))
    all_to_all = self._exchange(mesh, token_axes, expert_axes) == "all_to_all"
    body = functools.partial(_local_moe, cfg=cfg, token_axes=token_axes, expert_axes=expert_axes, mlp_axes=mlp_axes,
                             all_to_all=all_to_all, gather=gather)
    bias_spec = PartitionSpec(kernel_spec[0], kernel_spec[2])
    return jax.shard_map(body, in_specs=(tokens, tokens, PartitionSpec(), (kernel_spec,) * 3,
                                         (bias_spec,) * len(in_biases)),
                         out_specs=(tokens, {n: PartitionSpec() for n in (*AUX_NAMES, EXPERT_LOAD)}))(
                             x, logits, bias, kernels, in_biases)

  def _exchange(self, mesh, token_axes: tuple, expert_axes: tuple) -> str:
    """How expert parallelism moves the tokens: all_to_all where the expert axes all shard the
    tokens and routing is dropless, and expert_exchange asks for it or (auto) the expert axes
    outnumber the experts per token; all_gather otherwise (docs/design/moe.md: per token, the all-gather
    sends expert - 1 copies of it and the all-to-all about k, so the all-to-all wins above k)."""
    cfg = self.config
    devices = math.prod(mesh.shape[a] for a in expert_axes)
    if not (expert_axes and set(expert_axes) <= set(token_axes) and dropless(cfg.capacity_factor)):
      return "all_gather"
    if cfg.expert_exchange == "auto":
      return "all_to_all" if devices > cfg.num_experts_per_tok else "all_gather"
    return cfg.expert_exchange
