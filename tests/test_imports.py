"""The package's import graph, read with ast: no import cycle, and no product module importing
the benchmarks. Imports inside functions count: they are cycles all the same, only deferred."""

import ast
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


def imported(path: Path, modules) -> set:
  """The MaxText modules a file imports, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      # `from MaxText import train` imports the module MaxText.train; `from MaxText.train import x` MaxText.train.
      found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
  return found & set(modules)


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
