#!/usr/bin/env bash
# Creates .venv and installs requirements.txt, libtpu and this package (editable).
# A rerun with unchanged requirements does nothing but check a stamp.
set -euo pipefail
cd "$(dirname "$0")"
[ -x .venv/bin/python ] || python3 -m venv .venv
stamp=.venv/.installed
want=$(cat requirements.txt pyproject.toml setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt
  # libtpu, for the installed jax: it runs on TPU VMs, and compiles for TPU slices anywhere
  # (train_compile compile_topology=...). Nothing else needs it.
  jax_version=$(.venv/bin/python -c "import jax; print(jax.__version__)")
  .venv/bin/python -m pip install -q --disable-pip-version-check "jax[tpu]==$jax_version"
  # The XPK command-line tool, apart from the venv (it pins older pyyaml and friends): the tests
  # check end_to_end/launch_xpk.sh's command against its argument parser.
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade --target .venv/xpk "xpk==1.16.0" \
    2> >(grep -v "dependency resolver\|which is incompatible" >&2)
  # Apache Beam (prepare_data runner=...), apart for the same reason: it pins older protobuf,
  # pillow and python-dateutil. Run it with PYTHONPATH=.venv/beam.
  .venv/bin/python -m pip install -q --disable-pip-version-check --upgrade --target .venv/beam "apache-beam==2.77.0" \
    2> >(grep -v "dependency resolver\|which is incompatible" >&2)
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
  echo "$want" > "$stamp"
fi
