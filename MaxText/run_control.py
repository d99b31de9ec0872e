"""What keeps a run's directory safe while it trains: one process per run, a clean stop on
preemption signals, and a stop (saving nothing) when training diverges.
"""

import contextlib
import os
import re
import shutil
import signal

import jax
import yaml
from absl import logging
from jax.experimental import multihost_utils

from MaxText import checkpointing, config_schema, pyconfig
from MaxText.errors import ConfigError, UserError
from MaxText.input_pipeline import mixture
from MaxText.input_pipeline import tokenizer as tokenizers

# The signals that stop a run cleanly, by name; the exit code is then 128 + the signal number.
SIGNALS = {signal.SIGTERM: "SIGTERM", signal.SIGINT: "SIGINT"}


class Preempted(UserError):
  """A signal stopped the run after saving; rerunning resumes it."""

  label = "stopped"

  def __init__(self, signum: int, message: str):
    super().__init__(message)
    self.exit_code = 128 + signum


class Diverged(UserError):
  """Training produced non-finite values; nothing was saved from them."""


class NonfiniteStreak:
  """Steps in a row whose loss or gradient norm was not finite (each left the state as it was);
  Diverged once there are max_nonfinite_steps of them."""

  def __init__(self, limit: int):
    self.limit, self.count = limit, 0

  def update(self, step: int, nonfinite: float, latest_checkpoint) -> None:
    """After step `step`'s metrics; latest_checkpoint() names the step a rerun resumes from."""
    self.count = self.count + 1 if nonfinite else 0
    if self.count >= self.limit:
      raise Diverged(f"step {step}: loss or gradient norm not finite for {self.count} steps in a row "
                     f"(max_nonfinite_steps={self.limit}); stopped, latest checkpoint: {latest_checkpoint()}")

  def finish(self, last_step: int, latest_checkpoint) -> None:
    """After the last step: a run that ends inside a streak did not train its last steps, and
    saved nothing of them (the state is the one from before the streak)."""
    if self.count:
      raise Diverged(f"steps {last_step - self.count + 1}-{last_step} of {last_step}: loss or gradient norm not "
                     f"finite, not applied; the run ended inside that streak, so nothing after checkpoint "
                     f"{latest_checkpoint()} was saved")


def _not_running(pid: int) -> str | None:
  """Why process `pid` is not this program on this host ("process 7 is no longer running", or
  its pid reused by another program after a kill or a reboot), or None when it is."""
  if pid <= 0:
    return f"{pid} names no process"
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return f"process {pid} is no longer running"
  except PermissionError:  # someone else's live process
    pass
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      command = f.read()
  except FileNotFoundError:  # gone meanwhile
    return f"process {pid} is no longer running"
  except OSError:  # no /proc (not Linux): alive is all that can be told
    return None
  if b"MaxText" in command:
    return None
  program = os.path.basename(command.split(b"\0")[0]).decode(errors="replace") or "another process"
  return f"pid {pid} is now {program}, not MaxText"


def check_run_paths(config) -> None:
  """Every place a run writes, checked before it writes anything: the run directory and, where
  they already exist, its checkpoints and TensorBoard directories; the metrics file and the
  token cache."""
  check_writable("base_output_directory", config.run_dir)
  if config.enable_checkpointing:
    check_writable("base_output_directory", os.path.join(config.run_dir, "checkpoints"))
  if config.enable_emergency_checkpoint:
    if jax.process_count() > 1:
      raise ConfigError(f"enable_emergency_checkpoint=True: the local tier is for a run of one process "
                        f"({jax.process_count()} now); each host's tier would hold only its own shards")
    check_writable("local_checkpoint_directory", checkpointing.local_checkpoint_dir(config))
  if config.enable_tensorboard:
    check_writable("base_output_directory", os.path.join(config.run_dir, "tensorboard"))
  check_writable("dataset_cache_dir", config.dataset_cache_dir)
  if config.metrics_file:
    check_writable("metrics_file", config.metrics_file, is_file=True)


def check_writable(key: str, path: str, is_file: bool = False) -> None:
  """ConfigError unless the directory `path` (or, is_file, the file `path`) can be written or
  made: checked before a run writes anything, so a bad path costs one line, not a crash later."""
  path = os.path.abspath(path)
  if is_file and os.path.exists(path):
    if os.path.isdir(path) or not os.access(path, os.W_OK):
      raise ConfigError(f"{key}={path!r}: not a writable file")
    return
  existing = os.path.dirname(path) if is_file else path
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    problem = "is not a directory" if not os.path.isdir(existing) else "is not writable"
    raise ConfigError(f"{key}: cannot write {path!r}: {existing!r} {problem}")


@contextlib.contextmanager
def run_lock(run_dir: str, key: str = "run_name", doing: str = "trained"):
  """Holds <run_dir>/.lock (this process's pid) while the run trains (or, `doing`, while
  prepare_data writes the directory named by config key `key`); process 0 only.

  A second live process on the same run would interleave saves with this one's, so it is
  refused. A lock left by a killed process (its pid no longer running this program on this
  host) is taken over.
  """
  if jax.process_index() != 0:
    yield
    return
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, ".lock")
  while True:
    try:
      fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      break
    except FileExistsError:
      if not os.path.isfile(path):  # never removed: the project did not make it
        raise ConfigError(f"{key}: {path} is in the way of this run's lock file (it is not a file); "
                          "remove it") from None
      try:
        with open(path) as f:
          owner = f.read().strip()
      except OSError:
        owner = ""
      stale = _not_running(int(owner)) if owner.isdigit() else f"it holds {owner[:40]!r}, not a pid"
      if owner != str(os.getpid()) and not stale:
        raise ConfigError(f"{key}: {run_dir} is being {doing} by process {owner} ({path}); "
                          f"use another {key} or stop that process") from None
      logging.warning("taking over the stale lock %s: %s", path, stale or "an earlier process had this pid")
      with contextlib.suppress(FileNotFoundError):
        os.remove(path)
  with os.fdopen(fd, "w") as f:
    f.write(str(os.getpid()))
  try:
    yield
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)


def staging_dir(parent: str, writer: str) -> str:
  """A new directory `parent/.{writer}-{pid}.partial` for this process to write an output in
  before moving it into place: a name no user would pick, naming the tool and process that
  own it. Those of `writer` processes no longer running (killed mid-write) are removed
  first; nothing else is."""
  pattern = re.compile(re.escape(f".{writer}-") + r"(\d+)\.partial")
  for name in os.listdir(parent):
    match = pattern.fullmatch(name)
    stale = match and int(match[1]) != os.getpid() and _not_running(int(match[1]))
    if stale:
      logging.warning("removing %s, left by %s (%s)", os.path.join(parent, name), writer, stale)
      shutil.rmtree(os.path.join(parent, name))
  path = os.path.join(parent, f".{writer}-{os.getpid()}.partial")
  os.makedirs(path)
  return path


class _Signalled(BaseException):
  """What signals_raise's handler raises: a BaseException, as KeyboardInterrupt is, so that no
  library's `except Exception` around the line it lands on (tqdm's, starting its monitor
  thread) takes it for its own failure and carries on."""


@contextlib.contextmanager
def signals_raise():
  """SIGTERM and SIGINT raise Preempted in the main thread, so a tool's cleanup (its
  `except BaseException`) runs before it exits 143 or 130 with one line; by default SIGTERM
  would end the process at once, leaving its partial output behind."""
  def handle(signum, _):
    raise _Signalled(signum)

  previous = {s: signal.signal(s, handle) for s in SIGNALS}
  try:
    yield
  except _Signalled as e:
    raise Preempted(e.args[0], f"{SIGNALS[e.args[0]]} before the output was complete: nothing was written") from None
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


class SignalReceived(Exception):
  """What signals_deferred's check raises: an Exception, so that the library running the work it
  checks in (orbax's writer thread) fails that work as its own and returns to the caller."""


@contextlib.contextmanager
def signals_deferred():
  """Within signals_raise, for work in another thread (orbax's writer): SIGTERM and SIGINT are
  recorded and the work stops at its next `check()` (yielded), which raises SignalReceived. A
  signal raised in the main thread at once would leave that thread writing, and printing its
  tracebacks, while the caller's cleanup removed its output. Leaving with an exception after a
  signal raises what signals_raise turns into Preempted; a body that finished keeps its output."""
  received = []

  def handle(signum, _):
    received.append(signum)

  def check():
    if received:
      raise SignalReceived(received[0])

  previous = {s: signal.signal(s, handle) for s in SIGNALS}
  try:
    yield check
  except BaseException:
    if received:
      raise _Signalled(received[0]) from None
    raise
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  if received:
    logging.warning("%s arrived after the output was complete: kept", SIGNALS[received[0]])


def _write_atomic(path: str, text: str) -> None:
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    f.write(text)
  os.replace(tmp, path)


def check_resume(config, tokenizer, trained: bool) -> None:
  """ConfigError, with nothing written, for a start of an existing run that would change what it
  trained: a model key (`trained`: the run has checkpoints, which hold that model), or the
  tokenizer (its token ids would mean other text to the trained model). Call under run_lock."""
  path = os.path.join(config.run_dir, "config.yml")
  if trained and os.path.exists(path):
    with open(path) as f:
      before = yaml.safe_load(f) or {}
    for key in config_schema.fields("model"):
      if key in before and before[key] != getattr(config, key):
        raise ConfigError(f"{key}={getattr(config, key)!r}: run {config.run_dir} was trained with {key}="
                          f"{before[key]!r}, and a resume keeps its model; drop the key, or start a new run_name "
                          f"(load_parameters_path=<a checkpoint step of this run> starts it from these parameters)")
  path = os.path.join(config.run_dir, "tokenizer.json")
  if tokenizer is not None and os.path.exists(path) and tokenizers.read(
      path, f"{path}, the tokenizer run {config.run_dir} trained with (restore it, or use a new run_name)"
  ).to_str() != tokenizer.to_str():
    raise ConfigError(f"dataset_path, tokenizer_type, tokenizer_path, vocab_size, grain_train_files: they give a "
                      f"tokenizer other than the one run {config.run_dir} trained with ({path}); use the run's flags, "
                      "or a new run_name")


def keep_global_batch(config):
  """config, resuming a run that has checkpoints on another number of devices (or rows per
  device): its gradient_accumulation_steps set so each step takes the run's global batch again,
  said in one line; a ConfigError where its microbatches cannot make that batch up. A run's batch
  is the run's: a new one is a new run (load_parameters_path=<a step of this one>). Likewise the
  streams a run reads parquet as (grain_stream_count) are its first start's: the process count
  then, unless given."""
  path = os.path.join(config.run_dir, "config.yml")
  recorded = {}
  if os.path.exists(path) and checkpointing.latest_checkpoint(config) is not None:
    with open(path) as f:
      recorded = yaml.safe_load(f) or {}
  batch = recorded.get("global_batch_size_to_train_on")
  if batch not in (None, config.global_batch_size_to_train_on):
    micro = config.micro_batch_size
    if batch % micro:
      raise ConfigError(f"per_device_batch_size={config.per_device_batch_size:g}: run {config.run_dir} trains on "
                        f"global batches of {batch} rows, which microbatches of {micro} rows ({config.num_devices} "
                        "devices) cannot make up; give a per_device_batch_size whose microbatches divide it, or a new "
                        "run_name")
    logging.warning("run %s trains on global batches of %d rows: on %d devices each step takes %d microbatches of %d "
                    "(gradient_accumulation_steps=%d)", config.run_dir, batch, config.num_devices, batch // micro,
                    micro, batch // micro)
    config = pyconfig.replace(config, {"gradient_accumulation_steps": batch // micro})
  return _keep_stream_count(config, recorded.get("grain_stream_count"))


def _keep_stream_count(config, recorded: int | None):
  """config with the streams its parquet files are read as: the run's, else given, else one per process."""
  if config.dataset_type != "grain" or config.grain_file_type != "parquet":
    return config
  if recorded and config.grain_stream_count not in (0, recorded):
    raise ConfigError(f"grain_stream_count={config.grain_stream_count}: run {config.run_dir} reads its parquet files "
                      f"as {recorded} streams; leave the key out, or use a new run_name")
  count, processes, batch = recorded or config.grain_stream_count or jax.process_count(), jax.process_count(), \
      config.global_batch_size_to_train_on
  if count % processes or batch % count:
    raise ConfigError(f"grain_stream_count={count}: the parquet files are read as {count} streams, each giving its "
                      f"part of the global batch of {batch} rows, and {processes} processes each reading whole ones; "
                      f"give a count that divides the batch and that {processes} divides (a run keeps its first "
                      "start's)")
  return config if count == config.grain_stream_count else pyconfig.replace(config, {"grain_stream_count": count})


def _sources(value: str):
  """What a grain_train_files value draws rows from: its globs and weights in order (an inline
  mixture and a file of the same sources are one mixture), or the value itself where it no longer
  reads (a mixture file since removed)."""
  try:
    return [(source.pattern, source.weight) for source in mixture.parse("grain_train_files", value)]
  except ConfigError:
    return value


def record_run_files(config, tokenizer) -> None:
  """Writes run_dir/config.yml (the resolved config of this start) and, at the run's first start
  with text data, run_dir/tokenizer.json, the tokenizer every start and `decode` must use. Only
  after a start check_resume accepted and whose state was restored or created: a refused start
  leaves the run as it was. Process 0 only; call under run_lock."""
  if jax.process_index() != 0:
    return
  path = os.path.join(config.run_dir, "config.yml")
  if os.path.exists(path):  # a resume: its data order follows the mixture's weights
    with open(path) as f:
      before = yaml.safe_load(f) or {}
    quantized = before.get("quantization")
    if quantized not in (None, config.quantization):
      logging.warning("run %s was trained with quantization=%r and resumes with %r: its parameters go on, the "
                      "matmuls from here on are %s", config.run_dir, quantized, config.quantization,
                      config.quantization or "unquantized")
    trained_on = before.get("grain_train_files")
    if config.dataset_type == "grain" and trained_on is not None and _sources(trained_on) != _sources(
        config.grain_train_files):
      logging.warning("run %s was trained on grain_train_files=%r and resumes with %r, a new phase: the rows "
                      "trained so far stay as they were; from here on the rows are those the new weights give at "
                      "this step, as if the run had always had them", config.run_dir, trained_on,
                      config.grain_train_files)
  _write_atomic(path, yaml.safe_dump(config.to_dict(), sort_keys=False))
  path = os.path.join(config.run_dir, "tokenizer.json")
  if tokenizer is not None and not os.path.exists(path):
    _write_atomic(path, tokenizer.to_str())


@contextlib.contextmanager
def stop_signals():
  """Yields a list that SIGTERM and SIGINT append their number to, instead of killing the
  process, so the train loop can finish its step and save first; a second signal kills it as
  the default handlers would. Handlers are restored after.

  With several processes, SIGTERM is left to JAX's preemption notifier (jax.distributed
  installs it), which tells every process through the coordination service, so no process
  has to ask the others on the device each step; SIGINT is recorded and passed on to it."""
  received = []
  several = jax.process_count() > 1
  handled = [signal.SIGINT] if several else list(SIGNALS)
  # Python runs a handler once for all the signals that arrived during one call into C (a step,
  # a compile), so two sent 20 ms apart would count as one; its C handler also writes a byte
  # per signal delivered to the wakeup fd, which does count them.
  delivered, wakeup = os.pipe()
  for fd in (delivered, wakeup):
    os.set_blocking(fd, False)
  previous_wakeup = signal.set_wakeup_fd(wakeup, warn_on_full_buffer=False)

  def handle(signum, _):
    try:
      count = sum(byte in handled for byte in os.read(delivered, 512))
    except BlockingIOError:
      count = 0
    if received or count > 1:  # a second signal: the operator will not wait for the step; end at once
      signal.signal(signum, signal.SIG_DFL)
      signal.raise_signal(signum)
    received.append(signum)
    if several:
      signal.raise_signal(signal.SIGTERM)

  previous = {s: signal.signal(s, handle) for s in handled}
  try:
    yield received
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    signal.set_wakeup_fd(previous_wakeup)
    os.close(delivered)
    os.close(wakeup)


def stop_requested(received: list, step_index: int) -> int:
  """The signal to stop on after this start's step `step_index` (0, 1, ...: JAX's
  preemption sync counts the calls of this process, not global steps), or 0. With several
  processes the sync point is the same step on every process, whichever host the signal
  reached, and when."""
  if jax.process_count() == 1:
    return received[0] if received else 0
  if not multihost_utils.reached_preemption_sync_point(step_index):
    return 0
  return received[0] if received else signal.SIGTERM
