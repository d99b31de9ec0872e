#!/usr/bin/env bash
# The fault-injection suite: every row of docs/guides/checkpoints.md's "What survives what" table, each against
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
  tests/test_pyconfig.py tests/test_input_pipeline.py tests/test_tpu_compile.py::test_bad_topologies_are_config_errors \
  tests/test_tpu_compile.py::test_slices_joined_by_no_dcn_axis_are_a_config_error \
  tests/test_plan.py::test_the_smallest_candidate_is_named_with_its_size_however_small \
  tests/test_prepare_data.py::test_a_missing_or_damaged_shard_is_a_config_error_naming_it \
  tests/test_prepare_data.py::test_one_writer_at_a_time_and_a_prepared_corpus_is_replaced_only_when_asked \
  tests/test_prepare_data.py::test_a_killed_writers_leftovers_are_removed_and_paths_in_the_way_are_one_line \
  tests/test_prepare_data.py::test_sigterm_stops_prepare_data_with_one_line_and_leaves_nothing \
  tests/test_hf_checkpoint.py::test_an_imported_checkpoint_has_checksums_and_a_flipped_bit_is_not_exported \
  tests/test_hf_checkpoint.py::test_export_removes_only_its_own_dead_leftovers_and_paths_in_the_way_are_one_line \
  tests/test_train.py::test_train_compile_reports_the_train_step_memory tests/test_run_faults.py
