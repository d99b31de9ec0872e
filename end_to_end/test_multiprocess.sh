#!/usr/bin/env bash
# Multi-host training on one machine: 2 processes x 4 CPU devices talking over 127.0.0.1
# through jax.distributed must give the losses of 1 process x 8 devices on the same mesh
# (data=2 across processes, fsdp=4 within each), including across a checkpoint that both
# processes save and restore, and across a preemption: SIGTERM sent to process 1 alone stops
# both processes at the same step, and both save it. That checkpoint also resumes on another
# number of hosts: 1 process x 8 devices takes it on to the same losses.
# Usage: bash end_to_end/test_multiprocess.sh [OUTPUT_DIR] [extra key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}; shift || true
python=${PYTHON:-.venv/bin/python}
limit=${LIMIT_SECONDS:-300}
common=(configs/base.yml "base_output_directory=$out" steps=6 learning_rate_schedule_steps=6
        eval_interval=0 log_period=1 base_num_decoder_layers=2 per_device_batch_size=1
        max_target_length=64 vocab_size=512 checkpoint_period=3 "$@")
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

echo "== 2 processes x 4 devices: steps 1-3, checkpoint at step 3"
start_two steps=3
wait_two 0
echo "== 2 processes x 4 devices: restore step 3; SIGTERM to process 1 alone before step 4"
start_two
# The handler is installed before the restore is logged, and compiling the step takes seconds.
until grep -q "resuming from checkpoint step 3" "$out/process_1.log" || ! kill -0 "${pids[1]}"; do sleep 0.05; done
kill -TERM "${pids[1]}"
wait_two 143
# JAX's preemption sync picks the step; both processes must have stopped and saved at it.
stopped=$(grep -ho "stopped: SIGTERM at step [0-9]*: checkpoint [0-9]* saved" "$out"/process_*.log | sort -u)
echo "$stopped"
[ "$(cat "$out"/process_*.log | grep -c "stopped: SIGTERM")" = 2 ] && [ "$(echo "$stopped" | wc -l)" = 1 ]
step=$(echo "$stopped" | sed 's/.*at step \([0-9]*\).*/\1/')
echo "== 1 process x 8 devices (another number of hosts): restore a copy of step $step, on to step 6"
cp -r "$out/multi" "$out/rehosted"
cp "$out/multi.jsonl" "$out/rehosted.jsonl"
JAX_NUM_CPU_DEVICES=8 timeout "$limit" "$python" -m MaxText.train "${common[@]}" run_name=rehosted \
  ici_data_parallelism=2 ici_fsdp_parallelism=4 metrics_file="$out/rehosted.jsonl" > "$out/rehosted.log" 2>&1 ||
  { tail -n 20 "$out/rehosted.log"; exit 1; }
grep -q "resuming from checkpoint step $step" "$out/rehosted.log"
"$python" end_to_end/compare_losses.py "$out/single.jsonl" "$out/rehosted.jsonl" 1 6 1e-5
echo "== 2 processes x 4 devices: restore step $step, on to step 6"
start_two
wait_two 0
grep -q "resuming from checkpoint step $step" "$out/process_1.log"
"$python" end_to_end/compare_losses.py "$out/single.jsonl" "$out/multi.jsonl" 1 6 1e-5
echo "PASS: 2 processes x 4 devices reproduce 1 process x 8 devices, through a checkpoint and a SIGTERM;" \
  "their checkpoint resumes on 1 process"
