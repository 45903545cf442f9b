"""LoRA adapters on the transformer's block matrices, through qwix's LoRA provider (Hu et al. 2021).

Each targeted Linear keeps its frozen weight W (out, in) and gains two small trainable nnx.LoRAParams beside
it, weight_lora_a (in, r) and weight_lora_b (r, out), so that y = x W^T + (x A) B * alpha / r. B starts at
zero, so a fresh adapter leaves the model unchanged; A starts He-uniform (qwix's defaults).

qwix does the work: `qwix.apply_lora_to_model` runs the model once with its interceptors on, and every einsum
of a matched module whose operand traces back to one of that module's weights gets the low-rank term (and, on
that first run, its parameters). Unlike qwix's PTQ path (see flaxchat/model/quantize.py), LoRA leaves the base weight
as it is, so Linear's `self.weight[...].astype(...)` works, and the block matrices are multiplied in their own
module's frame, where qwix looks for them. What qwix does not cover, and how this module handles it:

- it intercepts one method, `GPT.__call__` (training, val loss). Generation runs `forward_cached`, so anything
  that samples (the reply check, ChatCORE, chat, eval) gets `merge_lora(model)`: W + (A B)^T * alpha / r
  folded into an ordinary GPT, as fast as the base model;
- the lm_head, smear gate and embeddings are not block matrices (the lm_head is multiplied in GPT's frame,
  out of qwix's reach): adapters go on the matrices under transformer.h only. The lm_head (or the embeddings)
  can train in full next to them instead (LoraConfig.full, PEFT's "modules_to_save"): a base model has never
  written the chat's special tokens, and with a frozen lm_head the demo's model never learned to end a reply;
- qwix creates the adapters during one eager call, which must run outside `jax.set_mesh` (see `apply_lora`).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from flaxchat.model.cpu import PLAIN
from flaxchat.model.gpt import GPT, Linear

BLOCK_MATRICES = ("c_q", "c_k", "c_v", "c_proj", "c_fc", "ve_gate")
DEFAULT_TARGETS = "c_q,c_k,c_v,c_proj,c_fc"  # every block matrix but the tiny value-embedding gates
# parameters that may be trained in full next to the adapters (PEFT's "modules_to_save"): name -> path prefix
FULL = {"lm_head": ("lm_head",), "wte": ("transformer", "wte"), "value_embeds": ("value_embeds",)}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """rank r, alpha (the update is scaled by alpha / r), targets (see `target_paths`) and `full`: names of FULL
    trained in full next to the adapters."""

    rank: int
    alpha: float
    targets: str = DEFAULT_TARGETS
    full: tuple[str, ...] = ()

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be positive, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha}")
        unknown = [n for n in self.full if n not in FULL]
        if unknown:
            raise ValueError(f"cannot train {', '.join(unknown)} in full next to LoRA; choose from {', '.join(FULL)}")
        object.__setattr__(self, "full", tuple(self.full))

    def trainable(self):
        """The nnx filter of what trains: the adapters and the `full` parameters."""
        return nnx.Any(nnx.LoRAParam, *(nnx.All(nnx.Param, _under(FULL[n])) for n in self.full))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "full": list(self.full)}

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        return cls(
            rank=int(d["rank"]),
            alpha=float(d["alpha"]),
            targets=d.get("targets", DEFAULT_TARGETS),
            full=tuple(d.get("full", ())),
        )


class AdaptedLinear(Linear):
    """A block matrix that gets a LoRA adapter: qwix intercepts the einsum of its product to add the low-rank term,
    so it multiplies in the plain form (cpu.PLAIN) whatever the model's forms, which could replace that einsum."""

    def __init__(self, linear: Linear):  # pylint: disable=super-init-not-called
        self.weight = linear.weight
        self.forms = PLAIN


def _module_at(model, path: tuple):
    return functools.reduce(lambda node, k: node[k] if isinstance(k, int) else getattr(node, k), path, model)


def _under(prefix: tuple):
    """An nnx filter: Variables whose path starts with `prefix`."""
    return lambda path, _: tuple(path[: len(prefix)]) == prefix


def target_paths(model: GPT, targets: str) -> list[str]:
    """Module paths ("transformer/h/0/attn/c_q") of the block matrices that `targets` names.

    targets: a comma list of matrix names (c_q,c_k,c_v,c_proj,c_fc,ve_gate; c_proj means both the attention's
    and the MLP's), or a regular expression matched against whole module paths, e.g. "transformer/h/[23]/mlp/.*".
    """
    names = [n.strip() for n in targets.split(",") if n.strip()]
    if names and all(n in BLOCK_MATRICES for n in names):
        pattern = r"transformer/h/\d+/(attn|mlp)/(" + "|".join(names) + ")"
    else:
        try:
            re.compile(targets)
        except re.error as e:
            raise ValueError(
                f"--lora-targets {targets!r} is neither a list of {', '.join(BLOCK_MATRICES)} nor a "
                f"regular expression ({e})"
            ) from None
        pattern = targets
    paths = [
        "/".join(map(str, path))
        for path, m in nnx.iter_modules(model)
        if isinstance(m, Linear) and path[:2] == ("transformer", "h")
    ]
    chosen = [p for p in paths if re.fullmatch(pattern, p)]
    if not chosen:
        raise ValueError(f"--lora-targets {targets!r} matches no block matrix; paths look like {paths[0]}")
    return chosen


def apply_lora(model: GPT, config: LoraConfig, seed: int = 0) -> GPT:
    """A copy of `model` (sharing its arrays) with adapters on the target matrices, each sharded like its weight.

    Call it outside `jax.set_mesh`: qwix runs the model eagerly once, and the model's per-shard kernels only run
    eagerly without a mesh context (the arrays keep their shardings either way)."""
    paths = target_paths(model, config.targets)
    provider = qwix.LoraProvider(module_path="|".join(map(re.escape, paths)), rank=config.rank, alpha=config.alpha)
    model = nnx.clone(model)  # its targets become AdaptedLinears; the caller's model stays as it is
    for path, m in list(nnx.iter_modules(model)):
        if "/".join(map(str, path)) in paths:
            setattr(_module_at(model, path[:-1]), path[-1], AdaptedLinear(m))
    idx = jnp.zeros((1, min(8, model.config.sequence_len)), jnp.int32)  # qwix creates the adapters on one call
    with warnings.catch_warnings():  # qwix 0.1.8 reads Variable.value, which flax 0.12 deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        lora_model = qwix.apply_lora_to_model(model, provider, idx, rngs=nnx.Rngs(seed))
    if len(adapter_modules(lora_model)) != len(paths):  # qwix found a weight in every target, or we say so
        raise ValueError(f"qwix put adapters on {len(adapter_modules(lora_model))} of {len(paths)} target matrices")
    return lora_model


def adapter_modules(model) -> list[tuple[tuple, Linear]]:
    """(path, Linear) of every Linear that carries an adapter."""
    return [(path, m) for path, m in nnx.iter_modules(model) if isinstance(m, Linear) and hasattr(m, "weight_lora_a")]


def count_params(model, what=nnx.Param) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, what)))


@functools.partial(jax.jit, static_argnums=3)
def _merged(w, a, b, scale):
    # w (out, in); a (in, r); b (r, out): x W^T + x A B s = x (W + s (A B)^T)^T
    return (w.astype(jnp.float32) + scale * (a.astype(jnp.float32) @ b.astype(jnp.float32)).T).astype(w.dtype)


def merge_lora(model, config: LoraConfig) -> GPT:
    """An ordinary GPT whose targeted weights are W + (A B)^T * alpha / r; every other array is shared."""
    kwargs = dict(dtype=model.dtype, attention=model.attention, remat=model.remat, forms=model.forms)
    plain = nnx.eval_shape(lambda: GPT(model.config, rngs=nnx.Rngs(0), **kwargs))
    nnx.update(plain, nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))
    for path, m in adapter_modules(model):
        _module_at(plain, path).weight.set_value(
            _merged(m.weight[...], m.weight_lora_a[...], m.weight_lora_b[...], config.scale)
        )
    return plain


# -----------------------------------------------------------------------------
# scripts.sft's LoRA flags


def add_lora_flags(p) -> None:
    """--lora-rank, --lora-alpha, --lora-targets, --lora-full and --lora-lr (lora_from_args reads them)."""
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


def lora_from_args(args) -> LoraConfig | None:
    """The LoraConfig of --lora-rank (None: 0, full fine-tuning), alpha 2 x rank unless --lora-alpha is given.
    ValueError: a bad rank, alpha or --lora-full name."""
    if not args.lora_rank:
        return None
    full = tuple(n.strip() for n in args.lora_full.split(",") if n.strip() not in ("", "none"))
    return LoraConfig(args.lora_rank, args.lora_alpha or 2.0 * args.lora_rank, args.lora_targets, full)
