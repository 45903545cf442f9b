"""Supervised fine-tuning: a base model becomes a chat assistant (nanochat's chat_sft, in JAX).

CPU / laptop (offline mixture, a few hundred steps; needs `python -m tasks.offline --fetch` for MMLU/ARC):
    python -m scripts.sft --config configs/sft_cpu.yaml
    python -m scripts.sft --mixture offline --num-iterations 400 --device-batch-size 8 --total-batch-size 8192 \
        --eval-every 100 --eval-tokens 65536 --chatcore-every -1 --reply-check 64
One GPU (inherits sequence length, batch sizes and learning rates from the base checkpoint):
    python -m scripts.sft --model-tag d20
Many devices / hosts: the same command; batches are split over every device of every process.

Warm start: the latest base checkpoint (--model-tag/--model-step pick another) and, with --load-optimizer 1,
its optimizer state (momentum buffers; the learning rates are SFT's own).

Data: --mixture online = nanochat's (SmolTalk, MMLU auxiliary_train, GSM8K train, SpellingBee, SimpleSpelling)
plus flaxchat's identity conversations; --mixture offline = flaxchat's synthetic conversations (identity,
arithmetic with calculator tool calls, story requests, multi-turn conversations, spelling and letter counting)
plus MMLU dev/validation and ARC validation as multiple choice. auto picks online when the Hugging Face hub is
reachable. Test splits are never trained on; they only serve as validation data.

Your own conversations (JSONL in the OpenAI chat format, a file or a folder; tasks/customjson.py), mixed into
the built-in mixture by weight, or alone with --mixture none; 5% of each is held out for val:
    python -m scripts.sft --chats my_chats.jsonl:3 --chats more_chats/ ...
LoRA: train rank-R adapters on the block matrices (AdamW on the adapters alone, the base frozen); the checkpoint
holds the adapters and names its base, and load_model (chat_cli, chat_web, eval) merges them on load:
    python -m scripts.sft --lora-rank 16 --chats my_chats.jsonl --mixture none ...
    python -m scripts.sft --merge --model-tag d4          # adapters -> full weights in chatsft_checkpoints/d4-merged
Long runs: --save-every N checkpoints along the way; --resume continues from the latest one exactly.

Outputs: $FLAXCHAT_BASE_DIR/chatsft_checkpoints/<tag>/ with the final checkpoint, metrics.jsonl, training.png.
"""

import argparse
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from flaxchat import sharding
from flaxchat.common import agree_max, compute_dtype, is_main_process, parse_args, print0, progress_bar
from flaxchat.data.chat_data import make_sft_loader
from flaxchat.data.tokenizer import get_token_bytes, get_tokenizer
from flaxchat.eval.bpb import evaluate_bpb
from flaxchat.eval.chat import (
    CHATCORE_TASKS,
    CPU_CHATCORE_CAT,
    CPU_EVAL_BATCHES,
    REPLY_ROOM,
    fitting_prompts,
    reply_end_rate,
    run_chatcore,
    sized_evaluation,
)
from flaxchat.eval.report import SFTStepLog, metrics_logger, plot_training, read_jsonl, restart_metrics
from flaxchat.model.gpt import add_kernel_flags
from flaxchat.model.lora import add_lora_flags, count_params, lora_from_args, merge_lora
from flaxchat.perf.machine import peak_flops_per_device
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir, find_model_tag, merge_lora_checkpoint, model_tag_arg
from flaxchat.train.flags import (
    FROM_BASE,
    add_batch_flags,
    add_dtype_flag,
    add_optimizer_flags,
    add_run_flag,
    add_schedule_flags,
    micro_steps,
)
from flaxchat.train.sft import (
    checkpoint_meta,
    fresh_loop,
    inherit,
    lr_multiplier,
    muon_momentum,
    restore_base,
    resume,
    set_hyperparams,
    sft_optimizer,
)
from flaxchat.train.step import FlatStep, InFlight, add_in_flight_flag, in_flight_depth
from tasks.mixtures import add_mixture_flags, build_mixtures, check_mixture_args, custom_tasks

# -----------------------------------------------------------------------------
# CLI

EPILOG = """your own chats and LoRA:
  --chats my_chats.jsonl:2   one conversation per line, {"messages": [{"role": "system"|"user"|"assistant",
                             "content": "..."}, ...]}: optional system, then user/assistant alternating, ending
                             with the assistant; every line is checked before training starts
  --lora-rank 16             adapters only (AdamW); the checkpoint holds them and names its base model, and
                             every script that loads the sft model merges them in on load
  --merge --model-tag d4     write the adapters of sft/d4 merged into full weights as sft/d4-merged"""


def build_parser():
    p = argparse.ArgumentParser(
        description="Supervised fine-tuning of a base model into a chat model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
    )
    add_run_flag(p)
    # model loading
    p.add_argument(
        "--model-tag",
        type=model_tag_arg,
        default=None,
        help="base checkpoint tag, also the output tag (default: the largest)",
    )
    p.add_argument(
        "--model-step",
        type=int,
        default=None,
        help="base checkpoint step (default: the latest; with --merge: the sft step)",
    )
    p.add_argument(
        "--output-tag",
        type=model_tag_arg,
        default=None,
        help="tag of the output checkpoint (default: --model-tag's; with --merge: TAG-merged)",
    )
    p.add_argument(
        "--load-optimizer",
        type=int,
        default=1,
        choices=[0, 1],
        help="warm-start the optimizer state from the base checkpoint",
    )
    add_dtype_flag(p)
    add_kernel_flags(p)
    # horizon and batch (None = inherit from the base checkpoint)
    p.add_argument("--num-iterations", type=int, default=-1, help="optimizer steps (-1 = one epoch of the mixture)")
    p.add_argument("--max-seq-len", type=int, default=None, help="row length in tokens (default: the base model's)")
    add_batch_flags(p, device_batch_size=FROM_BASE, total_batch_size=FROM_BASE)
    # optimisation (FROM_BASE = inherit the base run's flags)
    add_optimizer_flags(p, embedding_lr=FROM_BASE, unembedding_lr=FROM_BASE, matrix_lr=FROM_BASE, init_lr_frac=0.8)
    add_schedule_flags(p, warmup_ratio=0.0, warmdown_ratio=0.5, final_lr_frac=0.0)
    # evaluation
    p.add_argument("--eval-every", type=int, default=200, help="val bpb every N steps (-1 = only at the end)")
    p.add_argument(
        "--eval-tokens",
        type=int,
        default=None,
        help="tokens of val conversations per evaluation (default: nanochat's 40 x 524,288 on GPUs and TPUs; "
        f"{CPU_EVAL_BATCHES} micro-batches on a CPU)",
    )
    p.add_argument("--chatcore-every", type=int, default=200, help="ChatCORE every N steps and at the end (-1 = off)")
    p.add_argument("--chatcore-tasks", type=str, default=",".join(CHATCORE_TASKS), help="comma list of chat tasks")
    p.add_argument(
        "--chatcore-max-cat",
        type=int,
        default=None,
        help=f"problems per categorical task (-1 = all; default: all on GPUs and TPUs, {CPU_CHATCORE_CAT} on a CPU)",
    )
    p.add_argument("--chatcore-max-sample", type=int, default=24, help="problems per generative task (-1 = all)")
    p.add_argument(
        "--reply-check",
        type=int,
        default=32,
        help="at the end, sample replies to N val prompts and count those ending with <|assistant_end|> (0 = off)",
    )
    # data mixture (tasks.mixtures)
    add_mixture_flags(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversations and of sampling")
    # LoRA (flaxchat.model.lora)
    add_lora_flags(p)
    p.add_argument(
        "--merge",
        action="store_true",
        help="no training: write the LoRA checkpoint of --model-tag (step "
        "--model-step) as full merged weights, an ordinary sft checkpoint under --output-tag",
    )
    # checkpoints
    p.add_argument("--save-every", type=int, default=-1, help="also checkpoint every N steps (-1 = only at the end)")
    p.add_argument("--keep", type=int, default=1, help="checkpoints kept (the latest ones)")
    p.add_argument(
        "--resume", action="store_true", help="continue from the latest checkpoint under the output tag (same flags)"
    )
    add_in_flight_flag(p)
    # mesh
    sharding.add_mesh_flags(p)
    return p


def check_args(parser, args):
    for name in ("max_seq_len", "device_batch_size", "total_batch_size", "embedding_lr", "unembedding_lr", "matrix_lr"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    for name in ("init_lr_frac", "warmup_ratio", "warmdown_ratio", "final_lr_frac"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.warmup_ratio + args.warmdown_ratio > 1:
        parser.error("--warmup-ratio + --warmdown-ratio must be at most 1")
    if args.reply_check < 0:
        parser.error(f"--reply-check must be >= 0, got {args.reply_check}")
    if args.lora_rank < 0 or args.lora_lr <= 0 or (args.lora_alpha is not None and args.lora_alpha <= 0):
        parser.error("--lora-rank must be >= 0, --lora-lr and --lora-alpha positive")
    if args.keep < 1:
        parser.error(f"--keep must be positive, got {args.keep}")
    check_mixture_args(parser, args)


def sft_micro_steps(parser, args, model, dp: int) -> int:
    """Gradient accumulation steps of one optimizer step (the inherited flags filled in); parser.error where a row
    is longer than the model's context or the total batch is no whole number of micro-steps."""
    if args.max_seq_len > model.config.sequence_len:
        parser.error(f"--max-seq-len {args.max_seq_len} exceeds the model's context {model.config.sequence_len}")
    return micro_steps(parser, args.total_batch_size, args, dp)


def val_bpb(model, val_ds, tokenizer, token_bytes, args, global_batch: int, mesh) -> float:
    """Bits per byte over --eval-tokens tokens of the val conversations."""
    steps = max(1, args.eval_tokens // (global_batch * args.max_seq_len))
    val_loader = make_sft_loader(val_ds, tokenizer, global_batch, args.max_seq_len, mesh=mesh)
    with jax.set_mesh(mesh):
        return evaluate_bpb(model, val_loader, steps, token_bytes, progress=steps >= 20)


def load_base(parser, args, mesh, dtype, lora):
    """(tag, model, its optimizer's inner state or None, meta, step, tokenizer, token bytes) of the base checkpoint
    (--model-tag, --model-step), restored onto the mesh; one line and exit where it is missing or its vocabulary is
    not the tokenizer's."""
    try:
        model_tag = args.model_tag or find_model_tag("base")
        with_optimizer = bool(args.load_optimizer) and lora is None  # LoRA: the base's moments are of no use
        model, base_inner, meta, base_step = restore_base(
            model_tag, args.model_step, mesh, dtype, with_optimizer, attention=args.attention, remat=args.remat
        )
        tokenizer, token_bytes = get_tokenizer(), get_token_bytes()
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    except ValueError as e:  # an attention kernel this machine cannot run
        parser.error(str(e))
    print0(f"attention: {model.attention} | remat: {model.remat}")
    if tokenizer.get_vocab_size() != model.config.vocab_size:
        sys.exit(f"error: tokenizer vocab {tokenizer.get_vocab_size()} != model vocab {model.config.vocab_size}")
    print0(f"base model: {model_tag} step {base_step} | {model.config.to_dict()}")
    return model_tag, model, base_inner, meta, base_step, tokenizer, token_bytes


def mixtures(args, custom):
    """(train, val, which) of tasks.mixtures, with a line saying their sizes; one line and exit where a part's data
    is missing."""
    try:
        train_ds, val_ds, which = build_mixtures(args, custom)
    except (FileNotFoundError, ValueError) as e:
        hint = (
            "" if args.mixture in ("online", "none") else " (or leave that part out: --mc-epochs 0, --spelling-size 0)"
        )
        sys.exit(f"error: {e}{hint}")
    print0(
        f"{which} mixture{' + ' + str(len(custom)) + ' --chats' if custom else ''}: {len(train_ds):,} training "
        f"conversations, {len(val_ds):,} val conversations"
    )
    return train_ds, val_ds, which


def start_or_resume(args, out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref):
    """(loop state, the step resumed from or None): a fresh loop, or with --resume the latest checkpoint of out_dir
    restored into the model (its trained weights or adapters), optimizer and data loader. The metrics log restarts
    (a resumed run drops what was logged after its checkpoint: it is done again)."""
    loop, resume_step = fresh_loop(), None
    if args.resume:
        try:
            loop, resume_step = resume(out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: --resume: {e}")
        print0(f"resumed from step {resume_step} of {out_dir}")
    restart_metrics(os.path.join(out_dir, "metrics.jsonl"), resumed_from=resume_step)
    return loop, resume_step


def chatcore_check(model, tokenizer, args, source: str, step: int, say) -> dict:
    """ChatCORE over --chatcore-tasks (eval.chat.run_chatcore), said in a line; {} where none of the default tasks'
    data is on this machine, one line and exit where a named task cannot run."""
    try:
        sizes = (args.chatcore_max_cat, args.chatcore_max_sample, args.device_batch_size)
        result = run_chatcore(model, tokenizer, args.chatcore_tasks, *sizes, source)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: ChatCORE: {e} (or turn it off: --chatcore-every -1)")
    if result is None:  # the default check, not a failure of the run
        say(
            f"step {step:05d} | ChatCORE skipped: none of the ChatCORE tasks' data is on this machine; "
            "run `python -m tasks.offline --fetch`"
        )
        return {}
    say(f"step {step:05d} | ChatCORE {result['chatcore']:.4f} over {result['chatcore_tasks']} tasks")
    return result


def reply_check(model, tokenizer, val_ds, args) -> float:
    """The share of sampled replies to --reply-check val prompts that end with <|assistant_end|>, said in a line.
    Every process samples (the Engine runs on the global model); process 0 prints."""
    prompts = fitting_prompts(val_ds, tokenizer, args.reply_check, model.config.sequence_len - REPLY_ROOM)
    rate = reply_end_rate(model, tokenizer, prompts, max_tokens=args.max_seq_len // 2 + 128, seed=args.seed)
    print0(f"replies ending with <|assistant_end|>: {rate:.1%} of {len(prompts)}")
    return rate


def report(model_tag, out_dir, step, loop, num_trainable, summary) -> dict:
    """The chart (training.png), the run's last line, and what main returns."""
    if is_main_process():
        rows = read_jsonl(os.path.join(out_dir, "metrics.jsonl"))
        plot_training(rows, os.path.join(out_dir, "training.png"), title=f"{model_tag} SFT")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print0(
        f"SFT done: {step} steps | training time {loop['train_time'] / 60:.2f} min | min val bpb "
        f"{loop['min_val_bpb']:.4f} | trainable parameters {num_trainable:,} | peak RSS {peak_rss_mb:,.0f} MB | "
        f"checkpoint: {out_dir}"
    )
    about = {"val_bpb": loop["val_bpb"], "min_val_bpb": loop["min_val_bpb"], "trainable_params": num_trainable}
    return {"step": step, **about, "train_time": loop["train_time"], "peak_rss_mb": peak_rss_mb, **summary}


# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    check_args(parser, args)
    user_config = vars(args).copy()

    if args.merge:  # no training: the LoRA adapters of an sft checkpoint written as full weights
        try:
            tag, out = merge_lora_checkpoint(args.model_tag, args.model_step, args.output_tag)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: {e}")
        print0(f"merged the LoRA adapters of sft {tag} into full weights: {out}")
        return {"merged": out}

    # your own data first: a bad line stops the run before anything is loaded or trained
    try:
        custom = custom_tasks(args)
    except (OSError, ValueError) as e:  # unreadable or malformed: one line, no traceback
        sys.exit(f"error: {e}")
    try:
        lora = lora_from_args(args)
    except ValueError as e:
        parser.error(str(e))

    mesh = sharding.mesh_from_args(parser, args)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    dtype = compute_dtype(args.dtype)
    print0(
        f"devices: {jax.device_count()} x {jax.devices()[0].device_kind} | mesh: {dict(mesh.shape)} | "
        f"dtype: {jnp.dtype(dtype).name}"
    )

    # -------------------------------------------------------------------------
    # Base model (and optimizer state), tokenizer, inherited hyperparameters, the optimizer

    model_tag, model, base_inner, meta, base_step, tokenizer, token_bytes = load_base(parser, args, mesh, dtype, lora)
    inherit(args, meta)
    grad_accum, global_batch = sft_micro_steps(parser, args, model, dp), args.device_batch_size * dp
    print0(
        f"micro-batch: {global_batch} x {args.max_seq_len} | grad accumulation: {grad_accum}"
        + model.forms.sub_batch_note(args.device_batch_size, args.max_seq_len, mesh)
    )
    print0(sized_evaluation(args, global_batch, jax.default_backend() == "cpu"))

    try:
        model, optimizer, trainable = sft_optimizer(model, lora, base_inner, args, mesh)
    except ValueError as e:  # LoRA targets that match nothing
        parser.error(str(e))
    num_trainable = count_params(model, trainable)
    print0(
        f"trainable parameters: {num_trainable:,} (the base model has "
        f"{count_params(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))):,})"
    )
    base_ref = {"phase": "base", "model_tag": model_tag, "step": base_step, "saved_at": meta.get("saved_at")}
    # the model the Engine samples from: with LoRA the merged one (generation runs forward_cached, which qwix's
    # interception of __call__ does not reach)
    for_sampling = lambda: merge_lora(model, lora) if lora is not None else model  # noqa: E731

    # -------------------------------------------------------------------------
    # Data

    train_ds, val_ds, which = mixtures(args, custom)
    num_batches = args.num_iterations * grad_accum if args.num_iterations > 0 else -1
    train_loader = make_sft_loader(
        train_ds, tokenizer, global_batch, args.max_seq_len, mesh=mesh, num_batches=num_batches
    )
    data_source = "hub" if which == "online" else "offline"

    # -------------------------------------------------------------------------
    # Output directory; --resume restores the trained weights (or adapters), optimizer, data position and loop

    out_dir = checkpoint_dir("sft", args.output_tag or args.model_tag or model_tag)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    loop, resume_step = start_or_resume(args, out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref)
    log = metrics_logger(metrics_path, args.run, "flaxchat-sft", user_config)
    saved_once = resume_step is not None  # a resumed run keeps the checkpoints it continues

    # -------------------------------------------------------------------------
    # Training loop: eval at step 0 and every eval_every, train; at the end eval, save, then ChatCORE and the reply
    # check

    total = args.num_iterations if args.num_iterations > 0 else None
    bar = progress_bar(total=total, initial=loop["step"], desc="sft", disable=not is_main_process(), dynamic_ncols=True)
    say = bar.write if is_main_process() else (lambda _: None)
    # one jax.jit over the model's and optimizer's arrays, as pretrain calls the step: a call skips NNX's walk over
    # both (train.step.FlatStep)
    optimizer_step = FlatStep(model, optimizer)
    # as in pretraining, one step in flight on GPUs and TPUs (train.step.InFlight); evaluations and saves wait for it
    in_flight = InFlight(in_flight_depth(args.in_flight, jax.default_backend()))
    peak_flops = peak_flops_per_device(model.dtype)[0] * jax.device_count()
    flops_per_token, first = model.estimate_flops(), resume_step or 0
    record = SFTStepLog(log, bar, loop, args.total_batch_size, flops_per_token, peak_flops, first, args.num_iterations)
    summary = {}

    while True:
        step, last_step = loop["step"], loop["last_step"]
        again = step == resume_step  # the checkpoint we resumed from already evaluated and saved this step
        do_eval = last_step or (args.eval_every > 0 and step % args.eval_every == 0 and not again)
        do_save = last_step or (args.save_every > 0 and step > 0 and step % args.save_every == 0 and not again)
        do_chatcore = args.chatcore_every > 0 and (
            last_step or (step > 0 and step % args.chatcore_every == 0 and not again)
        )
        if do_eval or do_save or do_chatcore or last_step:
            record(in_flight.finish())
        if do_eval:
            loop["val_bpb"] = val_bpb(model, val_ds, tokenizer, token_bytes, args, global_batch, mesh)
            loop["min_val_bpb"] = min(loop["min_val_bpb"], loop["val_bpb"])
            say(f"step {step:05d} | val bpb {loop['val_bpb']:.4f}")
            log({"step": step, "val_bpb": loop["val_bpb"]})
        if do_save:  # before the slower checks, so a failing check never costs the trained model
            ckpt = Checkpointer(out_dir, keep=args.keep, keep_best=0)
            if not saved_once:
                ckpt.replace_earlier_run()
                saved_once = True
            about = checkpoint_meta(args, loop, user_config, which, base_ref, tokenizer.content_hash, lora)
            ckpt.save(step, model, optimizer, data_state=train_loader.get_state(), params=trainable, meta=about)
            ckpt.close()
        if do_chatcore:
            result = chatcore_check(for_sampling(), tokenizer, args, data_source, step, say)
            if result:
                log({"step": step, **result})
                summary.update(result)
        if last_step:
            break

        started = time.perf_counter()
        xs, ys = zip(*(next(train_loader) for _ in range(grad_accum)))
        # each process reads its own conversations, so each has its own view of the epoch: agree (MAX, as nanochat
        # all-reduces last_step) so all stop at the same step and write the same LR into the replicated optimizer
        last_step, progress = agree_max(train_loader.last_step, train_loader.progress)
        lrm = lr_multiplier(progress, args.warmup_ratio, args.warmdown_ratio, args.final_lr_frac)
        knobs = {"lr_multiplier": args.init_lr_frac * lrm}
        if lora is None:
            knobs["muon_momentum"] = muon_momentum(step)
        set_hyperparams(optimizer, **knobs)
        with jax.set_mesh(mesh):
            loss, _ = optimizer_step(xs, ys)  # (loss, optimizer_stats)
        step += 1
        loop.update(step=step, last_step=bool(last_step), progress=float(progress))
        record(in_flight.submit(loss, (step, lrm, float(progress), train_loader.epoch), started))
    bar.close()

    # -------------------------------------------------------------------------
    # The end: do the replies end, the chart, the last line

    if args.reply_check > 0:
        summary["reply_end_rate"] = reply_check(for_sampling(), tokenizer, val_ds, args)
        log({"step": step, "reply_end_rate": summary["reply_end_rate"]})
    return report(model_tag, out_dir, step, loop, num_trainable, summary)


if __name__ == "__main__":
    main()
