"""The GPT's loss: lm_head, logit soft-cap and cross-entropy, fused and computed chunk by chunk of rows.

Materialising (B*T, vocab) logits dominates a small model's step (a 4096 x 32768 fp32 tensor is 512 MB, written
and re-read several times). Computing them chunk by chunk, and producing the gradients of x and lm_head in the
same pass (as Liger's fused linear cross-entropy does), keeps every pass cache-sized. On a mesh each device runs
this on its own rows only (a shard_map over the batch axes): chunking the global rows instead would put the
sharding on the chunk axis and make every device compute every chunk.

`loss_sum` is the training loss (a custom VJP: its gradients come out of the forward pass), `token_losses` the
per-token losses, `softcapped_logits` the logits themselves. Each takes the model's `forms` (model/cpu.py) and
computes in them: the plain forms, or on a CPU smaller chunks and XLA:CPU's forms of the same products.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from flaxchat import sharding

SOFTCAP = 15.0  # nanochat's logit soft-cap: SOFTCAP * tanh(logits / SOFTCAP), in (-15, 15)

# Most bytes of (fp32) logits per chunk: thousands of rows per chunk keep the products large, and the chunks' logits
# are transient (a few of them live at once). A CPU's forms takes smaller chunks (loss_chunks).
LOSS_CHUNK_BYTES = 512 * 2**20


def chunk_rows(n_rows, vocab_size, forms):
    """Rows per chunk of the fused loss: as many as LOSS_CHUNK_BYTES of fp32 logits hold, or the forms's."""
    return forms.loss_chunk_rows(n_rows, vocab_size, LOSS_CHUNK_BYTES)


def softcapped_logits(x, w, vocab_size, forms):
    """x (n, C) against lm_head w (Vp, C) -> soft-capped fp32 logits (n, vocab_size); padded vocab rows dropped
    (vocab_size None: all Vp of them kept).

    The product comes out in the compute dtype, as nanochat's lm_head does: a bf16 run rounds its logits to bf16
    before the fp32 soft-cap (the same numbers as nanochat's), and on a GPU the largest tensor of the step is
    written and read back at half the bytes."""
    logits = forms.logits(x, w.astype(x.dtype))  # (n, Vp) fp32: the einsum's result in x's dtype, widened
    logits = logits if vocab_size is None else logits[:, :vocab_size]
    return SOFTCAP * jnp.tanh(logits / SOFTCAP)


def _token_losses(z, t, lse):
    """z (n, V) soft-capped logits, t (n,) targets with -1 = ignore, lse (n,) z's log-sum-exp -> per-token loss
    (0 where ignored)."""
    zt = jnp.take_along_axis(z, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
    return jnp.where(t >= 0, lse - zt, 0.0)


def _in_chunks(x, t, chunk):
    """Pad rows to a multiple of chunk (padded targets are -1) and reshape to (n_chunks, chunk, ...)."""
    n = x.shape[0]
    pad = (-n) % chunk
    x = jnp.pad(x, ((0, pad), (0, 0)))
    t = jnp.pad(t, (0, pad), constant_values=-1)
    return x.reshape(-1, chunk, x.shape[-1]), t.reshape(-1, chunk)


def _over_rows(f, x, targets, w, row_outputs):
    """f(x, targets, w, axes) on each device's own rows; row_outputs flags which outputs are per row."""
    axes = sharding.free_axes(sharding.BATCH_AXES)
    rows = P(axes)
    out_specs = tuple(rows if r else P() for r in row_outputs)
    return sharding.per_shard(functools.partial(f, axes=axes), axes, (rows, rows, P()), out_specs)(x, targets, w)


def _local_token_losses(x, targets, w, vocab_size, forms, axes):
    chunk = chunk_rows(x.shape[0], vocab_size, forms)
    xs, ts = _in_chunks(x, targets, chunk)

    def chunk_losses(a):
        z = softcapped_logits(a[0], w, vocab_size, forms)
        return _token_losses(z, a[1], jax.nn.logsumexp(z, axis=-1))

    losses = jax.lax.map(chunk_losses, (xs, ts))
    return (losses.reshape(-1)[: x.shape[0]],)


def token_losses(x, w, targets, vocab_size, forms):
    """Per-token cross-entropy (N,) of rows x (N, C) against lm_head w (Vp, C); computed chunk by chunk."""
    f = functools.partial(_local_token_losses, vocab_size=vocab_size, forms=forms)
    return _over_rows(f, x, targets, w, (True,))[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def loss_sum(x, w, targets, vocab_size, forms):
    """Sum of per-token losses; its gradient is computed in the forward pass (see the module's docstring)."""
    return _loss_sum_fwd(x, w, targets, vocab_size, forms)[0]


def _local_loss_and_grads(x, targets, w, vocab_size, forms, axes):
    """Loss sum and the gradients of x and w over this device's rows; sums over devices via psum."""
    n, C = x.shape
    chunk = chunk_rows(n, vocab_size, forms)
    xs, ts = _in_chunks(x, targets, chunk)
    pad_v = w.shape[0] - vocab_size
    wc = w.astype(x.dtype)  # lm_head in the compute dtype, for the logits and x's gradient
    head_grad = forms.lm_head_grad(chunk)  # how the chunks' lm_head gradients add up, in fp32

    def step(carry, a):
        total, dw = carry
        xc, tc = a
        # logits over all Vp columns, the padded ones' exp(z) zeroed: they add nothing to the sum, and their
        # gradient, e / sum - one-hot, is 0. A crop to the vocab and a pad back to Vp would copy the chunk's
        # logits twice
        z = softcapped_logits(xc, wc, None, forms)
        # |z| < SOFTCAP, so exp(z) cannot overflow (a row sums to at most V * e^15): the log-sum-exp needs no max
        # pass, the softmax reuses exp(z) and the target's one-hot is subtracted in the gradient's pass (no
        # scatter)
        e, cols = jnp.exp(z), jnp.arange(z.shape[-1])[None, :]
        if pad_v:
            e = jnp.where(cols < vocab_size, e, 0.0)
        total_e = jnp.sum(e, axis=-1)
        losses = _token_losses(z, tc, jnp.log(total_e))
        valid = (tc >= 0)[:, None]
        onehot = cols == tc[:, None]
        dz = e * (1.0 / total_e)[:, None] - onehot  # softmax minus the target's one-hot
        dlogits = jnp.where(valid, dz * (1.0 - jnp.square(z / SOFTCAP)), 0.0)  # through the tanh soft-cap
        # the two gradient matmuls run in the compute dtype and accumulate in fp32 (as autocast's backward does),
        # so bf16 runs do not pay for fp32 matmuls here
        # |dlogits| <= 1, and 0 or at least e**-30 / vocab x 2**-24 (a probability times a soft-cap factor of 0 or
        # at least 2**-24), far above 2**-109, which a CPU's forms may round by arithmetic (Forms.astype)
        dlogits = forms.astype(dlogits, x.dtype)
        dx = jnp.einsum("nv,vc->nc", dlogits, wc, preferred_element_type=jnp.float32).astype(x.dtype)
        dw = head_grad.add(dw, xc, dlogits)  # + dlogits^T xc
        return (total + jnp.sum(losses), dw), dx

    init = (jnp.zeros((), jnp.float32), head_grad.zeros(w.shape))
    (total, dw), dxs = jax.lax.scan(step, init, (xs, ts))
    dw = head_grad.total(dw)  # (Vp, C)
    dx = dxs.reshape(-1, C)[:n]
    return sharding.psum(total, axes), dx, sharding.psum(dw.astype(w.dtype), axes)


def _loss_sum_fwd(x, w, targets, vocab_size, forms):
    f = functools.partial(_local_loss_and_grads, vocab_size=vocab_size, forms=forms)
    total, dx, dw = _over_rows(f, x, targets, w, (False, True, False))
    return total, (dx, dw, targets)


def _loss_sum_bwd(vocab_size, forms, res, g):
    dx, dw, targets = res
    return (g * dx).astype(dx.dtype), g * dw, np.zeros(targets.shape, dtype=jax.dtypes.float0)


loss_sum.defvjp(_loss_sum_fwd, _loss_sum_bwd)
