"""nanochat's MuonAdamW as Optax transforms: its parameter groups, the non-finite skip, base_train's schedules, and
the assembly (muon_adamw, build_optimizer).

Matrices inside the transformer blocks are trained with Muon (flaxchat.train.muon: the orthogonalised update and
its state); embeddings, lm_head and the per-layer / smear scalars with AdamW, each group with nanochat's learning
rate and betas. A step whose gradients are not finite is dropped and counted (skip_nonfinite).

Using it in a train step (see `build_optimizer`):

    optimizer = build_optimizer(model, ..., schedule=Schedule(num_iterations=1000))
    grads = nnx.grad(loss_fn)(model, batch)
    optimizer.update(model, grads)          # inside nnx.jit; schedules read the step count
    optimizer_stats(optimizer)              # lr multiplier, momentum, wd, skipped steps
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from flaxchat.common import compute_dtype, print0
from flaxchat.model.cpu import PLAIN, Forms, forms_of
from flaxchat.train.muon import is_variable, muon, path_names, value_of

# nanochat tuned the AdamW learning rates on a 768-wide model and scales them by (n_embd/768)^-0.5.
REFERENCE_WIDTH = 768


# -----------------------------------------------------------------------------
# nanochat's parameter groups


@dataclasses.dataclass(frozen=True)
class AdamWGroup:
    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float = 1e-10


@dataclasses.dataclass(frozen=True)
class MuonGroup:
    lr: float
    weight_decay: float
    momentum: float = 0.95
    beta2: float = 0.9
    ns_steps: int = 5


def param_group(path: tuple) -> str:
    """nanochat's optimizer group of a parameter, from its path in the model (state_dict names)."""
    match path:
        case ("transformer", "h", *_):
            return "matrix"  # every block weight, ve_gate included -> Muon
        case ("transformer", "wte", "weight"):
            return "embedding"
        case ("lm_head", "weight"):
            return "unembedding"
        case ("value_embeds", _, "weight"):
            return "value_embeds"
        case ("resid_lambdas",):
            return "resid"
        case ("x0_lambdas",):
            return "x0"
        case ("smear_gate", "weight") | ("smear_lambda",) | ("backout_lambda",):
            return "smear"
    raise ValueError(f"parameter {'.'.join(map(str, path))} belongs to no optimizer group; add it to param_group")


def param_groups(n_embd, unembedding_lr, embedding_lr, matrix_lr, weight_decay, scalar_lr) -> dict:
    """The hyperparameters of each group, as nanochat's GPT.setup_optimizer sets them.

    `weight_decay` is Muon's; the AdamW groups keep nanochat's fixed decays.
    """
    s = (n_embd / REFERENCE_WIDTH) ** -0.5
    return {
        "unembedding": AdamWGroup(lr=unembedding_lr * s, betas=(0.8, 0.96), weight_decay=0.01),
        "embedding": AdamWGroup(lr=embedding_lr * s, betas=(0.8, 0.995), weight_decay=0.001),
        "value_embeds": AdamWGroup(lr=embedding_lr * s * 0.5, betas=(0.8, 0.995), weight_decay=0.01),
        "resid": AdamWGroup(lr=scalar_lr * 0.01, betas=(0.8, 0.95), weight_decay=0.05),
        "x0": AdamWGroup(lr=scalar_lr, betas=(0.96, 0.95), weight_decay=0.0),
        "smear": AdamWGroup(lr=0.2, betas=(0.8, 0.95), weight_decay=0.0),
        "matrix": MuonGroup(lr=matrix_lr, weight_decay=weight_decay),
    }


def param_labels(params):
    """Group name of every parameter; works on nnx States with or without Variable wrappers."""
    label = lambda path, _: param_group(path_names(path))
    return jax.tree_util.tree_map_with_path(label, params, is_leaf=is_variable)


def param_axes(model) -> dict:
    """{parameter path: its logical axis names} (the `out_sharding` the model annotated it with)."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=is_variable)[0]
    return {path_names(path): tuple(getattr(v, "out_sharding", None) or (None,) * v.ndim) for path, v in leaves}


def in_float32(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run `inner` in fp32 whatever the parameters' dtype, as nanochat's fused AdamW does for its bf16
    embeddings: the state stays in its own dtype between steps, the math is fp32, and the updates stay
    fp32 so that apply_updates rounds p + u to the parameter dtype once. A no-op for fp32 parameters."""

    def up(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def update(updates, state, params=None):
        new_updates, new_state = inner.update(up(updates), up(state), None if params is None else up(params))
        return new_updates, jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)

    return optax.GradientTransformation(inner.init, update)


# -----------------------------------------------------------------------------
# Non-finite skip


class SkipNonFiniteState(NamedTuple):
    skipped_steps: jax.Array  # () int32, how many updates were dropped
    inner_state: Any


# A gradient element beyond this magnitude drops the step as a non-finite one does. At or below it every square and
# every sum of squares the optimizer takes fits in fp32 (Adam's second moments; Muon's norms over matrices of up to
# 3e8 elements), so an update computed from such gradients is finite. Beyond it a norm can overflow, and MuonEq's
# row scaling (as nanochat's) turns inf / inf into NaN: gradients of 1e20 gave a d2 model NaN matrices.
GRADIENT_LIMIT = 1e15


def all_within(tree, limit) -> jax.Array:
    """Whether every element of every leaf is at most `limit` in magnitude, NaN failing: the max over 0 where an
    element passes and 1 where it does not. On a CPU that is two ops per leaf (the flags, then YNNPACK's max)
    where `all(isfinite(x))` took three (a mask, a tree of partial reductions, the last one). On a mesh the
    cross-device part of a float max is an all-reduce of its own kind, so XLA still combines the gradients' sums
    into one all-reduce (a float sum, e.g. of x - x, would have split them), and no NaN ever reaches a collective,
    whose max might drop it."""
    flags = [jnp.max(jnp.where(jnp.abs(x) <= limit, 0.0, 1.0)) for x in jax.tree.leaves(tree)]
    return jnp.max(jnp.stack(flags)) == 0


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """Drop a step whose gradients are not all finite, or beyond GRADIENT_LIMIT: zero update, inner state kept;
    count it. Below the limit every update is finite (`test_gradients_beyond_the_limit_are_dropped`), so a
    non-finite update is never applied.

    Written here rather than using optax.apply_if_finite, which gives in after `max_consecutive_errors` bad steps
    and lets huge finite gradients through. The check comes first and the whole update runs inside one
    conditional, so the state is updated in place. Checking the updates too, then selecting between the new state
    and the old (as apply_if_finite selects), kept both alive and copied one."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return SkipNonFiniteState(jnp.zeros([], jnp.int32), inner.init(params))

    def update(updates, state, params=None, **extra_args):
        ok = all_within(updates, GRADIENT_LIMIT)
        step = lambda: inner.update(updates, state.inner_state, params, **extra_args)
        # the updates' dtypes may differ from the gradients' (in_float32); an abstract trace, nothing runs twice
        shapes = jax.eval_shape(step)[0]
        skip = lambda: (jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes), state.inner_state)
        new_updates, new_inner = jax.lax.cond(ok, step, skip)
        skipped = state.skipped_steps + jnp.logical_not(ok).astype(jnp.int32)
        return new_updates, SkipNonFiniteState(skipped, new_inner)

    return optax.GradientTransformationExtraArgs(init, update)


def skip_report(step: int, loss: float, skipped_before: int, skipped_now: int) -> str | None:
    """The line a training loop prints when its step was dropped (the skipped count rose), else None."""
    if skipped_now <= skipped_before:
        return None
    why = "non-finite loss" if not math.isfinite(loss) else f"gradients not finite or beyond {GRADIENT_LIMIT:.0e}"
    return f"step {step}: {why}; the update was skipped ({skipped_now} skipped so far)"


# -----------------------------------------------------------------------------
# Schedules (nanochat's base_train), functions of the step; traceable under jit


@dataclasses.dataclass(frozen=True)
class Schedule:
    """LR warmup -> flat -> linear warmdown to final_lr_frac; Muon momentum 0.85 -> 0.97 over 400
    steps and down to 0.90 during the warmdown; Muon weight decay cosine-decayed to zero."""

    num_iterations: int
    warmup_steps: int = 40
    warmdown_ratio: float = 0.65
    final_lr_frac: float = 0.05

    def __post_init__(self):
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be positive, got {self.num_iterations}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.warmdown_ratio <= 1.0:
            raise ValueError(f"warmdown_ratio must be in [0, 1], got {self.warmdown_ratio}")
        if self.final_lr_frac < 0:
            raise ValueError(f"final_lr_frac must be >= 0, got {self.final_lr_frac}")

    @property
    def warmdown_iters(self) -> int:
        return round(self.warmdown_ratio * self.num_iterations)

    def lr_multiplier(self, step):
        step = jnp.asarray(step, jnp.float32)
        n, warmup, warmdown = self.num_iterations, self.warmup_steps, self.warmdown_iters
        progress = (n - step) / max(warmdown, 1)
        decayed = progress * 1.0 + (1 - progress) * self.final_lr_frac
        return jnp.where(step < warmup, (step + 1) / max(warmup, 1), jnp.where(step <= n - warmdown, 1.0, decayed))

    def muon_momentum(self, step):
        step = jnp.asarray(step, jnp.float32)
        warmdown_start = self.num_iterations - self.warmdown_iters
        frac = step / 400
        warming = (1 - frac) * 0.85 + frac * 0.97
        progress = (step - warmdown_start) / max(self.warmdown_iters, 1)
        cooling = 0.97 * (1 - progress) + 0.90 * progress
        return jnp.where(step < 400, warming, jnp.where(step >= warmdown_start, cooling, 0.97))

    def weight_decay_multiplier(self, step):
        step = jnp.asarray(step, jnp.float32)
        return 0.5 * (1 + jnp.cos(math.pi * step / self.num_iterations))


# -----------------------------------------------------------------------------
# The combined optimizer


def muon_adamw(
    groups: dict,
    schedule: Schedule | None = None,
    polar_dtype=jnp.float32,
    param_axes: dict | None = None,
    forms: Forms = PLAIN,
):
    """MuonAdamW over nanochat's groups, with the three per-step knobs as injected hyperparameters.

    lr_multiplier scales every group's learning rate; muon_momentum and muon_weight_decay are
    Muon's. They live in the state (`hyperparams`), so changing them never recompiles. With a
    schedule they follow the update count (a skipped step still advances it, as nanochat's loop
    step does); without one they are constants that a caller may overwrite in the state.
    """

    def factory(lr_multiplier, muon_momentum, muon_weight_decay):
        txs = {}
        for name, g in groups.items():
            if isinstance(g, MuonGroup):
                txs[name] = muon(
                    g.lr * lr_multiplier,
                    muon_momentum,
                    muon_weight_decay,
                    g.beta2,
                    g.ns_steps,
                    polar_dtype,
                    param_axes,
                    forms,
                )
            else:
                # optax.adamw is nanochat's AdamW up to float rounding: same EMA moments, bias
                # corrections on both, eps outside the sqrt, decoupled decay lr*wd*p on the old params.
                txs[name] = in_float32(
                    optax.adamw(g.lr * lr_multiplier, *g.betas, eps=g.eps, weight_decay=g.weight_decay)
                )
        return skip_nonfinite(optax.partition(txs, param_labels))

    matrix = groups["matrix"]
    if schedule is None:
        knobs = dict(lr_multiplier=1.0, muon_momentum=matrix.momentum, muon_weight_decay=matrix.weight_decay)
    else:
        knobs = dict(
            lr_multiplier=schedule.lr_multiplier,
            muon_momentum=schedule.muon_momentum,
            muon_weight_decay=lambda step: matrix.weight_decay * schedule.weight_decay_multiplier(step),
        )
    return optax.inject_hyperparams(factory)(**knobs)


def build_optimizer(
    model,
    unembedding_lr=0.004,
    embedding_lr=0.2,
    matrix_lr=0.02,
    weight_decay=0.0,
    scalar_lr=0.5,
    schedule: Schedule | None = None,
    *,
    polar_dtype=None,
    verbose: bool = True,
) -> nnx.Optimizer:
    """nanochat's GPT.setup_optimizer: an nnx.Optimizer over the model's nnx.Params.

    Arguments are setup_optimizer's (weight_decay is Muon's). Without `schedule` every
    hyperparameter is constant; with `Schedule(num_iterations, ...)` the learning rates, Muon
    momentum and Muon weight decay follow base_train's schedules of the step, where the step is
    the number of `optimizer.update` calls so far (equal to `optimizer.step`). To drive them by
    hand instead (no schedule), set the state before an update, inside or outside jit:

        optimizer.opt_state.hyperparams["lr_multiplier"][...] = 0.5

    (also "muon_momentum", "muon_weight_decay"). `optimizer_stats` reads them back together
    with the count of skipped non-finite steps. `polar_dtype` is the orthogonalisation dtype:
    bf16 when the model computes in bf16 (as nanochat), fp32 otherwise; it is multiplied in the model's forms
    (`model.forms`: on a CPU bf16 products accumulate in fp32).
    """
    if polar_dtype is None:
        polar_dtype = jnp.bfloat16 if getattr(model, "dtype", compute_dtype()) == jnp.bfloat16 else jnp.float32
    n_embd = model.config.n_embd
    if verbose:
        scale = (n_embd / REFERENCE_WIDTH) ** -0.5
        print0(f"Scaling the AdamW learning rates by (n_embd/{REFERENCE_WIDTH})^-0.5 = {scale:.6f}")
    groups = param_groups(n_embd, unembedding_lr, embedding_lr, matrix_lr, weight_decay, scalar_lr)
    tx = muon_adamw(groups, schedule, polar_dtype, param_axes(model), forms_of(model))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def optimizer_stats(optimizer: nnx.Optimizer) -> dict[str, jax.Array]:
    """The hyperparameters of the last update and the number of dropped steps (skip_nonfinite).

    Read off the state's variables one by one: nnx.as_pure would walk every buffer of the optimizer, host time a
    step while the device waits for the next one."""
    state = optimizer.opt_state
    stats = {name: value_of(v) for name, v in state.hyperparams.items()}
    stats["skipped_steps"] = value_of(state.inner_state.skipped_steps)
    return stats


def build_lora_optimizer(model, lr: float, config=None, weight_decay: float = 0.0, betas=(0.9, 0.999)) -> nnx.Optimizer:
    """AdamW over what a model.lora.LoraConfig `config` trains (the adapters, and its `full` parameters): the frozen
    base weights get no gradients and no optimizer state.

    AdamW rather than Muon: the adapters are thin (rank r) matrices, and AdamW is what LoRA was made with; in
    fp32 whatever the parameters' dtype (flaxchat.train.optim.in_float32: the embeddings may be bf16).
    lr_multiplier is an injected hyperparameter, as in flaxchat.train.optim, so the SFT schedule drives it the same
    way; steps with non-finite (or beyond 1e15) gradients are skipped and counted the same way too.
    """

    def factory(lr_multiplier):
        adamw = optax.adamw(lr * lr_multiplier, *betas, eps=1e-8, weight_decay=weight_decay)
        return skip_nonfinite(in_float32(adamw))

    wrt = config.trainable() if config is not None else nnx.LoRAParam
    return nnx.Optimizer(model, optax.inject_hyperparams(factory)(lr_multiplier=1.0), wrt=wrt)
