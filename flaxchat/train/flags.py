"""The training scripts' shared flag groups: batch size, learning rates, LR schedule, compute dtype, wandb run.

scripts.pretrain, sft, rl and bench add these groups to their parsers, so a flag has one name, one type and one
meaning in every script. Defaults are the caller's: nanochat's base_train, chat_sft and chat_rl pick different
ones. A default of FROM_BASE (None) means the script takes the value from the checkpoint it starts from, and the
help says so. A group's optional flags are added only where the caller gives them a default. The model's shape
flags live beside GPTConfig (model.config.add_model_flags), the mesh's in sharding.add_mesh_flags.
"""

from __future__ import annotations

FROM_BASE = None  # a default taken from the base checkpoint's own flags (scripts.sft inherits them)
ABSENT = object()  # an optional flag the caller leaves out of its parser

DTYPE_CHOICES = ("float32", "bfloat16")


def default_note(default, note: str | None = None) -> str:
    """The help's tail: the given note, or, for a FROM_BASE default, where the value comes from."""
    if note:
        return f" ({note})"
    return " (default: pretraining's)" if default is FROM_BASE else ""


def add_run_flag(parser) -> None:
    """--run: the wandb run name (eval.report.metrics_logger logs there)."""
    parser.add_argument(
        "--run", type=str, default="dummy", help="wandb run name ('dummy' disables wandb; needs wandb installed)"
    )


def add_dtype_flag(parser) -> None:
    """--dtype: the compute dtype (common.compute_dtype picks one where it is not given)."""
    parser.add_argument(
        "--dtype",
        type=str,
        default=None,
        choices=DTYPE_CHOICES,
        help="compute dtype (default: bf16 on GPU/TPU, fp32 on CPU; bfloat16 trains faster on CPUs "
        "with AVX512-BF16/AMX: bf16 products, fp32 activations)",
    )


def add_flag(parser, flag: str, type, default, what: str, note: str | None = None) -> None:
    """One flag of a group: its help is `what` and default_note's tail."""
    parser.add_argument(flag, type=type, default=default, help=what + default_note(default, note))


def add_batch_flags(
    parser, device_batch_size, total_batch_size=ABSENT, *, device_help: str | None = None, total_note: str | None = None
) -> None:
    """--device-batch-size (sequences per device per micro-step) and, given a default, --total-batch-size (tokens
    per optimizer step; gradient accumulation makes up the difference). device_help replaces the first's help
    where a script's micro-step is something else (RL's rollouts)."""
    parser.add_argument(
        "--device-batch-size",
        type=int,
        default=device_batch_size,
        help=device_help or "sequences per device per micro-step" + default_note(device_batch_size),
    )
    if total_batch_size is not ABSENT:
        add_flag(parser, "--total-batch-size", int, total_batch_size, "tokens per optimizer step", total_note)


def add_optimizer_flags(
    parser,
    embedding_lr,
    unembedding_lr,
    matrix_lr,
    *,
    scalar_lr=ABSENT,
    weight_decay=ABSENT,
    weight_decay_note: str | None = None,
    init_lr_frac=ABSENT,
) -> None:
    """MuonAdamW's learning rates (train.optim.build_optimizer's groups) and, given defaults, --scalar-lr,
    --weight-decay and --init-lr-frac (every LR scaled by it: fine-tuning starts below pretraining's rates)."""
    add_flag(parser, "--embedding-lr", float, embedding_lr, "AdamW LR for the token embedding")
    add_flag(parser, "--unembedding-lr", float, unembedding_lr, "AdamW LR for lm_head")
    add_flag(parser, "--matrix-lr", float, matrix_lr, "Muon LR for the block matrices")
    if scalar_lr is not ABSENT:
        add_flag(parser, "--scalar-lr", float, scalar_lr, "AdamW LR for the per-layer scalars")
    if weight_decay is not ABSENT:
        add_flag(parser, "--weight-decay", float, weight_decay, "Muon cautious weight decay", weight_decay_note)
    if init_lr_frac is not ABSENT:
        parser.add_argument(
            "--init-lr-frac", type=float, default=init_lr_frac, help="every LR as a fraction of its base value"
        )


def optimizer_lrs(args) -> dict:
    """The learning rates of add_optimizer_flags' group, as train.optim.build_optimizer's keywords."""
    return {"unembedding_lr": args.unembedding_lr, "embedding_lr": args.embedding_lr, "matrix_lr": args.matrix_lr}


def micro_steps(parser, total_batch_size: int, args, dp: int) -> int:
    """Micro-steps per optimizer step (gradient accumulation): the total batch over one micro-step's tokens
    (--device-batch-size rows x dp devices x --max-seq-len), which must divide it (parser.error otherwise)."""
    tokens_per_micro = args.device_batch_size * dp * args.max_seq_len
    if total_batch_size % tokens_per_micro:
        parser.error(
            f"total batch size {total_batch_size:,} tokens is not a multiple of one micro-step "
            f"({args.device_batch_size} x {dp} devices x {args.max_seq_len} = {tokens_per_micro:,})"
        )
    return total_batch_size // tokens_per_micro


def add_schedule_flags(parser, *, warmdown_ratio, final_lr_frac, warmup_steps=ABSENT, warmup_ratio=ABSENT) -> None:
    """The LR schedule's flags: warmup in steps (pretraining knows its horizon) or as a share of the run (SFT
    follows its progress through the data), then the warmdown share and the final LR."""
    if warmup_steps is not ABSENT:
        parser.add_argument("--warmup-steps", type=int, default=warmup_steps, help="LR warmup steps")
    if warmup_ratio is not ABSENT:
        parser.add_argument(
            "--warmup-ratio", type=float, default=warmup_ratio, help="fraction of the run spent in LR warmup"
        )
    parser.add_argument(
        "--warmdown-ratio", type=float, default=warmdown_ratio, help="fraction of the run spent in LR warmdown"
    )
    parser.add_argument("--final-lr-frac", type=float, default=final_lr_frac, help="final LR as a fraction of the peak")
