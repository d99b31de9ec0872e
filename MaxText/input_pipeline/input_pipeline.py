"""Input pipeline on grain: rows of tokens -> shuffled, per-process global batches.

DATASET_TYPES maps each dataset_type to the function giving its tokenizer and its train and
eval rows; the rest of the trainer never asks which type it has.

Every row is a dict of [max_target_length] int32 arrays, MaxText's names:
  inputs, targets (inputs shifted by one), inputs_position (position within the document),
  inputs_segmentation (document id within the row, 0 for padding), targets_segmentation
  (the loss mask: 0 where the target must not be scored).
Datasets are grain MapDatasets with random access (all but streamed parquet), so a restored
run starts at its step with exactly the batches it would have seen, on any number of hosts;
prepared shards may be a weighted mixture of corpora (mixture.py), which keeps that. Parquet
globs may be mixed too; they are read as a fixed number of streams (StreamBlocks) and resume from
the iterator state the checkpoint saves, on any number of hosts dividing that number.

Text is tokenized into a stream `doc EOD doc EOD ...` (dataset_type=text: in memory, cached as
.npy; grain: by prepare_data, read from ArrayRecord shards by token_shards.TokenStream), and
row r is the window stream[r*L : r*L + L + 1] (inputs and the targets one token on). Packing is done
here rather than with grain's iterator packers because windows of one stream are randomly
addressable: shuffling rows (not whole documents) and resuming at any index stay exact.
"""

import contextlib
import glob
import os
import signal
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

import grain
import jax
import numpy as np
from absl import logging
from tokenizers import Tokenizer

from MaxText.errors import ConfigError, first_line
from MaxText.input_pipeline import corpus, mixture, token_shards
from MaxText.input_pipeline import tokenizer as tokenizers


def synthetic_rows(config) -> grain.MapDataset:
  """Random tokens, one document per row; row i depends only on (data_shuffle_seed, i)."""
  length, vocab, seed = config.max_target_length, config.vocab_size, config.data_shuffle_seed

  def row(index):
    tokens = np.random.default_rng([seed, index]).integers(0, vocab, length + 1, dtype=np.int32)
    ones = np.ones(length, np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "inputs_position": np.arange(length, dtype=np.int32),
            "inputs_segmentation": ones, "targets_segmentation": ones}

  return grain.MapDataset.range(2**62).map(row)


def pack(window: np.ndarray, eod: int) -> dict:
  """One row from a window of L + 1 tokens of the document stream.

  A document's tokens share a segment id (1, 2, ... within the row) and count positions
  from 0; its EOD closes it. The target after an EOD (the next document's first token) is
  not scored, so nothing is learned across a document boundary.
  """
  inputs, targets = window[:-1], window[1:]
  index = np.arange(len(inputs))
  after_eod = np.concatenate([[False], inputs[:-1] == eod])
  segments = 1 + np.cumsum(after_eod, dtype=np.int32)
  starts = np.maximum.accumulate(np.where(after_eod, index, 0))
  return {"inputs": inputs, "targets": targets, "inputs_position": (index - starts).astype(np.int32),
          "inputs_segmentation": segments, "targets_segmentation": np.where(inputs == eod, 0, segments)}


def text_rows(stream: np.ndarray, length: int, eod: int) -> grain.MapDataset:
  num_rows = (len(stream) - 1) // length
  return grain.MapDataset.range(num_rows).map(
      lambda r: pack(np.asarray(stream[r * length:r * length + length + 1], np.int32), eod))


def _tokenized(config, documents, tokenizer, split) -> tuple[np.ndarray, str | None]:
  """(`doc EOD doc EOD ...` as int32, the cache file to write it to, or None when it was read
  from there: this corpus and tokenizer were seen before)."""
  key = tokenizers.fingerprint(documents + [tokenizer.to_str()])
  path = os.path.join(config.dataset_cache_dir, f"tokens-{split}-{key}.npy")
  if os.path.isfile(path):
    try:
      return np.load(path, mmap_mode="r"), None
    except (ValueError, OSError, EOFError) as e:  # written atomically, so damaged after the fact
      logging.warning("token cache %s is unreadable (%s); tokenizing again", path, e)
  eod = tokenizers.eod_id(tokenizer, "tokenizer")
  encoded = tokenizer.encode_batch(documents, add_special_tokens=False)
  return np.fromiter((t for e in encoded for t in (*e.ids, eod)), dtype=np.int32), path


def _cache(stream: np.ndarray, path: str) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}.npy"
  np.save(tmp, stream)
  os.replace(tmp, path)


class TextData:
  """The tokenizer and the tokenized train and eval streams of config.dataset_path. What was
  trained or tokenized here is cached by save_caches, which a command calls once it has
  accepted the start: a refused one writes nothing."""

  def __init__(self, config):
    train_docs, eval_docs = corpus.split_documents(corpus.read_documents(config))
    self.tokenizer, tokenizer_cache = tokenizers.load_or_train(config, train_docs)
    self.eod = tokenizers.eod_id(self.tokenizer, "tokenizer")
    streams = {split: _tokenized(config, docs, self.tokenizer, split)
               for split, docs in (("train", train_docs), ("eval", eval_docs))}
    for split, (stream, _) in streams.items():
      if len(stream) <= config.max_target_length:
        raise ConfigError(f"dataset_path={config.dataset_path!r}: the {split} split has {len(stream)} "
                          f"tokens, fewer than one row of max_target_length={config.max_target_length}")
    self.train, self.eval = (stream for stream, _ in streams.values())
    self._unsaved = [(stream, path) for stream, path in streams.values() if path]
    self._unsaved_tokenizer = tokenizer_cache

  def save_caches(self) -> None:
    if self._unsaved_tokenizer:
      tokenizers.save_atomic(self.tokenizer, self._unsaved_tokenizer)
    for stream, path in self._unsaved:
      _cache(stream, path)
    self._unsaved, self._unsaved_tokenizer = [], None


def batches(rows: grain.MapDataset, batch_size: int) -> grain.MapDataset:
  """This process's part of each global batch of `batch_size` rows, in order.

  Global batch s holds rows [s*G, (s+1)*G); process p of P loads the p-th of its P equal
  slices, which is the slice its devices hold once the arrays are assembled.
  """
  processes = jax.process_count()
  return rows.batch(batch_size // processes, drop_remainder=True)[jax.process_index()::processes]


def _batches(rows, batch_size: int, step: int = 0) -> grain.IterDataset:
  """This process's batches from global batch `step` on, of rows found by index (any step) or
  of one streamed process's rows (from its start)."""
  if isinstance(rows, grain.MapDataset):
    return batches(rows, batch_size)[step:].to_iter_dataset()
  return rows.batch(batch_size // jax.process_count(), drop_remainder=True)  # already this process's rows


class StreamBlocks(grain.DatasetIterator):
  """This process's part of each global batch of streamed rows: the next batch of each of its
  streams, in stream order. Global batch s is every stream's batch s, streams 0..N-1 one after
  another, and process p of P holds streams [p N/P, (p+1) N/P): its rows of the global batch,
  whatever P is. Its state names each of its streams, so the states every process saved restore
  on any number of processes dividing N (restore)."""

  def __init__(self, streams: dict[int, grain.DatasetIterator], count: int):
    super().__init__(list(streams.values()))
    self._streams, self.count = streams, count

  def __next__(self):
    parts = [next(stream) for stream in self._streams.values()]
    return jax.tree.map(lambda *blocks: np.concatenate(blocks), *parts)

  def get_state(self) -> dict:
    return {"stream_count": self.count, "streams": {str(k): stream.get_state() for k, stream in self._streams.items()}}

  def set_state(self, state: dict) -> None:
    if state["stream_count"] != self.count:
      raise ConfigError(f"grain_stream_count={self.count}: the run's data position was saved as "
                        f"{state['stream_count']} streams; resume with grain_stream_count={state['stream_count']}")
    for k, stream in self._streams.items():
      stream.set_state(state["streams"][str(k)])

  def restore(self, saved: dict[int, dict], processes: int) -> None:
    """Sets the position the `processes` processes of a save left: saved[p] is process p's state.
    A state without streams (saved before streams were named) is its process's stream."""
    streams = {}
    for process, state in saved.items():
      streams.update(state["streams"] if "streams" in state else {str(process): state})
    count = next((state["stream_count"] for state in saved.values() if "streams" in state), processes)
    self.set_state({"stream_count": count, "streams": streams})


class Data(NamedTuple):
  """What a dataset type gives the trainer."""

  tokenizer: Tokenizer | None  # None: the data is not text (synthetic)
  # Rows, endless and shuffled: a MapDataset of all rows (each process takes its slices), or
  # the rows of each stream (streamed formats: StreamBlocks).
  train: grain.MapDataset | list[grain.IterDataset]
  # The same rows every evaluation; None: no held-out data; {source: rows} for several sources,
  # each evaluated alone and weighted by eval_weights into the total.
  eval: grain.MapDataset | grain.IterDataset | dict[str, grain.MapDataset] | None
  worker_count: int = 0  # grain worker processes preparing batches (0: threads)
  worker_buffer_size: int = 1
  save_caches: Callable[[], None] = lambda: None  # writes what loading trained or tokenized, once a run is accepted
  eval_weights: dict[str, float] | None = None  # of the eval sources, when eval is a dict
  # The data/* metrics once the first `rows` global training rows are drawn (mixture.Mixture).
  progress: Callable[[int], dict] = lambda rows: {}


def synthetic_data(config) -> Data:
  rows = synthetic_rows(config)
  return Data(None, rows, rows[-config.eval_steps * config.micro_batch_size:])


def text_data(config) -> Data:
  text = TextData(config)
  length = config.max_target_length
  return Data(text.tokenizer, text_rows(text.train, length, text.eod).shuffle(seed=config.data_shuffle_seed).repeat(),
              text_rows(text.eval, length, text.eod).repeat(), save_caches=text.save_caches)


def _shards(config, key: str, pattern: str):
  """(TokenStream, Tokenizer) of the prepared shards matching `pattern`, a source of config key `key`."""
  stream, tokenizer = token_shards.open_split(key, pattern)
  if len(stream) <= config.max_target_length:
    raise ConfigError(f"{key}={pattern!r}: {len(stream)} tokens, fewer than one row of "
                      f"max_target_length={config.max_target_length}")
  tokenizers.check_vocab_size(tokenizer, config.vocab_size, f"the tokenizer of {key}={pattern!r}")
  return stream, tokenizer


class _JsonRestorable(grain.IterDataset):
  """grain's concat-then-split with its state read back from a checkpoint's JSON. It marks "no
  part of a document left over" by slices (-1, -1), which JSON turns into lists it takes for a
  leftover part: the restored stream would skip a document. Its slices go back as tuples."""

  def __iter__(self):
    return _JsonRestorableIterator(iter(self._parent))


class _JsonRestorableIterator(grain.DatasetIterator):

  def __next__(self):
    return next(self._parent)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    slices = {key: tuple(s) for key, s in state["remainder_slices"].items()}
    self._parent.set_state({**state, "remainder_slices": slices})


def _parquet_files(config, key: str, pattern: str, streams: int) -> list[str]:
  """The parquet files matching `pattern`, a source of config key `key`, sorted; each readable
  and with config.text_column, and at least one for each of `streams` streams."""
  import pyarrow.parquet  # noqa: PLC0415 (only parquet needs it)
  files = sorted(glob.glob(pattern))
  if not files:
    raise ConfigError(f"{key}={pattern!r}: no parquet file matches")
  if len(files) < streams:
    raise ConfigError(f"{key}={pattern!r}: {len(files)} parquet files, fewer than the {streams} streams they are "
                      "read as (" + ("grain_stream_count; 0: " if key == "grain_train_files" else "") +
                      "one per process)")
  for path in files:
    try:
      names = pyarrow.parquet.ParquetFile(path).schema_arrow.names
    except (OSError, pyarrow.ArrowException) as e:
      raise ConfigError(f"{key}: cannot read {path} ({first_line(e)})") from None
    if config.text_column not in names:
      raise ConfigError(f"text_column={config.text_column!r}: {path} has no such column")
  return files


def _parquet_rows(config, files: list[str], tokenizer: Tokenizer, seed: int | None) -> grain.IterDataset:
  """Rows of the parquet `files`, tokenized on the fly and cut into windows of L + 1 tokens by
  grain's concat-then-split: files shuffled with `seed` (None: in order), reshuffled every epoch;
  their position is the iterator's state."""
  eod, column = tokenizers.eod_id(tokenizer, "tokenizer"), config.text_column

  def tokens(record):
    text = record[column]
    ids = tokenizer.encode(text, add_special_tokens=False).ids if isinstance(text, str) else []
    return {"tokens": np.asarray([*ids, eod], np.int32)}

  paths = grain.MapDataset.source(files)
  paths = paths if seed is None else paths.shuffle(seed=seed)
  documents = grain.experimental.InterleaveIterDataset(paths.repeat().map(grain.experimental.ParquetIterDataset),
                                                       cycle_length=min(len(files), 16))
  windows = _JsonRestorable(grain.experimental.ConcatThenSplitIterDataset(
      documents.map(tokens).filter(lambda d: len(d["tokens"]) > 1),
      length_struct={"tokens": config.max_target_length + 1}))
  return windows.map(lambda window: pack(window["tokens"], eod))


class _Sources(NamedTuple):
  names: list[str]
  weights: list[Fraction]  # as written
  # each source's rows, unshuffled, of prepared shards; of parquet, [stream][source]: endless, shuffled when trained on
  rows: list[grain.MapDataset] | list[list[grain.IterDataset]]
  tokenizer: Tokenizer


def _shard_sources(config, key: str) -> _Sources:
  """The prepared corpora config key `key` names (mixture.parse), which must share one tokenizer."""
  sources = mixture.parse(key, getattr(config, key))
  opened = [_shards(config, key, source.pattern) for source in sources]
  names = mixture.names(sources, [os.path.dirname(stream.paths[0]) for stream, _ in opened])
  first = opened[0][1]
  for name, source, (_, tokenizer) in zip(names, sources, opened):
    if tokenizer.to_str() != first.to_str():
      raise ConfigError(f"{key}: source {name!r} ({source.pattern}) was tokenized with another tokenizer "
                        f"(vocabulary {tokenizer.get_vocab_size()}) than source {names[0]!r} (vocabulary "
                        f"{first.get_vocab_size()}); a mixture's corpora must share one")
  rows = [text_rows(stream, config.max_target_length, stream.eod) for stream, _ in opened]
  return _Sources(names, [s.weight for s in sources], rows, first)


def _parquet_sources(config, key: str, tokenizer: Tokenizer, shuffle: bool, streams: int) -> _Sources:
  """The parquet globs config key `key` names (mixture.parse), all read with the configured
  tokenizer as `streams` streams: stream k of source i reads every streams-th file from the k-th,
  shuffled with mixture.source_seed(i), as a prepared corpus would be."""
  sources = mixture.parse(key, getattr(config, key))
  files = [_parquet_files(config, key, source.pattern, streams) for source in sources]
  rows = [[_parquet_rows(config, paths[k::streams], tokenizer,
                         mixture.source_seed(config.data_shuffle_seed, i) if shuffle else None)
           for i, paths in enumerate(files)] for k in range(streams)]
  names = mixture.names(sources, [os.path.dirname(paths[0]) for paths in files])
  return _Sources(names, [s.weight for s in sources], rows, tokenizer)


def grain_data(config) -> Data:
  """Shards written by prepare_data, read a window at a time (token_shards.TokenStream), or
  parquet files streamed (grain_file_type=parquet); either a weighted mixture (mixture.py)."""
  if config.eval_interval and not config.grain_eval_files:
    raise ConfigError(f"grain_eval_files='': needed for eval_interval={config.eval_interval} (e.g. "
                      f"DIR/eval-*.arrayrecord beside the train shards), or set eval_interval=0")
  if config.grain_file_type == "parquet":
    tokenizer = tokenizers.load_pretrained(config, "grain_file_type='parquet'")
    tokenizers.check_vocab_size(tokenizer, config.vocab_size, "the tokenizer of grain_file_type='parquet'")
    # Evaluation reads a stream per process: it starts afresh every time.
    streams = {"grain_train_files": config.grain_stream_count or jax.process_count(),
               "grain_eval_files": jax.process_count()}
    sources = lambda key, shuffle: _parquet_sources(config, key, tokenizer, shuffle, streams[key])
  else:
    sources = lambda key, shuffle: _shard_sources(config, key)
  trained = sources("grain_train_files", True)
  tokenizer = trained.tokenizer
  mixed = mixture.Mixture(trained.names, trained.rows, trained.weights, config.data_shuffle_seed)
  held_out, extra = None, {"progress": mixed.progress}
  if config.grain_eval_files:
    held = sources("grain_eval_files", False)
    if held.tokenizer.to_str() != tokenizer.to_str():
      raise ConfigError(f"grain_eval_files={config.grain_eval_files!r}: tokenized with another tokenizer than "
                        f"grain_train_files={config.grain_train_files!r}")
    streamed = config.grain_file_type == "parquet"
    endless = held.rows[jax.process_index()] if streamed else [rows.repeat() for rows in held.rows]
    if len(endless) == 1:
      held_out = endless[0]
    else:
      held_out = dict(zip(held.names, endless))
      extra["eval_weights"] = {name: float(w) for name, w in zip(held.names, held.weights)}
  return Data(tokenizer, mixed.rows, held_out, config.grain_worker_count, config.grain_per_worker_buffer_size,
              **extra)


# dataset_type -> the function giving its Data; the only place that tells the types apart.
DATASET_TYPES = {"text": text_data, "grain": grain_data, "synthetic": synthetic_data}


def load(config) -> Data:
  return DATASET_TYPES[config.dataset_type](config)


def resumes_by_step(data: Data) -> bool:
  """Whether the training batches from step s on depend on s alone: rows found by index (a
  MapDataset), so a checkpoint resumes at its step on any number of processes and workers.
  Streamed rows resume from the iterator state grain saves (StreamBlocks)."""
  return isinstance(data.train, grain.MapDataset)


# Stop signals are the trainer's: it stops at a step boundary and then closes grain's workers
# itself. A worker killed by one (a signal to the process group, as timeout and Ctrl-C send, or to
# every process, as schedulers send) left the trainer waiting for its batch forever. A worker is
# started from a thread that holds them (blocked, so it starts with them blocked), then ignores
# them before it unblocks them; the trainer's other threads take them meanwhile.
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _ignore_stop_signals(worker_index: int, worker_count: int) -> None:
  del worker_index, worker_count
  for signum in _STOP_SIGNALS:
    signal.signal(signum, signal.SIG_IGN)
  signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


@contextlib.contextmanager
def _stop_signals_held():
  held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
  try:
    yield
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, held)


class _WorkersStartedHeld(grain.DatasetIterator):
  """Its parent's batches, every call that may start a worker made with the stop signals held."""

  def __next__(self):
    with _stop_signals_held():
      return next(self._parent)

  def get_state(self) -> dict:
    return self._parent.get_state()

  def set_state(self, state: dict) -> None:
    with _stop_signals_held():
      self._parent.set_state(state)

  def start_prefetch(self) -> None:
    with _stop_signals_held():
      self._parent.start_prefetch()


def _started(batches: grain.IterDataset, data: Data) -> grain.DatasetIterator:
  """An iterator of `batches`, prepared by data.worker_count worker processes (0: threads)."""
  if not data.worker_count:
    return iter(batches)
  # The workers' batches cross pickled, not in shared memory: grain frees shared memory from a
  # thread pool that the interpreter's exit cuts short, so every run ended with multiprocessing's
  # "leaked shared_memory objects" warning; a batch of token ids is a few MB at most.
  batches = grain.experimental.WithOptionsIterDataset(batches, grain.experimental.DatasetOptions(min_shm_size=2**62))
  return _WorkersStartedHeld(iter(batches.mp_prefetch(
      grain.MultiprocessingOptions(num_workers=data.worker_count, per_worker_buffer_size=data.worker_buffer_size),
      worker_init_fn=_ignore_stop_signals)))


def create_train_iterator(config, data: Data, step: int = 0) -> grain.DatasetIterator:
  """Endless shuffled training batches (reshuffled every epoch) from global batch `step` on;
  checkpointable. Streamed rows start at 0 only: their position is the iterator's state, set
  from a checkpoint."""
  if resumes_by_step(data):
    return _started(_batches(data.train, config.global_batch_size_to_train_on, step), data)
  if step:
    raise ValueError(f"streamed rows cannot start at step {step}: restore the iterator's state")
  count, processes = len(data.train), jax.process_count()  # run_control.keep_global_batch checked they divide
  rows = config.global_batch_size_to_train_on // count
  mine = range(jax.process_index() * count // processes, (jax.process_index() + 1) * count // processes)
  return StreamBlocks({k: _started(data.train[k].batch(rows, drop_remainder=True), data) for k in mine}, count)


def create_eval_iterator(config, rows: grain.MapDataset | grain.IterDataset) -> grain.DatasetIterator:
  """The same eval_steps batches of held-out rows (data.eval, or one of its sources) every time
  (repeated if the split is short)."""
  return iter(_batches(rows, config.micro_batch_size))
