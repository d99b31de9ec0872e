#!/usr/bin/env bash
# TPU pod training on GKE through XPK: one process per TPU host, NUM_SLICES slices joined
# over the data-center network.
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
set -euo pipefail
: "${CLUSTER:?}" "${WORKLOAD:?}" "${TPU_TYPE:?}" "${DOCKER_IMAGE:?}"
NUM_SLICES=${NUM_SLICES:-1}
OUTPUT_DIR=${OUTPUT_DIR:-/tmp/outputs}
RUN_NAME=${RUN_NAME:-$WORKLOAD}
xpk workload create --cluster "$CLUSTER" --workload "$WORKLOAD" --tpu-type "$TPU_TYPE" \
  --num-slices "$NUM_SLICES" --docker-image "$DOCKER_IMAGE" \
  --command "cd /app && python3 -m MaxText.train configs/base.yml model_name=llama3-8b \
    run_name=$RUN_NAME base_output_directory=$OUTPUT_DIR dtype=bfloat16 \
    dcn_data_parallelism=$NUM_SLICES ici_fsdp_parallelism=-1 per_device_batch_size=1 \
    num_vocab_tiling=8 remat_policy=full $*"
