"""Reports of measured or predicted results, for the planner and the benchmarks alike: Pareto
fronts, Markdown tables, byte counts, and a result saved as .md, .json and .png."""

import json
import os

import numpy as np


def pareto_front(points: dict) -> list:
  """Names of the points no other point beats in both time and memory, fastest first."""
  front = [n for n, (t, m) in points.items()
           if not any(t2 <= t and m2 <= m and (t2, m2) != (t, m) for t2, m2 in points.values())]
  return sorted(front, key=lambda n: points[n][0])


def markdown_table(header: list, rows: list) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
  return "\n".join(lines)


def save(output_dir: str, name: str, markdown: str, data: dict, figure) -> None:
  os.makedirs(output_dir, exist_ok=True)
  with open(os.path.join(output_dir, f"{name}.md"), "w") as f:
    f.write(markdown + "\n")
  with open(os.path.join(output_dir, f"{name}.json"), "w") as f:
    json.dump(data, f, indent=2, default=lambda x: x.item() if isinstance(x, np.generic) else str(x))
  figure.savefig(os.path.join(output_dir, f"{name}.png"), dpi=120, bbox_inches="tight")
  print(f"wrote {output_dir}/{name}.md, .json and .png")


def mib(num_bytes: int) -> str:
  return f"{num_bytes / 2**20:,.1f}"


def gib(num_bytes: int) -> str:
  return f"{num_bytes / 2**30:,.2f}"
