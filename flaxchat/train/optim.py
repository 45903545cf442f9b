"""nanochat's MuonAdamW as Optax transforms, its parameter groups, and base_train's schedules.

Matrices inside the transformer blocks are trained with Muon; embeddings, lm_head and the
per-layer / smear scalars with AdamW, each group with nanochat's learning rate and betas.

Muon, one step per matrix (each a pure function below; `muon` chains them into one Optax transform):

    Nesterov momentum -> MuonEq row equilibration -> Polar Express orthogonalisation
    -> Muon+ Frobenius renormalisation -> NorMuon variance reduction
    -> learning rate (shape-scaled) with cautious weight decay

Every reduction after the momentum runs over a matrix's last two axes only, so the functions take
stacks (K, rows, cols) and update each matrix independently of its neighbours. Like nanochat's
DistMuonAdamW, `muon` stacks same-shape matrices and splits the stack across the devices of the
mesh, so each device orthogonalises only its share; the learning rate and weight decay then apply
leaf by leaf, in each parameter's own layout. The optimizer state stays one leaf per parameter
(the checkpoint layout does not depend on the mesh).

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
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.common import compute_dtype, print0
from flaxchat.model.cpu import PLAIN, Forms, forms_of, split_in_two

# Polar Express coefficients for 5 iterations (safety factor 2e-2, cushion 2), from
# Amsel, Persson, Musco, Gower, "The Polar Express", arXiv:2505.16932 — the values nanochat uses.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)

# nanochat tuned the AdamW learning rates on a 768-wide model and scales them by (n_embd/768)^-0.5.
REFERENCE_WIDTH = 768


# -----------------------------------------------------------------------------
# Muon, one pure function per step (arrays (..., rows, cols); reductions over the last two axes)


def lerp(start, end, weight):
    """torch.lerp's formula (nanochat's moving averages use it): the branch depends on the weight
    so that both ends are reproduced exactly."""
    small = start + weight * (end - start)
    large = end - (end - start) * (1 - weight)
    return jnp.where(jnp.abs(weight) < 0.5, small, large)


def _frobenius_norm(x):
    """Norm over the last two axes in fp32, returned in x's dtype (as torch's norm of bf16 does)."""
    xf = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(xf * xf, axis=(-2, -1), keepdims=True)).astype(x.dtype)


def nesterov_momentum(grad, momentum_buffer, momentum):
    """Nesterov momentum in EMA form: buffer <- lerp(buffer, g, 1-m); update = lerp(g, buffer, m)."""
    momentum = jnp.asarray(momentum, grad.dtype)
    momentum_buffer = lerp(momentum_buffer, grad, 1 - momentum)
    return lerp(grad, momentum_buffer, momentum), momentum_buffer


def equilibrate_rows(x):
    """MuonEq (arXiv:2603.28254): rescale every row to the mean row norm, so the spectrum entering
    the orthogonalisation is better conditioned. Norms in fp32, the product in x's dtype."""
    xf = x.astype(jnp.float32)
    target = jnp.sqrt(jnp.sum(xf * xf, axis=(-2, -1), keepdims=True)) / (x.shape[-2] ** 0.5)
    row_norm = jnp.maximum(jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True)), 1e-6)
    return x * (target / row_norm).astype(x.dtype)


def _scale(c: float, x):
    """c * x with c kept in fp32 and one rounding to x's dtype, as torch treats a Python scalar.
    A bare `c * x` in JAX first rounds c to x's dtype: in bf16 8.1566 becomes 8.125, which
    roughly doubles the error of a bf16 Polar Express."""
    return (jnp.float32(c) * x.astype(jnp.float32)).astype(x.dtype)


def polar_express(x, ns_steps: int = 5, forms: Forms = PLAIN):
    """Approximate the orthogonal polar factor of x with Polar Express quintic iterations.

    The 1.01 margin keeps the spectral norm strictly below one after the Frobenius
    normalisation. The Gram matrix is formed on the short side, so the cost is min(rows, cols)^2.
    An fp32 matrix at least twice as long as it is wide takes the Gram form (polar_express_gram), the
    same iterates with about half the products. forms: the model's (flaxchat.model.cpu.Forms).
    """
    denom = _scale(1.01, _frobenius_norm(x))
    x = x / (denom + jnp.asarray(1e-6, x.dtype))
    # "highest" so that an fp32 orthogonalisation really is fp32 on TPU/GPU; bf16 in the model's forms (on a CPU
    # its products accumulate in fp32, twice as fast as fp32 ones: bf16_products)
    if x.dtype == jnp.bfloat16:
        mm = lambda a, b: forms.einsum("...ij,...jk->...ik", a, b)
    else:
        mm = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)
    tall = x.shape[-2] > x.shape[-1]
    if x.dtype == jnp.float32 and max(x.shape[-2:]) >= GRAM_FORM_MIN_ASPECT * min(x.shape[-2:]):
        return polar_express_gram(x, ns_steps, tall, mm, forms)
    for a, b, c in POLAR_EXPRESS_COEFFS[:ns_steps]:
        gram = gram_matrix(x, tall, mm, forms)
        if tall:
            x = _scale(a, x) + mm(x, _scale(b, gram) + _scale(c, mm(gram, gram)))
        else:
            x = _scale(a, x) + mm(_scale(b, gram) + _scale(c, mm(gram, gram)), x)
    return x


# the Gram form pays off from this aspect ratio on: per iteration it costs 4 short-side products instead of
# 2 * aspect + 1, plus 2 * aspect once
GRAM_FORM_MIN_ASPECT = 2


def polar_express_gram(x, ns_steps: int, tall: bool, mm, forms: Forms = PLAIN):
    """polar_express's iterates kept as x0 @ q (tall; q @ x0 wide), with q a short-side square matrix.

    Each step x <- a x + b x g + c x g^2 (g = x^T x) is x <- x p(g), and every matrix in play is a polynomial
    in g0 = x0^T x0, so they commute: q <- q p, g <- p g p. Only g0 and the final x0 @ q touch the long side,
    so a 4:1 matrix (nanochat's MLP) orthogonalises in about half the time of the direct iteration; in fp32 it
    lands closer to the float64 iterates than the direct form does (6e-7 against 2.3e-6 at a (4, 1024, 256)
    stack: fewer roundings of long-side products). In bf16 the drift of g away from the iterates' real Gram
    matrix would matter, so bf16 keeps the direct form.
    """
    g = gram_matrix(x, tall, mm, forms)
    eye = jnp.eye(g.shape[-1], dtype=g.dtype)
    q = None
    for i, (a, b, c) in enumerate(POLAR_EXPRESS_COEFFS[:ns_steps]):
        p = _scale(a, eye) + _scale(b, g) + _scale(c, mm(g, g))
        q = p if q is None else mm(q, p) if tall else mm(p, q)
        if i + 1 < ns_steps:
            g = mm(mm(p, g), p)
    if q is None:
        return x
    return mm(x, q) if tall else mm(q, x)


def gram_matrix(x, tall: bool, mm, forms: Forms = PLAIN):
    """x^T x (tall) or x x^T (wide), the short side's Gram matrix of a stack of matrices.

    bf16 under bf16_products (a CPU's forms): the long side is split in two (cpu.split_in_two), so the product runs
    in XLA:CPU's bf16 kernel instead of in fp32. Same sums (an fp32 accumulation of the same products)."""
    axis = -2 if tall else -1
    if not (forms.widened(x) and x.shape[axis] % 2 == 0):
        return mm(jnp.swapaxes(x, -1, -2), x) if tall else mm(x, jnp.swapaxes(x, -1, -2))
    halves = split_in_two(x, axis)
    return forms.einsum("...bji,...bjk->...ik" if tall else "...ibj,...kbj->...ik", halves, halves)


def renormalize(x):
    """Muon+ (arXiv:2602.21545): snap the Frobenius norm to sqrt(min(rows, cols)), the norm of an
    exactly semi-orthogonal matrix, undoing under-convergence of the polar iteration."""
    target = min(x.shape[-2], x.shape[-1]) ** 0.5
    current = jnp.maximum(_frobenius_norm(x.astype(jnp.float32)), 1e-6)
    return x * (target / current).astype(x.dtype)


def normuon_reduction_axis(shape) -> int:
    """NorMuon keeps one second moment per row of a tall/square matrix, per column of a wide one."""
    return -1 if shape[-2] >= shape[-1] else -2


def normuon_state_shape(shape) -> tuple[int, ...]:
    axis = len(shape) + normuon_reduction_axis(shape)
    return tuple(1 if i == axis else n for i, n in enumerate(shape))


def normuon_variance_reduction(g, second_momentum_buffer, beta2):
    """NorMuon (arXiv:2510.05491): per-neuron adaptive step sizes from an EMA of the mean squared
    update, rescaled so the update keeps the Frobenius norm it had before."""
    axis = normuon_reduction_axis(g.shape)
    n = g.shape[axis]
    gf = g.astype(jnp.float32)
    v_mean = jnp.mean(gf * gf, axis=axis, keepdims=True)
    v_norm = jnp.sqrt(jnp.sum(v_mean, axis=(-2, -1), keepdims=True) * n)
    beta2 = jnp.asarray(beta2, g.dtype)
    second_momentum_buffer = lerp(second_momentum_buffer, v_mean.astype(second_momentum_buffer.dtype), 1 - beta2)
    step_size = jax.lax.rsqrt(jnp.maximum(second_momentum_buffer, 1e-10))
    scaled_sq_sum = (v_mean * n) * jnp.square(step_size.astype(jnp.float32))
    v_norm_new = jnp.sqrt(jnp.sum(scaled_sq_sum, axis=(-2, -1), keepdims=True))
    final_scale = step_size * (v_norm / jnp.maximum(v_norm_new, 1e-10))
    return g * final_scale.astype(g.dtype), second_momentum_buffer


def muon_lr_scale(shape) -> float:
    """Tall matrices take a larger step, sqrt(rows/cols) (nanochat; shapes in (out, in) layout)."""
    return max(1.0, shape[-2] / shape[-1]) ** 0.5


def cautious_weight_decay_update(g, param, lr, weight_decay):
    """The additive update -(lr*g + lr*wd*p*mask): weight decay only where the update and the
    parameter agree in sign (cautious weight decay), so decay never fights the gradient step."""
    lr = jnp.asarray(lr, g.dtype)
    weight_decay = jnp.asarray(weight_decay, g.dtype)
    mask = (g * param) >= 0
    return -(lr * g + lr * weight_decay * param * mask)


# -----------------------------------------------------------------------------
# Muon as an Optax transform, distributed over the devices of the mesh
#
# The momentum is elementwise and stays in each parameter's own layout. Everything after it costs
# O(rows * cols * min(rows, cols)) per matrix, so it is split across devices the way nanochat's
# DistMuonAdamW splits it across ranks: same-shape matrices are stacked (K, rows, cols), the stack is
# padded to a multiple of the device count and sharded along K ('stack' in flaxchat.sharding), each
# device orthogonalises its own matrices, and XLA gathers the finished updates back into the
# parameters' layouts (one all-gather per shape). Padding matrices are zero and give zero updates.


SHARE_OUT_MIN_SIZE = 2**14  # smaller matrices are orthogonalised whole on every device: moving them costs more


class MuonState(NamedTuple):
    momentum_buffer: Any  # per matrix, the parameter's shape
    second_momentum_buffer: Any  # per matrix, NorMuon's factored shape (one entry per row or column)


def _value(x):
    return x.get_value() if isinstance(x, nnx.Variable) else x


def is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _buffer_axes(axes, shape) -> tuple:
    """Logical axes of a matrix's NorMuon buffer: the matrix's own minus the one the buffer collapses to size 1
    (none at all for a matrix small enough to be orthogonalised whole on every device)."""
    axes = [None] * len(axes) if math.prod(shape) < SHARE_OUT_MIN_SIZE else list(axes)
    axes[normuon_reduction_axis(shape)] = None
    return tuple(axes)


def orthogonalized_update(g, second_momentum_buffer, *, beta2, ns_steps, polar_dtype, dtype, forms=PLAIN):
    """Muon's steps after the momentum, for g of shape (..., rows, cols); returns (direction, new NorMuon buffer),
    the direction before the learning rate and weight decay (cautious_weight_decay_update, leaf by leaf).

    Equilibration and Polar Express run in polar_dtype (bf16 when that is the compute dtype, as nanochat),
    the rest in dtype (the parameters').
    """
    g = equilibrate_rows(g.astype(polar_dtype))
    g = polar_express(g, ns_steps, forms).astype(dtype)
    g = renormalize(g)
    return normuon_variance_reduction(g, second_momentum_buffer, beta2)


def _stack(arrays, size, layouts):
    """Stack same-shape arrays into (size, ...) with zero padding, then share the stack out over the mesh."""
    x = jnp.stack(arrays)
    x = jnp.pad(x, ((0, size - len(arrays)),) + ((0, 0),) * (x.ndim - 1))
    for spec in layouts:
        x = jax.lax.with_sharding_constraint(x, spec)
    return x


def _unstack(x, n, layouts):
    """The stack back to its arrays, the layouts walked backwards from the one _stack ended on: pinning the result
    to that split too keeps XLA from partitioning the orthogonalisation's products some other way."""
    for spec in layouts[::-1]:
        x = jax.lax.with_sharding_constraint(x, spec)
    return [x[i] for i in range(n)]


def muon(
    learning_rate,
    momentum=0.95,
    weight_decay=0.0,
    beta2=0.9,
    ns_steps: int = 5,
    polar_dtype=jnp.float32,
    param_axes: dict | None = None,
    forms: Forms = PLAIN,
) -> optax.GradientTransformation:
    """nanochat's Muon for matrices (torch layout (out, in)); returns additive updates; needs params.

    param_axes: {parameter path: logical axis names}, for sharing the orthogonalisations out over a mesh
    without gathering whole stacks (see `sharding.stack_layouts`); unknown paths count as unsplit. forms: the
    model's (flaxchat.model.cpu.Forms), for the orthogonalisation's bf16 products.
    """
    param_axes = param_axes or {}

    def init(params):
        def zeros(p):
            if p.ndim < 2:
                raise ValueError(f"Muon needs matrices, got a parameter of shape {p.shape}")
            return jnp.zeros_like(p)

        def factored(p):  # laid out as update() leaves it (a different start would recompile the step after one)
            value = _value(p)
            buffer = jnp.zeros(normuon_state_shape(value.shape), value.dtype)
            axes = getattr(p, "out_sharding", None) if is_variable(p) else None
            if axes is None:
                return buffer
            axes = _buffer_axes(axes, value.shape)
            return p.replace(value=sharding.constrain(buffer, axes), out_sharding=axes)

        # the momentum keeps each parameter's sharding annotation (tree.map rewraps nnx Variables)
        return MuonState(jax.tree.map(zeros, params), jax.tree.map(factored, params, is_leaf=is_variable))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("Muon's cautious weight decay needs the parameters: pass params to update()")
        with_paths, treedef = jax.tree_util.tree_flatten_with_path(updates)
        grads = [g for _, g in with_paths]
        params = [_value(p) for p in treedef.flatten_up_to(params)]
        buffers = treedef.flatten_up_to(state.momentum_buffer)
        second = treedef.flatten_up_to(state.second_momentum_buffer)
        stepped = [nesterov_momentum(g, b, momentum) for g, b in zip(grads, buffers)]
        directions = [s[0] for s in stepped]
        out, new_second = [None] * len(grads), list(second)
        # same shape, dtype and layout on the mesh -> one stack
        groups: dict[tuple, list[int]] = {}
        for i, (path, g) in enumerate(with_paths):
            axes = tuple(param_axes.get(path_names(path)) or (None,) * g.ndim)
            if math.prod(g.shape) < SHARE_OUT_MIN_SIZE:  # tiny (ve_gate): every device does the whole stack
                layouts = v_layouts = () if sharding.context_mesh() is None else (P(),)
            else:  # NorMuon's buffers are not split along the axis they collapse
                layouts = tuple(sharding.stack_layouts(axes))
                v_layouts = tuple(sharding.stack_layouts(_buffer_axes(axes, g.shape)))
            groups.setdefault((g.shape, g.dtype, layouts, v_layouts), []).append(i)
        for (_, _, layouts, v_layouts), idx in groups.items():
            shards = sharding.stack_size() if len(layouts) > 1 else 1
            size = -(-len(idx) // shards) * shards
            g = _stack([directions[i] for i in idx], size, layouts)
            v = _stack([second[i] for i in idx], size, v_layouts)
            u, v = orthogonalized_update(
                g, v, beta2=beta2, ns_steps=ns_steps, polar_dtype=polar_dtype, dtype=params[idx[0]].dtype, forms=forms
            )
            lr = learning_rate * muon_lr_scale(g.shape)
            # the weight decay's sign test reads the parameters where they live: only the directions travel
            # to the stack's layout and back, never the parameters
            for i, ui, vi in zip(idx, _unstack(u, len(idx), layouts), _unstack(v, len(idx), v_layouts)):
                out[i] = cautious_weight_decay_update(ui, params[i], lr, weight_decay)
                new_second[i] = vi
        new_state = MuonState(treedef.unflatten([s[1] for s in stepped]), treedef.unflatten(new_second))
        return treedef.unflatten(out), new_state

    return optax.GradientTransformation(init, update)


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


def path_names(path) -> tuple:
    names = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            names.append(key.key)
        elif isinstance(key, jax.tree_util.SequenceKey):
            names.append(key.idx)
        elif isinstance(key, jax.tree_util.GetAttrKey):
            names.append(key.name)
        else:
            names.append(str(key))
    return tuple(names)


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
    stats = {name: _value(v) for name, v in state.hyperparams.items()}
    stats["skipped_steps"] = _value(state.inner_state.skipped_steps)
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
