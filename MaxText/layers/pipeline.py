"""Pipeline parallelism: the decoder's layers in stages along the `pipeline` mesh axis.

A stack's stored layers [L, ...] (the `layers` axis sharded over `pipeline`) are viewed as
[S stages, R repeats, L / (S R) layers]: stage s runs the layer groups s, S + s, 2S + s, ...
(circular with num_pipeline_repeats R > 1). A run keeps them in stage order, stage s's groups the
s-th contiguous block of the stored axis (to_stage_order), so that each stage's shard of the axis
holds the layers it runs and no weight moves between stages in a step; with R = 1 stage order is
layer order. Checkpoints hold layer order whatever the stages (to_layer_order on save, its
inverse on restore), so they resume under any layout. All stages run
in each iteration, each on its own microbatch, as one program vmapped over the stage axis
(spmd_axis_name="pipeline"), and their outputs move one stage on by a shift along that axis,
which the partitioner turns into a collective permute: only activations cross between stages.

Microbatch m at repeat r enters stage s in iteration r M + m + s (M microbatches). Stage 0 reads
from a buffer of the M microbatches: their embeddings for repeat 0, and for later repeats the
last stage's output, written there M - S + 1 >= 1 iterations before it is read.

`forward` is the GPipe schedule: autodiff runs every backward after every forward, so a stage
keeps the residuals (what remat_policy saves) of all R M + S - 1 iterations. `gradients` is 1F1B:
an iteration runs a forward and a backward per stage, the loss and its gradient inside the loop,
each phase only in the iterations where some stage has its work (M + S - 1 of each, as GPipe's
forward and backward loops run). A stage keeps only its inputs, of at most 2S - 1 microbatches (the round trip to the
last stage and back; M where M is fewer), however many microbatches there are, and its backward
runs the stage's forward again for the vjp: the residuals (what remat_policy saves) exist for
one microbatch at a time, for one more forward of the stage per microbatch. (Keeping each
forward's vjp residuals instead would save that forward, but a vjp that holds a shard_map, as the
flash kernels are, does not lower when called under vmap in another iteration's trace.)
"""

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from MaxText import remat

# The state passed between stages: [stage, rows, length, embed]; the microbatches waiting for the
# first stage: [microbatch, rows, length, embed]. Every array a loop carries is constrained: left
# to itself the partitioner may keep a carry whole on every device.
STATE_AXES = ("layers", "activation_batch", "activation_length", "activation_embed")
BUFFER_AXES = (None, "activation_batch", "activation_length", "activation_embed")


class Stage(NamedTuple):
  """A stage's layers as functions of its slice [L / (S R), ...] of the stored layers."""

  regroup: Callable  # the slice -> the layout its layers read (linear, so its transpose is cheap)
  # (regrouped, x, positions, segment ids, model's index of its first layer) -> (x, what its layers
  # report: a tree of arrays, the same for every stage)
  apply: Callable
  per_stage: int  # layers per stage and repeat
  first: int  # the model's index of the stack's first layer


def microbatches(tree, count: int):
  """[count * m, ...] -> [count, m, ...], microbatch k = rows k, k + count, ...: every
  microbatch is spread over the batch shards like the whole batch."""
  return jax.tree.map(lambda x: jnp.swapaxes(x.reshape(-1, count, *x.shape[1:]), 0, 1), tree)


def rows(x):
  """microbatches' inverse: [count, m, ...] -> [count * m, ...] in the batch's row order."""
  return jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])


def bubble(cfg) -> float:
  """The share of the stages' executed forwards and backwards that compute nothing:
  (S - 1) / (R M + S - 1), for GPipe and for 1F1B (R = 1), whose loop runs a phase only in the
  iterations where some stage has its work."""
  stages, work = cfg.pipeline_stages, cfg.num_pipeline_repeats * cfg.num_pipeline_microbatches
  return (stages - 1) / (work + stages - 1) if stages > 1 else 0.0


def _on_stages(x, axes=None):
  """x with the logical `axes`, or else x [S, ...] with its stage axis on `pipeline` and the
  rest as the partitioner likes."""
  if axes is not None:
    return nn.with_logical_constraint(x, axes)
  return jax.lax.with_sharding_constraint(x, PartitionSpec("pipeline", *(PartitionSpec.UNCONSTRAINED,) * (x.ndim - 1)))


# Every traced index below is a select over the indexed axis: a dynamic slice, gather or scatter
# there makes the TPU partitioner gather the row axis the arrays shard (a whole microbatch per
# device), and the selects cost one pass over arrays of a few microbatches.
def _hits(i, count: int, ndim: int):
  """True where position k of the indexed axis is i (i: [] or one per stage [S]), shaped to
  broadcast against an array of ndim dimensions indexed at axis i.ndim."""
  i = jnp.asarray(i)
  return (jnp.arange(count) == i[..., None]).reshape(*i.shape, count, *(1,) * (ndim - i.ndim - 1))


@jax.checkpoint  # the backward rebuilds the mask from the index instead of keeping it
def _at(x, i):
  """x[i] (i scalar), or x[s, i[s]] for every stage s (i [S], x [S, N, ...])."""
  i = jnp.asarray(i)
  return jnp.sum(jnp.where(_hits(i, x.shape[i.ndim], x.ndim), x, 0), axis=i.ndim)


@jax.checkpoint
def _put(x, i, value):
  """x with x[i] = value (i scalar), or x[s, i[s]] = value[s] for every stage s (i [S])."""
  i = jnp.asarray(i)
  return jnp.where(_hits(i, x.shape[i.ndim], x.ndim), jnp.expand_dims(value, i.ndim), x)


def _pick(x, i):
  """x [N, ...], i [S] -> [S, ...]: x[i[s]] for every stage s."""
  return _at(jnp.broadcast_to(x[None], (i.shape[0], *x.shape)), i)


def _shift(x, by: int):
  """x [S, ...] moved `by` (+1 or -1) stages along, the emptied end zero: stage s sends to s + by
  alone (a collective permute without the pair that a roll's wrap-around would add)."""
  pad = [(max(by, 0), max(-by, 0))] + [(0, 0)] * (x.ndim - 1)
  return jnp.pad(x[:-1] if by > 0 else x[1:], pad)


def reorders(cfg) -> bool:
  """Whether a run keeps the stored layers in another order than layer order: circular stages."""
  return cfg.pipeline_stages > 1 and cfg.num_pipeline_repeats > 1


def to_stage_order(cfg, x):
  """x [L, ...] in layer order (groups r S + s) -> stage order (stage s's groups s, S + s, ... the
  s-th block): where a run with circular stages keeps the stored layers; x as it is otherwise."""
  if not reorders(cfg):
    return x
  return jnp.swapaxes(x.reshape(cfg.num_pipeline_repeats, cfg.pipeline_stages, -1, *x.shape[1:]), 0, 1).reshape(x.shape)


def to_layer_order(cfg, x):
  """to_stage_order's inverse."""
  if not reorders(cfg):
    return x
  return jnp.swapaxes(x.reshape(cfg.pipeline_stages, cfg.num_pipeline_repeats, -1, *x.shape[1:]), 0, 1).reshape(x.shape)


def stage_layers(cfg, layers):
  """The stored [L, ...] (stage order) -> [S, R, L / (S R), ...], the stage axis on `pipeline`:
  each stage's block of the stored axis, where its shard already is."""
  stages, repeats = cfg.pipeline_stages, cfg.num_pipeline_repeats
  return jax.tree.map(lambda p: _on_stages(p.reshape(stages, repeats, -1, *p.shape[1:])), layers)


def _stage_run(cfg, stage: Stage):
  """(stage_layers' [S, R, ...], repeat per stage [S], x, positions, segment ids [S, ...]) -> (x,
  statistics [S, ...]): every stage's layers of its repeat on its microbatch. Under a remat policy the whole is
  checkpointed keeping what the layers' policy keeps and their inputs: the backward re-selects a
  circular stage's weights from the stored ones rather than keep each iteration's, and recomputes
  no layer the layers' own checkpoints do not."""
  stages = cfg.pipeline_stages

  def one(layers, repeat, x, positions, segment_ids, index):
    first = stage.first + (repeat * stages + index) * stage.per_stage
    return stage.apply(stage.regroup(layers), x, positions, segment_ids, first)

  run = jax.vmap(one, spmd_axis_name="pipeline")

  def every_stage(layers, repeat, x, positions, segment_ids):
    if cfg.num_pipeline_repeats > 1:
      layers = jax.tree.map(lambda p: _at(p, repeat), layers)
    else:
      layers = jax.tree.map(lambda p: p[:, 0], layers)
    return run(layers, repeat, x, positions, segment_ids, jnp.arange(stages))

  if cfg.remat_policy == "none":
    return every_stage
  return jax.checkpoint(every_stage, policy=remat.checkpoint_policy(cfg, keep_input=True), prevent_cse=False)


def forward(cfg, stage: Stage, layers, x, positions, segment_ids):
  """x [B, T, D] through a stack's layers pipelined over its stages, GPipe's schedule
  (circular when R > 1); differentiable, so autodiff gives the backward. Returns it and what the
  stages reported (Stage.apply), each leaf [microbatch, stage and repeat, ...]: each microbatch's,
  in layer order."""
  stages, repeats, count = cfg.pipeline_stages, cfg.num_pipeline_repeats, cfg.num_pipeline_microbatches
  run = _stage_run(cfg, stage)
  params = stage_layers(cfg, layers)
  buffer, positions, segment_ids = microbatches((x, positions, segment_ids), count)
  index = jnp.arange(stages)

  def iteration(carry, t):
    state, buffer, stats = carry
    state = _on_stages(_put(state, 0, _at(buffer, t % count)), STATE_AXES)
    work = t - index  # each stage's (repeat, microbatch) as r M + m
    ran = (work >= 0) & (work < repeats * count)
    work = jnp.clip(work, 0, repeats * count - 1)
    m, repeat = work % count, work // count
    out, new = run(params, repeat, state, _pick(positions, m), _pick(segment_ids, m))
    out = _on_stages(out, STATE_AXES)
    # The microbatch the last stage finished, from iteration S - 1 on (before it, index M: none).
    done = jnp.where(t >= stages - 1, (t - stages + 1) % count, count)
    buffer = _on_stages(_put(buffer, done, out[-1]), BUFFER_AXES)
    # Each stage's statistics at [its microbatch, its repeat, the stage].
    hits = ((jnp.arange(count)[:, None, None] == m) & (jnp.arange(repeats)[None, :, None] == repeat) & ran)
    stats = jax.tree.map(lambda v, old: jnp.where(hits.reshape(*hits.shape, *(1,) * (v.ndim - 1)), v, old), new, stats)
    return (_on_stages(_shift(out, 1), STATE_AXES), buffer, stats), None

  buffer = _on_stages(buffer, BUFFER_AXES)
  state = _on_stages(jnp.zeros((stages, *buffer.shape[1:]), buffer.dtype), STATE_AXES)
  shapes = jax.eval_shape(run, params, index, state, positions[:stages], segment_ids[:stages])[1]
  stats = jax.tree.map(lambda v: jnp.zeros((count, repeats, *v.shape), v.dtype), shapes)
  (_, buffer, stats), _ = jax.lax.scan(iteration, (state, buffer, stats), jnp.arange(repeats * count + stages - 1))
  # [M, R, S, L / (S R), ...]: the layers of repeat r and stage s are the (r S + s)-th group.
  return rows(buffer), jax.tree.map(lambda v: v.reshape(count, -1, *v.shape[4:]), stats)


def gradients(cfg, stage: Stage, layers, rest, embed: Callable, head: Callable, batch: dict, report: Callable):
  """1F1B: ((loss, the head's sums, the reports' sums), (gradient of the stack's layers, gradient
  of `rest`), what the stages reported (Stage.apply), each leaf [layer, ...] summed over the
  microbatches) of the batch's microbatches, an iteration a forward and a backward per stage (each
  phase only where some stage has its work).

  embed(rest, microbatch) -> x [m, T, D]: the first stage's input; head(rest, y, microbatch) ->
  (loss, sums): the loss of the last stage's output, whose gradient starts the backward;
  report(microbatch, what a stage reported) -> (loss, sums): what the layers' reports add to the
  loss, linear in them (their terms; its gradient is the reports' cotangent). `rest` are the
  parameters besides the stack (the embedding, the final norm, the head and what follows it);
  each `sums` (a tree of arrays) is summed over the microbatches as the loss is."""
  stages, count = cfg.pipeline_stages, cfg.num_pipeline_microbatches
  # Microbatches in flight at a stage: at most the round trip's 2S - 1, and never more than M.
  slots = min(2 * stages - 1, count)
  regroup = jax.vmap(stage.regroup)
  # Each stage's layers (1F1B is not circular) as they run, and the map of their gradient back
  # to the stored layers: the transpose of that view.
  params, to_stored = jax.vjp(lambda stored: regroup(jax.tree.map(lambda p: p[:, 0], stage_layers(cfg, stored))),
                              layers)
  batch = microbatches(batch, count)
  index = jnp.arange(stages)
  first = stage.first + index * stage.per_stage
  run = jax.vmap(stage.apply, spmd_axis_name="pipeline")
  take = lambda m: jax.tree.map(lambda a: _at(a, jnp.clip(m, 0, count - 1)), batch)
  per_stage = lambda m: jax.tree.map(lambda a: _pick(a, jnp.clip(m, 0, count - 1)), batch)
  reported = jax.vmap(report)
  stat_cotangent = jax.vmap(jax.grad(lambda microbatch, stats: report(microbatch, stats)[0], argnums=1))
  x0 = jax.eval_shape(lambda: embed(rest, take(0)))
  state = jnp.zeros((stages, *x0.shape), x0.dtype)
  stats_shape = jax.eval_shape(lambda: run(params, state, batch["inputs_position"][:stages],
                                           batch["inputs_segmentation"][:stages], first)[1])
  inputs = jnp.zeros((stages, slots, *x0.shape), x0.dtype)
  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  head_shape = jax.eval_shape(lambda: head(rest, state[0], take(0)))
  report_shape = jax.eval_shape(lambda: reported(per_stage(index), zeros(stats_shape)))
  per_stage_sums = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), report_shape[1])
  total = (jnp.zeros((), head_shape[0].dtype), zeros(head_shape[1]), zeros(per_stage_sums))
  mask = lambda live, x: jnp.where(live.reshape(-1, *(1,) * (x.ndim - 1)), x, 0)

  def head_one(rest, y, microbatch, scored):
    out, vjp = jax.vjp(lambda r, y: head(r, y, microbatch), rest, y)
    d_rest, dy = vjp((jnp.where(scored, 1.0, 0.0).astype(out[0].dtype), zeros(out[1])))
    return out, d_rest, dy

  def embed_one(microbatch, dx):
    return jax.vjp(lambda r: embed(r, microbatch), rest)[1](dx)[0]

  heads = jax.vmap(head_one, spmd_axis_name="pipeline")
  # `rest` as every stage's own copy: a grouped matmul (the experts of a layer after the stack,
  # multi-token prediction's) batches only where its weights are batched too.
  rest_on_stages = jax.tree.map(lambda a: _on_stages(jnp.broadcast_to(a, (stages, *a.shape))), rest)
  embeds = jax.vmap(embed_one, spmd_axis_name="pipeline")

  # An iteration's three phases, each skipped where no stage has its work (lax.cond on the
  # iteration, the same on every device): forwards run in iterations 0 .. M + S - 2, the head in
  # S - 1 .. M + S - 2 and backwards from S - 1 on, so a step runs M + S - 1 forwards and
  # backwards of every stage, as GPipe's does, not M + 2S - 2 of each. The carries go through
  # the conds: three scans, one per span of phases, or conds that return only what is added to
  # the carries, ran slower on XLA:CPU and took more memory on TPU (docs/guides/pipeline.md).
  def forward_phase(state, inputs, stats_sums, t):
    # Stage s runs microbatch t - s; the first stage's input is embedded here.
    state = _on_stages(_put(state, 0, embed(rest, take(t))), STATE_AXES)
    m_f = t - index
    ran = (m_f >= 0) & (m_f < count)
    forward = per_stage(m_f)
    y, stats = run(params, state, forward["inputs_position"], forward["inputs_segmentation"], first)
    # A stage past its last forward writes nowhere (slot `slots`): with fewer slots than the round
    # trip its slot may still hold a microbatch waiting for its backward.
    slot_f = jnp.where(t - index < count, (t - index) % slots, slots)
    inputs = _put(inputs, slot_f, state)
    stats_sums = jax.tree.map(lambda a, b: a + mask(ran, b), stats_sums, stats)
    loss, sums = jax.tree.map(lambda x: jnp.sum(mask(ran, x), axis=0), reported(forward, stats))
    return _on_stages(y, STATE_AXES), inputs, stats_sums, loss, sums

  def head_phase(y, t):
    # The loss of the microbatch the last stage just finished, and its gradient: computed by every
    # stage on its own output and kept by the last, so that no stage's output crosses to another.
    m_l = t - stages + 1
    scored = (index == stages - 1) & (m_l >= 0) & (m_l < count)
    out, d_rest, dy = heads(rest_on_stages, y, per_stage(jnp.full((stages,), m_l)), scored)
    return jax.tree.map(lambda x: jnp.sum(mask(scored, x), axis=0), out), d_rest, dy

  def backward_phase(cotangent, inputs, grads, rest_grads, t):
    # Stage s runs microbatch t - 2S + 2 + s, its cotangent from stage s + 1 (the last stage's
    # from the head).
    m_b = t - 2 * stages + 2 + index
    live = (m_b >= 0) & (m_b < count)
    backward = per_stage(m_b)
    (_, stats), stage_vjp = jax.vjp(
        lambda p, x: run(p, x, backward["inputs_position"], backward["inputs_segmentation"], first),
        params, _at(inputs, m_b % slots))
    d_stats = jax.tree.map(lambda d: mask(live, d), stat_cotangent(backward, stats))
    d_params, dx = stage_vjp((cotangent, d_stats))
    grads = jax.tree.map(lambda g, d: g + mask(live, d), grads, d_params)
    # The first stage's input gradient reaches the embedding, on the first stage's devices.
    d_embed = embeds(backward, mask(live & (index == 0), dx))
    return dx, grads, jax.tree.map(jnp.add, rest_grads, d_embed)

  def skipped(shapes, *kept):
    """A phase's outputs where it has no work: zeros of `shapes`, but for the carries it passes on
    (kept: their positions among its arguments, by output)."""
    return lambda *args: tuple(args[k] if k is not None else zeros(shape) for k, shape in zip(kept, shapes))

  def iteration(carry, t):
    state, cotangent, inputs, grads, rest_grads, total, stats_sums = carry
    y, inputs, stats_sums, loss, sums = jax.lax.cond(
        t < count + stages - 1, forward_phase, skipped(forward_shapes, None, 1, 2, None, None),
        state, inputs, stats_sums, t)
    out, d_rest, dy = jax.lax.cond((t >= stages - 1) & (t < count + stages - 1), head_phase,
                                   skipped(head_shapes, None, None, None), y, t)
    total = (total[0] + loss + out[0], jax.tree.map(jnp.add, total[1], out[1]), jax.tree.map(jnp.add, total[2], sums))
    cotangent = _on_stages(jnp.where((index == stages - 1).reshape(-1, *(1,) * (dy.ndim - 1)), dy, cotangent),
                           STATE_AXES)
    dx, grads, rest_grads = jax.lax.cond(t >= stages - 1, backward_phase, skipped(backward_shapes, None, 2, 3),
                                         cotangent, inputs, grads, rest_grads, t)
    rest_grads = jax.tree.map(jnp.add, rest_grads, d_rest)
    return (_on_stages(_shift(y, 1), STATE_AXES), _on_stages(_shift(dx, -1), STATE_AXES), inputs, grads, rest_grads,
            total, stats_sums), None

  # The gradients of `rest`, one per stage (each stage's head and embedding), summed once at the end.
  rest_grads = jax.tree.map(lambda a: _on_stages(jnp.zeros((stages, *a.shape), a.dtype)), rest)
  carry = (state, jnp.zeros_like(state), inputs, zeros(params), rest_grads, total, zeros(stats_shape))
  forward_shapes = jax.eval_shape(forward_phase, state, inputs, carry[-1], 0)
  head_shapes = jax.eval_shape(head_phase, state, stages - 1)
  backward_shapes = jax.eval_shape(backward_phase, state, inputs, carry[3], rest_grads, stages - 1)
  (*_, grads, rest_grads, total, stats_sums), _ = jax.lax.scan(iteration, carry,
                                                               jnp.arange(count + 2 * stages - 2))
  (layer_grads,) = to_stored(grads)
  rest_grads = jax.tree.map(lambda g: jnp.sum(g, axis=0), rest_grads)
  return total, (layer_grads, rest_grads), jax.tree.map(lambda v: v.reshape(-1, *v.shape[2:]), stats_sums)
