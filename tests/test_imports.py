"""The package's import graph, read with ast: no import cycle, and no product module importing
the benchmarks. Imports inside functions count: they are cycles all the same, only deferred."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT

BENCHMARKS = "MaxText.benchmarks"


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
  assert {"MaxText.errors", "MaxText.sharding", "MaxText.losses"} <= graph["MaxText.pyconfig"]


def test_no_module_imports_itself_back():
  cycle = find_cycle(import_graph())
  assert not cycle, " -> ".join(cycle)


def test_only_benchmarks_import_benchmarks():
  offenders = {name: sorted(m for m in imports if m.startswith(BENCHMARKS))
               for name, imports in import_graph().items() if not name.startswith(BENCHMARKS)}
  assert not {name: found for name, found in offenders.items() if found}


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
