"""The package's import graph, read with ast: every module imports only modules of its own layer
or the layers below it, in the table of docs' architecture.md, and no import cycle. Imports
inside functions count: they are cycles and upward imports all the same, only deferred."""

import ast
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

BENCHMARKS = "MaxText.benchmarks"
PACKAGE = "MaxText"  # its __init__ lies beneath every layer: it may import nothing
TABLE_HEADER = "| layer | modules | job |"


def module_names() -> dict:
  """{dotted module name: file} of every module in MaxText/."""
  names = {}
  for path in sorted((ROOT / "MaxText").rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return names


def imports(path: Path, modules) -> set:
  """Every module a file imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from MaxText import train` imports the module MaxText.train; `from MaxText.train import x` MaxText.train.
      found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
  return found


def imported(path: Path, modules) -> set:
  """The MaxText modules a file imports, anywhere in it."""
  return imports(path, modules) & set(modules)


def import_graph() -> dict:
  modules = module_names()
  return {name: imported(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict) -> list:
  """One cycle [a, b, ..., a] of a {node: successors} graph, or [] when it has none."""
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for successor in sorted(graph.get(node, ())):
      if state.get(successor) == "open":
        return stack[stack.index(successor):] + [successor]
      if successor not in state:
        cycle = visit(successor)
        if cycle:
          return cycle
    state[node] = "done"
    stack.pop()
    return []

  for node in sorted(graph):
    if node not in state:
      cycle = visit(node)
      if cycle:
        return cycle
  return []


def test_the_cycle_finder_finds_cycles():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_imports_inside_functions():
  graph = import_graph()
  assert "MaxText.input_pipeline.beam_pipeline" in graph["MaxText.input_pipeline.prepare_data"]
  assert {"MaxText.errors", "MaxText.sharding", "MaxText.losses"} <= graph["MaxText.config_schema"]


def test_no_module_imports_itself_back():
  cycle = find_cycle(import_graph())
  assert not cycle, " -> ".join(cycle)


def layer_rows(text: str) -> list:
  """[(layer, modules cell)] of the architecture table in `text`, lowest layer first."""
  lines = text[text.index(TABLE_HEADER):].splitlines()[2:]  # past the header and its rule
  cells = [line.strip().strip("|").split("|", 2) for line in itertools.takewhile(lambda x: x.startswith("|"), lines)]
  return [(layer.strip(), modules) for layer, modules, _ in cells]


def named(cell: str) -> tuple:
  """(modules, packages) a modules cell names: `a` is the module MaxText.a and `p/a` MaxText.p.a;
  `p/` is the package MaxText.p, all of it; `p/` (`a`, `b`) is its __init__ and the modules
  MaxText.p.a and MaxText.p.b only."""
  modules, packages = set(), set()
  for package, members in re.findall(r"`(\w+)/` \(([^)]*)\)", cell):
    modules |= {f"{PACKAGE}.{package}"} | {f"{PACKAGE}.{package}.{m}" for m in re.findall(r"`(\w+)`", members)}
  for name in re.findall(r"`([\w/]+)`", re.sub(r"`\w+/` \([^)]*\)", "", cell)):
    dotted = f"{PACKAGE}.{name.strip('/').replace('/', '.')}"
    (packages if name.endswith("/") else modules).add(dotted)
  return modules, packages


def layers_of(modules, rows) -> tuple:
  """({module: index of its row in `rows`}, problems): a module in no row or in two, and a name
  in a row that is no module of `modules`."""
  claims = [named(cell) for _, cell in rows]
  problems = [f"{layer}: `{name}` names no module" for (layer, _), (exact, packages) in zip(rows, claims)
              for name in sorted(exact | packages)
              if not any(m == name or m.startswith(name + ".") for m in modules)]
  layer = {PACKAGE: -1}
  for module in sorted(set(modules) - {PACKAGE}):
    found = [i for i, (exact, packages) in enumerate(claims)
             if module in exact or any(module == p or module.startswith(p + ".") for p in packages)]
    if len(found) != 1:
      problems.append(f"{module} is in {len(found)} rows: {[rows[i][0] for i in found]}")
    elif found:
      layer[module] = found[0]
  return layer, problems


def upward_imports(graph: dict, layer: dict) -> list:
  """[(module, imported)] of a {module: imported modules} graph where a module imports one of a
  higher layer ({module: layer index}); a layer may import within itself (cycles are
  test_no_module_imports_itself_back's)."""
  return sorted((m, i) for m, found in graph.items() for i in found if layer[i] > layer[m])


def architecture_table() -> list:
  # Wherever docs/ keeps the architecture page.
  return layer_rows(next((ROOT / "docs").rglob("architecture.md")).read_text())


def test_the_layer_checker_finds_upward_imports():
  rows = layer_rows("text\n\n| layer | modules | job |\n| --- | --- | --- |\n"
                    "| low | `a`, `p/` (`b`) | x |\n| high | `c`, `p/d`, `q/` | y |\n\nmore text\n")
  modules = ["MaxText", "MaxText.a", "MaxText.p", "MaxText.p.b", "MaxText.p.d", "MaxText.c", "MaxText.q.e",
             "MaxText.f"]
  layer, problems = layers_of(modules, rows)
  assert problems == ["MaxText.f is in 0 rows: []"]
  assert layer == {"MaxText": -1, "MaxText.a": 0, "MaxText.p": 0, "MaxText.p.b": 0, "MaxText.c": 1,
                   "MaxText.p.d": 1, "MaxText.q.e": 1}
  graph = {"MaxText": set(), "MaxText.a": {"MaxText.p.b"}, "MaxText.p.b": {"MaxText.p.d"},
           "MaxText.c": {"MaxText.a", "MaxText.q.e"}, "MaxText.q.e": {"MaxText.c"}}
  assert upward_imports(graph, layer) == [("MaxText.p.b", "MaxText.p.d")]
  assert layers_of(["MaxText.a"], rows + [("top", "`a`")])[1] == [
      *(f"low: `MaxText.{n}` names no module" for n in ("p", "p.b")),
      *(f"high: `MaxText.{n}` names no module" for n in ("c", "p.d", "q")), "MaxText.a is in 2 rows: ['low', 'top']"]


def test_every_module_is_in_one_row_of_the_architecture_table():
  problems = layers_of(module_names(), architecture_table())[1]
  assert not problems, "\n".join(problems)


def test_every_module_imports_only_its_layer_and_below():
  rows = architecture_table()
  layer = layers_of(module_names(), rows)[0]
  # A module in no row is the other test's failure.
  graph = {m: found & layer.keys() for m, found in import_graph().items() if m in layer}
  name = lambda m: rows[layer[m]][0] if layer[m] >= 0 else "the package"
  upward = [f"{m} ({name(m)}) imports {i} ({name(i)})" for m, i in upward_imports(graph, layer)]
  assert not upward, "\n".join(upward)


def libraries(modules: dict) -> set:
  """Every non-MaxText module the files of `modules` ({name: file}) import, anywhere in them."""
  return {name for path in modules.values() for name in imports(path, modules) if name.split(".")[0] != "MaxText"}


def test_importing_the_package_changes_nothing_in_the_process():
  """Every product module imported in a fresh interpreter, after the libraries they import: no
  environment variable set, no asyncio class patched, no plotting library loaded. Set-up is the
  entry points' (runtime.setup)."""
  # beam_pipeline needs Apache Beam, which lives apart (.venv/beam) and runs only with a Beam runner.
  modules = {name: path for name, path in module_names().items() if not name.startswith(BENCHMARKS)
             and not name.endswith(("__main__", "beam_pipeline"))}
  script = ("import asyncio, importlib, json, os, sys\n"
            f"for name in {sorted(n for n in libraries(modules) if not n.startswith('matplotlib'))!r}:\n"
            "  try:\n    importlib.import_module(name)\n  except ImportError:\n    pass\n"
            "env = dict(os.environ)\n"
            "loop = dict(vars(asyncio.BaseEventLoop))\n"
                      f"for name in {sorted(modules)!r}:\n  importlib.import_module(name)\n"
            "print(json.dumps({'env': sorted(set(os.environ.items()) ^ set(env.items())),\n"
            "  'asyncio': sorted(k for k, v in vars(asyncio.BaseEventLoop).items() if loop.get(k) is not v),\n"
            "  'new_event_loop': asyncio.new_event_loop.__module__,\n"
            "  'plotting': sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')}))\n")
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={k: v for k, v in os.environ.items() if not k.startswith("TPU_")
                               and k != "ALLOW_MULTIPLE_LIBTPU_LOAD"})
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads(result.stdout.splitlines()[-1]) == {"env": [], "asyncio": [], "new_event_loop": "asyncio.events",
                                                        "plotting": []}


def test_the_train_step_and_loop_name_no_model_feature():
  """What a model adds to its objective reaches the step as terms.Term and objective.Sums: the step
  and the loop never name the features that add them."""
  for name in ("train_step.py", "train.py"):
    text = (ROOT / "MaxText" / name).read_text()
    assert not re.findall(r"expert|router|moe|mtp|multi.token", text, re.IGNORECASE), name
