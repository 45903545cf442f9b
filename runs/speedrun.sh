#!/usr/bin/env bash
# The speedrun: a GPT-2-grade chat model on one 8-GPU node (H100/H200), data to chat UI, like nanochat's.
# Expect ~3-4 hours on 8xH100 (d24 at ratio 8: ~1.4B params with embeddings, ~6e19 FLOPs at ~40% MFU).
#   bash runs/speedrun.sh                 # WANDB_RUN=name to log to wandb (pip install wandb)
set -euo pipefail
cd "$(dirname "$0")/.."
export FLAXCHAT_BASE_DIR=${FLAXCHAT_BASE_DIR:-$HOME/.cache/flaxchat}
WANDB_RUN=${WANDB_RUN:-dummy}
# JAX takes 75% of GPU memory by default; give it nearly all (override by exporting your own value).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}
# Compiled programs are kept across runs: a restarted or resumed stage skips minutes of compilation.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$FLAXCHAT_BASE_DIR/jax_cache}
GPU="--expect-backend gpu"   # stop at once if JAX fell back to the CPU (a broken CUDA install)

pip install -e ".[gpu]"

# data + tokenizer (the bulk of the shards download while the tokenizer trains)
python -m scripts.data --source parquet-download --num-shards 8
python -m scripts.data --source parquet-download --num-shards 170 &
DOWNLOAD=$!
python -m scripts.tok_train --vocab-size 32768
python -m scripts.tok_eval
python -m tasks.offline --fetch || true   # offline eval packs (the hub is used when reachable)
wait $DOWNLOAD

# pretraining: one process drives all 8 GPUs (data parallel; add --fsdp 8 for larger depths)
python -m scripts.pretrain --depth 24 --target-param-data-ratio 8 --device-batch-size 16 --run "$WANDB_RUN" $GPU
python -m scripts.eval --model base --tasks core,bpb

# chat: SFT, (optional) RL on GSM8K, evaluation
python -m scripts.sft --run "$WANDB_RUN" $GPU
python -m scripts.eval --model sft --tasks chat
# python -m scripts.rl --run "$WANDB_RUN" $GPU && python -m scripts.eval --model rl --tasks gsm8k

python -c "from flaxchat.eval.report import Report; print(Report().generate())"
echo "chat: python -m scripts.chat_web -i sft   (or scripts.chat_cli)"
