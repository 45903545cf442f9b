"""Pretrain a base GPT: nanochat's base_train, in JAX.

CPU / laptop (tiny model, a few minutes):
    python -m scripts.pretrain --depth 4 --max-seq-len 512 --device-batch-size 8 --total-batch-size 4096 \
        --num-iterations 200 --eval-every 50 --eval-tokens 32768 --sample-every 100
One GPU (the d20 "speedrun" model):
    python -m scripts.pretrain --depth 20 --device-batch-size 32
Many devices / hosts (same script; the mesh spans every device of every process):
    python -m scripts.pretrain --depth 26 --device-batch-size 16 --fsdp 8          # 8 GPUs, FSDP
    runs/multihost.sh                                                              # TPU pod / multi-node
Resume a run from its latest checkpoint (exactly: model, optimizer, data position, loop state):
    python -m scripts.pretrain --depth 4 ... --resume

Data: parquet shards under $FLAXCHAT_BASE_DIR/base_data (python -m scripts.data --help).
Tokenizer: $FLAXCHAT_BASE_DIR/tokenizer (python -m scripts.tok_train).
Outputs: $FLAXCHAT_BASE_DIR/base_checkpoints/d<depth>/ with checkpoints, metrics.jsonl and training.png.
"""

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_dtype, is_main_process, parse_args, print0, progress_bar, quiet_library_logs
from flaxchat.data.dataloader import make_loader, make_val_loader
from flaxchat.data.tokenizer import get_token_bytes, get_tokenizer
from flaxchat.eval.bpb import evaluate_bpb
from flaxchat.eval.core import evaluate_core
from flaxchat.eval.report import Report, StepLog, metrics_logger, plot_training, read_jsonl, restart_metrics
from flaxchat.generate.engine import generate
from flaxchat.generate.reply import stop_tokens
from flaxchat.model.config import GPTConfig, add_model_flags, config_from_flags, derive_training
from flaxchat.model.gpt import GPT, add_kernel_flags
from flaxchat.perf.machine import peak_flops_per_device, peak_memory_gb, speed_tips
from flaxchat.perf.profiler import StepProfiler, save_profile_summary
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir, git_commit, model_tag_arg
from flaxchat.train.flags import (
    add_batch_flags,
    add_dtype_flag,
    add_optimizer_flags,
    add_run_flag,
    add_schedule_flags,
    micro_steps,
    optimizer_lrs,
)
from flaxchat.train.optim import Schedule, build_optimizer, optimizer_stats
from flaxchat.train.step import FlatStep, InFlight, add_in_flight_flag, in_flight_depth

SAMPLE_PROMPTS = [
    "The capital of France is",
    "The chemical symbol of gold is",
    "If yesterday was Friday, then tomorrow will be",
    "The opposite of hot is",
    "The planets of the solar system are:",
    "My favorite color is",
    "If 5*x + 3 = 13, then x is",
]


# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="Pretrain a base model (nanochat's base_train for JAX).")
    add_run_flag(p)
    # model
    add_model_flags(p)
    add_dtype_flag(p)
    add_kernel_flags(p)
    # horizon (first positive one wins, in this order)
    p.add_argument("--num-iterations", type=int, default=-1, help="explicit number of optimizer steps (-1 = off)")
    p.add_argument(
        "--target-flops", type=float, default=-1.0, help="steps to reach this many training FLOPs (-1 = off)"
    )
    p.add_argument("--target-param-data-ratio", type=float, default=12, help="tokens : scaling-params ratio (-1 = off)")
    # optimisation
    add_batch_flags(p, device_batch_size=32, total_batch_size=-1, total_note="-1 = derive from depth")
    add_optimizer_flags(
        p,
        embedding_lr=0.3,
        unembedding_lr=0.008,
        matrix_lr=0.02,
        scalar_lr=0.5,
        weight_decay=0.28,
        weight_decay_note="scaled with batch and horizon",
    )
    p.add_argument(
        "--no-hparam-scaling",
        action="store_true",
        help="use the LRs and weight decay as given, without nanochat's batch-size/horizon scaling (small CPU runs)",
    )
    add_schedule_flags(p, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)
    p.add_argument("--seed", type=int, default=0, help="parameter init seed")
    # evaluation, sampling, checkpoints
    p.add_argument("--eval-every", type=int, default=250, help="val bpb every N steps (-1 = off)")
    p.add_argument("--eval-tokens", type=int, default=80 * 524288, help="tokens of val data per evaluation")
    p.add_argument("--core-metric-every", type=int, default=-1, help="CORE metric every N steps (-1 = off)")
    p.add_argument("--core-metric-max-per-task", type=int, default=500, help="examples per CORE task")
    p.add_argument(
        "--sample-every", type=int, default=2000, help="greedy samples from fixed prompts every N steps (-1 = off)"
    )
    p.add_argument("--save-every", type=int, default=-1, help="checkpoint every N steps (-1 = only at the end)")
    p.add_argument("--keep", type=int, default=2, help="checkpoints to keep (plus the best by val bpb)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the latest checkpoint of this model tag (on any number of devices or hosts: the data "
        "position carries over)",
    )
    p.add_argument("--resume-from-step", type=int, default=-1, help="continue from this step's checkpoint (-1 = off)")
    p.add_argument("--model-tag", type=model_tag_arg, default=None, help="checkpoint directory name (default d<depth>)")
    p.add_argument(
        "--source", type=str, default=None, help="folder of parquet shards (default $FLAXCHAT_BASE_DIR/base_data)"
    )
    StepProfiler.add_flag(p, "<checkpoint dir>/profile, and where their time went to profile/summary.json")
    add_in_flight_flag(p)
    # mesh
    sharding.add_mesh_flags(p)
    return p


def check_args(parser, args):
    if args.device_batch_size < 1:
        parser.error(f"--device-batch-size must be positive, got {args.device_batch_size}")
    try:
        config_from_flags(args, vocab_size=64)  # shape flags checked before any work starts
    except ValueError as e:
        parser.error(str(e))
    if args.num_iterations <= 0 and args.target_flops <= 0 and args.target_param_data_ratio <= 0:
        parser.error("no training horizon: set --num-iterations, --target-flops or --target-param-data-ratio")


def plan_training(args, abstract_model, vocab_size):
    """nanochat's scaling rules: batch size, LRs, weight decay and horizon from depth (d12 is the reference)."""
    d12 = GPTConfig.from_depth(
        12, args.aspect_ratio, args.head_dim, args.max_seq_len, args.window_pattern.upper(), vocab_size
    )
    reference = nnx.eval_shape(lambda: GPT(d12, rngs=nnx.Rngs(0)))
    return derive_training(
        depth=args.depth,
        num_scaling_params=abstract_model.num_scaling_params(),
        flops_per_token=abstract_model.estimate_flops(),
        reference_scaling_params=reference.num_scaling_params(),
        num_iterations=args.num_iterations,
        target_flops=args.target_flops,
        target_param_data_ratio=args.target_param_data_ratio,
        total_batch_size=args.total_batch_size,
        **optimizer_lrs(args),
        scalar_lr=args.scalar_lr,
        weight_decay=args.weight_decay,
        scale_hparams=not args.no_hparam_scaling,
    )


def optimizer_factory(args, plan):
    """model -> MuonAdamW at the plan's learning rates and weight decay, on nanochat's schedule over the plan's
    horizon."""
    schedule = Schedule(plan.num_iterations, args.warmup_steps, args.warmdown_ratio, args.final_lr_frac)
    return lambda model: build_optimizer(
        model,
        unembedding_lr=plan.unembedding_lr,
        embedding_lr=plan.embedding_lr,
        matrix_lr=plan.matrix_lr,
        weight_decay=plan.weight_decay,
        scalar_lr=plan.scalar_lr,
        schedule=schedule,
    )


def start_or_resume(args, ckpt, make_model, make_optimizer, abstract_model, config, mesh):
    """(model, optimizer, step, data loader states, loop state, the step resumed from or None): a fresh model born
    sharded with its optimizer, or with --resume / --resume-from-step the checkpoint restored straight onto the
    mesh (its model config must be the flags'). One line and exit where there is nothing to resume."""
    loop = {"min_val_bpb": float("inf"), "smooth_train_loss": 0.0, "total_training_time": 0.0, "val_bpb": None}
    if not (args.resume or args.resume_from_step >= 0):
        model = sharding.create_sharded(make_model, mesh)
        with jax.set_mesh(mesh):
            optimizer = make_optimizer(model)
        return model, optimizer, 0, None, loop, None
    resume_step = args.resume_from_step if args.resume_from_step >= 0 else ckpt.latest_step()
    if resume_step is None:
        sys.exit(f"error: --resume: no checkpoint in {ckpt.directory} yet")
    model, optimizer = abstract_model, nnx.eval_shape(make_optimizer, abstract_model)
    try:
        info = ckpt.restore(model, optimizer, step=resume_step, mesh=mesh)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    saved_cfg = info["meta"].get("model_config")
    if saved_cfg != config.to_dict():
        sys.exit(f"error: checkpoint config {saved_cfg} differs from the flags' config {config.to_dict()}")
    print0(f"resumed from step {info['step']} of {ckpt.directory}")
    return model, optimizer, info["step"], info["data_states"], info["meta"]["loop_state"], resume_step


def val_bpb(model, tokenizer, token_bytes, args, global_batch: int, mesh) -> float:
    """Bits per byte over --eval-tokens tokens of the val shard."""
    eval_steps = max(1, args.eval_tokens // (global_batch * args.max_seq_len))
    val_loader = make_val_loader(tokenizer, global_batch, args.max_seq_len, mesh=mesh, data_dir=args.source)
    try:
        with jax.set_mesh(mesh):
            return evaluate_bpb(model, val_loader, eval_steps, token_bytes, progress=eval_steps >= 20)
    finally:
        val_loader.close()


def sample(model, tokenizer):
    """Greedy continuations of SAMPLE_PROMPTS, every prompt a row of one jitted loop; a row ends at a stop token,
    which is not printed."""
    prompts = [tokenizer.encode(prompt, prepend="<|bos|>") for prompt in SAMPLE_PROMPTS]
    stops = stop_tokens(tokenizer)
    for prompt, new in zip(prompts, generate(model, prompts, 16, temperature=0.0, stop_tokens=stops)):
        print0(tokenizer.decode(prompt + [t for t in new if t not in stops]))


def checkpoint_meta(args, loop, user_config, total_batch_size, tokenizer_hash) -> dict:
    """What a checkpoint keeps beside the weights: the flags, the batch, the tokenizer it was trained with, the
    commit, and the loop state a resumed run continues from."""
    return {
        "val_bpb": loop["val_bpb"],
        "user_config": user_config,
        "total_batch_size": total_batch_size,
        "device_batch_size": args.device_batch_size,
        "max_seq_len": args.max_seq_len,
        "tokenizer_hash": tokenizer_hash,
        "git_commit": git_commit(),
        "seed": args.seed,
        "loop_state": loop,
    }


def report(model_tag, abstract_model, plan, loop, out_dir, rows) -> None:
    """The run's last line (peak memory, training time, best val bpb) and the report card's pretraining section: the
    model, the run's size, and from its metrics rows the final smoothed loss and the median tok/s and MFU of the
    steady steps (the two that compile left out)."""
    peak_mem, config = peak_memory_gb(), abstract_model.config
    best = loop["min_val_bpb"] if math.isfinite(loop["min_val_bpb"]) else None  # None: --eval-every -1
    print0(
        f"peak memory: {peak_mem:.2f} GiB | training time: {loop['total_training_time'] / 60:.2f} min | "
        f"min val bpb: {'not evaluated' if best is None else f'{best:.4f}'} | checkpoints: {out_dir}"
    )
    timed = [r for r in rows if "tok_per_s" in r][2:]
    section = {
        "model": model_tag,
        "parameters": abstract_model.num_scaling_params()["total"],
        "layers": config.n_layer,
        "width": config.n_embd,
        "heads": config.n_head,
        "seq len": config.sequence_len,
        "vocab": config.vocab_size,
        "iterations": plan.num_iterations,
        "total batch (tokens)": plan.total_batch_size,
        "tokens trained": plan.num_iterations * plan.total_batch_size,
        "devices": jax.device_count(),
        "final train loss": rows and next((r["smooth_loss"] for r in reversed(rows) if "smooth_loss" in r), None),
        "min val bpb": "not evaluated" if best is None else best,
        "training time (min)": loop["total_training_time"] / 60,
        "tokens/s (median)": float(np.median([r["tok_per_s"] for r in timed])) if timed else None,
        "MFU % (median)": float(np.median([r["mfu"] for r in timed])) if timed else None,
        "peak memory (GiB)": peak_mem,
    }
    Report().log("pretrain", section, charts=[os.path.join(out_dir, "training.png")])


def main(argv=None):
    quiet_library_logs()
    parser = build_parser()
    args = parse_args(parser, argv)
    StepProfiler.prepare(args.profile_steps)  # before JAX starts its backend
    check_args(parser, args)
    user_config = vars(args).copy()

    # -------------------------------------------------------------------------
    # Devices, tokenizer, model config

    mesh = sharding.mesh_from_args(parser, args)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    dtype = compute_dtype(args.dtype)
    print0(
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} | processes: {jax.process_count()} | "
        f"mesh: {dict(mesh.shape)} | dtype: {jnp.dtype(dtype).name}"
    )

    try:
        tokenizer = get_tokenizer()
        token_bytes = get_token_bytes()
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    config = config_from_flags(args, tokenizer.get_vocab_size())
    print0(f"model config:\n{config.describe()}")
    make_model = lambda: GPT(config, rngs=nnx.Rngs(args.seed), dtype=dtype, attention=args.attention, remat=args.remat)
    try:
        abstract_model = nnx.eval_shape(make_model)
    except ValueError as e:  # an attention kernel this machine cannot run
        parser.error(str(e))
    print0(f"attention: {abstract_model.attention} | remat: {abstract_model.remat}")

    # -------------------------------------------------------------------------
    # Training plan: batch size, LRs, weight decay, horizon (nanochat's scaling rules)

    try:
        plan = plan_training(args, abstract_model, tokenizer.get_vocab_size())
    except ValueError as e:
        parser.error(str(e))
    print0(plan.describe())
    global_batch, tokens_per_micro = args.device_batch_size * dp, args.device_batch_size * dp * args.max_seq_len
    grad_accum, num_iterations = micro_steps(parser, plan.total_batch_size, args, dp), plan.num_iterations
    print0(
        f"micro-batch: {global_batch} x {args.max_seq_len} = {tokens_per_micro:,} tokens | "
        f"grad accumulation: {grad_accum}"
        + abstract_model.forms.sub_batch_note(args.device_batch_size, args.max_seq_len, mesh)
    )
    make_optimizer = optimizer_factory(args, plan)

    # -------------------------------------------------------------------------
    # Model + optimizer: fresh (born sharded) or restored straight onto the mesh; the data

    model_tag = args.model_tag or f"d{args.depth}"
    out_dir = checkpoint_dir("base", model_tag)
    ckpt = Checkpointer(out_dir, keep=args.keep)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    model, optimizer, step, data_states, loop, resume_step = start_or_resume(
        args, ckpt, make_model, make_optimizer, abstract_model, config, mesh
    )
    restart_metrics(metrics_path, resumed_from=resume_step)
    try:
        train_loader = make_loader(
            tokenizer, global_batch, args.max_seq_len, "train", mesh=mesh, state=data_states, data_dir=args.source
        )
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")

    # -------------------------------------------------------------------------
    # Training loop (runs num_iterations + 1 times so the last step can eval and save)

    flops_per_token = abstract_model.estimate_flops()
    peak, peak_source = peak_flops_per_device(dtype)
    print0(f"peak FLOP/s per device: {peak:.3e} ({peak_source})")
    for tip in speed_tips(dtype):
        print0(tip)
    log = metrics_logger(metrics_path, args.run, "flaxchat", user_config)
    saved_once = resume_step is not None  # a resumed run keeps the checkpoints it continues
    bar = progress_bar(
        total=num_iterations, initial=step, desc="pretrain", disable=not is_main_process(), dynamic_ncols=True
    )
    profiler = StepProfiler(args.profile_steps, os.path.join(out_dir, "profile"))
    # one jax.jit over the model's and optimizer's arrays: a call skips NNX's walk over both (train.step.FlatStep)
    optimizer_step = FlatStep(model, optimizer)
    # on GPUs and TPUs the next step is dispatched before this one's loss is read (train.step.InFlight); evaluations,
    # samples, saves and profiled steps wait for the step in flight, so they find the device free
    in_flight = InFlight(in_flight_depth(args.in_flight, jax.default_backend()))

    skipped = int(optimizer_stats(optimizer)["skipped_steps"])  # as restored: a resumed run counts on
    peak_flops = peak * jax.device_count()
    record = StepLog(log, bar, loop, plan.total_batch_size, flops_per_token, peak_flops, resume_step or 0, skipped)
    last = {}  # the latest step's batches (the profile summary compiles the step for them)

    def dispatch():
        """Read a step's batches (data loading is part of the step: the trace shows it) and dispatch the step."""
        xs, ys = last["batch"] = tuple(zip(*(next(train_loader) for _ in range(grad_accum))))
        with jax.set_mesh(mesh):
            outputs = optimizer_step(xs, ys)  # (loss, optimizer_stats)
        return outputs, (step, train_loader.epoch)

    while True:
        last_step = step == num_iterations
        do_eval = args.eval_every > 0 and (last_step or step % args.eval_every == 0)
        do_core = args.core_metric_every > 0 and (last_step or (step > 0 and step % args.core_metric_every == 0))
        do_sample = args.sample_every > 0 and (last_step or (step > 0 and step % args.sample_every == 0))
        do_save = last_step or (
            step > 0 and step != resume_step and args.save_every > 0 and step % args.save_every == 0
        )
        if do_eval or do_core or do_sample or do_save or last_step:
            record(in_flight.finish())
        if do_eval:
            loop["val_bpb"] = val_bpb(model, tokenizer, token_bytes, args, global_batch, mesh)
            loop["min_val_bpb"] = min(loop["min_val_bpb"], loop["val_bpb"])
            if is_main_process():
                bar.write(f"step {step:05d} | val bpb {loop['val_bpb']:.4f}")
            log({"step": step, "val_bpb": loop["val_bpb"]})
        if do_core:
            core = evaluate_core(model, tokenizer, max_per_task=args.core_metric_max_per_task)
            log({"step": step, "core_metric": core["core_metric"]})
        if do_sample:
            sample(model, tokenizer)  # every process: the Engine's programs run on the global parameters
        if do_save:
            if not saved_once:
                ckpt.replace_earlier_run()
                saved_once = True
            meta = checkpoint_meta(args, loop, user_config, plan.total_batch_size, tokenizer.content_hash)
            metrics = {"val_bpb": loop["val_bpb"]} if loop["val_bpb"] is not None else None
            ckpt.save(step, model, optimizer, data_state=train_loader.get_state(), meta=meta, metrics=metrics)
        if is_main_process() and (last_step or do_eval):
            plot_training(
                read_jsonl(metrics_path), os.path.join(out_dir, "training.png"), title=f"{model_tag} pretraining"
            )
        if last_step:
            break

        for done in profiler.dispatch(step, in_flight, dispatch):  # a profiled step runs alone
            record(done)
        step += 1

    # -------------------------------------------------------------------------
    # The end: where profiled steps' time went, the last line, the report card's section

    bar.close()
    profiler.close()
    if profiler.written and is_main_process():  # where the profiled steps' time went, saved beside the trace
        save_profile_summary(profiler, optimizer_step, last["batch"], mesh)
    ckpt.close()
    train_loader.close()
    report(model_tag, abstract_model, plan, loop, out_dir, read_jsonl(metrics_path) if is_main_process() else [])
    return loop


if __name__ == "__main__":
    main()
