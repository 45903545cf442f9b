#!/usr/bin/env bash
# Pretrain across many hosts with the same script as one laptop: JAX sharding + jax.distributed.
#
# TPU pod slice (e.g. v5p-64, 8 hosts): run the same command on every host at once; jax.distributed
# discovers the pod by itself.
#   gcloud compute tpus tpu-vm ssh $TPU --worker=all --command "cd flaxchat && BACKEND=tpu bash runs/multihost.sh"
#
# Multi-node GPUs (N nodes x 8 GPUs, one process per node), set on every node:
#   JAX_COORDINATOR_ADDRESS=<node0-ip>:1234 JAX_NUM_PROCESSES=N JAX_PROCESS_ID=<0..N-1> bash runs/multihost.sh
# Under SLURM (srun --ntasks-per-node=1), jax.distributed reads the job's variables itself.
#
# Expect: d26 (~1.6B params with embeddings) at ratio 12 in roughly 3-4 hours on a v5p-64 or 4x8 H100
# (about 6e19 FLOPs at ~40% MFU). Data and the tokenizer must be on every host (or on a shared disk
# pointed to by FLAXCHAT_BASE_DIR); each process reads only its own part of the shards.
set -euo pipefail
cd "$(dirname "$0")/.."

DEPTH=${DEPTH:-26}
FSDP=${FSDP:-8}          # parameters + optimizer state sharded over this many devices (within a host is best)
BACKEND=${BACKEND:-gpu}  # tpu on a TPU slice: every process stops at start-up if JAX is running on anything else
export FLAXCHAT_BASE_DIR=${FLAXCHAT_BASE_DIR:-$HOME/.cache/flaxchat}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}   # GPUs: JAX's default is 0.75
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$FLAXCHAT_BASE_DIR/jax_cache}

# once, on every host (or on the shared disk): data and tokenizer
if [ ! -f "$FLAXCHAT_BASE_DIR/tokenizer/tokenizer.json" ]; then
  python -m scripts.data --source parquet-download --num-shards 240
  python -m scripts.tok_train --vocab-size 32768
fi

python -m scripts.pretrain \
  --depth "$DEPTH" \
  --device-batch-size 16 \
  --fsdp "$FSDP" \
  --expect-backend "$BACKEND" \
  --save-every 1000 \
  --run "${WANDB_RUN:-dummy}" \
  "$@"
