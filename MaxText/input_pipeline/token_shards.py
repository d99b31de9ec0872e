"""Tokenized corpora as ArrayRecord shards: what prepare_data writes and dataset_type=grain reads.

  output_path/train-00000-of-00016.arrayrecord   one record per document: its token ids, int32 little-endian
  output_path/train-00000-of-00016.offsets       int64 little-endian: where each document's `doc EOD` ends
                                                 in the shard's stream (the index that makes windows
                                                 randomly addressable without reading the shard)
  output_path/eval-00000-of-00001.arrayrecord    the held-out documents, likewise
  output_path/tokenizer.json, manifest.json      manifest.json is written last: a directory without it
                                                 is not a prepared corpus

Document k of a split goes to shard k % N as its record k // N, so the shards are the same
whichever machine or runner wrote them. A split's stream is its shards' streams one after
another, `doc EOD doc EOD ...`, read through TokenStream.
"""

import glob
import json
import os
import re
import threading

import numpy as np
from array_record.python import array_record_module
from tokenizers import Tokenizer

from MaxText.errors import ConfigError, first_line
from MaxText.input_pipeline import tokenizer as tokenizers

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
SPLITS = ("train", "eval")
# Groups of 64 records: the writer keeps an index entry per group until it closes, so one per
# record (group_size:1) would grow with the corpus; a random read decompresses 64 documents.
WRITER_OPTIONS = "group_size:64,zstd:3"
_RANDOM_ACCESS = "readahead_buffer_size:0,max_parallelism:0"  # array_record's advice for random reads


def shard_name(split: str, index: int, count: int) -> str:
  return f"{split}-{index:05d}-of-{count:05d}.arrayrecord"


def offsets_path(shard_path: str) -> str:
  return shard_path.removesuffix(".arrayrecord") + ".offsets"


def _offsets(shard_path: str) -> np.ndarray:
  """The shard's offsets, mapped, not read: an index of a billion documents stays on disk."""
  path = offsets_path(shard_path)
  return np.memmap(path, "<i8", mode="r") if os.path.getsize(path) else np.zeros(0, np.int64)


class ShardWriter:
  """Appends documents to one shard and its offsets file.

  A round-robin pass keeps every shard of a split open at once, and array_record's Python
  writer holds a 16 MiB buffer per open file: N shards would hold N x 16 MiB, growing with the
  corpus until each shard passes 16 MiB. So documents go first to a plain spill file beside the
  shard (4 bytes a token, a small buffer), and close() writes the ArrayRecord shard from it,
  one shard at a time, and deletes it.
  """

  def __init__(self, path: str):
    self.path = path
    self._spill = open(_spill_path(path), "wb")  # closed in close()
    self._offsets = open(offsets_path(path), "wb")  # closed in close()
    self.documents = self.stream_tokens = 0

  def add(self, ids: np.ndarray) -> None:
    self._spill.write(np.asarray(ids, "<i4").tobytes())
    self.documents += 1
    self.stream_tokens += len(ids) + 1  # and its EOD
    self._offsets.write(np.int64(self.stream_tokens).astype("<i8").tobytes())

  def close(self) -> None:
    self._spill.close()
    self._offsets.close()
    records = array_record_module.ArrayRecordWriter(self.path, WRITER_OPTIONS)
    with open(_spill_path(self.path), "rb") as spill, open(offsets_path(self.path), "rb") as offsets:
      previous = 0
      while block := offsets.read(8 << 16):
        ends = np.frombuffer(block, "<i8")
        for length in np.diff(ends, prepend=previous) - 1:  # each document's tokens, its EOD not stored
          records.write(spill.read(4 * int(length)))
        previous = int(ends[-1])
    records.close()
    os.remove(_spill_path(self.path))


def _spill_path(shard_path: str) -> str:
  return shard_path.removesuffix(".arrayrecord") + ".spill"


def shard_stats(directory: str, split: str) -> list[dict]:
  """[{file, documents, tokens (EODs not counted)}] of the split's shards in `directory`."""
  stats = []
  for path in sorted(glob.glob(os.path.join(directory, f"{split}-*-of-*.arrayrecord"))):
    offsets = _offsets(path)
    stream = int(offsets[-1]) if len(offsets) else 0
    stats.append({"file": os.path.basename(path), "documents": len(offsets), "tokens": stream - len(offsets)})
  return stats


def write_manifest(directory: str, tokenizer: Tokenizer, extra: dict) -> dict:
  """Describes the shards in `directory` (read back from their offsets) and writes
  tokenizer.json, then manifest.json, each atomically."""
  splits = {}
  for split in SPLITS:
    shards = shard_stats(directory, split)
    splits[split] = {"documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
                     "shards": shards}
  manifest = {"tokenizer": TOKENIZER, "tokenizer_fingerprint": tokenizers.fingerprint([tokenizer.to_str()]),
              "eod_id": tokenizers.eod_id(tokenizer, "tokenizer"), "vocab_size": tokenizer.get_vocab_size(),
              "dtype": "int32", "splits": splits, **extra}
  tokenizers.save_atomic(tokenizer, os.path.join(directory, TOKENIZER))
  tmp = os.path.join(directory, f"{MANIFEST}.tmp{os.getpid()}")
  with open(tmp, "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(tmp, os.path.join(directory, MANIFEST))
  return manifest


def _corrupt(path: str, why: str) -> ConfigError:
  return ConfigError(f"grain shard {path}: {why}; prepare it again with python -m MaxText.prepare_data")


def open_split(key: str, pattern: str):
  """(TokenStream, Tokenizer) of the shards matching `pattern` (the value of config key `key`),
  checked against the manifest beside them: a missing or damaged shard is a ConfigError naming it."""
  paths = sorted(p for p in glob.glob(pattern) if p.endswith(".arrayrecord"))  # not the .offsets beside them
  if not paths:
    raise ConfigError(f"{key}={pattern!r}: matches no .arrayrecord files")
  directories = {os.path.dirname(os.path.abspath(p)) for p in paths}
  if len(directories) > 1:
    raise ConfigError(f"{key}={pattern!r}: matches shards of {len(directories)} directories; give one prepared corpus")
  directory = directories.pop()
  manifest_path = os.path.join(directory, MANIFEST)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
    tokenizer = Tokenizer.from_file(os.path.join(directory, manifest["tokenizer"]))
  except Exception as e:  # json, KeyError, OSError, and tokenizers' bare Exceptions
    raise ConfigError(f"{key}={pattern!r}: {manifest_path} or its tokenizer is missing or unreadable "
                      f"({first_line(e)}); is this a prepare_data output?") from None
  if tokenizers.fingerprint([tokenizer.to_str()]) != manifest.get("tokenizer_fingerprint"):
    raise ConfigError(f"{key}={pattern!r}: {os.path.join(directory, manifest['tokenizer'])} is not the tokenizer the "
                      f"shards were tokenized with (its fingerprint differs from {manifest_path}'s); prepare them "
                      "again")
  listed = {s["file"]: s for split in manifest["splits"].values() for s in split["shards"]}
  for path in paths:  # `-of-N` promises N shards: one gone would silently drop its documents
    named = re.fullmatch(r"(.+)-\d+-of-(\d+)\.arrayrecord", os.path.basename(path))
    for index in range(int(named[2]) if named else 0):
      sibling = os.path.join(directory, shard_name(named[1], index, int(named[2])))
      if not os.path.isfile(sibling):
        raise _corrupt(sibling, "missing")
  ends = []
  for path in paths:
    shard = listed.get(os.path.basename(path))
    if shard is None:
      raise ConfigError(f"{key}={pattern!r}: {path} is not listed in {manifest_path}")
    offsets = offsets_path(path)
    if not os.path.isfile(offsets) or os.path.getsize(offsets) != 8 * shard["documents"]:
      raise _corrupt(offsets, f"missing or not {shard['documents']} offsets long")
    try:
      reader = array_record_module.ArrayRecordReader(path)
      records = reader.num_records()
      reader.close()
    except (RuntimeError, OSError, ValueError) as e:
      raise _corrupt(path, f"unreadable ({first_line(e)})") from None
    stream = int(_offsets(path)[-1]) if records else 0
    if records != shard["documents"] or stream != shard["tokens"] + shard["documents"]:
      raise _corrupt(path, f"{records} records and {stream} tokens, the manifest says {shard['documents']} "
                     f"and {shard['tokens'] + shard['documents']}")
    ends.append(stream)
  return TokenStream(paths, ends, manifest["eod_id"]), tokenizer


class TokenStream:
  """The stream `doc EOD doc EOD ...` of a list of shards, sliced like an array:
  stream[a:b] reads only the documents that overlap [a, b)."""

  def __init__(self, paths: list[str], stream_lengths: list[int], eod: int):
    self.paths, self.eod = paths, eod
    self._ends = np.cumsum(stream_lengths)
    self._open()

  def _open(self):
    self._offsets = [_offsets(p) for p in self.paths]
    self._readers = threading.local()  # grain calls from several threads; one reader each

  # Worker processes get the paths and open the files themselves (a memmap would be copied).
  def __getstate__(self):
    return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_offsets")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._open()

  def _record(self, shard: int, index: int) -> bytes:
    """Record `index` of shard `shard`, by array_record's reader: grain's source would log an
    error for every shard not written with group_size:1 (see WRITER_OPTIONS)."""
    readers = self._readers.__dict__
    if shard not in readers:
      readers[shard] = array_record_module.ArrayRecordReader(self.paths[shard], _RANDOM_ACCESS)
    return readers[shard].read([index])[0]

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def __getitem__(self, window: slice) -> np.ndarray:
    start, stop, _ = window.indices(len(self))
    pieces = []
    while start < stop:
      shard = int(np.searchsorted(self._ends, start, side="right"))
      local = start - (int(self._ends[shard - 1]) if shard else 0)
      offsets = self._offsets[shard]
      document = int(np.searchsorted(offsets, local, side="right"))
      begin = int(offsets[document - 1]) if document else 0
      try:
        ids = np.frombuffer(self._record(shard, document), "<i4")
      except Exception as e:  # array_record raises bare RuntimeErrors for damaged chunks
        raise _corrupt(self.paths[shard], f"record {document} unreadable ({first_line(e)})") from None
      if len(ids) + 1 != int(offsets[document]) - begin:
        raise _corrupt(self.paths[shard], f"record {document} has {len(ids)} tokens, its offsets say "
                       f"{int(offsets[document]) - begin - 1}")
      piece = np.append(ids, np.int32(self.eod))[local - begin:local - begin + stop - start]
      pieces.append(piece)
      start += len(piece)
    return np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
