"""Reinforcement learning on math word problems (nanochat's chat_rl, in JAX).

nanochat calls it "GRPO" in quotes; it is closer to plain REINFORCE:
  - on-policy, so no PPO ratio or clipping, and no KL term to a reference model;
  - the advantage of a sample is its reward minus the mean reward of its group (the samples of one question),
    not a z-score;
  - the policy-gradient loss is normalised per token (DAPO), not per sequence.

CPU / laptop (generated arithmetic problems, pass@k on a held-out generated set):
    python -m scripts.rl --config configs/rl_cpu.yaml
    python -m scripts.rl --task arithmetic --num-steps 30 --examples-per-step 16 --num-samples 16 \
        --device-batch-size 16 --max-new-tokens 160 --init-lr-frac 0.1 --eval-every 15 --eval-samples 8
One GPU (GSM8K train when the Hugging Face hub is reachable, else generated problems):
    python -m scripts.rl
Many devices: rollouts are sampled on this process, the policy-gradient step is split over every device.

Rewards: 1 when the number after "####" in the sampled answer equals the reference answer, else 0. Rollouts use
the Engine, so calculator tool calls run while sampling; tool outputs and the prompt are never trained on.
Outputs: $FLAXCHAT_BASE_DIR/chatrl_checkpoints/<tag>/ with checkpoints (model only), metrics.jsonl and rl.png.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat import sharding
from flaxchat.common import compute_dtype, is_main_process, parse_args, print0, progress_bar
from flaxchat.eval.chat import evaluate_pass_at_k, sample_groups
from flaxchat.eval.report import metrics_logger, plot_rl, read_jsonl, restart_metrics
from flaxchat.generate.engine import Engine
from flaxchat.generate.scheduler import auto_slots
from flaxchat.train.checkpoint import (
    Checkpointer,
    checkpoint_dir,
    find_model_tag,
    git_commit,
    load_model,
    model_tag_arg,
)
from flaxchat.train.flags import add_batch_flags, add_dtype_flag, add_optimizer_flags, add_run_flag, optimizer_lrs
from flaxchat.train.optim import build_optimizer
from flaxchat.train.rl import group_advantages, rl_step, rollout_batches
from tasks.common import hub_reachable
from tasks.gsm8k import GSM8K
from tasks.synthetic_chat import ArithmeticProblems

# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="Reinforcement learning on math word problems (nanochat's chat_rl).")
    add_run_flag(p)
    p.add_argument("--source", type=str, default="sft", choices=["sft", "rl"], help="checkpoint phase to start from")
    p.add_argument(
        "--model-tag",
        type=model_tag_arg,
        default=None,
        help="checkpoint tag, also the output tag (default: the largest)",
    )
    p.add_argument("--model-step", type=int, default=None, help="checkpoint step (default: the latest)")
    add_dtype_flag(p)
    # task
    p.add_argument(
        "--task",
        type=str,
        default="auto",
        choices=["auto", "gsm8k", "arithmetic"],
        help="gsm8k (train split from the hub) or generated arithmetic problems; auto = gsm8k if the hub is reachable",
    )
    p.add_argument("--train-size", type=int, default=8000, help="arithmetic: number of generated training problems")
    p.add_argument("--eval-size", type=int, default=400, help="arithmetic: number of held-out generated problems")
    p.add_argument("--seed", type=int, default=0, help="arithmetic: generator seed")
    # horizon
    p.add_argument("--num-epochs", type=int, default=1, help="epochs over the training problems")
    p.add_argument("--num-steps", type=int, default=-1, help="optimizer steps (-1 = from --num-epochs)")
    # batch sizes / sampling
    add_batch_flags(
        p,
        device_batch_size=8,
        device_help="rollouts per training forward pass (micro-batch), padded to their own longest; a "
        "micro-batch whose advantages are all zero runs no pass",
    )
    p.add_argument(
        "--sample-rows",
        type=int,
        default=0,
        help="most rollouts (KV-cache rows) sampled at once, whole groups of --num-samples; several "
        "questions share one batch (0 = auto: every rollout of a step, or as many as have their KV "
        "cache in a quarter of the free memory; at most 16 on a CPU). Also bounds the pass@k "
        "eval's batches",
    )
    p.add_argument("--examples-per-step", type=int, default=16, help="questions per optimizer step")
    p.add_argument("--num-samples", type=int, default=16, help="sampled answers per question (the group)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per sampled answer")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of rollouts")
    p.add_argument("--top-k", type=int, default=50, help="top-k sampling of rollouts (0 = off)")
    # optimisation
    add_optimizer_flags(p, embedding_lr=0.2, unembedding_lr=0.004, matrix_lr=0.02, weight_decay=0.0, init_lr_frac=0.05)
    # evaluation / checkpoints
    p.add_argument("--eval-every", type=int, default=60, help="pass@k every N steps and at the end")
    p.add_argument("--eval-examples", type=int, default=400, help="held-out problems per pass@k evaluation")
    p.add_argument("--eval-samples", type=int, default=-1, help="k of pass@k (-1 = --device-batch-size)")
    p.add_argument("--eval-temperature", type=float, default=1.0, help="sampling temperature of the pass@k eval")
    p.add_argument(
        "--eval-greedy",
        type=int,
        default=0,
        choices=[0, 1],
        help="also report greedy accuracy (temperature 0) in each eval",
    )
    p.add_argument("--save-every", type=int, default=60, help="checkpoint every N steps and at the end")
    # mesh
    sharding.add_mesh_flags(p)
    return p


def check_args(parser, args):
    if args.sample_rows < 0:
        parser.error(f"--sample-rows must be 0 (auto) or positive, got {args.sample_rows}")
    for name in (
        "device_batch_size",
        "examples_per_step",
        "num_samples",
        "max_new_tokens",
        "train_size",
        "eval_size",
        "num_epochs",
        "eval_examples",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.num_samples % args.device_batch_size:
        parser.error(
            f"--num-samples {args.num_samples} must be a multiple of --device-batch-size {args.device_batch_size}"
        )
    if args.temperature < 0 or args.eval_temperature < 0:
        parser.error("temperatures must be >= 0")
    if args.num_samples < 2:
        parser.error("--num-samples must be at least 2: advantages compare the samples of one question")


# -----------------------------------------------------------------------------
# Tasks, rollouts, evaluation


def build_tasks(args):
    """(train task, eval task, which): GSM8K train/test from the hub, or generated train/held-out problems."""
    which = args.task if args.task != "auto" else ("gsm8k" if hub_reachable() else "arithmetic")
    if which == "gsm8k":
        # as nanochat: the test split is only ever evaluated on, never trained on
        return GSM8K("main", "train", source="hub"), GSM8K("main", "test", source="hub"), which
    return (
        ArithmeticProblems(args.train_size, "train", args.seed),
        ArithmeticProblems(args.eval_size, "val", args.seed),
        which,
    )


CPU_SAMPLE_ROWS = 16  # auto --sample-rows on a CPU. Past about this many rows a CPU's decode step takes longer
# in proportion to its rows (the cores are already busy), while a wider batch waits longer for its longest reply:
# sampling more rollouts at once makes a step slower there, not faster


def rollout_rows(model, args) -> int:
    """Rollouts sampled at once: --sample-rows, or (auto) every rollout of a step when their KV cache fits in a
    quarter of the free memory, else the largest power of two that does; on a CPU at most CPU_SAMPLE_ROWS."""
    total = args.examples_per_step * args.num_samples
    most = 1 << (total - 1).bit_length()
    if jax.default_backend() == "cpu":
        most = min(most, CPU_SAMPLE_ROWS)
    return args.sample_rows or auto_slots(model, most=most)[0]


def rollouts(engine, tokenizer, task, questions, step, args, rows):
    """--num-samples answers to each of `questions` (indices into task), sampled `rows` at a time with the Engine:
    (sequences, masks, rewards, advantages), one entry per rollout, question by question. Seeds follow the step and
    the question, so a rerun samples the same rollouts."""
    sequences, masks, rewards, advantages = [], [], [], []
    sampling = dict(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
    seeds = [hash((step, i)) & 0x7FFFFFFF for i in questions]
    conversations = [task[i] for i in questions]
    for seqs, ms, rs in sample_groups(
        engine, tokenizer, task, conversations, seeds, args.num_samples, rows, **sampling
    ):
        sequences += seqs
        masks += ms
        rewards += rs
        advantages += list(group_advantages(rs))
    return sequences, masks, rewards, advantages


def evaluate(engine, tokenizer, task, args, k, rows) -> dict:
    """pass@1..k over --eval-examples held-out problems (and greedy@1 with --eval-greedy 1)."""
    result = evaluate_pass_at_k(
        engine,
        tokenizer,
        task,
        args.eval_examples,
        k,
        args.max_new_tokens,
        args.eval_temperature,
        args.top_k or None,
        seed=10_000_019,
        rows=rows,
    )
    if args.eval_greedy:
        n = args.eval_examples
        greedy = evaluate_pass_at_k(engine, tokenizer, task, n, 1, args.max_new_tokens, 0.0, None, rows=rows)
        result["greedy@1"] = greedy["pass@1"]
    return result


# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    check_args(parser, args)
    user_config = vars(args).copy()
    k = args.eval_samples if args.eval_samples > 0 else args.device_batch_size

    mesh = sharding.mesh_from_args(parser, args)
    if jax.process_count() > 1:
        sys.exit("error: scripts.rl samples rollouts in one process; run it on one host (any number of local devices)")
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if args.device_batch_size % dp:
        parser.error(
            f"--device-batch-size {args.device_batch_size} must be a multiple of the mesh's data x fsdp size {dp}"
        )

    # -------------------------------------------------------------------------
    # Model, tasks, optimizer

    try:
        model_tag = args.model_tag or find_model_tag(args.source)
        model, tokenizer, meta = load_model(
            args.source, model_tag, args.model_step, mesh=mesh, dtype=compute_dtype(args.dtype)
        )
        train_task, eval_task, which = build_tasks(args)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    engine = Engine(model, tokenizer, compact=jax.default_backend() == "cpu")  # a long job: packing earns its compiles
    rows = rollout_rows(model, args)
    num_steps = args.num_steps if args.num_steps > 0 else (len(train_task) // args.examples_per_step) * args.num_epochs
    if num_steps < 1:
        parser.error(f"no steps: {len(train_task)} problems make no full step of {args.examples_per_step} examples")
    print0(
        f"{which}: {len(train_task):,} training problems, {len(eval_task):,} eval problems | {num_steps} steps of "
        f"{args.examples_per_step} x {args.num_samples} rollouts, sampled {rows} at a time | "
        f"from {args.source} {model_tag} step {meta['step']}"
    )
    with jax.set_mesh(mesh):
        optimizer = build_optimizer(model, **optimizer_lrs(args), weight_decay=args.weight_decay)
    lr_var = optimizer.opt_state.hyperparams["lr_multiplier"]

    out_dir = checkpoint_dir("rl", args.model_tag or model_tag)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    restart_metrics(metrics_path)
    ckpt = Checkpointer(out_dir, keep=2, keep_best=0)
    log = metrics_logger(metrics_path, args.run, "flaxchat-rl", user_config)
    source = {"phase": args.source, "model_tag": model_tag, "step": meta["step"]}

    # -------------------------------------------------------------------------
    # Training loop: rollouts of examples_per_step questions, one policy-gradient step, evals and saves

    pad = tokenizer.encode_special("<|assistant_end|>")  # any token: padding is never a target
    bar = progress_bar(total=num_steps, desc="rl", disable=not is_main_process(), dynamic_ncols=True)
    results, saved_once = {}, False
    for step in range(num_steps + 1):
        if step % args.eval_every == 0 or step == num_steps:
            results = evaluate(engine, tokenizer, eval_task, args, k, rows)
            if is_main_process():
                shown = [key for key in ("pass@1", f"pass@{k}", "greedy@1") if key in results]
                bar.write(f"step {step} | " + " | ".join(f"{key} {results[key]:.4f}" for key in shown))
            log({"step": step, **results})
        if step > 0 and (step % args.save_every == 0 or step == num_steps):
            if not saved_once:
                ckpt.replace_earlier_run()
                saved_once = True
            about = {"user_config": user_config, "task": which, "git_commit": git_commit(), "source": source}
            ckpt.save(step, model, meta={**about, **results})
        if step == num_steps:
            break

        t0 = time.perf_counter()
        questions = [(step * args.examples_per_step + i) % len(train_task) for i in range(args.examples_per_step)]
        sequences, masks, rewards, advantages = rollouts(engine, tokenizer, train_task, questions, step, args, rows)
        t_rollout = time.perf_counter() - t0
        batches = rollout_batches(sequences, masks, advantages, pad, args.device_batch_size)
        lrm = 1.0 - step / num_steps  # nanochat: linear ramp to zero
        lr_var[...] = jnp.asarray(args.init_lr_frac * lrm, lr_var.dtype)
        with jax.set_mesh(mesh):
            loss = rl_step(model, optimizer, batches, mesh)
        row = {
            "step": step + 1,
            "reward": float(np.mean(rewards)),
            "loss": loss,
            "lrm": lrm,
            "dt": time.perf_counter() - t0,
            "rollout_s": t_rollout,
            "sequence_length": float(np.mean([len(s) for s in sequences])),
            "skipped_batches": sum(not np.any(b[2]) for b in batches),
        }  # all-zero advantages: no pass
        log(row)
        bar.set_postfix(
            reward=f"{row['reward']:.3f}", len=f"{row['sequence_length']:.0f}", lrm=f"{lrm:.2f}", refresh=False
        )
        bar.update(1)

    # -------------------------------------------------------------------------
    # The end: the chart and pass@k before and after

    bar.close()
    ckpt.close()
    rows = read_jsonl(metrics_path)
    plot_rl(rows, os.path.join(out_dir, "rl.png"), title=f"{model_tag} RL ({which})")
    first = next(r for r in rows if "pass@1" in r)
    print0(
        f"RL done: {num_steps} steps | held-out pass@1 {first['pass@1']:.4f} -> {results['pass@1']:.4f} | "
        f"pass@{k} {first[f'pass@{k}']:.4f} -> {results[f'pass@{k}']:.4f} | checkpoints: {out_dir}"
    )
    return {"first": first, "last": results, "rows": rows}


if __name__ == "__main__":
    main()
