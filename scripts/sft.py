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
import json
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
from flaxchat.eval import chat as chat_eval
from flaxchat.eval.bpb import evaluate_bpb
from flaxchat.eval.report import metrics_logger, plot_training, read_jsonl
from flaxchat.generate.engine import Engine
from flaxchat.generate.sandbox import SandboxUnavailable
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, add_kernel_flags
from flaxchat.model.lora import DEFAULT_TARGETS, LoraConfig, adapter_modules, apply_lora, count_params, merge_lora
from flaxchat.perf.machine import peak_flops_per_device
from flaxchat.train.checkpoint import (
    Checkpointer,
    checkpoint_dir,
    find_model_tag,
    git_commit,
    merge_lora_checkpoint,
    model_tag_arg,
)
from flaxchat.train.flags import (
    FROM_BASE,
    add_batch_flags,
    add_dtype_flag,
    add_optimizer_flags,
    add_run_flag,
    add_schedule_flags,
)
from flaxchat.train.optim import Schedule, build_lora_optimizer, build_optimizer
from flaxchat.train.step import FlatStep, InFlight, add_in_flight_flag, in_flight_depth
from tasks.arc import ARC
from tasks.common import TaskMixture, hub_reachable
from tasks.customjson import CustomJSON, weighted
from tasks.gsm8k import GSM8K
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk
from tasks.spellingbee import SimpleSpelling, SpellingBee
from tasks.synthetic_chat import ArithmeticProblems, IdentityChat, MultiTurnChat, StoryRequests

CPU_EVAL_BATCHES = 16  # a CPU's val pass: this many micro-batches (a GPU's is 40 x 524,288 tokens, nanochat's)
CPU_CHATCORE_CAT = 100  # a CPU's ChatCORE: this many problems per categorical task (MMLU alone has 14,042)

# flag -> (fallback, where the base checkpoint keeps it): None means "inherit from the base model"
INHERITED = {
    "max_seq_len": (2048, "meta"),
    "device_batch_size": (32, "meta"),
    "total_batch_size": (524288, "meta"),
    "embedding_lr": (0.3, "user_config"),
    "unembedding_lr": (0.004, "user_config"),
    "matrix_lr": (0.02, "user_config"),
}


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
    p.add_argument(
        "--chatcore-tasks",
        type=str,
        default="ARC-Easy,ARC-Challenge,MMLU,GSM8K,HumanEval",
        help="comma list of chat tasks",
    )
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
    # data mixture
    p.add_argument(
        "--mixture",
        type=str,
        default="auto",
        choices=["auto", "online", "offline", "none"],
        help="built-in training mixture (auto: online if the HF hub is reachable; none: only --chats)",
    )
    p.add_argument(
        "--chats",
        action="append",
        default=[],
        metavar="PATH[:WEIGHT]",
        help='your conversations: a JSONL file in the OpenAI chat format (one {"messages": [...]} per line; '
        "optional system, then user/assistant alternating) or a folder of them. WEIGHT: how many times "
        "it appears per epoch of the mixture (default 1; 0.5 = half of it, 3 = three times). Repeatable",
    )
    p.add_argument(
        "--chats-val-fraction", type=float, default=0.05, help="share of each --chats source held out for val"
    )
    p.add_argument("--mmlu-epochs", type=int, default=3, help="online: epochs of MMLU auxiliary_train")
    p.add_argument("--gsm8k-epochs", type=int, default=4, help="online: epochs of GSM8K train")
    p.add_argument(
        "--mc-epochs", type=int, default=1, help="offline: epochs of MMLU dev+validation and ARC validation (0 = none)"
    )
    p.add_argument("--identity-size", type=int, default=1000, help="identity conversations (online and offline)")
    p.add_argument(
        "--arithmetic-size", type=int, default=4000, help="offline: arithmetic word problems with tool calls"
    )
    p.add_argument("--story-size", type=int, default=1000, help="offline: story requests")
    p.add_argument(
        "--multi-turn-size",
        type=int,
        default=1000,
        help="offline: conversations that need an earlier turn (a fact the user told, the previous answer)",
    )
    p.add_argument(
        "--spelling-size",
        type=int,
        default=1000,
        help="offline: SpellingBee and SimpleSpelling examples each (0 = none)",
    )
    p.add_argument("--val-size", type=int, default=200, help="offline: val conversations per synthetic task")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic conversations and of sampling")
    # LoRA
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        help="train rank-R LoRA adapters (qwix) on the block matrices, "
        "base frozen, instead of every weight (0 = full fine-tuning)",
    )
    p.add_argument(
        "--lora-alpha", type=float, default=None, help="LoRA updates are scaled by alpha / rank (default: 2 x rank)"
    )
    p.add_argument(
        "--lora-targets",
        type=str,
        default=DEFAULT_TARGETS,
        help="matrices with adapters: a comma list of "
        "c_q,c_k,c_v,c_proj,c_fc,ve_gate (c_proj: attention's and MLP's) or a regex over module paths such as "
        "transformer/h/[0-3]/mlp/c_fc",
    )
    p.add_argument(
        "--lora-full",
        type=str,
        default="lm_head",
        help="also train these in full, next to the adapters: a "
        "comma list of lm_head, wte, value_embeds, or none. A base model has never written the chat's special "
        "tokens: with a frozen lm_head no reply learns to end",
    )
    p.add_argument(
        "--lora-lr",
        type=float,
        default=1e-2,
        help="AdamW LR of the adapters (and --lora-full), scaled by "
        "--init-lr-frac and the schedule (tuned on the laptop demo's model; large models may want less)",
    )
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
    for name in (
        "mmlu_epochs",
        "gsm8k_epochs",
        "mc_epochs",
        "identity_size",
        "arithmetic_size",
        "story_size",
        "multi_turn_size",
        "spelling_size",
        "reply_check",
    ):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.val_size < 1:
        parser.error(f"--val-size must be positive, got {args.val_size}")
    if args.lora_rank < 0 or args.lora_lr <= 0 or (args.lora_alpha is not None and args.lora_alpha <= 0):
        parser.error("--lora-rank must be >= 0, --lora-lr and --lora-alpha positive")
    if args.keep < 1:
        parser.error(f"--keep must be positive, got {args.keep}")
    if not 0 <= args.chats_val_fraction < 1:
        parser.error(f"--chats-val-fraction must be in [0, 1), got {args.chats_val_fraction}")
    if args.mixture == "none" and not args.chats:
        parser.error("--mixture none trains on --chats only: give at least one --chats file")
    args.chats = [parse_chats_spec(parser, spec) for spec in args.chats]


def parse_chats_spec(parser, spec: str) -> tuple[str, float]:
    """ "path" or "path:weight" -> (path, weight)."""
    path, sep, tail = spec.rpartition(":")
    try:
        if not sep:
            raise ValueError
        weight = float(tail)
    except ValueError:
        path, weight = spec, 1.0  # no weight (or a colon inside the path)
    if weight <= 0:
        parser.error(f"--chats {spec}: the weight must be positive")
    return path, weight


def inherit(args, meta: dict) -> None:
    """Fill flags left at None from the base checkpoint, as nanochat does (explicit flags win)."""
    for name, (fallback, where) in INHERITED.items():
        source = meta if where == "meta" else meta.get("user_config", {})
        saved = source.get(name)
        if getattr(args, name) is None:
            setattr(args, name, saved if saved is not None else fallback)
            print0(f"inherited {name}={getattr(args, name)} from the base checkpoint")
        elif saved is not None and getattr(args, name) != saved:
            print0(f"--{name.replace('_', '-')}={getattr(args, name)} overrides the base checkpoint's {saved}")


# -----------------------------------------------------------------------------
# Data mixtures


def online_mixture(args):
    train = TaskMixture(
        [
            SmolTalk(split="train", source="hub"),
            *[MMLU(subset="all", split="auxiliary_train", source="hub") for _ in range(args.mmlu_epochs)],
            *[GSM8K(subset="main", split="train", source="hub") for _ in range(args.gsm8k_epochs)],
            *[IdentityChat(args.identity_size, "train", args.seed) for _ in range(2) if args.identity_size],
            SimpleSpelling(size=200_000, split="train"),
            SpellingBee(size=80_000, split="train"),
        ]
    )
    val = TaskMixture(
        [  # test splits serve as validation only, never as training data
            SmolTalk(split="test", source="hub"),
            MMLU(subset="all", split="test", source="hub", stop=5200),
            GSM8K(subset="main", split="test", source="hub", stop=420),
        ]
    )
    return train, val


def offline_mixture(args):
    synthetic = [
        (IdentityChat, args.identity_size),
        (ArithmeticProblems, args.arithmetic_size),
        (StoryRequests, args.story_size),
        (MultiTurnChat, args.multi_turn_size),
    ]
    train = [task(size, "train", args.seed) for task, size in synthetic if size]
    val = [task(args.val_size, "val", args.seed) for task, _ in synthetic]

    def spelling():
        return (
            [SpellingBee(args.spelling_size, "train"), SimpleSpelling(args.spelling_size, "train")],
            [SpellingBee(args.val_size, "test")],
        )

    def multiple_choice():
        one_epoch = [
            MMLU("all", "dev", source="offline"),
            MMLU("all", "validation", source="offline"),
            ARC("ARC-Easy", "validation", source="offline"),
            ARC("ARC-Challenge", "validation", source="offline"),
        ]
        return one_epoch * args.mc_epochs, [MMLU("all", "test", source="offline", stop=args.val_size)]

    for flag, make in (("spelling_size", spelling), ("mc_epochs", multiple_choice)):
        if not getattr(args, flag):
            continue
        try:
            more_train, more_val = make()
        except FileNotFoundError as e:
            if getattr(args, flag) != build_parser().get_default(flag):
                raise  # asked for by name: its data must be there
            print0(f"offline mixture: leaving out --{flag.replace('_', '-')} data, not on this machine: {e}")
            continue
        train += more_train
        val += more_val
    if not train:
        raise ValueError("the offline mixture is empty: every size flag is 0")
    return TaskMixture(train), TaskMixture(val)


def custom_tasks(args) -> list:
    """(train, val, weight) of every --chats source; reading validates every line (ChatFileError, a ValueError)."""
    return [
        (
            CustomJSON(path, "train", args.chats_val_fraction, args.seed),
            CustomJSON(path, "val", args.chats_val_fraction, args.seed),
            weight,
        )
        for path, weight in args.chats
    ]


def build_mixtures(args, custom=()):
    """(train, val, which) where which is "online", "offline" or "none"; custom: custom_tasks(args), mixed in."""
    which = args.mixture
    if which == "auto":  # every process must train on the same mixture: online only if every process reaches the hub
        (unreachable,) = agree_max(not hub_reachable())
        which = "offline" if unreachable else "online"
    train, val = [], []
    if which != "none":
        builtin_train, builtin_val = online_mixture(args) if which == "online" else offline_mixture(args)
        if not custom:
            return builtin_train, builtin_val, which
        train, val = builtin_train.tasks, builtin_val.tasks
    for task_train, task_val, weight in custom:
        train += weighted(task_train, weight)
        val += [task_val] if len(task_val) else []
    if not val:
        raise ValueError("no val conversations: --chats needs --chats-val-fraction > 0 and two or more conversations")
    return TaskMixture(train), TaskMixture(val), which


# -----------------------------------------------------------------------------
# Schedules (nanochat's chat_sft: the LR follows progress through the data, since an epoch's length in
# steps is not known in advance)


def lr_multiplier(progress: float, warmup_ratio: float, warmdown_ratio: float, final_lr_frac: float) -> float:
    # progress counts conversations taken and ends an epoch a little past 1.0; past 1 the LR stays at its
    # final value (nanochat's formula would turn it negative there)
    progress = min(progress, 1.0)
    if progress < warmup_ratio:
        return (progress + 1e-8) / warmup_ratio
    if progress <= 1.0 - warmdown_ratio:
        return 1.0
    decay = (progress - (1.0 - warmdown_ratio)) / warmdown_ratio
    return (1 - decay) * 1.0 + decay * final_lr_frac


def muon_momentum(step: int) -> float:
    frac = min(step / 300, 1)
    return (1 - frac) * 0.85 + frac * 0.95


def set_hyperparams(optimizer, **values) -> None:
    """Write the optimizer's injected hyperparameters (lr_multiplier, muon_momentum) before a step."""
    for name, value in values.items():
        var = optimizer.opt_state.hyperparams[name]
        var[...] = jnp.asarray(value, var.dtype)


# -----------------------------------------------------------------------------
# Model and optimizer from the base checkpoint


def restore_base(model_tag, step, mesh, dtype, with_optimizer: bool, **model_kwargs):
    """(model, optimizer inner state or None, meta, step) restored straight onto the mesh; model_kwargs go to
    GPT (attention, remat)."""
    ckpt = Checkpointer(checkpoint_dir("base", model_tag), async_save=False, read_only=True)
    try:
        meta = ckpt.read_meta(step)
        step = meta["step"]
        config = GPTConfig.from_dict(meta["model_config"])
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype, **model_kwargs))
        base_opt = None
        if with_optimizer and os.path.isdir(os.path.join(ckpt.directory, str(step), "optimizer")):
            # pretraining's optimizer follows a Schedule; only its inner state (moments, momentum buffers)
            # carries over, and that has the same structure whatever the schedule
            base_opt = nnx.eval_shape(lambda m: build_optimizer(m, schedule=Schedule(1)), model)
        ckpt.restore(model, base_opt, step=step, mesh=mesh)
    finally:
        ckpt.close()
    inner = None if base_opt is None else nnx.state(base_opt)["opt_state"]["inner_state"]
    return model, inner, meta, step


def resume(out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref) -> tuple[dict, int]:
    """Restore the latest checkpoint of out_dir into model (its `trainable` Variables), optimizer and train_loader;
    returns (loop state, step). The checkpoint must come from a run with the same base, LoRA settings and readers."""
    ckpt = Checkpointer(out_dir, async_save=False, read_only=True)
    try:
        step = ckpt.latest_step()
        meta = ckpt.read_meta(step)
        if meta.get("lora") != (lora.to_dict() if lora is not None else None) or meta.get("base") != base_ref:
            raise ValueError(
                f"the checkpoint in {out_dir} (step {step}) was trained from {meta.get('base')} with LoRA "
                f"{meta.get('lora')}; these flags ask for {base_ref} with LoRA {lora}"
            )
        if "loop_state" not in meta or meta["loop_state"]["last_step"]:
            raise ValueError(f"the run in {out_dir} already finished at step {step}")
        info = ckpt.restore(model, optimizer, step=step, mesh=mesh, params=trainable)
    finally:
        ckpt.close()
    states = info["data_states"] or []
    if len(states) != jax.process_count():
        raise ValueError(f"the checkpoint has data positions for {len(states)} processes; resume on as many")
    train_loader.set_state(states[jax.process_index()])
    return meta["loop_state"], step


# -----------------------------------------------------------------------------
# Generative checks


REPLY_ROOM = 64  # the reply check only uses prompts that leave at least this many tokens for the reply


def fitting_prompts(dataset, tokenizer, n: int, max_prompt_tokens: int) -> list[dict]:
    """The first n conversations of dataset whose prompt has at most max_prompt_tokens tokens."""
    chosen = []
    for i in range(len(dataset)):
        if len(chosen) == n:
            break
        if len(tokenizer.render_for_completion(dataset[i])) <= max_prompt_tokens:
            chosen.append(dataset[i])
    return chosen


def reply_end_rate(
    model, tokenizer, conversations, max_tokens: int, seed: int = 0, show: int = 3, rows: int = 64
) -> float:
    """Fraction of sampled replies (temperature 1, top-k 50) that end with <|assistant_end|>.

    A reply ends when the model writes <|assistant_end|> or <|bos|>, or is cut at max_tokens; only the first
    counts as a reply that ended. The calculator tool runs as in chat. Conversation i samples with seed + i,
    `rows` conversations a batch.
    """
    engine = Engine(model, tokenizer)
    end = tokenizer.encode_special("<|assistant_end|>")
    ended = 0
    with progress_bar(total=len(conversations), desc="reply check", leave=False, disable=not is_main_process()) as bar:
        for first in range(0, len(conversations), rows):
            batch = conversations[first : first + rows]
            replies = [[] for _ in batch]
            for column, _, live in engine.generate_many(
                [tokenizer.render_for_completion(c) for c in batch],
                max_tokens=max_tokens,
                temperature=1.0,
                top_k=50,
                seeds=[seed + first + i for i in range(len(batch))],
            ):
                for reply, token, going in zip(replies, column, live):
                    if going:
                        reply.append(token)
            for i, (conversation, tokens) in enumerate(zip(batch, replies), start=first):
                ended += int(bool(tokens) and tokens[-1] == end)
                if i < show:
                    print0(f"--- {conversation['messages'][-2]['content'][:120]!r}\n{tokenizer.decode(tokens)}")
            bar.update(len(batch))
    return ended / max(len(conversations), 1)


def sized_evaluation(args, global_batch: int, on_cpu: bool) -> str:
    """Fill in the evaluation sizes left at their defaults (None) and say what they are. nanochat's are for 8 GPUs:
    on a CPU a val pass of 40 x 524,288 tokens, or every MMLU question, would outlast the run."""
    if args.eval_tokens is None:
        args.eval_tokens = CPU_EVAL_BATCHES * global_batch * args.max_seq_len if on_cpu else 40 * 524288
    if args.chatcore_max_cat is None:
        args.chatcore_max_cat = CPU_CHATCORE_CAT if on_cpu else -1
    per_task = "every" if args.chatcore_max_cat < 0 else f"{args.chatcore_max_cat:,}"
    return (
        f"evaluation: {args.eval_tokens:,} val tokens a pass, {per_task} categorical problems per ChatCORE task "
        f"({'CPU' if on_cpu else 'accelerator'} defaults unless set: --eval-tokens, --chatcore-max-cat)"
    )


def run_chatcore(model, tokenizer, args, source: str) -> dict | None:
    """ChatCORE over --chatcore-tasks (flaxchat.eval.chat); {"chatcore", "chatcore_tasks", per-task accuracy}.

    The default tasks whose data this machine lacks, or (HumanEval) whose code no sandbox here may run, are left
    out with a note (None when that is all of them); a task named with --chatcore-tasks must run (FileNotFoundError,
    SandboxUnavailable)."""
    engine = Engine(model, tokenizer)
    accuracies = {}
    chosen = args.chatcore_tasks != build_parser().get_default("chatcore_tasks")
    for name in [t.strip() for t in args.chatcore_tasks.split(",") if t.strip()]:
        categorical = name in ("ARC-Easy", "ARC-Challenge", "MMLU")
        limit = args.chatcore_max_cat if categorical else args.chatcore_max_sample
        try:
            result = chat_eval.run_chat_eval(
                name,
                model,
                tokenizer,
                engine,
                batch_size=args.device_batch_size,
                max_problems=None if limit < 0 else limit,
                source=source,
            )
        except FileNotFoundError as e:
            if chosen:  # named with --chatcore-tasks: its data must be there
                raise
            print0(f"ChatCORE: leaving out {name}, its data is not on this machine: {e}")
            continue
        except SandboxUnavailable as e:  # HumanEval's tests run model-written code: only in a real sandbox
            if chosen:
                raise
            print0(f"ChatCORE: leaving out {name}: {e}")
            continue
        accuracies[name] = result["accuracy"]
    if not accuracies:
        return None
    score, n = chat_eval.chatcore(accuracies)
    return {"chatcore": score, "chatcore_tasks": n, **{f"chatcore/{k}": v for k, v in accuracies.items()}}


# -----------------------------------------------------------------------------
# Main


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    check_args(parser, args)
    user_config = vars(args).copy()

    if args.merge:
        try:
            tag = args.model_tag or find_model_tag("sft")
            output_tag = args.output_tag or f"{tag}-merged"
            if output_tag == tag:
                parser.error("--merge writes a new checkpoint: --output-tag must differ from --model-tag")
            out = merge_lora_checkpoint(tag, args.model_step, output_tag)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: {e}")
        print0(f"merged the LoRA adapters of sft {tag} into full weights: {out}")
        return {"merged": out}

    # your own data first: a bad line stops the run before anything is loaded or trained
    try:
        custom = custom_tasks(args)
    except (OSError, ValueError) as e:  # unreadable or malformed: one line, no traceback
        sys.exit(f"error: {e}")
    lora = None
    if args.lora_rank:
        try:
            full = tuple(n.strip() for n in args.lora_full.split(",") if n.strip() not in ("", "none"))
            lora = LoraConfig(args.lora_rank, args.lora_alpha or 2.0 * args.lora_rank, args.lora_targets, full)
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
    # Base model (and optimizer state), tokenizer, inherited hyperparameters

    try:
        model_tag = args.model_tag or find_model_tag("base")
        model, base_inner, meta, base_step = restore_base(
            model_tag,
            args.model_step,
            mesh,
            dtype,
            bool(args.load_optimizer) and lora is None,
            attention=args.attention,
            remat=args.remat,
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
    inherit(args, meta)
    if args.max_seq_len > model.config.sequence_len:
        parser.error(f"--max-seq-len {args.max_seq_len} exceeds the model's context {model.config.sequence_len}")
    tokens_per_micro = args.device_batch_size * dp * args.max_seq_len
    if args.total_batch_size % tokens_per_micro:
        parser.error(
            f"total batch size {args.total_batch_size:,} is not a multiple of one micro-step "
            f"({args.device_batch_size} x {dp} devices x {args.max_seq_len} = {tokens_per_micro:,})"
        )
    grad_accum = args.total_batch_size // tokens_per_micro
    global_batch = args.device_batch_size * dp
    print0(
        f"micro-batch: {global_batch} x {args.max_seq_len} | grad accumulation: {grad_accum}"
        + model.forms.sub_batch_note(args.device_batch_size, args.max_seq_len, mesh)
    )
    print0(sized_evaluation(args, global_batch, jax.default_backend() == "cpu"))

    if lora is not None:
        # the base stays frozen: only the adapters get gradients and optimizer state, so the base optimizer's
        # moments are of no use here
        try:
            model = apply_lora(model, lora, seed=args.seed)
        except ValueError as e:
            parser.error(str(e))
        optimizer = build_lora_optimizer(model, args.lora_lr, lora)
        trainable = lora.trainable()
        print0(
            f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {len(adapter_modules(model))} matrices ({lora.targets}) | "
            f"AdamW lr {args.lora_lr:g} on the adapters{''.join(', ' + n for n in lora.full)}; the rest frozen"
        )
    else:
        # nanochat: weight decay 0 (pretraining ends with it decayed to zero); LRs x init_lr_frac via the multiplier
        with jax.set_mesh(mesh):
            optimizer = build_optimizer(
                model,
                unembedding_lr=args.unembedding_lr,
                embedding_lr=args.embedding_lr,
                matrix_lr=args.matrix_lr,
                weight_decay=0.0,
            )
        trainable = nnx.Param
        if base_inner is not None:
            nnx.update(optimizer, nnx.State({"opt_state": {"inner_state": base_inner}}))
            print0("optimizer state warm-started from the base checkpoint (moments only; SFT's own LRs)")
        elif args.load_optimizer:
            print0("warning: the base checkpoint has no optimizer state; starting with a fresh optimizer")
    num_trainable = count_params(model, trainable)
    print0(
        f"trainable parameters: {num_trainable:,} (the base model has "
        f"{count_params(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))):,})"
    )
    base_ref = {"phase": "base", "model_tag": model_tag, "step": base_step, "saved_at": meta.get("saved_at")}

    # -------------------------------------------------------------------------
    # Data

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
    train_loader = make_sft_loader(
        train_ds,
        tokenizer,
        global_batch,
        args.max_seq_len,
        mesh=mesh,
        num_batches=args.num_iterations * grad_accum if args.num_iterations > 0 else -1,
    )
    data_source = "hub" if which == "online" else "offline"

    # -------------------------------------------------------------------------
    # Output directory; --resume restores the trained weights (or adapters), optimizer, data position and loop

    out_dir = checkpoint_dir("sft", args.output_tag or args.model_tag or model_tag)
    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    loop = {
        "step": 0,
        "smooth": 0.0,
        "train_time": 0.0,
        "val_bpb": None,
        "min_val_bpb": float("inf"),
        "last_step": False,
        "progress": 0.0,
    }
    resume_step = None
    if args.resume:
        try:
            loop, resume_step = resume(out_dir, model, optimizer, train_loader, mesh, trainable, lora, base_ref)
        except (FileNotFoundError, ValueError) as e:
            sys.exit(f"error: --resume: {e}")
        print0(f"resumed from step {resume_step} of {out_dir}")
    if is_main_process():
        os.makedirs(out_dir, exist_ok=True)
        if resume_step is not None:  # drop what was logged after the checkpoint: it is done again
            rows = (
                [r for r in read_jsonl(metrics_path) if r["step"] <= resume_step]
                if os.path.exists(metrics_path)
                else []
            )
            with open(metrics_path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        elif os.path.exists(metrics_path):
            os.remove(metrics_path)
    flops_per_token = model.estimate_flops()
    peak, _ = peak_flops_per_device(model.dtype)
    log = metrics_logger(metrics_path, args.run, "flaxchat-sft", user_config)

    def for_sampling():
        """The model the Engine samples from: with LoRA the merged one (generation runs forward_cached, which
        qwix's interception of __call__ does not reach)."""
        return merge_lora(model, lora) if lora is not None else model

    def evaluate_val():
        steps = max(1, args.eval_tokens // (global_batch * args.max_seq_len))
        val_loader = make_sft_loader(val_ds, tokenizer, global_batch, args.max_seq_len, mesh=mesh)
        with jax.set_mesh(mesh):
            return evaluate_bpb(model, val_loader, steps, token_bytes, progress=steps >= 20)

    saved_once = resume_step is not None  # a resumed run keeps the checkpoints it continues

    def save(step):
        nonlocal saved_once
        ckpt = Checkpointer(out_dir, keep=args.keep, keep_best=0)
        if not saved_once:
            ckpt.replace_earlier_run()
            saved_once = True
        ckpt.save(
            step,
            model,
            optimizer,
            data_state=train_loader.get_state(),
            params=trainable,
            meta={
                "val_bpb": loop["val_bpb"],
                "user_config": user_config,
                "max_seq_len": args.max_seq_len,
                "device_batch_size": args.device_batch_size,
                "total_batch_size": args.total_batch_size,
                "mixture": which,
                "chats": [list(d) for d in args.chats],
                "base": base_ref,
                "tokenizer_hash": tokenizer.content_hash,
                "git_commit": git_commit(),
                "loop_state": loop,
                **({"lora": lora.to_dict()} if lora is not None else {}),
            },
        )
        ckpt.close()

    # -------------------------------------------------------------------------
    # Training loop: eval at step 0 and every eval_every, train; at the end eval, save, then ChatCORE and the reply
    # check

    bar = progress_bar(
        total=args.num_iterations if args.num_iterations > 0 else None,
        initial=loop["step"],
        desc="sft",
        disable=not is_main_process(),
        dynamic_ncols=True,
    )
    say = bar.write if is_main_process() else (lambda _: None)
    # one jax.jit over the model's and optimizer's arrays, as pretrain calls the step: a call skips NNX's walk over
    # both (train.step.FlatStep)
    optimizer_step = FlatStep(model, optimizer)
    ema, summary = 0.9, {}
    # as in pretraining, one step in flight on GPUs and TPUs (train.step.InFlight); evaluations and saves wait for it
    in_flight = InFlight(in_flight_depth(args.in_flight, jax.default_backend()))

    def record(done):
        """Log a finished step (InFlight's (loss, info, seconds)); None: nothing finished."""
        if done is None:
            return
        loss, (n, lrm, progress, epoch), dt = done  # n: steps done, this one included
        loss = float(loss)
        loop["smooth"] = ema * loop["smooth"] + (1 - ema) * loss
        debiased = loop["smooth"] / (1 - ema**n)
        tok_per_s = args.total_batch_size / dt
        mfu = 100 * flops_per_token * args.total_batch_size / dt / (peak * jax.device_count())
        if n - (resume_step or 0) > 2:  # the first steps compile
            loop["train_time"] += dt
        log(
            {
                "step": n,
                "loss": loss,
                "smooth_loss": debiased,
                "lrm": lrm,
                "dt": dt,
                "tok_per_s": tok_per_s,
                "mfu": mfu,
                "epoch": epoch,
                "progress": progress,
            }
        )
        if args.num_iterations <= 0 and progress > 0:
            bar.total = max(n, round(n / progress))  # steps in one epoch, estimated as we go
        bar.set_postfix(loss=f"{debiased:.4f}", lrm=f"{lrm:.2f}", tok_s=f"{tok_per_s:,.0f}", epoch=epoch, refresh=False)
        bar.update(1)

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
            loop["val_bpb"] = evaluate_val()
            loop["min_val_bpb"] = min(loop["min_val_bpb"], loop["val_bpb"])
            say(f"step {step:05d} | val bpb {loop['val_bpb']:.4f}")
            log({"step": step, "val_bpb": loop["val_bpb"]})
        if do_save:
            save(step)  # before the slower checks, so a failing check never costs the trained model
        if do_chatcore:
            try:
                result = run_chatcore(for_sampling(), tokenizer, args, data_source)
            except (FileNotFoundError, ValueError) as e:
                sys.exit(f"error: ChatCORE: {e} (or turn it off: --chatcore-every -1)")
            if result is None:  # the default check, not a failure of the run
                say(
                    f"step {step:05d} | ChatCORE skipped: none of the ChatCORE tasks' data is on this machine; "
                    "run `python -m tasks.offline --fetch`"
                )
            else:
                say(f"step {step:05d} | ChatCORE {result['chatcore']:.4f} over {result['chatcore_tasks']} tasks")
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

    if args.reply_check > 0:  # every process samples (the Engine runs on the global model); process 0 prints and logs
        prompts = fitting_prompts(val_ds, tokenizer, args.reply_check, model.config.sequence_len - REPLY_ROOM)
        rate = reply_end_rate(
            for_sampling(), tokenizer, prompts, max_tokens=args.max_seq_len // 2 + 128, seed=args.seed
        )
        print0(f"replies ending with <|assistant_end|>: {rate:.1%} of {len(prompts)}")
        log({"step": step, "reply_end_rate": rate})
        summary["reply_end_rate"] = rate

    if is_main_process():
        plot_training(read_jsonl(metrics_path), os.path.join(out_dir, "training.png"), title=f"{model_tag} SFT")
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print0(
        f"SFT done: {step} steps | training time {loop['train_time'] / 60:.2f} min | min val bpb "
        f"{loop['min_val_bpb']:.4f} | trainable parameters {num_trainable:,} | peak RSS {peak_rss_mb:,.0f} MB | "
        f"checkpoint: {out_dir}"
    )
    return {
        "step": step,
        "val_bpb": loop["val_bpb"],
        "min_val_bpb": loop["min_val_bpb"],
        "trainable_params": num_trainable,
        "train_time": loop["train_time"],
        "peak_rss_mb": peak_rss_mb,
        **summary,
    }


if __name__ == "__main__":
    main()
