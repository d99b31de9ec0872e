"""Memory planner: python -m MaxText.plan configs/base.yml [hbm_budget_gib=...] [key=value ...]

Finds the fastest num_vocab_tiling x remat_policy x remat_layer_interval x per_device_batch_size
(x mlp_chunks x attention_head_chunks x gradient_accumulation_steps x ici_context_parallelism x
context_parallel_strategy x ici_/dcn_pipeline_parallelism x num_pipeline_microbatches x pipeline_schedule
x pipeline_keep_residuals) whose train step fits hbm_budget_gib per device, for the devices
train_compile compiles for: a TPU slice (compile_topology=v5p-64), or the visible devices
(JAX_NUM_CPU_DEVICES=N simulates N). Every other key is held as given, and so is a search key
given on the command line. Each candidate is the train step `train` runs, AOT-compiled: memory
from memory_analysis(), HBM bytes from cost_analysis() plus the matmuls' bytes at their loop trip
counts, FLOPs from the traced step (recomputation included). Its predicted step time is a roofline
per device, max(FLOPs / peak FLOP/s, bytes / HBM bandwidth), from the chip table (on CPU, both
rates are measured once at start-up).

The search walks, for each context setting x pipeline setting x remat_policy x mlp_chunks x attention_head_chunks x
gradient_accumulation_steps, up plan_remat_layer_intervals, and at each interval up the
plan_per_device_batch_sizes ladder; at each batch size it compiles the fewest tile counts of
plan_num_vocab_tiling that could fit, one more, then the most: when those do not fit, the
ladder ends; when they do, the fewest that fit are found by bisection. Memory grows with the
batch, the interval and the tensors a policy keeps, and falls with the tile count, so a batch
starts from the tiles that fit the batch below it and the same batch at the interval below, an
interval tries no batch that did not fit at the interval below, and a candidate that needs no
less memory than one that did not fit, in any setting, is not compiled. Nor is one that cannot
be faster than the fastest that fits so far: its traced FLOPs and matmul bytes, with XLA's bytes
of a compiled neighbour that accesses no more, bound its roofline time from below, and a
batch's candidates are skipped together when that bound is too slow for all of them. Policies
that keep the same tensors where they count are compiled once (on CPU, where host memory is
device memory, an offloaded policy equals the one that keeps those tensors), and on CPU the
compiles skip LLVM's optimization of the code, which changes neither the memory nor XLA's cost
analysis. The settings' searches run side by side, sharing what they learn, their compiles in
parallel processes (plan_workers) when the devices are simulated CPUs or a compile_topology. It
prints every compile, the Pareto front of memory vs predicted tokens/s as Markdown and the fastest
candidate that fits as a `python -m MaxText.train` line, and writes
base_output_directory/run_name/plan/plan.{md,json,png}. Exit code 2 when nothing fits the budget.
With max_target_length=auto it answers the longest sequence that fits: the search at each of
plan_max_target_lengths, ascending, until one has no candidate that fits. MaxText.auto runs the
same search for `auto` keys at the start of train and train_compile. """

import concurrent.futures
import contextlib
import functools
import heapq
import itertools
import math
import multiprocessing
import os
import time

import jax
import jax.numpy as jnp

from MaxText import (
  accelerators,
  config_schema,
  costs,
  errors,
  pyconfig,
  remat,
  reports,
  run_control,
  runtime,
  sharding,
  train_step,
)

# Search key -> the key listing the values the planner tries, in search order.
SEARCH_KEYS = {
    "remat_policy": "plan_remat_policies",
    "remat_layer_interval": "plan_remat_layer_intervals",
    "mlp_chunks": "plan_mlp_chunks",
    "attention_head_chunks": "plan_attention_head_chunks",
    "ici_context_parallelism": "plan_context_parallelism",
    "context_parallel_strategy": "plan_context_parallel_strategies",
    "ici_pipeline_parallelism": "plan_pipeline_parallelism",
    "dcn_pipeline_parallelism": "plan_dcn_pipeline_parallelism",
    "num_pipeline_microbatches": "plan_num_pipeline_microbatches",
    "pipeline_schedule": "plan_pipeline_schedules",
    "pipeline_keep_residuals": "plan_pipeline_keep_residuals",
    "gradient_accumulation_steps": "plan_gradient_accumulation_steps",
    "per_device_batch_size": "plan_per_device_batch_sizes",
    "num_vocab_tiling": "plan_num_vocab_tiling",
}
# The mesh settings each chain of the search fixes: context parallelism and pipeline stages.
CONTEXT_KEYS = ("ici_context_parallelism", "context_parallel_strategy")
PIPELINE_KEYS = ("ici_pipeline_parallelism", "dcn_pipeline_parallelism", "num_pipeline_microbatches",
                 "pipeline_schedule", "pipeline_keep_residuals")
PARALLEL_KEYS = CONTEXT_KEYS + PIPELINE_KEYS
# Left of a device's memory for what the compiled step does not count: the runtime,
# fragmentation, the next input batch.
MARGIN = 0.1
def _key(arg: str) -> str:
  return arg.partition("=")[0]


def _assignments(settings: dict) -> list:
  """key=value for each setting; a key left unset (None: its default rule) is left out."""
  return [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items() if v is not None]


def describe(settings: dict) -> str:
  return " ".join(_assignments(settings))


def roofline_rates(device) -> tuple[float, float, str]:
  """(peak FLOP/s, memory bytes/s, where they come from) of one device."""
  chip = accelerators.chip_of(device.device_kind)
  if chip:
    return chip.peak_bf16_tflops * 1e12, chip.hbm_gb_per_s * 1e9, f"{device.device_kind}: vendor figures"
  return (*_host_rates(), f"{device.platform}: measured (float32 matmul, array copy)")


@functools.cache
def _host_rates() -> tuple[float, float]:
  """A CPU has no published figures: the float32 matmul rate and copy bandwidth of device 0,
  each the fastest of several runs after a warm-up."""

  def fastest(fn, x):
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(5):
      start = time.perf_counter()
      jax.block_until_ready(fn(x))
      times.append(time.perf_counter() - start)
    return min(times)

  square = jnp.ones((1024, 1024), jnp.float32)
  flat = jnp.ones((32 * 2**20,), jnp.float32)
  flops = 2 * 1024**3 / fastest(jax.jit(lambda a: a @ a), square)
  bandwidth = 2 * flat.nbytes / fastest(jax.jit(lambda a: a + 1), flat)  # read once, write once
  return flops, bandwidth


def budget_bytes(config, device) -> tuple[int, str]:
  """(bytes a step may use per device, how that was set)."""
  if config.hbm_budget_gib:
    return int(config.hbm_budget_gib * 2**30), f"hbm_budget_gib={config.hbm_budget_gib:g}"
  limit = costs.memory_limit_bytes(device, config.num_devices)  # the planner's devices are one process's
  if limit is None:
    raise errors.ConfigError(f"hbm_budget_gib=null: the memory of a {device.device_kind} is not known here; give "
                      "hbm_budget_gib")
  what = f"host memory / {config.num_devices} devices" if device.platform == "cpu" else f"{device.device_kind} memory"
  return int(limit * (1 - MARGIN)), f"{what} minus {MARGIN:.0%}"


def search_space(config, free) -> dict:
  """{search key: values}: the plan_* list for each key in `free`, else the config's value."""
  space = {}
  for key, plan_key in SEARCH_KEYS.items():
    values = list(getattr(config, plan_key)) if key in free else [getattr(config, key)]
    if key == "remat_policy":
      # Policies that keep the same tensors where they count on this platform compile alike.
      values = remat.distinct_policies(values or remat.SEARCHABLE_POLICIES, config.platform)[0]
    if key in PARALLEL_KEYS and not values:
      # Without a pipeline the configured microbatches resolved to 1; a searched pipeline's
      # default is one per stage.
      values = [-1 if key == "num_pipeline_microbatches" and config.pipeline_stages == 1 else getattr(config, key)]
    if key in ("ici_context_parallelism", "ici_pipeline_parallelism") and any(config.num_devices % x for x in values):
      raise errors.ConfigError(f"{plan_key}={values}: {next(x for x in values if config.num_devices % x)}"
                               f" does not divide the {config.num_devices} devices")
    if key == "dcn_pipeline_parallelism" and values != [config.dcn_pipeline_parallelism]:
      granules = math.prod(config.dcn_mesh_shape)
      if any(granules % x for x in values):
        raise errors.ConfigError(f"{plan_key}={values}: {next(x for x in values if granules % x)} does not divide "
                                 f"the {granules} slices/processes")
      if not any(getattr(config, f"dcn_{axis}_parallelism") == -1 for axis in sharding.MESH_AXES):
        raise errors.ConfigError(f"{plan_key}={values}: needs another dcn_*_parallelism=-1 to take the slices the "
                                 "stages leave (e.g. dcn_data_parallelism=-1)")
    if key == "remat_layer_interval":
      values = [i for i in values if i <= config.base_num_decoder_layers]
      if not values:
        raise errors.ConfigError(f"plan_remat_layer_intervals={list(config.plan_remat_layer_intervals)}: none is "
                                 f"<= base_num_decoder_layers={config.base_num_decoder_layers}")
    space[key] = values
  return space


@contextlib.contextmanager
def _without_code_optimization(platform: str):
  """On CPU, the planner's compiles skip LLVM's optimization of the generated code: buffer
  assignment (memory_analysis) and the HLO cost analysis come before it and are the same, in
  about half the compile time. The flag is the process's, so it is set around one compile."""
  if platform != "cpu" or jax.config.read("jax_disable_most_optimizations"):
    yield
    return
  jax.config.update("jax_disable_most_optimizations", True)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", False)


def _speed(tokens: float, flops: float, hbm_bytes: float, rates: tuple) -> float:
  """Tokens/s of one device by the roofline, from its tokens, FLOPs and HBM bytes per step."""
  peak, bandwidth, _ = rates
  return tokens / max(flops / peak, hbm_bytes / bandwidth)


def evaluate(base, settings: dict, rates: tuple, floor: float = 0.0, bytes_floor: float = 0.0) -> dict:
  """One candidate: the config `base` with `settings` (pyconfig.replace), compiled; its memory
  and predicted speed, or why not. Not compiled ("pruned") when the traced step bounds its speed
  below `floor` tokens/s/chip: the roofline's bytes are XLA's (at least `bytes_floor`) plus the
  matmuls', so the FLOPs and the matmuls' bytes give a step time it cannot beat."""
  record = {"settings": settings}
  try:
    config = pyconfig.replace(base, settings)
    trainer = train_step.build(config, sharding.create_mesh(config))
    jaxpr = train_step.trace_train_step(trainer, config).jaxpr
    flops = costs.flops_report(config, jaxpr)
    model_flops, step_flops = flops["model_flops_per_step"], flops["traced_flops_per_step"]
    tokens = config.global_batch_size_to_train_on * config.max_target_length
    per_device = (tokens / config.num_devices, step_flops / config.num_devices)
    matmul_bytes = costs.matmul_bytes(jaxpr) / config.num_devices
    most = _speed(*per_device, matmul_bytes + bytes_floor, rates)
    if most < floor:
      return {**record, "status": "pruned", "reason": f"at most {most:,.0f} tokens/s/chip"}
    with _without_code_optimization(config.platform):
      compiled = train_step.compile_train_step(trainer, config)
  except errors.ConfigError as e:
    return {**record, "status": "invalid", "reason": str(e)}
  except errors.UserError as e:  # the TPU compiler refuses a step larger than HBM
    return {**record, "status": "does not fit", "reason": str(e).removeprefix("does not fit: ")}
  except Exception as e:  # a compiler failure is a result to report, not the end of the search
    return {**record, "status": "failed", "reason": f"{type(e).__name__}: {errors.first_line(e)}"}
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  # XLA's bytes count a loop body (scanned layers, vocabulary tiles) once; the matmuls' operand
  # and result bytes at their loop trip counts are added (so a loop body's matmuls count once more).
  hbm_bytes = cost.get("bytes accessed", 0.0) + matmul_bytes
  peak, bandwidth, _ = rates
  compute_s, memory_s = per_device[1] / peak, hbm_bytes / bandwidth
  seconds = max(compute_s, memory_s)
  return {**record, "status": "ok", **costs.memory_stats(compiled), "tokens_per_step": tokens,
          "model_flops_per_step": model_flops, "step_flops_per_step": step_flops,
          "recompute_ratio": step_flops / model_flops, "cost_analysis_flops_per_device": cost.get("flops", 0.0),
          "cost_analysis_bytes_per_device": cost.get("bytes accessed", 0.0),
          "matmul_bytes_per_device": matmul_bytes, "hbm_bytes_per_device": hbm_bytes, "roofline_seconds": seconds,
          "bound": "compute" if compute_s >= memory_s else "memory",
          "tokens_per_second_per_chip": tokens / config.num_devices / seconds}


def _line(record: dict) -> str:
  if record["status"] != "ok":
    return f"  {describe(record['settings'])}: {record['status']}: {record['reason']}"
  return (f"  {describe(record['settings'])}: {record['total_bytes'] / 2**30:.2f} GiB"
          f"{'' if record['fits'] else ' (over budget)'}, {record['tokens_per_second_per_chip']:,.0f} tokens/s/chip")


# The search keys along which memory is ordered (see _Known); candidates are compared on them
# only when every other setting is the same.
_ORDERED = ("remat_policy", "remat_layer_interval", "per_device_batch_size", "num_vocab_tiling")


class _Known:
  """What the compiles so far say about candidates not compiled: the fastest fitting one's
  tokens/s/chip, which cannot fit, and a floor under their XLA bytes. Memory grows with the
  batch, the interval and the tensors a policy keeps (remat.needs_no_less) and falls with the
  tile count, so a candidate that did not fit rules out every candidate that needs no less
  memory, in any setting's chain. XLA's bytes grow with the batch and fall with the tile count
  (it counts a tile's loop body once), all else the same."""

  def __init__(self, platform: str):
    self.platform, self.best, self.over, self.sized = platform, 0.0, [], []

  def learn(self, record: dict):
    if record["fits"]:
      self.best = max(self.best, record["tokens_per_second_per_chip"])
    elif record["status"] in ("ok", "does not fit"):
      self.over.append(record["settings"])
    if record["status"] == "ok":
      self.sized.append(record)

  def cannot_fit(self, settings: dict) -> bool:
    return any(_others(settings) == _others(o)
               and remat.needs_no_less(settings["remat_policy"], o["remat_policy"], self.platform)
               and settings["remat_layer_interval"] >= o["remat_layer_interval"]
               and settings["per_device_batch_size"] >= o["per_device_batch_size"]
               and settings["num_vocab_tiling"] <= o["num_vocab_tiling"] for o in self.over)

  def bytes_floor(self, settings: dict) -> float:
    """XLA's bytes per device that the candidate `settings` accesses at least."""
    same = {k: v for k, v in settings.items() if k not in ("per_device_batch_size", "num_vocab_tiling")}
    return max((r["cost_analysis_bytes_per_device"] for r in self.sized
                if same == {k: r["settings"][k] for k in same}
                and r["settings"]["per_device_batch_size"] <= settings["per_device_batch_size"]
                and r["settings"]["num_vocab_tiling"] >= settings["num_vocab_tiling"]), default=0.0)


def _others(settings: dict) -> dict:
  return {k: v for k, v in settings.items() if k not in _ORDERED}


def _chain(base, space: dict, rates: tuple, known: _Known, fixed: dict):
  """One setting's candidates (see the module doc), a generator: it yields (the settings to
  compile next, the floor under its XLA bytes for the speed bound, or None where it is compiled
  whatever its bound) and is sent each one's record. For each remat_layer_interval, ascending,
  the batch ladder; at each batch the fewest tiles that could fit first (those that fit the batch
  below and the same batch at the interval below), then one more tile (where a batch that needs
  more tiles most often fits), then the most tiles: when those do not fit, no larger batch does;
  when they do, the fewest that fit lie between, found by bisection. The speed bound skips the
  rest of a batch: no tile count between has fewer matmul bytes than the fewest compiled, the
  same FLOPs, nor fewer XLA bytes than the most; only these compiles tell the memory."""
  intervals = space["remat_layer_interval"][:1] if fixed["remat_policy"] == "none" else space["remat_layer_interval"]
  below = None  # {batch: the index of the fewest tiles that can fit it at the interval below}
  for interval in intervals:
    reached, start = {}, 0
    for batch in space["per_device_batch_size"]:
      if below is not None and batch not in below:
        break
      tiles = _valid_tiles(base, {**fixed, "remat_layer_interval": interval, "per_device_batch_size": batch},
                           space["num_vocab_tiling"])
      row = [{**fixed, "remat_layer_interval": interval, "per_device_batch_size": batch, "num_vocab_tiling": t}
             for t in tiles]
      low, high = max(start, (below or {}).get(batch, 0)), len(row) - 1
      record = yield row[low], known.bytes_floor(row[high])
      if record["status"] in ("pruned", "invalid"):  # a larger batch may be faster, or valid
        reached[batch] = low
        continue
      least = record if record["status"] == "ok" else None
      if not record["fits"] and low < high:
        low += 1
        record = yield row[low], None
        least = least or (record if record["status"] == "ok" else None)
      if not record["fits"]:
        if low == high:
          break
        most = yield row[high], None
        if not most["fits"]:
          break
        low += 1
        if least and most["status"] == "ok" and known.best > _speed(
            least["tokens_per_step"] / base.num_devices, least["step_flops_per_step"] / base.num_devices,
            least["matmul_bytes_per_device"] + most["cost_analysis_bytes_per_device"], rates):
          reached[batch] = low
          continue
        while low < high:
          middle = (low + high) // 2
          if (yield row[middle], None)["fits"]:
            high = middle
          else:
            low = middle + 1
      reached[batch] = start = low
    if not reached:
      break
    below = reached


def _valid_tiles(base, settings: dict, tiles: list) -> list:
  """The tile counts the config accepts with `settings` (a count past the tokens is not), or all
  of them when it accepts none: evaluate() then reports why."""
  valid = []
  for t in tiles:
    try:
      pyconfig.replace(base, {**settings, "num_vocab_tiling": t})
      valid.append(t)
    except errors.ConfigError:
      pass
  return valid or tiles


def candidate_bound(space: dict) -> tuple[int, int]:
  """(settings searched in parallel, most compiles the search can make): each setting's
  intervals x batches x tile counts; the ladders stop early."""
  settings = len(_settings(space))
  per_setting = (len(space["remat_layer_interval"]) * len(space["per_device_batch_size"])
                 * len(space["num_vocab_tiling"]))
  return settings, settings * per_setting


def _parallel(space: dict, keys: tuple, configured: tuple | None) -> list:
  """The settings of one parallelism the chains run under: its degree (the product of the leading
  *_parallelism keys: within and across slices), and at degrees above 1 every value of the other
  keys (at 1, their first). The keys appear in the candidates' settings (and the train line) when
  searched, or fixed by a one-value plan_* list to other than the config's."""
  degrees = [k for k in keys if k.endswith("_parallelism")]
  others = keys[len(degrees):]
  combos = [(*sizes, *rest) for sizes in itertools.product(*(space[k] for k in degrees))
            for rest in itertools.product(*(space[k] if math.prod(sizes) > 1 else space[k][:1] for k in others))]
  searched = len(combos) > 1 or (configured is not None and combos[0] != configured)
  return [dict(zip(keys, combo)) if searched else {} for combo in combos]


def _settings(space: dict, fixed: dict | None = None, configured: dict | None = None) -> list:
  """One dict per chain of the search: the context, pipeline, policy, slicing and accumulation
  settings (the interval, set along the chain, keeps its place in the candidates' settings).
  `configured`: the config's values of PARALLEL_KEYS."""
  configured = configured or {}
  contexts = _parallel(space, CONTEXT_KEYS, tuple(configured[k] for k in CONTEXT_KEYS) if configured else None)
  pipelines = _parallel(space, PIPELINE_KEYS, tuple(configured[k] for k in PIPELINE_KEYS) if configured else None)
  # Keeping residuals is 1F1B's: GPipe's autodiff keeps them all.
  pipelines = [p for p in pipelines if not (p.get("pipeline_keep_residuals") and p.get("pipeline_schedule") == "gpipe")]
  return [{**(fixed or {}), **context, **stages, "remat_policy": p, "remat_layer_interval": None, "mlp_chunks": c,
           "attention_head_chunks": a, "gradient_accumulation_steps": g}
          for context in contexts for stages in pipelines for p in space["remat_policy"] for c in space["mlp_chunks"]
          for a in space["attention_head_chunks"] for g in space["gradient_accumulation_steps"]]


def search(base, space: dict, budget: int, rates: tuple, workers: int, verbose: bool = False,
           fixed: dict | None = None) -> list:
  """Every candidate the pruned search compiled from the config `base`, as evaluate() records
  with `fits`; `fixed` settings go into every candidate's. The settings' chains run side by side,
  a compile each at a time, sharing what they learn (_Known); those of the policies that keep
  the least go first, as what does not fit for them does not fit for the others."""
  known = _Known(base.platform)
  settings = _settings(space, fixed, {k: getattr(base, k) for k in PARALLEL_KEYS})
  policies = space["remat_policy"]
  settings.sort(key=lambda s: sum(remat.needs_no_less(s["remat_policy"], p, base.platform) for p in policies))
  ready = []  # (chain index, settings to compile); the lowest index goes first
  chains = [_chain(base, space, rates, known, s) for s in settings]

  def advance(index, record):
    try:
      heapq.heappush(ready, (index, chains[index].send(record)))
    except StopIteration:
      pass

  for index in range(len(chains)):
    advance(index, None)
  records = []
  workers = min(workers, len(chains))
  # Separate processes: compiles in one process serialize. spawn, not fork: JAX is running.
  pool = (concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
          if workers > 1 else concurrent.futures.ThreadPoolExecutor(1))
  with pool:
    running = {}
    while ready or running:
      while ready and len(running) < workers:
        index, (candidate, bytes_floor) = heapq.heappop(ready)
        if known.cannot_fit(candidate):
          advance(index, {"settings": candidate, "status": "does not fit", "fits": False})
        elif bytes_floor is None:
          running[pool.submit(evaluate, base, candidate, rates)] = index
        else:
          running[pool.submit(evaluate, base, candidate, rates, known.best, bytes_floor)] = index
      done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in done:
        record = future.result()
        record["fits"] = record["status"] == "ok" and record["total_bytes"] <= budget
        known.learn(record)
        if record["status"] != "pruned":
          records.append(record)
        if verbose:
          print(_line(record), flush=True)
        advance(running.pop(future), record)
  return records


def search_longest(base, space: dict, budget: int, rates: tuple, workers: int, lengths: list) -> list:
  """max_target_length=auto: the search at each of `lengths` (ascending) until one has no
  candidate that fits; the records of the longest at which one does (each with its
  max_target_length in its settings), or, when none fits even the shortest, the shortest's."""
  longest = None
  for length in lengths:
    print(f"max_target_length={length}:", flush=True)
    records = search(base, space, budget, rates, workers, verbose=True, fixed={"max_target_length": length})
    if not any(r["fits"] for r in records):
      return longest or records
    longest = records
  return longest


def choose(records: list, budget: int, how: str) -> dict:
  """The candidate predicted fastest among those that fit (the smaller on a tie); a ConfigError
  naming the smallest found when none does."""
  fitting = [r for r in records if r["fits"]]
  if fitting:
    return min(fitting, key=lambda r: (-r["tokens_per_second_per_chip"], r["total_bytes"]))
  sized = [r for r in records if r["status"] == "ok"]
  if not sized:
    reasons = sorted({f"{r['status']}: {r['reason']}" for r in records})
    raise errors.UserError(f"no candidate compiled ({len(records)} tried): {'; '.join(reasons)[:500]}")
  smallest = min(sized, key=lambda r: r["total_bytes"])
  raise errors.ConfigError(
      f"hbm_budget_gib: the budget of {budget / 2**30:.4g} GiB per device ({how}) is below every candidate; the "
      f"smallest found needs {smallest['total_bytes'] / 2**30:.4g} GiB per device ({describe(smallest['settings'])})")


def _name(settings: dict) -> str:
  name = f"{settings['remat_policy']} /{settings['remat_layer_interval']} tiles {settings['num_vocab_tiling']} " \
         f"batch {settings['per_device_batch_size']:g}"
  name += f" mlp/{settings['mlp_chunks']}" if settings["mlp_chunks"] > 1 else ""
  name += f" attention/{settings['attention_head_chunks']}" if settings["attention_head_chunks"] > 1 else ""
  context = settings.get("ici_context_parallelism", 1)
  name += f" context {context} {settings['context_parallel_strategy']}" if context > 1 else ""
  stages = settings.get("ici_pipeline_parallelism", 1) * settings.get("dcn_pipeline_parallelism", 1)
  name += (f" pipeline {stages} {settings['pipeline_schedule'] or 'default'} m{settings['num_pipeline_microbatches']}"
           if stages > 1 else "")
  return name + (f" x{settings['gradient_accumulation_steps']}" if settings["gradient_accumulation_steps"] > 1 else "")


def report(records: list, chosen: dict, budget: int, how: str, train_line: str) -> tuple[str, object]:
  """(Markdown: the Pareto front and the chosen line, the figure of the front with the budget)."""
  sized = {_name(r["settings"]): r for r in records if r["status"] == "ok"}
  fitting = {n: r for n, r in sized.items() if r["fits"]}
  front = reports.pareto_front({n: (1 / r["tokens_per_second_per_chip"], r["total_bytes"]) for n, r in fitting.items()})
  rows = [[n, reports.gib(r["total_bytes"]), f"{r['tokens_per_step']:,}", f"{r['recompute_ratio']:.3f}",
           f"{r['roofline_seconds']:.4g} ({r['bound']})", f"{r['tokens_per_second_per_chip']:,.0f}",
           "yes" if r is chosen else ""] for n, r in ((n, fitting[n]) for n in front)]
  table = reports.markdown_table(["remat /interval, tiles, batch", "GiB/device", "tokens/step",
                                 "step FLOPs / model FLOPs", "roofline s/step", "tokens/s/chip", "chosen"], rows)
  failed = [f"- {describe(r['settings'])}: {r['status']}: {r['reason']}" for r in records
            if r["status"] in ("failed", "does not fit")]
  markdown = (f"Pareto front of the {len(fitting)} candidates that fit {reports.gib(budget)} GiB per device ({how}), "
              f"of {len(records)} compiled:\n\n{table}\n\n" + ("Compiles that failed:\n" + "\n".join(failed) + "\n\n"
                                                                 if failed else "") + f"Chosen:\n\n    {train_line}")
  # MaxText's defaults: full remat on every layer, no tiling, the largest batch that fits.
  maxtext = {"remat_policy": "full", "num_vocab_tiling": 1, "remat_layer_interval": 1, "gradient_accumulation_steps": 1,
             "mlp_chunks": 1, "attention_head_chunks": 1}
  defaults = [r for r in fitting.values() if all(r["settings"][k] == v for k, v in maxtext.items())]
  if defaults:
    default = max(defaults, key=lambda r: r["settings"]["per_device_batch_size"])
    markdown += (f"\n\nMaxText's defaults (remat_policy=full, 1 tile, the largest batch that fits among those "
                 f"compiled: {default['settings']['per_device_batch_size']:g}) predict "
                 f"{default['tokens_per_second_per_chip']:,.0f} tokens/s/chip at {reports.gib(default['total_bytes'])} "
                 "GiB; the choice "
                 f"{chosen['tokens_per_second_per_chip'] / default['tokens_per_second_per_chip'] - 1:+.1%}.")
  from matplotlib.figure import Figure  # noqa: PLC0415 (a plot's library, loaded only to draw one)
  figure = Figure(figsize=(9, 6))
  axis = figure.subplots()
  for name, r in sized.items():
    color = "tab:red" if name in front else "tab:blue" if r["fits"] else "tab:gray"
    axis.scatter(r["total_bytes"] / 2**30, r["tokens_per_second_per_chip"], s=18, color=color, zorder=3)
    axis.annotate(name, (r["total_bytes"] / 2**30, r["tokens_per_second_per_chip"]), fontsize=6, xytext=(3, 3),
                  textcoords="offset points")
  axis.plot([fitting[n]["total_bytes"] / 2**30 for n in front],
            [fitting[n]["tokens_per_second_per_chip"] for n in front], color="tab:red", label="Pareto front")
  axis.axvline(budget / 2**30, color="black", linestyle="--", label=f"budget {budget / 2**30:.1f} GiB")
  axis.set_xlabel("compiled memory per device, GiB")
  axis.set_ylabel("predicted tokens/s/chip (roofline)")
  axis.legend()
  return markdown, figure


def main(argv):
  args = argv[1:]
  if not args:
    raise errors.ConfigError("usage: python -m MaxText.plan <config.yml> [key=value ...]")
  given = {_key(a): a.partition("=")[2] for a in args[1:]}
  free = {k for k in SEARCH_KEYS if given.get(k, "auto") == "auto"}
  longest = given.get("max_target_length") == "auto"  # the question: the longest sequence that fits
  fixed_argv = [a for a in args if _key(a) not in free and not (longest and _key(a) == "max_target_length")]
  config = pyconfig.initialize(fixed_argv)
  run_control.check_writable("base_output_directory", os.path.join(config.run_dir, "plan"))  # before the compiles
  device = sharding.run_devices(config.compile_topology, config.compile_topology_num_slices)[0]
  budget, how = budget_bytes(config, device)
  rates = roofline_rates(device)
  space = search_space(config, free)
  # Worker processes compile for devices they do not drive: simulated CPUs or a topology.
  workers = config.plan_workers or os.cpu_count() if config.compile_topology or device.platform == "cpu" else 1
  print(f"planning for {config.num_devices} x {device.device_kind}: budget {budget / 2**30:.2f} GiB per device "
        f"({how}); roofline {rates[0] / 1e12:.3g} TFLOP/s, {rates[1] / 1e9:.4g} GB/s ({rates[2]}); "
        f"searching {', '.join(f'{k} {v}' for k, v in space.items() if len(v) > 1)} with {workers} worker(s)"
        + (f", at max_target_length {list(config.plan_max_target_lengths)} up to the longest that fits" if longest
           else ""), flush=True)
  if "remat_policy" in free:
    equal = remat.distinct_policies(config.plan_remat_policies or remat.SEARCHABLE_POLICIES, config.platform)[1]
    if equal:
      print(f"not compiled, as they keep what another keeps on {config.platform}: "
            + ", ".join(f"{p} (= {q})" for p, q in equal.items()), flush=True)
  chains, most = candidate_bound(space)
  print(f"{chains} settings, searched in parallel, at most {most} compiles" + (" per length" if longest else "")
        + "; each batch stops at the fewest tiles that fit, and a compile is skipped when it cannot fit or be faster "
        "than one compiled", flush=True)
  start = time.perf_counter()
  if longest:
    records = search_longest(config, space, budget, rates, workers, list(config.plan_max_target_lengths))
  else:
    records = search(config, space, budget, rates, workers, verbose=True)
  seconds = time.perf_counter() - start
  chosen = choose(records, budget, how)
  drop = (set(SEARCH_KEYS) | set(config_schema.fields(sections=[config_schema.Plan]))
          | {"compile_topology", "compile_topology_num_slices", "memory_stats_file"})
  drop |= {"max_target_length"} if longest else set()
  train_line = " ".join(["python -m MaxText.train", args[0], *[a for a in args[1:] if _key(a) not in drop],
                         *_assignments(chosen["settings"])])
  markdown, figure = report(records, chosen, budget, how, train_line)
  compiled = sum(r["status"] != "invalid" for r in records)
  markdown = f"{compiled} compiles in {seconds:.0f} s ({workers} worker(s)).\n\n" + markdown
  if longest:
    longest_line = f"The longest sequence that fits: max_target_length={chosen['settings']['max_target_length']}."
    markdown = f"{longest_line}\n\n{markdown}"
  print(markdown)
  reports.save(os.path.join(config.run_dir, "plan"), "plan", markdown,
              {"budget_bytes": budget, "budget": how, "roofline": {"peak_flops": rates[0], "bytes_per_second": rates[1],
                                                                   "source": rates[2]},
               "compiles": compiled, "seconds": seconds, "workers": workers, "chosen": chosen["settings"],
               "train_command": train_line, "candidates": records}, figure)


if __name__ == "__main__":
  runtime.run(main)
