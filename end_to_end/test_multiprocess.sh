#!/usr/bin/env bash
# Multi-host training on one machine, elastic: 2 processes x 4 CPU devices talking over
# 127.0.0.1 through jax.distributed must give the losses of 1 process x 8 devices on the same
# mesh (data=2 across processes, fsdp=4 within each), on text streamed from parquet files as two
# streams (grain_stream_count=2), including across a checkpoint that both processes save and
# restore, and across a preemption: SIGTERM sent to process 1 alone stops both processes at the
# same step, and both save it. That checkpoint resumes on what would be left of the two hosts
# after one is lost: 1 process x 4 devices, the same per_device_batch_size, each step
# accumulating two microbatches of the run's global batch and reading both streams, on to the
# same losses.
# Usage: bash end_to_end/test_multiprocess.sh [OUTPUT_DIR] [extra key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}; shift || true
python=${PYTHON:-.venv/bin/python}
limit=${LIMIT_SECONDS:-300}
# Shakespeare's plays as parquet files of paragraphs, four files.
"$python" - "$out/parquet" <<'PY'
import pathlib, re, sys
import pyarrow, pyarrow.parquet
from MaxText.input_pipeline import corpus
paragraphs = [p for path in corpus.files("") for p in re.split(r"\n\n+", corpus.strip_markdown(open(path).read()))]
out = pathlib.Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
for f in range(4):
  pyarrow.parquet.write_table(pyarrow.table({"text": paragraphs[f::4]}), out / f"{f}.parquet")
PY
common=(configs/base.yml "base_output_directory=$out" steps=8 learning_rate_schedule_steps=8
        eval_interval=0 log_period=1 base_num_decoder_layers=2 per_device_batch_size=1
        max_target_length=64 vocab_size=320 tokenizer_type=byte checkpoint_period=4 dataset_type=grain
        grain_file_type=parquet "grain_train_files=$out/parquet/*.parquet" grain_stream_count=2 "$@")
pids=()
stop() { for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done; }
trap stop EXIT

echo "== 1 process x 8 devices"
JAX_NUM_CPU_DEVICES=8 timeout "$limit" "$python" -m MaxText.train "${common[@]}" run_name=single \
  ici_data_parallelism=2 ici_fsdp_parallelism=4 enable_checkpointing=false metrics_file="$out/single.jsonl"

# Both processes in the background; wait_two EXPECTED waits for both and fails unless each
# exits with EXPECTED.
start_two() {
  local port=$((20000 + RANDOM % 20000))
  pids=()
  for id in 0 1; do
    JAX_NUM_CPU_DEVICES=4 timeout "$limit" "$python" -m MaxText.train "${common[@]}" run_name=multi \
      dcn_data_parallelism=2 ici_fsdp_parallelism=4 metrics_file="$out/multi.jsonl" \
      jax_distributed_coordinator=127.0.0.1:$port jax_num_processes=2 jax_process_id=$id "$@" \
      > "$out/process_$id.log" 2>&1 &
    pids+=($!)
  done
}
wait_two() {
  local failed=0 status
  for pid in "${pids[@]}"; do
    status=0; wait "$pid" || status=$?
    [ "$status" = "$1" ] || { echo "a process exited with $status, expected $1"; failed=1; }
  done
  if [ "$failed" != 0 ]; then tail -n 20 "$out"/process_*.log; return 1; fi
}

echo "== 2 processes x 4 devices: steps 1-4, checkpoint at step 4"
start_two steps=4
wait_two 0
echo "== 2 processes x 4 devices: restore step 4; SIGTERM to process 1 alone before step 5"
start_two
# The handler is installed before the restore is logged, and compiling the step takes seconds.
until grep -q "resuming from checkpoint step 4" "$out/process_1.log" || ! kill -0 "${pids[1]}"; do sleep 0.05; done
kill -TERM "${pids[1]}"
wait_two 143
# JAX's preemption sync picks the step; both processes must have stopped and saved at it.
stopped=$(grep -ho "stopped: SIGTERM at step [0-9]*: checkpoint [0-9]* saved" "$out"/process_*.log | sort -u)
echo "$stopped"
[ "$(cat "$out"/process_*.log | grep -c "stopped: SIGTERM")" = 2 ] && [ "$(echo "$stopped" | wc -l)" = 1 ]
step=$(echo "$stopped" | sed 's/.*at step \([0-9]*\).*/\1/')
echo "== 1 process x 4 devices (one host lost): restore step $step, on to step 8"
JAX_NUM_CPU_DEVICES=4 timeout "$limit" "$python" -m MaxText.train "${common[@]}" run_name=multi \
  ici_fsdp_parallelism=4 metrics_file="$out/multi.jsonl" > "$out/survivor.log" 2>&1 ||
  { tail -n 20 "$out/survivor.log"; exit 1; }
grep -q "resuming from checkpoint step $step" "$out/survivor.log"
grep -q "each step takes 2 microbatches" "$out/survivor.log"
"$python" end_to_end/compare_losses.py "$out/single.jsonl" "$out/multi.jsonl" 1 8 1e-5
echo "PASS: 2 processes x 4 devices reproduce 1 process x 8 devices, through a checkpoint and a SIGTERM;" \
  "their checkpoint resumes on 1 process x 4 devices"
