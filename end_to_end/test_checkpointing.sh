#!/usr/bin/env bash
# Train, interrupt, resume: the resumed losses must equal an uninterrupted run's exactly.
#   1. a 20-step reference run;
#   2. the same run stopped with steps=10, then rerun with steps=20;
#   3. the same run killed with SIGKILL at a random moment, then rerun;
#   4. the same run sent SIGTERM (preemption) at a random moment: it saves the step it is on,
#      exits with code 143, and the rerun resumes from that step.
# Usage: bash end_to_end/test_checkpointing.sh [OUTPUT_DIR] [extra key=value ...]
# With dataset_type=grain (and no grain_train_files) it first prepares the default corpus into
# OUTPUT_DIR/shards with MaxText.prepare_data and streams it with grain's worker processes.
# learning_rate_schedule_steps is pinned so that the run stopped at 10 follows the 20-step
# schedule; checkpoint_period=2 makes the kill land between, or during, saves.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}; shift || true
python=${PYTHON:-.venv/bin/python}
if [[ " $* " == *" dataset_type=grain "* && " $* " != *" grain_train_files="* ]]; then
  echo "== preparing the default corpus as grain shards"
  "$python" -m MaxText.prepare_data configs/base.yml tokenizer_type=byte "output_path=$out/shards" num_train_shards=4
  set -- "$@" "grain_train_files=$out/shards/train-*" "grain_eval_files=$out/shards/eval-*"
fi
common=(configs/base.yml "base_output_directory=$out" steps=20 learning_rate_schedule_steps=20
        checkpoint_period=2 eval_interval=0 log_period=5 base_num_decoder_layers=2
        per_device_batch_size=4 max_target_length=128 "$@")
pid=
trap '[ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true' EXIT

echo "== reference: 20 uninterrupted steps"
"$python" -m MaxText.train "${common[@]}" run_name=reference metrics_file="$out/reference.jsonl"

echo "== stopped after step 10, then resumed"
"$python" -m MaxText.train "${common[@]}" run_name=stopped steps=10 metrics_file="$out/stopped.jsonl"
"$python" -m MaxText.train "${common[@]}" run_name=stopped metrics_file="$out/stopped.jsonl"
"$python" end_to_end/compare_losses.py "$out/reference.jsonl" "$out/stopped.jsonl" 11 20

echo "== killed with SIGKILL at a random moment, then resumed"
"$python" -m MaxText.train "${common[@]}" run_name=killed metrics_file="$out/killed.jsonl" &
pid=$!
target=$((RANDOM % 12 + 4))  # kill once this many steps are logged (4..15)
while kill -0 "$pid" 2>/dev/null && [ "$(cat "$out/killed.jsonl" 2>/dev/null | wc -l)" -lt "$target" ]; do
  sleep 0.$((RANDOM % 10))
done
kill -9 "$pid" 2>/dev/null || true
wait "$pid" 2>/dev/null || true
pid=
echo "killed after $(wc -l < "$out/killed.jsonl") logged steps"
"$python" -m MaxText.train "${common[@]}" run_name=killed metrics_file="$out/killed.jsonl"
"$python" end_to_end/compare_losses.py "$out/reference.jsonl" "$out/killed.jsonl" 1 20

echo "== sent SIGTERM at a random moment, then resumed"
"$python" -m MaxText.train "${common[@]}" run_name=preempted metrics_file="$out/preempted.jsonl" &
pid=$!
target=$((RANDOM % 12 + 4))
while kill -0 "$pid" 2>/dev/null && [ "$(cat "$out/preempted.jsonl" 2>/dev/null | wc -l)" -lt "$target" ]; do
  sleep 0.$((RANDOM % 10))
done
kill -TERM "$pid"
status=0; wait "$pid" || status=$?
pid=
[ "$status" = 143 ] || { echo "FAIL: exit code $status after SIGTERM, expected 143"; exit 1; }
echo "preempted after $(wc -l < "$out/preempted.jsonl") logged steps"
"$python" -m MaxText.train "${common[@]}" run_name=preempted metrics_file="$out/preempted.jsonl"
"$python" end_to_end/compare_losses.py "$out/reference.jsonl" "$out/preempted.jsonl" 1 20
echo "PASS: resumed runs reproduce the uninterrupted run exactly"
