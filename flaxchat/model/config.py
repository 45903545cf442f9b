"""Model configuration and the one dial: `--depth` sizes everything.

Field names follow nanochat's GPTConfig so readers can diff the two.
"""

from __future__ import annotations

import dataclasses
import json
import math


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6  # query heads
    n_kv_head: int = 6  # key/value heads (GQA when < n_head)
    n_embd: int = 768
    # Tiled over layers; S = short window (quarter context rounded up to 128), L = full context.
    # The last layer is always L.
    window_pattern: str = "SSSL"

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.n_kv_head > self.n_head or self.n_head % self.n_kv_head:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if not self.window_pattern or any(c not in "SL" for c in self.window_pattern.upper()):
            raise ValueError(f"window_pattern={self.window_pattern!r} may only contain S and L")
        if min(self.sequence_len, self.vocab_size, self.n_layer) < 1:
            raise ValueError("sequence_len, vocab_size and n_layer must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Vocab rounded up to a multiple of 64 (efficient matmuls); logits are cropped back."""
        return -(-self.vocab_size // 64) * 64

    def window_sizes(self) -> list[int]:
        """Per-layer left window (tokens before the current one that a query may see).

        A window w means keys at positions i-w..i are visible (FlashAttention's convention).
        """
        long_window = self.sequence_len
        short_window = -(-long_window // 4 // 128) * 128  # quarter context, ceil to 128 (2048 -> 512)
        pattern = self.window_pattern.upper()
        sizes = [long_window if pattern[i % len(pattern)] == "L" else short_window for i in range(self.n_layer)]
        sizes[-1] = long_window
        return sizes

    def has_ve(self, layer_idx: int) -> bool:
        """Value embeddings on alternating layers, the last layer always included."""
        return layer_idx % 2 == (self.n_layer - 1) % 2

    @classmethod
    def from_depth(
        cls,
        depth: int,
        aspect_ratio: int = 64,
        head_dim: int = 128,
        max_seq_len: int = 2048,
        window_pattern: str = "SSSL",
        vocab_size: int = 32768,
        n_kv_head: int | None = None,
    ) -> "GPTConfig":
        """nanochat's base_train sizing: width = depth * aspect_ratio rounded up to a multiple of head_dim."""
        if depth < 1 or aspect_ratio < 1 or head_dim < 1:
            raise ValueError("depth, aspect_ratio and head_dim must be positive")
        model_dim = -(-(depth * aspect_ratio) // head_dim) * head_dim
        n_head = model_dim // head_dim
        return cls(
            sequence_len=max_seq_len,
            vocab_size=vocab_size,
            n_layer=depth,
            n_head=n_head,
            n_kv_head=n_head if n_kv_head is None else n_kv_head,
            n_embd=model_dim,
            window_pattern=window_pattern,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown GPTConfig fields: {sorted(unknown)}")
        return cls(**d)

    def describe(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


# =============================================================================
# Training hyperparameters derived from depth (nanochat's base_train scaling rules)
#
# d12 is the reference where nanochat tuned batch size, learning rates and weight decay; other
# depths get them by scaling laws. The model's parameter counts and FLOPs come in as arguments
# (GPT.num_scaling_params() / estimate_flops(), and the d12 model's counts, e.g. via nnx.eval_shape).

REFERENCE_BATCH_SIZE = 2**19  # B_ref: tokens per step measured best for d12


def scaling_params(counts: dict) -> int:
    """The parameters that scaling laws count: transformer matrices + lm_head (nanochat's choice,
    the cleanest fit in its experiments)."""
    return counts["transformer_matrices"] + counts["lm_head"]


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    depth: int
    num_scaling_params: int
    flops_per_token: int
    target_tokens: int  # target_param_data_ratio * scaling params
    total_batch_size: int  # tokens per optimizer step
    batch_size_derived: bool  # False when given by the user
    batch_lr_scale: float
    embedding_lr: float
    unembedding_lr: float
    matrix_lr: float
    scalar_lr: float
    weight_decay: float  # Muon's, after scaling (its schedule decays it from here)
    num_iterations: int
    horizon: str  # which flag set num_iterations

    @property
    def total_tokens(self) -> int:
        return self.total_batch_size * self.num_iterations

    @property
    def total_flops(self) -> int:
        return self.flops_per_token * self.total_tokens

    def describe(self) -> str:
        how = "derived from the horizon, Bopt ∝ D^0.383" if self.batch_size_derived else "given"
        return "\n".join(
            [
                f"training plan for depth {self.depth}:",
                f"  scaling params (matrices + lm_head): {self.num_scaling_params:,}",
                f"  FLOPs per token: {self.flops_per_token:e}",
                f"  total batch size: {self.total_batch_size:,} tokens ({how})",
                f"  LR scale for batch size (sqrt(B/{REFERENCE_BATCH_SIZE:,})): {self.batch_lr_scale:.4f}",
                f"  LRs: embedding {self.embedding_lr:.6g}, unembedding {self.unembedding_lr:.6g}, "
                f"matrix {self.matrix_lr:.6g}, scalar {self.scalar_lr:.6g}",
                f"  Muon weight decay: {self.weight_decay:.6f}",
                f"  iterations: {self.num_iterations:,} ({self.horizon})",
                f"  total tokens: {self.total_tokens:,} | tokens : scaling params = "
                f"{self.total_tokens / self.num_scaling_params:.2f} | total FLOPs: {self.total_flops:e}",
            ]
        )


def _horizon(num_iterations, target_flops, target_param_data_ratio, flops_per_token, batch, target_tokens):
    """nanochat's precedence: explicit iterations, then a FLOPs budget, then the data:param ratio."""
    if num_iterations > 0:
        return num_iterations, "--num-iterations"
    if target_flops > 0:
        return round(target_flops / (flops_per_token * batch)), f"--target-flops {target_flops:e}"
    if target_param_data_ratio > 0:
        return target_tokens // batch, f"--target-param-data-ratio {target_param_data_ratio:g}"
    raise ValueError("no training horizon: set --num-iterations, --target-flops or --target-param-data-ratio > 0")


def derive_training(
    depth: int,
    num_scaling_params: dict,
    flops_per_token: int,
    reference_scaling_params: dict,
    *,
    target_param_data_ratio: float = 12.0,
    target_flops: float = -1.0,
    num_iterations: int = -1,
    total_batch_size: int = -1,
    embedding_lr: float = 0.3,
    unembedding_lr: float = 0.008,
    matrix_lr: float = 0.02,
    scalar_lr: float = 0.5,
    weight_decay: float = 0.28,
    scale_hparams: bool = True,
) -> TrainingPlan:
    """Batch size, learning rates, weight decay and horizon as nanochat's base_train computes them.

    `num_scaling_params` / `reference_scaling_params` are num_scaling_params() dicts of the model
    and of the d12 reference built with the same width rules; defaults are base_train's flags.
    """
    if target_param_data_ratio == 0:
        raise ValueError("--target-param-data-ratio must be positive, or -1 to leave the horizon to other flags")
    if total_batch_size == 0 or total_batch_size < -1:
        raise ValueError(f"--total-batch-size must be positive or -1 (derive), got {total_batch_size}")
    n_params = scaling_params(num_scaling_params)
    # Horizon in tokens at the target ratio, for this model and for d12. The ratio cancels in the
    # batch-size and weight-decay rules below, so they stay meaningful when it is -1 (disabled).
    target_tokens = int(target_param_data_ratio * n_params)
    reference_tokens = target_param_data_ratio * scaling_params(reference_scaling_params)

    derived = total_batch_size == -1
    if derived:  # Power Lines (arXiv:2505.13738): optimal batch grows as D^0.383; snap to a power of 2
        predicted = REFERENCE_BATCH_SIZE * (target_tokens / reference_tokens) ** 0.383
        total_batch_size = 2 ** round(math.log2(predicted))
    batch_ratio = total_batch_size / REFERENCE_BATCH_SIZE
    batch_lr_scale, wd_scale = 1.0, 1.0
    if scale_hparams:
        batch_lr_scale = batch_ratio**0.5 if batch_ratio != 1.0 else 1.0  # eta ∝ sqrt(B/B_ref), AdamW-style
        # Constant T_epoch = B/(eta*lambda*D) (arXiv:2405.13698) with eta ∝ sqrt(B): lambda ∝ sqrt(B/B_ref) * D_ref/D.
        wd_scale = math.sqrt(batch_ratio) * (reference_tokens / target_tokens)
    # scale_hparams=False is for tiny CPU runs: batches ~100x below d12's make the sqrt rule shrink every LR ~10x,
    # which stalls a few hundred steps of training (docs/LOG.md has a d2 run each way).
    weight_decay = weight_decay * wd_scale

    iterations, horizon = _horizon(
        num_iterations, target_flops, target_param_data_ratio, flops_per_token, total_batch_size, target_tokens
    )
    if iterations < 1:
        raise ValueError(
            f"{horizon} gives {iterations} iterations at {total_batch_size:,} tokens per step; "
            "raise the target or lower --total-batch-size"
        )
    return TrainingPlan(
        depth=depth,
        num_scaling_params=n_params,
        flops_per_token=flops_per_token,
        target_tokens=target_tokens,
        total_batch_size=total_batch_size,
        batch_size_derived=derived,
        batch_lr_scale=batch_lr_scale,
        embedding_lr=embedding_lr * batch_lr_scale,
        unembedding_lr=unembedding_lr * batch_lr_scale,
        matrix_lr=matrix_lr * batch_lr_scale,
        scalar_lr=scalar_lr * batch_lr_scale,
        weight_decay=weight_decay,
        num_iterations=iterations,
        horizon=horizon,
    )


# =============================================================================
# Command-line flags for the model's shape, shared by every script that builds a model


def add_model_flags(parser, depth: int = 20, max_seq_len: int = 2048) -> None:
    """--depth, --aspect-ratio, --head-dim, --max-seq-len, --window-pattern (nanochat's base_train flags)."""
    parser.add_argument("--depth", type=int, default=depth, help="number of layers; width and heads follow from it")
    parser.add_argument(
        "--aspect-ratio", type=int, default=64, help="model_dim = depth * aspect_ratio (rounded up to head_dim)"
    )
    parser.add_argument("--head-dim", type=int, default=128, help="attention head dimension")
    parser.add_argument("--max-seq-len", type=int, default=max_seq_len, help="context length")
    parser.add_argument(
        "--window-pattern",
        type=str,
        default="SSSL",
        help="sliding windows tiled over layers: L=full, S=quarter context",
    )


def config_from_flags(args, vocab_size: int) -> GPTConfig:
    """GPTConfig from add_model_flags' values; raises ValueError with a one-line reason on bad values."""
    for name in ("depth", "aspect_ratio", "head_dim", "max_seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return GPTConfig.from_depth(
        args.depth, args.aspect_ratio, args.head_dim, args.max_seq_len, args.window_pattern.upper(), vocab_size
    )
