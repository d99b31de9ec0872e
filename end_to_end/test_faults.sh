#!/usr/bin/env bash
# The fault-injection suite: every row of docs/checkpoints.md's "What survives what" table, each against
# the tiny model, asserting the exit code, one error line and no traceback, nothing written
# where nothing may be, and every good checkpoint still there and restorable. The faults are
# pytest tests (CI runs them with the rest); this runs just them, time-bounded.
# Usage: bash end_to_end/test_faults.sh [extra pytest arguments]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
timeout "${LIMIT_SECONDS:-1800}" "$python" -m pytest -q "$@" \
  tests/test_checkpointing.py tests/test_multiprocess.py \
  "tests/test_train.py::test_a_nonfinite_step_is_not_applied_and_the_next_one_is" \
  tests/test_pyconfig.py tests/test_input_pipeline.py tests/test_tpu_compile.py::test_bad_topologies_are_config_errors
