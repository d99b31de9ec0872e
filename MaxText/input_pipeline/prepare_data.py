"""Tokenizes a corpus once into ArrayRecord shards for dataset_type=grain:

  python -m MaxText.prepare_data configs/base.yml dataset_path=GLOB tokenizer_path=tokenizer.json output_path=DIR

Files (.txt, .md, .jsonl, .parquet with text_column) are read lazily in sorted order, split
by the text path's held-out rule (corpus.split_stream), tokenized by prepare_workers processes
in chunks of about _CHUNK_BYTES of text with at most two chunks per worker in flight, and
written as token_shards describes; memory does not grow with the corpus. runner=DirectRunner
(or any Beam runner) runs the same preparation as an Apache Beam pipeline (beam_pipeline.py).

Bad records (empty documents, bytes that are not UTF-8, malformed .jsonl lines, parquet files
without text_column or unreadable) are counted, skipped and summarised in one line at the end;
strict_data=true stops at the first one instead (exit 2, nothing written).
"""

import collections
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import shutil
import signal
import sys
import time

import numpy as np
from absl import logging
from tokenizers import Tokenizer
from tqdm import tqdm

from MaxText import errors, launch, run_control, runtime
from MaxText.input_pipeline import corpus, token_shards
from MaxText.input_pipeline import tokenizer as tokenizers

SUFFIXES = (*corpus.TEXT_SUFFIXES, ".parquet")
_CHUNK_BYTES = 1 << 20
_LOGGED_BAD = 5  # bad records logged one by one; the rest only counted


def check_output_path(config) -> list | None:
  """The files of the prepared corpus output_path holds, which overwrite_output_path=true lets
  this preparation replace (None: it holds none). Before any work, a ConfigError for a corpus
  not to be replaced, a manifest that cannot say what it consists of, or a file of the user's
  that this preparation would write over."""
  if not config.output_path:
    raise errors.ConfigError("output_path='': give the directory to write the shards to")
  run_control.check_writable("output_path", config.output_path)
  listed = _prepared_files(config.output_path)
  if listed is not None and not config.overwrite_output_path:
    raise errors.ConfigError(f"output_path={config.output_path!r}: already holds a prepared corpus "
                             f"({token_shards.MANIFEST}); choose another directory, or set "
                             "overwrite_output_path=true to replace it")
  if listed is None and not config.overwrite_output_path:
    shards = [token_shards.shard_name(split, i, count) for split, count in
              (("train", config.num_train_shards), ("eval", config.num_eval_shards)) for i in range(count)]
    clash = [name for name in (token_shards.TOKENIZER, *shards, *map(token_shards.offsets_path, shards))
             if os.path.lexists(os.path.join(config.output_path, name))]
    if clash:
      raise errors.ConfigError(f"output_path={config.output_path!r}: holds {clash[0]}, which this preparation "
                               f"writes, and no {token_shards.MANIFEST}; move it, or set overwrite_output_path=true "
                               "to replace it")
  return listed


def _prepared_files(directory: str) -> list | None:
  """The files `directory`'s manifest lists (None without one), each a plain file name in it:
  a manifest naming anything else (`../x`, a path) or not a manifest at all is a ConfigError,
  for nothing is to be removed on its word."""
  path = os.path.join(directory, token_shards.MANIFEST)
  if not os.path.lexists(path):
    return None
  try:
    with open(path) as f:
      manifest = json.load(f)
    shards = [s["file"] for split in manifest["splits"].values() for s in split["shards"]]
    names = [manifest["tokenizer"], *shards, *map(token_shards.offsets_path, shards)]
  except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
    raise errors.ConfigError(f"output_path={directory!r}: {token_shards.MANIFEST} does not say which files the "
                             f"corpus is ({type(e).__name__}: {errors.first_line(e)}); nothing was touched: remove "
                             "the corpus yourself, or choose another directory") from None
  odd = [name for name in names if not isinstance(name, str) or name in ("", ".", "..")
         or os.path.basename(name) != name]
  if odd:
    raise errors.ConfigError(f"output_path={directory!r}: {token_shards.MANIFEST} lists {odd[0]!r}, not a file "
                             "name in output_path; nothing was touched: remove the corpus yourself, or choose "
                             "another directory")
  return names


def _remove_prepared(directory: str, names: list | None) -> None:
  """The prepared corpus in `directory`: its manifest first (the directory is then no corpus),
  then the files it listed (`names`, from check_output_path); nothing else there is touched."""
  if names is None:
    return
  os.remove(os.path.join(directory, token_shards.MANIFEST))
  for name in names:
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(directory, name))


class BadRecords:
  """Counts bad records by kind; strict_data turns the first into a ConfigError."""

  def __init__(self, strict: bool):
    self.strict, self.counts = strict, collections.Counter()

  def add(self, record: corpus.BadRecord) -> None:
    if self.strict:
      raise errors.ConfigError(f"{record.message} (strict_data=true)")
    self.counts[record.kind] += 1
    if sum(self.counts.values()) <= _LOGGED_BAD:
      logging.warning("skipped: %s", record.message)

  def summary(self) -> str:
    if not self.counts:
      return "no bad records"
    kinds = ", ".join(f"{n} {kind}" for kind, n in self.counts.most_common())
    return f"skipped {sum(self.counts.values())} bad records ({kinds})"


def documents(paths, text_column: str, bad: BadRecords, read: list):
  """The corpus's documents in order; read[0] counts the bytes of input consumed."""
  done = 0
  for path in paths:
    for record, consumed in corpus.records(path, text_column):
      read[0] = done + consumed
      if isinstance(record, corpus.BadRecord):
        bad.add(record)
      elif not record.strip():
        bad.add(corpus.BadRecord("empty document", f"dataset_path: {path} has an empty document"))
      else:
        yield record
    done += os.path.getsize(path)
    read[0] = done


def _chunks(split_documents, read: list):
  """Lists of (split, position, text) of about _CHUNK_BYTES of text, with the bytes read so far."""
  chunk, size = [], 0
  for item in split_documents:
    chunk.append(item)
    size += len(item[2])
    if size >= _CHUNK_BYTES:
      yield chunk, read[0]
      chunk, size = [], 0
  if chunk:
    yield chunk, read[0]


_worker_tokenizer = None


def _init_worker(tokenizer_json: str) -> None:
  global _worker_tokenizer
  _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def encode(texts: list[str]) -> list[np.ndarray]:
  """In a worker: token ids of each text, no special tokens (the EOD is the stream's)."""
  return [np.asarray(e.ids, np.int32) for e in _worker_tokenizer.encode_batch(texts, add_special_tokens=False)]


def _tokenized(pool, chunks, workers: int):
  """(chunk, ids) in order, with at most 2 * workers chunks queued: reading never runs ahead."""
  pending = collections.deque()
  for chunk, read in chunks:
    pending.append((chunk, read, pool.apply_async(encode, ([text for _, _, text in chunk],))))
    if len(pending) >= 2 * workers:
      chunk, read, result = pending.popleft()
      yield chunk, read, result.get()
  while pending:
    chunk, read, result = pending.popleft()
    yield chunk, read, result.get()


def peak_rss_mib() -> tuple[float, float]:
  """(this process, its largest finished child) peak resident set sizes in MiB."""
  return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def prepare_local(config, tokenizer, paths, partial: str, bad: BadRecords) -> int:
  """Writes the shards into `partial`; returns the tokens written."""
  counts = {"train": config.num_train_shards, "eval": config.num_eval_shards}
  writers = {split: [token_shards.ShardWriter(os.path.join(partial, token_shards.shard_name(split, i, n)))
                     for i in range(n)] for split, n in counts.items()}
  workers = config.prepare_workers or os.cpu_count()
  read = [0]
  stream = corpus.split_stream(documents(paths, config.text_column, bad, read))
  total_bytes = sum(os.path.getsize(p) for p in paths)
  tokens = 0
  context = multiprocessing.get_context("spawn")  # fork would copy JAX's threads into the workers
  # SIGTERM and SIGINT are held while the pool starts: one arriving while a worker reads its
  # start-up data from this process would cut that short (a traceback from the worker). Held,
  # it is raised again inside the try below and stops the preparation as anywhere else.
  held = []
  handlers = {s: signal.signal(s, lambda signum, _: held.append(signum)) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    pool = context.Pool(workers, _init_worker, (tokenizer.to_str(),))
  finally:
    for s, handler in handlers.items():
      signal.signal(s, handler)
  try:
    if held:
      signal.raise_signal(held[0])
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr,
              disable=None) as bar:
      start = time.perf_counter()
      for chunk, chunk_read, ids in _tokenized(pool, _chunks(stream, read), workers):
        for (split, position, _), document in zip(chunk, ids):
          writers[split][position % counts[split]].add(document)
          tokens += len(document)
        bar.update(chunk_read - bar.n)
        bar.set_postfix(tokens=f"{tokens:.3g}", tokens_per_s=f"{tokens / (time.perf_counter() - start):.3g}",
                        refresh=False)
  finally:
    # Closed and joined, not terminated, also when stopped: a worker killed before it has read
    # its start-up data from this process prints a traceback. Queued chunks (at most two per
    # worker) are tokenized first.
    pool.close()
    pool.join()
  for writer in itertools.chain(*writers.values()):
    writer.close()
  return tokens


def _beam():
  try:
    from MaxText.input_pipeline import beam_pipeline  # noqa: PLC0415 (Beam is installed apart; only runner= needs it)
  except ImportError as e:
    raise errors.ConfigError(f"runner: an Apache Beam runner needs apache_beam ({e}); setup.sh installs it "
                             "apart, into .venv/beam: run with PYTHONPATH=.venv/beam") from None
  return beam_pipeline


def prepare(config) -> dict:
  """Prepares config.dataset_path into config.output_path; returns the manifest."""
  check_output_path(config)
  tokenizer = tokenizers.load_pretrained(config, "prepare_data")
  paths = corpus.files(config.dataset_path, SUFFIXES)
  created = not os.path.exists(config.output_path)
  # One writer at a time: a second one would replace the first's files with its own.
  with run_control.run_lock(config.output_path, "output_path", "prepared"), run_control.signals_raise():
    listed = check_output_path(config)  # again, holding the lock: the writer that held it may have finished
    partial = run_control.staging_dir(config.output_path, "prepare_data")
    bad = BadRecords(config.strict_data)
    start = time.perf_counter()
    try:
      if config.runner:
        tokens = _beam().run(config, tokenizer, paths, partial, bad)
      else:
        tokens = prepare_local(config, tokenizer, paths, partial, bad)
    except BaseException:  # nothing of a failed preparation stays
      shutil.rmtree(config.output_path if created else partial)
      raise
    seconds = time.perf_counter() - start
    _remove_prepared(config.output_path, listed)  # overwrite_output_path=true
    for name in sorted(os.listdir(partial)):
      os.replace(os.path.join(partial, name), os.path.join(config.output_path, name))
    os.rmdir(partial)
    size = sum(os.path.getsize(p) for p in paths)
    main_rss, worker_rss = peak_rss_mib()
    measured = {"seconds": round(seconds, 2), "input_bytes": size, "mb_per_s": round(size / 1e6 / seconds, 2),
                "tokens_per_s": round(tokens / seconds), "peak_rss_mib": round(main_rss),
                "peak_worker_rss_mib": round(worker_rss)}
    manifest = token_shards.write_manifest(config.output_path, tokenizer, {
        "dataset_path": config.dataset_path, "text_column": config.text_column, "files": len(paths),
        "bad_records": dict(bad.counts), "preparation": measured})
  train, held_out = manifest["splits"]["train"], manifest["splits"]["eval"]
  print(f"prepared {config.output_path}: {train['documents']} train documents ({train['tokens']} tokens), "
        f"{held_out['documents']} eval documents ({held_out['tokens']} tokens); {measured['mb_per_s']} MB/s, "
        f"{measured['tokens_per_s']} tokens/s, peak RSS {measured['peak_rss_mib']} MiB "
        f"(workers {measured['peak_worker_rss_mib']} MiB); {bad.summary()}")
  return manifest


def main(argv):
  prepare(launch.config(argv[1:]))


if __name__ == "__main__":
  runtime.run(main)
