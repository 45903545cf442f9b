"""nanochat's Muon for the block matrices, as an Optax transform: the orthogonalised update and its state.

One step per matrix, each a pure function below; `muon` chains them into one Optax transform:

    Nesterov momentum -> MuonEq row equilibration -> Polar Express orthogonalisation
    -> Muon+ Frobenius renormalisation -> NorMuon variance reduction
    -> learning rate (shape-scaled) with cautious weight decay

Every reduction after the momentum runs over a matrix's last two axes only, so the functions take
stacks (K, rows, cols) and update each matrix independently of its neighbours. Like nanochat's
DistMuonAdamW, `muon` stacks same-shape matrices and splits the stack across the devices of the
mesh, so each device orthogonalises only its share; the learning rate and weight decay then apply
leaf by leaf, in each parameter's own layout. The optimizer state stays one leaf per parameter
(the checkpoint layout does not depend on the mesh). flaxchat.train.optim puts it together with
AdamW over nanochat's parameter groups (muon_adamw, build_optimizer).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.model.cpu import PLAIN, Forms, split_in_two

# Polar Express coefficients for 5 iterations (safety factor 2e-2, cushion 2), from
# Amsel, Persson, Musco, Gower, "The Polar Express", arXiv:2505.16932 — the values nanochat uses.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


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


def value_of(x):
    """An nnx Variable's array, or x itself."""
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
            value = value_of(p)
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
        params = [value_of(p) for p in treedef.flatten_up_to(params)]
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
