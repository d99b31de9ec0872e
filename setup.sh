#!/usr/bin/env bash
# Creates .venv on Python >= 3.12 and installs the locked versions (requirements.lock), libtpu's
# included, then this package (editable). A rerun with nothing changed only checks a stamp.
#
#   bash setup.sh              # the versions in requirements.lock: what CI tested
#   bash setup.sh --upgrade    # the newest versions requirements.txt allows, written to the
#                              # lock files; then run the suite: .venv/bin/python -m pytest -q tests
#
# The Python: $PYTHON when set, else the newest python3.X (X >= 12) that runs, pyenv's
# installed versions included whether or not one is active.
set -euo pipefail
cd "$(dirname "$0")"
MIN_MINOR=12

usable() {  # the interpreter's minor version if it runs and is Python 3.MIN_MINOR or newer
  "$1" -c "import sys; assert sys.version_info[:2] >= (3, $MIN_MINOR); print(sys.version_info[1])" 2>/dev/null
}

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    usable "$PYTHON" >/dev/null || { echo "setup.sh: PYTHON=$PYTHON is not a Python >= 3.$MIN_MINOR that runs" >&2; exit 2; }
    echo "$PYTHON"
    return
  fi
  local best="" best_minor=0 candidate minor
  for candidate in $(compgen -c python3. | sort -u) "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.*/bin/python3; do
    minor=$(usable "$candidate") || continue
    if [ "$minor" -gt "$best_minor" ]; then best=$candidate best_minor=$minor; fi
  done
  [ -n "$best" ] || { echo "setup.sh: no Python >= 3.$MIN_MINOR found: install one (e.g. pyenv install 3.12) or set PYTHON" >&2; exit 2; }
  echo "$best"
}

python=$(find_python)
want_minor=$(usable "$python")
if [ -e .venv ] && [ "$(usable .venv/bin/python || true)" != "$want_minor" ]; then
  echo "setup.sh: .venv is not on Python 3.$want_minor: rebuilding it" >&2
  rm -rf .venv
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@"; }
quiet_resolver() { grep -v "dependency resolver\|which is incompatible" >&2 || true; }

if [ "${1:-}" = "--upgrade" ]; then
  # Everything from requirements.txt's lower bounds up, into fresh directories, then locked.
  rm -rf .venv/xpk .venv/beam .venv/.installed
  pip install --upgrade -r requirements.txt
  # libtpu, for the installed jax: it runs on TPU VMs, and compiles for TPU slices anywhere.
  pip install "jax[tpu]==$(.venv/bin/python -c 'import jax; print(jax.__version__)')"
  pip install --target .venv/xpk "xpk==1.16.0" 2> >(quiet_resolver)
  pip install --target .venv/beam "apache-beam==2.77.0" 2> >(quiet_resolver)
  header="# Written by 'bash setup.sh --upgrade' on Python 3.$want_minor; 'bash setup.sh' installs exactly these."
  { echo "$header"; pip freeze --exclude-editable; } > requirements.lock
  { echo "$header"; pip freeze --path .venv/xpk; } > requirements-xpk.lock
  { echo "$header"; pip freeze --path .venv/beam; } > requirements-beam.lock
fi

stamp=.venv/.installed
want=$(cat requirements*.lock pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # The XPK command-line tool and Apache Beam (prepare_data runner=...), apart from the venv:
  # they pin older pyyaml, protobuf, pillow and python-dateutil. The tests check
  # end_to_end/launch_xpk.sh against XPK's parser; Beam runs with PYTHONPATH=.venv/beam.
  # The three installs share only pip's cache: run together, they take about the longest one's time.
  pip install --no-deps --upgrade --target .venv/xpk -r requirements-xpk.lock 2> >(quiet_resolver) &
  xpk=$!
  pip install --no-deps --upgrade --target .venv/beam -r requirements-beam.lock 2> >(quiet_resolver) &
  beam=$!
  pip install -r requirements.lock
  wait "$xpk"
  wait "$beam"
  pip install --no-deps -e .
  echo "$want" > "$stamp"
fi
