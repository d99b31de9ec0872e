#!/usr/bin/env bash
# Creates .venv and installs requirements.txt plus this package (editable).
# A rerun with unchanged requirements does nothing but check a stamp.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.installed
want=$(cat requirements.txt pyproject.toml | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi
