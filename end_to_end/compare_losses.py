"""python end_to_end/compare_losses.py REFERENCE.jsonl OTHER.jsonl FIRST_STEP LAST_STEP

Exits 0 when OTHER's learning/loss equals REFERENCE's exactly at every step in
[FIRST_STEP, LAST_STEP] (the last line written for a step counts: resumed runs rewrite some).
"""

import json
import sys


def losses(path):
  with open(path) as f:
    return {r["step"]: r["learning/loss"] for r in map(json.loads, f)}


def main(reference, other, first, last):
  want, got = losses(reference), losses(other)
  bad = [s for s in range(int(first), int(last) + 1) if got.get(s) != want.get(s)]
  for step in range(int(first), int(last) + 1):
    print(f"step {step:3d}  reference {want.get(step)}  resumed {got.get(step)}"
          f"{'  MISMATCH' if step in bad else ''}")
  print("losses match exactly" if not bad else f"{len(bad)} steps differ")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
