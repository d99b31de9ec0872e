#!/usr/bin/env bash
# Multi-host GPU training under SLURM: one process per node, each driving all GPUs of its node.
# Submit with: sbatch --nodes=4 end_to_end/launch_slurm.sh [extra key=value ...]
#SBATCH --job-name=maxtext
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#
# Read from the environment:
#   REPO            checkout on a filesystem every node sees, with .venv made by setup.sh (default: cwd)
#   OUTPUT_DIR      shared directory for checkpoints and metrics (default: $REPO/outputs)
#   RUN_NAME        run name; resubmitting the same name resumes it (default: slurm-$SLURM_JOB_ID)
#   GPUS_PER_NODE   devices per process (default: 8)
#   SLURM_NNODES    set by SLURM: FSDP spans nodes over the network (dcn), devices within each node (ici)
# jax.distributed finds its coordinator, process count and process id from SLURM's variables.
set -euo pipefail
REPO=${REPO:-$PWD}
OUTPUT_DIR=${OUTPUT_DIR:-$REPO/outputs}
RUN_NAME=${RUN_NAME:-slurm-$SLURM_JOB_ID}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
srun --kill-on-bad-exit=1 "$REPO/.venv/bin/python" -m MaxText.train "$REPO/configs/base.yml" \
  model_name=llama3-8b run_name="$RUN_NAME" base_output_directory="$OUTPUT_DIR" \
  dcn_fsdp_parallelism="$SLURM_NNODES" ici_fsdp_parallelism="$GPUS_PER_NODE" \
  per_device_batch_size=1 num_vocab_tiling=8 remat_policy=full "$@"
