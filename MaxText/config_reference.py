"""The configuration reference, docs/config.md, written from configs/base.yml: every key under its
section (the file's `# ---- Name ----` headers) with its type, default and description (the
comment on its line, after the comment block directly above it).

  python -m MaxText.config_reference > docs/config.md

tests/test_pyconfig.py fails when docs/config.md is not what this writes, or when a key of
base.yml is in no section.
"""

import json
import re

from MaxText import pyconfig

_SECTION = re.compile(r"^# ---- (.*?)[\s-]*$")
_KEY = re.compile(r"^([a-z_0-9]+):")


def sections(path: str = pyconfig.SCHEMA) -> dict:
  """{section title: {key: description}} in the file's order; keys before the first header go
  under ""."""
  found, title, block = {"": {}}, "", []
  with open(path) as f:
    for line in f:
      line = line.rstrip("\n")
      if header := _SECTION.match(line):
        title, block = header.group(1).strip(), []
        found[title] = {}
      elif line.startswith("#"):
        block.append(line.lstrip("# ").strip())
      elif key := _KEY.match(line):
        inline = line.split("#", 1)[1].strip() if re.search(r"\s#\s", line) else ""
        found[title][key.group(1)] = " ".join([*block, inline]).strip()
        block = []
      elif not line.strip():
        block = []
  if not found[""]:
    del found[""]
  return found


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown(path: str = pyconfig.SCHEMA) -> str:
  defaults = pyconfig.load_yaml(path)
  lines = ["# Configuration keys", "",
           "Every key of `configs/base.yml`, by section, with its type and default; `key=value` on the command",
           "line or a config file overrides it (see the top of `base.yml`). Written by",
           "`python -m MaxText.config_reference > docs/config.md`; the suite fails when it is stale."]
  for title, keys in sections(path).items():
    lines += ["", f"## {title}", "", "| key | type | default | description |", "| --- | --- | --- | --- |"]
    for key, description in keys.items():
      default = defaults[key]
      kind = pyconfig.type_name(default).removeprefix("a ").removeprefix("an ")
      lines.append(f"| `{key}` | {kind} | `{_cell(json.dumps(default))}` | {_cell(description)} |")
  return "\n".join(lines) + "\n"


if __name__ == "__main__":
  print(markdown(), end="")
