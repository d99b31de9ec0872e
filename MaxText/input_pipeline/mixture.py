"""Weighted mixtures of prepared corpora: grain_train_files="GLOB,WEIGHT;GLOB,WEIGHT;..." (MaxText's syntax).

Global row r of a mixture comes from the source `Interleave` assigns it, a fixed function of r
and the weights: a low-discrepancy interleaving, so every prefix of the rows holds each source
within a few rows of its share (a pseudo-random choice per row would stray by sqrt(r)). The
k-th row a source gives is row k of that source's rows shuffled and repeated, which grain
reshuffles each epoch (the seed plus the epoch). Both are closed forms of r, so the mixture
stays a MapDataset with random access: a run resumed at any step, on any number of processes,
reads the rows the uninterrupted run read, and the rows each source gave up to a step (its
share, its epochs) follow from the step alone.
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


class Source(NamedTuple):
  pattern: str  # a glob of one prepared corpus's shards
  weight: Fraction  # exact, as written: 0.3 is 3/10


def parse(key: str, value: str) -> list[Source]:
  """The sources of config key `key`: "GLOB" (weight 1) or "GLOB,WEIGHT;GLOB,WEIGHT;...". A glob
  may hold commas: the weight is what follows the last one."""
  entries = [e.strip() for e in value.split(";") if e.strip()] or [value.strip()]
  sources = []
  for entry in entries:
    pattern, comma, weight = entry.rpartition(",")
    if not comma:
      if len(entries) > 1:
        raise ConfigError(f"{key}: source {entry!r} has no weight; give every source of a mixture one "
                          f"(GLOB,WEIGHT;GLOB,WEIGHT)")
      return [Source(entry, Fraction(1))]
    try:
      exact = Fraction(weight.strip())
    except (ValueError, ZeroDivisionError):
      exact = None
    if exact is None or exact <= 0:
      raise ConfigError(f"{key}: source {pattern.strip()!r} has weight {weight.strip()!r}, not a positive number")
    sources.append(Source(pattern.strip(), exact))
  return sources


def names(directories: list[str]) -> list[str]:
  """Each source's name: its prepared corpus's directory name, numbered where two share one."""
  bases = [os.path.basename(d.rstrip(os.sep)) or d for d in directories]
  repeated = {name for name, count in Counter(bases).items() if count > 1}
  seen = Counter()
  named = []
  for base in bases:
    seen[base] += 1
    named.append(f"{base}_{seen[base]}" if base in repeated else base)
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


class Mixture:
  """A mixture's endless training rows and what the metrics say of them."""

  def __init__(self, names: list[str], sources: list[grain.MapDataset], weights: list[Fraction], seed: int):
    """Source i is shuffled with data_shuffle_seed + i * SEED_STRIDE (plus its epoch) and repeated;
    one source is exactly its shuffled rows, as a glob without weight always was."""
    self.names, self.sizes, self.interleave = names, [len(rows) for rows in sources], Interleave(weights)
    shuffled = [rows.shuffle(seed=(seed + i * SEED_STRIDE) % 2**32).repeat() for i, rows in enumerate(sources)]
    self.rows = (shuffled[0] if len(shuffled) == 1 else
                 grain.MapDataset.select_from_datasets(shuffled, self.interleave))

  def progress(self, rows: int) -> dict:
    """data/fraction/<source> and data/epochs/<source> once the first `rows` global rows are drawn."""
    metrics = {}
    for name, size, count in zip(self.names, self.sizes, self.interleave.counts(rows)):
      metrics[f"data/fraction/{name}"] = count / max(rows, 1)
      metrics[f"data/epochs/{name}"] = count / size
    return metrics
