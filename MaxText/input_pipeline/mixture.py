"""Weighted mixtures of prepared corpora: grain_train_files="GLOB,WEIGHT;GLOB,WEIGHT;..." (MaxText's syntax).

Global row r of a mixture comes from the source `Interleave` assigns it, a fixed function of r
and the weights: a low-discrepancy interleaving, so every prefix of the rows holds each source
within a few rows of its share (a pseudo-random choice per row would stray by sqrt(r)). The
k-th row a source gives is row k of that source's rows shuffled and repeated, which grain
reshuffles each epoch (the seed plus the epoch). Both are closed forms of r, so the mixture
stays a MapDataset with random access: a run resumed at any step, on any number of processes,
reads the rows the uninterrupted run read, and the rows each source gave up to a step (its
share, its epochs) follow from the step alone.

Streamed sources (parquet, IterDatasets) are read as streams (input_pipeline), each holding
its part of every source; within a stream `Streams` takes the next row of the source `Interleave`
names: row r of the stream still comes from the same source, so the shares are those of prepared
corpora, but a source's k-th row is wherever its stream is, and the position is the iterator's
state (every source's, saved in the checkpoint).
"""

import math
import os
import sys
from collections import Counter
from fractions import Fraction
from typing import NamedTuple

import grain

from MaxText.errors import ConfigError

# grain shuffles epoch e of a source with its seed + e: sources 2**20 seeds apart share no
# epoch's order for a million epochs, and source 0 keeps data_shuffle_seed, as a lone corpus.
SEED_STRIDE = 2**20


def source_seed(seed: int, index: int) -> int:
  """The shuffle seed of a mixture's source `index`, given data_shuffle_seed."""
  return (seed + index * SEED_STRIDE) % 2**32


class Source(NamedTuple):
  pattern: str  # a glob of one prepared corpus's shards, or of parquet files
  weight: Fraction  # exact, as written: 0.3 is 3/10
  name: str | None = None  # a mixture file's; else its directory's (names())


MIXTURE_FILES = (".yml", ".yaml")


def parse(key: str, value: str) -> list[Source]:
  """The sources of config key `key`: "GLOB" (weight 1), "GLOB,WEIGHT;GLOB,WEIGHT;..." (a glob
  may hold commas: the weight is what follows the last one; a lone glob with nothing numeric after
  its last comma is a glob), or a mixture file (read_file)."""
  if value.strip().endswith(MIXTURE_FILES):
    return read_file(key, value.strip())
  entries = [e.strip() for e in value.split(";") if e.strip()] or [value.strip()]
  sources = []
  for entry in entries:
    pattern, comma, weight = entry.rpartition(",")
    if not comma or (len(entries) == 1 and not _numeric(weight)):
      if len(entries) > 1:
        raise ConfigError(f"{key}: source {entry!r} has no weight; give every source of a mixture one "
                          f"(GLOB,WEIGHT;GLOB,WEIGHT)")
      return [Source(entry, Fraction(1))]
    sources.append(Source(pattern.strip(), _weight(key, pattern.strip(), weight.strip())))
  return sources


def _numeric(text: str) -> bool:
  try:
    Fraction(text.strip())
  except (ValueError, ZeroDivisionError):
    return False
  return True


def _weight(key: str, name: str, weight) -> Fraction:
  try:
    exact = Fraction(str(weight).strip())
  except (ValueError, ZeroDivisionError):
    exact = None
  if exact is None or exact <= 0:
    raise ConfigError(f"{key}: source {name!r} has weight {weight!r}, not a positive number")
  return exact


def read_file(key: str, path: str) -> list[Source]:
  """A mixture file (YAML), which names the sources, in order (their shuffle seeds follow it):

    web: {files: "web/train-*", weight: 0.7}
    code: {files: "code/train-*", weight: 0.3}
  """
  import yaml  # noqa: PLC0415 (only mixture files need it)
  try:
    with open(path) as f:
      text = f.read()
    node, spec = yaml.compose(text, Loader=yaml.SafeLoader), yaml.safe_load(text)
  except OSError as e:
    raise ConfigError(f"{key}={path!r}: cannot read the mixture file ({e.strerror})") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"{key}={path!r}: not YAML ({str(e).splitlines()[0]})") from None
  # YAML keeps the last of two equal keys: the first source would never be read.
  named = Counter(k.value for k, _ in node.value) if isinstance(node, yaml.MappingNode) else Counter()
  twice = [name for name, count in named.items() if count > 1]
  if twice:
    raise ConfigError(f"{key}={path!r}: source {twice[0]!r} is named twice")
  if not isinstance(spec, dict) or not spec:
    raise ConfigError(f"{key}={path!r}: a mixture file maps each source's name to its files and weight, e.g. "
                      "web: {files: \"web/train-*\", weight: 0.7}")
  sources = []
  for name, entry in spec.items():
    if not isinstance(entry, dict) or set(entry) != {"files", "weight"} or not isinstance(entry["files"], str):
      raise ConfigError(f"{key}={path!r}: source {name!r} must have exactly files (a glob) and weight")
    sources.append(Source(entry["files"], _weight(f"{key}={path!r}", str(name), entry["weight"]), str(name)))
  return sources


def names(sources: list[Source], directories: list[str]) -> list[str]:
  """Each source's name: a mixture file's, else its corpus's directory name, numbered where two
  share one."""
  bases = [s.name or os.path.basename(d.rstrip(os.sep)) or d for s, d in zip(sources, directories)]
  repeated = {name for name, count in Counter(bases).items() if count > 1}
  # A number never makes a name another source already has (web, web and web_1: web_2, web_3, web_1).
  named, used = [], {base for base in bases if base not in repeated}
  for base in bases:
    name, k = base, 1
    while base in repeated and (name := f"{base}_{k}") in used:
      k += 1
    used.add(name)
    named.append(name)
  return named


class Interleave(grain.transforms.DatasetSelectionMap):
  """Global row -> (source, its row), for exact rational weights.

  Source 0 takes ceil(r * w0 / W) of the first r rows (Bresenham's line: never more than one row
  off its share); the rows it leaves are split among the rest the same way, source 1 first. So
  `counts` is closed-form, O(sources) per row, and source i strays from its share by at most i + 1
  rows. grain's own `mix` interleaves the same way but rounds the weights to integers of 1% of
  the smallest and does not expose the counts the metrics need.
  """

  def __init__(self, weights: list[Fraction]):
    scale = math.lcm(*(w.denominator for w in weights))
    integers = [int(w * scale) for w in weights]
    common = math.gcd(*integers)
    self.weights = [w // common for w in integers]

  def counts(self, rows: int) -> list[int]:
    """How many of the first `rows` global rows each source gives."""
    taken, remaining = [], sum(self.weights)
    for weight in self.weights:
      rest = rows * (remaining - weight) // remaining
      taken.append(rows - rest)
      rows, remaining = rest, remaining - weight
    return taken

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, row: int) -> tuple[int, int]:
    before, after = self.counts(row), self.counts(row + 1)
    source = next(i for i, (a, b) in enumerate(zip(before, after)) if a != b)
    return source, before[source]


class Streams(grain.IterDataset):
  """Rows of streamed sources in `interleave`'s order: row r is the next row of the source
  interleave[r] names. Its state is the row count and every source's state."""

  def __init__(self, sources: list[grain.IterDataset], interleave: Interleave):
    super().__init__(sources)
    self.interleave = interleave

  def __iter__(self):
    return _StreamsIterator(self)


class _StreamsIterator(grain.DatasetIterator):

  def __init__(self, streams: Streams):
    super().__init__([iter(source) for source in streams.parents])
    self._interleave, self._row = streams.interleave, 0

  def __next__(self):
    source, _ = self._interleave[self._row]
    row = next(self._parents[source])
    self._row += 1
    return row

  def get_state(self) -> dict:
    return {"row": self._row, "sources": [source.get_state() for source in self._parents]}

  def set_state(self, state: dict) -> None:
    for source, source_state in zip(self._parents, state["sources"], strict=True):
      source.set_state(source_state)
    self._row = state["row"]


class Mixture:
  """A mixture's endless training rows and what the metrics say of them."""

  def __init__(self, names: list[str], sources: list[grain.MapDataset] | list[list[grain.IterDataset]],
               weights: list[Fraction], seed: int):
    """Source i of rows found by index (MapDatasets) is shuffled with source_seed(seed, i) (plus
    its epoch) and repeated; one source is exactly its shuffled rows, as a glob without weight
    always was; `rows` is a MapDataset. Streamed sources come as sources[stream][source], shuffled
    with those seeds and endless; `rows` is a list of each stream's rows, mixed within the stream:
    their sizes are unknown, and the counts are per stream."""
    self.names, self.interleave = names, Interleave(weights)
    if all(isinstance(rows, grain.MapDataset) for rows in sources):
      self.sizes, self.streams = [len(rows) for rows in sources], 1
      sources = [rows.shuffle(seed=source_seed(seed, i)).repeat() for i, rows in enumerate(sources)]
      self.rows = sources[0] if len(sources) == 1 else grain.MapDataset.select_from_datasets(sources, self.interleave)
    else:
      self.sizes, self.streams = None, len(sources)
      self.rows = [rows[0] if len(rows) == 1 else Streams(rows, self.interleave) for rows in sources]

  def progress(self, rows: int) -> dict:
    """data/fraction/<source> and, where the sources' sizes are known, data/epochs/<source> once
    the first `rows` global rows are drawn."""
    counts = [count * self.streams for count in self.interleave.counts(rows // self.streams)]
    metrics = {f"data/fraction/{name}": count / max(rows, 1) for name, count in zip(self.names, counts)}
    if self.sizes:
      metrics.update({f"data/epochs/{name}": count / size for name, size, count in zip(self.names, self.sizes, counts)})
    return metrics
