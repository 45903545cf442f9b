#!/usr/bin/env bash
# The whole pipeline on a CPU box (no GPU), offline: synthetic stories, a depth-4 model, SFT, RL, eval.
# Expect ~1 hour on 2 cores (most of it pretraining); more cores go proportionally faster.
# For a much shorter version use the laptop demo: python -m scripts.run_tinystories
set -euo pipefail
cd "$(dirname "$0")/.."
export FLAXCHAT_BASE_DIR=${FLAXCHAT_BASE_DIR:-$HOME/.cache/flaxchat/cpu}

python -m scripts.data --source synthetic-stories --num-shards 8
python -m scripts.tok_train --vocab-size 4096
python -m scripts.tok_eval
python -m tasks.offline --fetch

python -m scripts.pretrain --depth 4 --max-seq-len 512 --device-batch-size 16 --total-batch-size 16384 \
    --num-iterations 1500 --no-hparam-scaling --warmup-steps 20 --eval-every 250 --eval-tokens 262144 \
    --sample-every 500 --save-every 500
python -m scripts.eval --model base --tasks bpb,core --max-per-task 100

python -m scripts.sft --mixture offline --num-iterations 600 --eval-every 200 --eval-tokens 262144 --chatcore-every 300
python -m scripts.eval --model sft --tasks chat --max-per-task 100
python -m scripts.rl --config configs/rl_cpu.yaml
python -m scripts.eval --model rl --tasks gsm8k --max-per-task 100

python -c "from flaxchat.eval.report import Report; print(Report().generate())"
