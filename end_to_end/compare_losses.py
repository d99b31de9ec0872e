"""python end_to_end/compare_losses.py REFERENCE.jsonl OTHER.jsonl FIRST_STEP LAST_STEP [RTOL]

Exits 0 when OTHER's learning/loss equals REFERENCE's at every step in [FIRST_STEP, LAST_STEP]:
exactly, or within relative tolerance RTOL when given (the last line written for a step
counts: resumed runs rewrite some).
"""

import json
import sys


def losses(path):
  with open(path) as f:
    return {r["step"]: r["learning/loss"] for r in map(json.loads, f)}


def close(a, b, rtol):
  return a is not None and b is not None and (a == b if rtol == 0 else abs(a - b) <= rtol * abs(b))


def main(reference, other, first, last, rtol="0"):
  want, got = losses(reference), losses(other)
  bad = [s for s in range(int(first), int(last) + 1) if not close(got.get(s), want.get(s), float(rtol))]
  for step in range(int(first), int(last) + 1):
    print(f"step {step:3d}  reference {want.get(step)}  compared {got.get(step)}"
          f"{'  MISMATCH' if step in bad else ''}")
  match = "exactly" if float(rtol) == 0 else f"within rtol {rtol}"
  print(f"losses match {match}" if not bad else f"{len(bad)} steps differ")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
