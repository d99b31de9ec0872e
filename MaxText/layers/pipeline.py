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
keeps the residuals (what remat_policy saves) of all R M + S - 1 iterations. `gradients` is 1F1B
(interleaved with R > 1): an iteration runs a forward and a backward per stage, the loss and its
gradient inside the loop, each phase only in the iterations where some stage has its work
(R M + S - 1 of each, as GPipe's forward and backward loops run). A stage keeps only its inputs,
of at most 2 R S - 1 work items (the round trip to the last stage and back; R M where that is
fewer), however many microbatches there are, and its backward
runs the stage's forward again for the vjp: the residuals (what remat_policy saves) exist for
one microbatch at a time, for one more forward of the stage per microbatch. With
pipeline_keep_residuals a stage keeps each item's residuals instead, those that depend on the
item (_saved), and its backward starts from them: GPipe's forwards, in the memory of the items in
flight.
"""

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval  # dce_jaxpr: no public API prunes a jaxpr to some outputs
from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
from jax.sharding import PartitionSpec

from MaxText import costs, remat

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
  (S - 1) / (R M + S - 1), for GPipe and for 1F1B, whose loop runs a phase only in the iterations
  where some stage has its work."""
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


def _swap_groups(x, outer: int, inner: int):
  """x [outer x inner groups, ...] with the two group indices swapped."""
  return jnp.swapaxes(x.reshape(outer, inner, -1, *x.shape[1:]), 0, 1).reshape(x.shape)


def to_stage_order(cfg, x):
  """x [L, ...] in layer order (groups r S + s) -> stage order (stage s's groups s, S + s, ... the
  s-th block): where a run with circular stages keeps the stored layers; x as it is otherwise."""
  return _swap_groups(x, cfg.num_pipeline_repeats, cfg.pipeline_stages) if reorders(cfg) else x


def to_layer_order(cfg, x):
  """to_stage_order's inverse."""
  return _swap_groups(x, cfg.pipeline_stages, cfg.num_pipeline_repeats) if reorders(cfg) else x


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
  iterations = repeats * count + stages - 1

  def iteration(carry, t):
    state, buffer, stats = carry
    # The first stage reads its input only where it has work: the backward's sum of what it read
    # over the stages (the buffer is every stage's) then runs there only.
    with costs.runs_in(repeats * count, iterations):
      state = jax.lax.cond(t < repeats * count, lambda s, b: _put(s, 0, _at(b, t % count)), lambda s, b: s,
                           state, buffer)
    state = _on_stages(state, STATE_AXES)
    work = t - index  # each stage's (repeat, microbatch) as r M + m
    ran = (work >= 0) & (work < repeats * count)
    work = jnp.clip(work, 0, repeats * count - 1)
    m, repeat = work % count, work // count
    out, new = run(params, repeat, state, _pick(positions, m), _pick(segment_ids, m))
    out = _on_stages(out, STATE_AXES)
    # The microbatch the last stage finished, from iteration S - 1 on, written where every stage
    # reads it: only in those iterations, as is the shift, not from the last one.
    with costs.runs_in(repeats * count, iterations):
      buffer = jax.lax.cond(t >= stages - 1, lambda b, y: _put(b, (t - stages + 1) % count, y[-1]), lambda b, y: b,
                            buffer, out)
    buffer = _on_stages(buffer, BUFFER_AXES)
    # Each stage's statistics at [its microbatch, its repeat, the stage].
    hits = ((jnp.arange(count)[:, None, None] == m) & (jnp.arange(repeats)[None, :, None] == repeat) & ran)
    stats = jax.tree.map(lambda v, old: jnp.where(hits.reshape(*hits.shape, *(1,) * (v.ndim - 1)), v, old), new, stats)
    with costs.runs_in(iterations - 1, iterations):
      state = jax.lax.cond(t < iterations - 1, lambda y: _shift(y, 1), jnp.zeros_like, out)
    return (_on_stages(state, STATE_AXES), buffer, stats), None

  buffer = _on_stages(buffer, BUFFER_AXES)
  state = _on_stages(jnp.zeros((stages, *buffer.shape[1:]), buffer.dtype), STATE_AXES)
  shapes = jax.eval_shape(run, params, index, state, positions[:stages], segment_ids[:stages])[1]
  stats = jax.tree.map(lambda v: jnp.zeros((count, repeats, *v.shape), v.dtype), shapes)
  (_, buffer, stats), _ = jax.lax.scan(iteration, (state, buffer, stats), jnp.arange(iterations))
  # [M, R, S, L / (S R), ...]: the layers of repeat r and stage s are the (r S + s)-th group.
  return rows(buffer), jax.tree.map(lambda v: v.reshape(count, -1, *v.shape[4:]), stats)


class _Saved(NamedTuple):
  """A stage's vjp split in two: what the forward of an item keeps for its backward (what depends on
  its input, positions or segment ids: remat_policy's tensors, the input where its layers keep it),
  and what the backward rebuilds from the layers alone (the weights as the layers read them), so
  that no weight is kept per item."""

  # (layers, x, positions, segment ids, first) -> ((x, report), the kept leaves)
  forward: Callable
  # (layers, first, the kept leaves, cotangents of (x, report)) -> (gradient of layers, of x)
  backward: Callable
  kept: list  # ShapeDtypeStructs of the kept leaves


def _saved(stage: Stage, layers, x, positions, segment_ids) -> _Saved:
  """_Saved of one stage's apply, for one stage's arguments' shapes."""
  structure = []

  def leaves(layers, x, positions, segment_ids, first):
    out, vjp = jax.vjp(lambda p, x: stage.apply(p, x, positions, segment_ids, first), layers, x)
    # The structure as traced here, out of any loop: the vjp's function holds no value of a trace.
    structure[:] = structure or [jax.tree.structure(out), jax.tree.structure(vjp)]
    return out, jax.tree.leaves(vjp)

  closed = jax.make_jaxpr(leaves)(layers, x, positions, segment_ids, stage.first)
  outputs = structure[0].num_leaves
  count = len(jax.tree.leaves(layers))
  depends = set(closed.jaxpr.invars[count:count + 3])  # x, positions, segment ids
  for eqn in closed.jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in depends for v in eqn.invars):
      depends.update(eqn.outvars)
  kept = [not isinstance(v, Literal) and v in depends for v in closed.jaxpr.outvars[outputs:]]
  rebuilt, used = partial_eval.dce_jaxpr(closed.jaxpr, [False] * outputs + [not k for k in kept])
  assert not any(used[count:count + 3]), "a rebuilt residual depends on the item"
  rebuild = jaxpr_as_fun(ClosedJaxpr(rebuilt, closed.consts))

  def forward(layers, x, positions, segment_ids, first):
    out, residuals = leaves(layers, x, positions, segment_ids, first)
    return out, [r for r, k in zip(residuals, kept) if k]

  def backward(layers, first, kept_leaves, cotangents):
    arguments = [*jax.tree.leaves(layers), None, None, None, first]
    rebuilt_leaves = iter(rebuild(*[a for a, u in zip(arguments, used) if u]))
    kept_leaves = iter(kept_leaves)
    vjp = jax.tree.unflatten(structure[1], [next(kept_leaves) if k else next(rebuilt_leaves) for k in kept])
    return vjp(cotangents)

  shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a, k in zip(closed.out_avals[outputs:], kept) if k]
  return _Saved(forward, backward, shapes)


def gradients(cfg, stage: Stage, layers, rest, embed: Callable, head: Callable, batch: dict, report: Callable):
  """1F1B: ((loss, the head's sums, the reports' sums), (gradient of the stack's layers, gradient
  of `rest`), what the stages reported (Stage.apply), each leaf [layer, ...] summed over the
  microbatches) of the batch's microbatches, an iteration a forward and a backward per stage (each
  phase only where some stage has its work).

  Interleaved with R > 1 repeats: a stage's work items are microbatch g S + j at repeat r, item
  i = g R S + r S + j: the microbatches go through the stages in groups of S, a group through
  every repeat before the next starts, so what the last stage sends at repeat r is the first
  stage's input at r + 1 in the next iteration (the shift wraps around), and the bubble is
  GPipe's circular one. Stage s runs forward item t - s and backward item t - (R S - 1) - (S - 1 - s)
  of the same order with the repeats reversed (the last stage at the last repeat first, in the
  iteration its forward ran), and keeps the inputs of at most 2 R S - 1 items.

  embed(rest, microbatch) -> x [m, T, D]: the first stage's input; head(rest, y, microbatch) ->
  (loss, sums): the loss of the last stage's output, whose gradient starts the backward;
  report(microbatch, what a stage reported) -> (loss, sums): what the layers' reports add to the
  loss, linear in them (their terms; its gradient is the reports' cotangent). `rest` are the
  parameters besides the stack (the embedding, the final norm, the head and what follows it);
  each `sums` (a tree of arrays) is summed over the microbatches as the loss is."""
  stages, repeats, count = cfg.pipeline_stages, cfg.num_pipeline_repeats, cfg.num_pipeline_microbatches
  work, lag = repeats * count, repeats * stages - 1  # items per stage; the first backward's iteration
  # Items in flight at a stage: at most the round trip's 2 R S - 1, and never more than there are.
  slots = min(2 * repeats * stages - 1, work)
  # Each stage's layers of every repeat as they run [S, R, ...], and the map of their gradient back
  # to the stored layers: the transpose of that view.
  params, to_stored = jax.vjp(lambda stored: jax.vmap(jax.vmap(stage.regroup))(stage_layers(cfg, stored)), layers)
  # Each stage's layers of its repeat r [S]: with one repeat the slice, no select per iteration.
  at_repeat = (lambda p, r: jax.tree.map(lambda a: a[:, 0], p)) if repeats == 1 else (
      lambda p, r: jax.tree.map(lambda a: _at(a, r), p))
  # The shift between stages. With repeats it wraps around, the last stage feeding the first (and
  # back), so every stage's output crosses: it runs in the phases, only where one reads it (not a
  # phase's that did not run, nor the outputs only the head or the embedding reads). With one
  # repeat it runs between iterations, where the last stage sends nothing and the compiled step
  # holds less memory (libtpu).
  inside = repeats > 1

  def received(x, by, t, after):
    """What the stages beside sent, in the phase of iteration t: shifted here after `after` (an
    iteration where the phase ran), or already between iterations."""
    if not inside:
      return x
    with costs.runs_in(work + stages - 2, work + stages - 1):
      return jax.lax.cond(t > after, lambda x: jnp.roll(x, by, axis=0), jnp.zeros_like, x)

  sent = (lambda x, by: x) if inside else _shift
  batch = microbatches(batch, count)
  index = jnp.arange(stages)
  first = lambda r: stage.first + (r * stages + index) * stage.per_stage

  def item(i):
    """Work item i (one per stage) -> (microbatch, repeat, whether it is one)."""
    live = (i >= 0) & (i < work)
    i = jnp.clip(i, 0, work - 1)
    group, within = i // (repeats * stages), i % (repeats * stages)
    return group * stages + within % stages, within // stages, live

  run = jax.vmap(stage.apply, spmd_axis_name="pipeline")
  take = lambda m: jax.tree.map(lambda a: _at(a, jnp.clip(m, 0, count - 1)), batch)
  per_stage = lambda m: jax.tree.map(lambda a: _pick(a, jnp.clip(m, 0, count - 1)), batch)
  reported = jax.vmap(report)
  stat_cotangent = jax.vmap(jax.grad(lambda microbatch, stats: report(microbatch, stats)[0], argnums=1))
  x0 = jax.eval_shape(lambda: embed(rest, take(0)))
  state = jnp.zeros((stages, *x0.shape), x0.dtype)
  zero_repeat = jnp.zeros((stages,), jnp.int32)
  stats_shape = jax.eval_shape(lambda: run(at_repeat(params, zero_repeat), state, batch["inputs_position"][:stages],
                                           batch["inputs_segmentation"][:stages], first(zero_repeat))[1])
  zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)
  # What a stage holds of each item in flight until its backward, [S, slots, ...] each: its input
  # (the backward runs the stage's forward again), or with pipeline_keep_residuals what its forward
  # saved and what it reported.
  if cfg.pipeline_keep_residuals:
    one = lambda a, skip: jax.ShapeDtypeStruct(a.shape[skip:], a.dtype)
    saved = _saved(stage, jax.tree.map(lambda a: one(a, 2), params), x0, one(batch["inputs_position"], 1),
                   one(batch["inputs_segmentation"], 1))
    held = [*saved.kept, *jax.tree.map(lambda a: one(a, 1), jax.tree.leaves(stats_shape))]
    keeping, rebuilding = (jax.vmap(f, spmd_axis_name="pipeline") for f in (saved.forward, saved.backward))
  else:
    saved, held = None, [x0]
  inputs = [jnp.zeros((stages, slots, *a.shape), a.dtype) for a in held]
  head_shape = jax.eval_shape(lambda: head(rest, state[0], take(0)))
  report_shape = jax.eval_shape(lambda: reported(per_stage(index), zeros(stats_shape)))
  per_stage_sums = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), report_shape[1])
  total = (jnp.zeros((), head_shape[0].dtype), zeros(head_shape[1]), zeros(per_stage_sums))
  mask = lambda live, x: jnp.where(live.reshape(-1, *(1,) * (x.ndim - 1)), x, 0)
  # Each stage's statistics by repeat [S, R, ...].
  stats_zeros = jax.tree.map(lambda a: jnp.zeros((stages, repeats, *a.shape[1:]), a.dtype), stats_shape)

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

  def backward_item(t):
    """Each stage's backward this iteration: (microbatch, repeat, whether it is one, the slot of its
    forward's input)."""
    m, reversed_repeat, live = item(t - lag - (stages - 1 - index))
    repeat = repeats - 1 - reversed_repeat
    return m, repeat, live, ((m // stages) * repeats * stages + repeat * stages + m % stages) % slots

  # An iteration's three phases, each skipped where no stage has its work (lax.cond on the
  # iteration, the same on every device): forwards run in iterations 0 .. R M + S - 2, the head
  # where the last stage finishes a microbatch's last repeat and backwards from R S - 1 on, so a
  # step runs R M + S - 1 forwards and backwards of every stage, as GPipe's does. The carries go
  # through the conds: three scans, one per span of phases, or conds that return only what is
  # added to the carries, ran slower on XLA:CPU and took more memory on TPU (docs/guides/pipeline.md).
  def forward_phase(y, inputs, stats_sums, t):
    state = _on_stages(received(y, 1, t, 0), STATE_AXES)
    m_f, r_f, ran = item(t - index)
    # The first stage's input at the first repeat is embedded here; at later ones the last stage sent it.
    fresh = ((index == 0) & (r_f == 0)).reshape(-1, *(1,) * (state.ndim - 1))
    state = _on_stages(jnp.where(fresh, embed(rest, take(m_f[0]))[None], state), STATE_AXES)
    forward = per_stage(m_f)
    args = (at_repeat(params, r_f), state, forward["inputs_position"], forward["inputs_segmentation"], first(r_f))
    if saved is None:
      (y, stats), kept = run(*args), [state]
    else:
      (y, stats), kept = keeping(*args)
      kept = [*kept, *jax.tree.leaves(stats)]
    # A stage past its last forward writes nowhere (slot `slots`): with fewer slots than the round
    # trip its slot may still hold an item waiting for its backward.
    slot_f = jnp.where(t - index < work, (t - index) % slots, slots)
    inputs = [_put(buffer, slot_f, value) for buffer, value in zip(inputs, kept)]
    stats_sums = jax.tree.map(lambda a, b: a + jnp.where(_hits(r_f, repeats, a.ndim), mask(ran, b)[:, None], 0),
                              stats_sums, stats)
    loss, sums = jax.tree.map(lambda x: jnp.sum(mask(ran, x), axis=0), reported(forward, stats))
    return _on_stages(y, STATE_AXES), inputs, stats_sums, loss, sums

  def head_phase(y, t):
    # The loss of the microbatch the last stage just finished at its last repeat, and its gradient:
    # computed by every stage on its own output and kept by the last, so that no stage's output
    # crosses to another.
    m_l, r_l, live = item(t - index)
    scored = (index == stages - 1) & live & (r_l == repeats - 1)
    out, d_rest, dy = heads(rest_on_stages, y, per_stage(m_l), scored)
    return jax.tree.map(lambda x: jnp.sum(mask(scored, x), axis=0), out), d_rest, dy

  def backward_phase(dx, dy, inputs, grads, rest_grads, t):
    # Its cotangent came from the stage after it (the last stage's at the last repeat from the
    # head, at earlier repeats from the first stage).
    m_b, r_b, live, slot_b = backward_item(t)
    from_head = ((index == stages - 1) & (r_b == repeats - 1)).reshape(-1, *(1,) * (dy.ndim - 1))
    cotangent = _on_stages(jnp.where(from_head, dy, received(dx, -1, t, lag)), STATE_AXES)
    backward = per_stage(m_b)
    kept = [_at(buffer, slot_b) for buffer in inputs]
    if saved is None:
      (_, stats), stage_vjp = jax.vjp(
          lambda p, x: run(at_repeat(p, r_b), x, backward["inputs_position"], backward["inputs_segmentation"],
                           first(r_b)),
          params, kept[0])
    else:
      stats = jax.tree.unflatten(jax.tree.structure(stats_shape), kept[len(saved.kept):])
      selected, select_vjp = jax.vjp(lambda p: at_repeat(p, r_b), params)

      def stage_vjp(cotangents):
        d_selected, dx = rebuilding(selected, first(r_b), kept[:len(saved.kept)], cotangents)
        return select_vjp(d_selected)[0], dx
    d_stats = jax.tree.map(lambda d: mask(live, d), stat_cotangent(backward, stats))
    d_params, dx = stage_vjp((cotangent, d_stats))
    grads = jax.tree.map(lambda g, d: g + mask(live, d), grads, d_params)
    # The first stage's input gradient at the first repeat reaches the embedding, on its devices.
    d_embed = embeds(backward, mask(live & (index == 0) & (r_b == 0), dx))
    return dx, grads, jax.tree.map(jnp.add, rest_grads, d_embed)

  def skipped(shapes, *kept):
    """A phase's outputs where it has no work: zeros of `shapes`, but for the carries it passes on
    (kept: their positions among its arguments, by output)."""
    return lambda *args: tuple(args[k] if k is not None else zeros(shape) for k, shape in zip(kept, shapes))

  iterations = lag + work + stages - 1

  def iteration(carry, t):
    y, dx, inputs, grads, rest_grads, total, stats_sums = carry
    with costs.runs_in(work + stages - 1, iterations):
      y, inputs, stats_sums, loss, sums = jax.lax.cond(
          t < work + stages - 1, forward_phase, skipped(forward_shapes, None, 1, 2, None, None),
          y, inputs, stats_sums, t)
    last = t - (stages - 1)  # the last stage's forward item
    scoring = (last >= 0) & (last < work) & ((last % (repeats * stages)) // stages == repeats - 1)
    with costs.runs_in(count, iterations):
      out, d_rest, dy = jax.lax.cond(scoring, head_phase, skipped(head_shapes, None, None, None), y, t)
    total = (total[0] + loss + out[0], jax.tree.map(jnp.add, total[1], out[1]), jax.tree.map(jnp.add, total[2], sums))
    with costs.runs_in(work + stages - 1, iterations):
      dx, grads, rest_grads = jax.lax.cond(t >= lag, backward_phase, skipped(backward_shapes, None, 3, 4),
                                           dx, dy, inputs, grads, rest_grads, t)
    rest_grads = jax.tree.map(jnp.add, rest_grads, d_rest)
    return (_on_stages(sent(y, 1), STATE_AXES), _on_stages(sent(dx, -1), STATE_AXES), inputs, grads, rest_grads,
            total, stats_sums), None

  # The gradients of `rest`, one per stage (each stage's head and embedding), summed once at the end.
  rest_grads = jax.tree.map(lambda a: _on_stages(jnp.zeros((stages, *a.shape), a.dtype)), rest)
  carry = (state, jnp.zeros_like(state), inputs, zeros(params), rest_grads, total, stats_zeros)
  forward_shapes = jax.eval_shape(forward_phase, state, inputs, carry[-1], 0)
  head_shapes = jax.eval_shape(head_phase, state, stages - 1)
  backward_shapes = jax.eval_shape(backward_phase, state, state, inputs, carry[3], rest_grads, lag)
  (*_, grads, rest_grads, total, stats_sums), _ = jax.lax.scan(iteration, carry, jnp.arange(iterations))
  (layer_grads,) = to_stored(grads)
  rest_grads = jax.tree.map(lambda g: jnp.sum(g, axis=0), rest_grads)
  # [S, R, L / (S R), ...] -> layer order: the layers of repeat r and stage s are the (r S + s)-th group.
  return total, (layer_grads, rest_grads), jax.tree.map(
      lambda v: jnp.swapaxes(v, 0, 1).reshape(-1, *v.shape[3:]), stats_sums)
