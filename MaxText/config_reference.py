"""configs/base.yml and the configuration reference, docs/reference/config.md, both written from
the sections of config_schema: every key under its section with its type, default and description.

  python -m MaxText.config_reference

tests/test_pyconfig.py fails when either file is not what this writes.
"""

import dataclasses
import json
import os
import textwrap

from MaxText import config_schema, pyconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_YML = os.path.join(ROOT, "configs", "base.yml")
REFERENCE = os.path.join(ROOT, "docs", "reference", "config.md")
_WIDTH = 100
_HEADER = """\
Every key the trainer reads, with its default, by section. `model_name=NAME` layers
configs/models/NAME.yml over this file; `key=value` arguments override both and are parsed to the
key's type. Unknown keys are errors. A config file given instead of this one sets every key, or
starts `base_config: base.yml` (its path relative to the file, as in MaxText) and sets only the keys
it changes. Written by `python -m MaxText.config_reference` from MaxText/config_schema.py; the
reference with each key's type is docs/reference/config.md."""


def _yaml(value) -> str:
  if isinstance(value, float):
    mantissa, e, exponent = repr(value).partition("e")
    return f"{mantissa}{'' if '.' in mantissa else '.0'}e{exponent}" if e else repr(value)  # YAML 1.1 needs the dot
  return json.dumps(value)


def _comment(text: str, indent: str = "") -> list:
  return [f"{indent}# {line}" for line in textwrap.wrap(text, _WIDTH - len(indent) - 2)]


def base_yml() -> str:
  defaults = pyconfig.defaults()
  lines = _comment(" ".join(_HEADER.split()))
  for section in config_schema.SECTIONS:
    lines += ["", f"# ---- {section.title} ".ljust(_WIDTH - 10, "-"), *_comment(" ".join(section.__doc__.split()))]
    for f in dataclasses.fields(section):
      lines += _comment(f.metadata["doc"])
      value = defaults[f.name]
      if f.name == "logical_axis_rules":
        lines += [f"{f.name}: [  # {f.metadata['help']}", *[f"  {_yaml(rule)}," for rule in value], "]"]
      else:
        lines.append(f"{f.name}: {_yaml(value)}".ljust(36) + f"  # {f.metadata['help']}")
  return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def markdown() -> str:
  defaults = pyconfig.defaults()
  lines = ["# Configuration keys", "",
           "Every key of `configs/base.yml`, by section, with its type and default; `key=value` on the command",
           "line or a config file overrides it (see the top of `base.yml`). Written by",
           "`python -m MaxText.config_reference` from `MaxText/config_schema.py`; the suite fails when it is stale."]
  for section in config_schema.SECTIONS:
    lines += ["", f"## {section.title}", "", " ".join(section.__doc__.split()), "",
              "| key | type | default | description |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(section):
      description = " ".join(x for x in (f.metadata["help"], f.metadata["doc"]) if x)
      lines.append(f"| `{f.name}` | {_cell(pyconfig.type_name(f.type))} | `{_cell(json.dumps(defaults[f.name]))}` | "
                   f"{_cell(description)} |")
  return "\n".join(lines) + "\n"


def main() -> None:
  for path, text in ((BASE_YML, base_yml()), (REFERENCE, markdown())):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
      f.write(text)
    print(f"wrote {os.path.relpath(path, ROOT)}")


if __name__ == "__main__":
  main()
