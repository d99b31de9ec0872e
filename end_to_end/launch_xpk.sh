#!/usr/bin/env bash
# TPU pod training on GKE through XPK: one process per TPU host, NUM_SLICES slices joined
# over the data-center network. First compiles the very train step for TPU_TYPE x NUM_SLICES
# here (libtpu compiles without TPUs) and launches nothing if it fails or does not fit.
# Usage: bash end_to_end/launch_xpk.sh [extra key=value ...]
#
# Read from the environment (the first four are required):
#   CLUSTER       XPK cluster name
#   WORKLOAD      workload name (lower case, unique per submission)
#   TPU_TYPE      slice type, e.g. v5p-256
#   DOCKER_IMAGE  image with this repository at /app and its requirements installed
#   NUM_SLICES    number of slices (default: 1); data parallelism spans slices (dcn),
#                 FSDP the chips within a slice (ici)
#   OUTPUT_DIR    checkpoint and metrics directory that every host mounts, e.g. a Filestore or
#                 GCS FUSE mount (paths are local-filesystem paths; gs:// URLs are not supported)
#                 (default: /tmp/outputs, host-local: fine for a smoke test, lost afterwards)
#   RUN_NAME      run name; resubmitting the same name resumes it (default: $WORKLOAD)
#   MODEL         model_name (default: llama3-8b)
#   PYTHON        python for the compile check (default: .venv/bin/python, made by setup.sh)
#   DRY_RUN       1: print the xpk command instead of running it
set -euo pipefail
cd "$(dirname "$0")/.."
: "${CLUSTER:?}" "${WORKLOAD:?}" "${TPU_TYPE:?}" "${DOCKER_IMAGE:?}"
NUM_SLICES=${NUM_SLICES:-1}
OUTPUT_DIR=${OUTPUT_DIR:-/tmp/outputs}
RUN_NAME=${RUN_NAME:-$WORKLOAD}
PYTHON=${PYTHON:-.venv/bin/python}
args=(model_name="${MODEL:-llama3-8b}" run_name="$RUN_NAME" base_output_directory="$OUTPUT_DIR"
      dcn_data_parallelism="$NUM_SLICES" ici_fsdp_parallelism=-1 per_device_batch_size=1
      num_vocab_tiling=8 remat_policy=full "$@")
if ! "$PYTHON" -m MaxText.train_compile configs/base.yml "${args[@]}" \
    compile_topology="$TPU_TYPE" compile_topology_num_slices="$NUM_SLICES" >&2; then
  echo "launch_xpk: not launched: the train step does not compile or fit on $NUM_SLICES x $TPU_TYPE (above)" >&2
  exit 1
fi
command=(xpk workload create --cluster "$CLUSTER" --workload "$WORKLOAD" --tpu-type "$TPU_TYPE"
         --num-slices "$NUM_SLICES" --docker-image "$DOCKER_IMAGE"
         --command "cd /app && python3 -m MaxText.train configs/base.yml ${args[*]@Q}")
if [ "${DRY_RUN:-0}" = 1 ]; then
  echo "${command[*]@Q}"
else
  "${command[@]}"
fi
