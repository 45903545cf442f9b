"""XLA:CPU-only fast paths, and the one interface through which the model, its loss and the train step reach them.

`Forms` says how a model computes: a frozen dataclass of the paths below that are on, chosen once when the model is
built (`GPT(config, ...)` calls `forms_for(dtype)`) and held as `model.forms`. The model's Linears and attention, its
loss and the train step ask it for each form (a Linear's product, the loss's chunks and lm_head gradient, a
micro-batch's sub-batches), and none of them reads the backend or the switch below again. Off the CPU backend a
model's forms are PLAIN: every form is the plain one that `model/gpt.py`, `model/loss.py` and `train/step.py` would
write inline (each method says which), and a reader can skip the rest of this module. On a CPU the paths below are
on: each computes the same numbers in a form XLA's CPU backend runs faster.

The switch: FLAXCHAT_CPU_PATHS=0 turns every path off (the plain forms then run on the CPU too);
FLAXCHAT_CPU_PATHS=-loss_chunks,-sub_batches turns the named paths off and keeps the rest. Unset (or 1), every path
runs. It is read when a model is built (`forms_for`; also by `int8_options`, for generation programs). The paths:

    chunked_attention   causal attention a cache-sized chunk of rows and query blocks at a time
    sub_batches         a micro-batch's rows in sub-batches of CPU_SUB_BATCH_TOKENS (training and evaluation)
    loss_chunks         the fused loss in chunks of at most LOSS_CHUNK_ROWS rows, lm_head's gradient transposed
    bf16_products       bf16 models: bf16 operands multiplied into fp32, fp32 activations (as torch's autocast)
    matmul_form         a decode step's row as x @ w.T, which XLA:CPU runs as one fused loop over w's rows
    int8_vectors        generation programs over int8 weights compiled for 512-bit vectors (AVX-512)

Each earns its place: without it the laptop demo's pretraining step (or batch-1 decode) takes at least 3% longer
(docs/cpu-speed.md has the figures, docs/LOG.md the sitting); tests/test_cpu.py checks that a model built with every
path gives the numbers of one built with none.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from flaxchat import sharding

PATHS = ("chunked_attention", "sub_batches", "loss_chunks", "bf16_products", "matmul_form", "int8_vectors")
SWITCH = "FLAXCHAT_CPU_PATHS"
# Helpers that only change how a product is computed: a compiled program's source lines (perf.hlo.op_sources, a
# profile's lines) name the line that called them, as for jnp.einsum itself
PASS_THROUGH = frozenset(
    {"einsum", "_widened_einsum", "_widened_einsum_fwd", "_widened_einsum_bwd", "linear", "_widened", "add", "logits"}
)


def switched_off() -> set[str]:
    """The paths FLAXCHAT_CPU_PATHS turns off: all of them for 0 (or "none", "off"), those named with a leading '-'
    in a comma-separated list, none when unset or 1. An unknown name is an error."""
    value = os.environ.get(SWITCH, "").strip().lower()
    if value in ("", "1", "all", "on"):
        return set()
    if value in ("0", "none", "off"):
        return set(PATHS)
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if not n.startswith("-") or n[1:] not in PATHS]
    if unknown:
        raise ValueError(f"{SWITCH}={value!r}: give 0, 1 or -NAME,... with NAME among {', '.join(PATHS)}")
    return {n[1:] for n in names}


# -----------------------------------------------------------------------------
# The interface


@dataclasses.dataclass(frozen=True)
class Forms:
    """How a model computes: one flag per path of PATHS (PLAIN: none), and `products`, the dtype of a bf16 model's
    products beside its fp32 activations (bf16_products on a bf16 model), or None. Held by the model, its Linears and
    its attention; the loss and the train step take the model's. Hashable, and static under jit."""

    chunked_attention: bool = False
    sub_batches: bool = False
    loss_chunks: bool = False
    bf16_products: bool = False
    matmul_form: bool = False
    int8_vectors: bool = False
    products: Any = None

    def __post_init__(self):
        if self.products is not None and not self.bf16_products:
            raise ValueError("bf16 products beside wider activations need bf16_products")

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths that are on (for logs and tests)."""
        return tuple(name for name in PATHS if getattr(self, name))

    def activation_dtype(self, dtype):
        """The dtype a model of compute dtype `dtype` keeps its training forward's activations in: fp32 beside bf16
        products (bf16_products), else `dtype`. bf16 is then the products' dtype only, as under torch's autocast:
        norms, rotary, softmax and the residual stream stay fp32, since XLA:CPU rounds the result of every bf16
        elementwise op back to bf16 and runs such chains several times slower than fp32 ones."""
        return jnp.float32 if self.products is not None and jnp.dtype(dtype) == self.products else dtype

    def residual_dtype(self, dtype):
        """The dtype attention's output projection answers in, for a residual stream of `dtype`: that dtype beside
        bf16 products (the chunked kernel answers in bf16; the projection's result goes back to the fp32 stream),
        else None (its operand's dtype, the plain form)."""
        return None if self.products is None else dtype

    def widened(self, *operands) -> bool:
        """Whether a product of these operands (all bf16) asks XLA for an fp32 result (bf16_products). XLA:CPU's
        library multiplies bf16 into fp32 with the CPU's bf16 instructions (AVX512-BF16, AMX) at up to twice its
        fp32 rate, while a bf16 result takes a path slower than fp32 (upcast operands)."""
        return self.bf16_products and all(x.dtype == jnp.bfloat16 for x in operands)

    def einsum(self, spec: str, a, b, out_dtype=None):
        """jnp.einsum(spec, a, b) with the result in out_dtype (default a's); bf16 operands under bf16_products
        multiply into fp32 (module-level `einsum`)."""
        if self.widened(a, b):
            return einsum(spec, a, b, out_dtype)
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.dtype(out_dtype or a.dtype))

    def linear(self, x, w, out_dtype=None):
        """x (..., in) @ w (out, in).T as a Linear computes it, w in x's dtype, the result in out_dtype (default
        x's): plain, jnp.einsum("...i,oi->...o", x, w). On a CPU, beside wider activations (products) the operands
        in `products`; bf16 operands multiplied into fp32 (bf16_products); and one row (a decode step) as
        x @ w.T (matmul_form), which lowers to one fused loop of contiguous dot products over w's rows, where the
        einsum form becomes a library call that repacks the weight first."""
        if self.products is not None and x.dtype != self.products:
            return self.einsum("...i,oi->...o", x.astype(self.products), w.astype(self.products), out_dtype or x.dtype)
        w = w.astype(x.dtype)
        if self.widened(x, w):
            return einsum("...i,oi->...o", x, w, out_dtype)
        if self.matmul_form and math.prod(x.shape[:-1]) == 1:
            return jnp.matmul(x, w.T, preferred_element_type=out_dtype)
        return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=out_dtype)

    # --- the fused loss (model/loss.py) ---

    def loss_chunk_rows(self, n_rows: int, vocab_size: int, most_bytes: int) -> int:
        """Rows per chunk of the fused loss: as many as `most_bytes` of fp32 logits hold (at least 8), and under
        loss_chunks at most LOSS_CHUNK_BYTES and LOSS_CHUNK_ROWS (see there)."""
        most_bytes, most_rows = (LOSS_CHUNK_BYTES, LOSS_CHUNK_ROWS) if self.loss_chunks else (most_bytes, n_rows)
        return min(n_rows, max(8, most_bytes // (4 * vocab_size)), most_rows)

    def logits(self, x, w):
        """x (n, C) @ w (Vp, C).T, both in the compute dtype, as fp32 values of a product rounded to that dtype:
        plain, the product's own result widened. bf16 under bf16_products: an fp32 product rounded to bf16's values
        in fp32 (bf16_grid), the same numbers but for an infinite logit (an overflowed product)."""
        if self.widened(x, w):
            return bf16_grid(einsum("nc,vc->nv", x, w, out_dtype=jnp.float32))
        return jnp.einsum("nc,vc->nv", x, w).astype(jnp.float32)

    def astype(self, x, dtype):
        """fp32 x.astype(dtype); to bf16 under bf16_products by bf16_grid's arithmetic (to_bf16: 0 or finite values
        of at least 2**-109 only), which XLA:CPU runs at the speed of the fusion around it."""
        return to_bf16(x) if self.bf16_products and jnp.dtype(dtype) == jnp.bfloat16 else x.astype(dtype)

    def lm_head_grad(self, chunk: int) -> LmHeadGrad:
        """How the fused loss sums its chunks' lm_head gradients: transposed under loss_chunks for a chunk of an
        even number of rows (LmHeadGrad)."""
        return LmHeadGrad(transposed=self.loss_chunks and chunk % 2 == 0)

    # --- sub-batches (train/step.py, evaluation) ---

    def n_sub_batches(self, rows: int, seq_len: int, splits_model: bool = False) -> int:
        """How many sub-batches a micro-batch of `rows` rows (one device's) runs in: the fewest that divide the rows
        into at most CPU_SUB_BATCH_TOKENS tokens each (one row each when a row alone is longer); 1 without
        sub_batches, and when the mesh splits the model (`splits_model`: FSDP or tensor parallelism, whose weight
        gathers and activation sums would then run once per sub-batch)."""
        if splits_model or not self.sub_batches:
            return 1
        return next(
            k for k in range(1, rows + 1) if rows % k == 0 and rows // k * seq_len <= CPU_SUB_BATCH_TOKENS or k == rows
        )

    def sub_batch_note(self, rows: int, seq_len: int, mesh) -> str:
        """The training loops' note on sub-batches for their micro-batch line ("" when a micro-batch runs whole)."""
        k = self.n_sub_batches(rows, seq_len, splits_model=any(mesh.shape[a] > 1 for a in sharding.MODEL_AXES))
        if k == 1:
            return ""
        return (
            f" | on this CPU each device's {rows} rows run as {k} sub-batches of {rows // k} "
            "(model.cpu.CPU_SUB_BATCH_TOKENS)"
        )

    # --- generation programs ---

    def int8_options(self, params) -> tuple:
        """XLA options for generation programs over these parameters, as (name, value) pairs (int8_vectors): int8
        weights get 512-bit vectors where the processor has them. Their matrix-vector products are XLA's own
        loops that convert each weight as they read it, bound by that conversion rather than by memory, and run
        markedly faster that wide; float weights go through library kernels or stream from memory and gain
        nothing."""
        if self.int8_vectors and any(x.dtype == jnp.int8 for x in jax.tree.leaves(params)):
            return (("xla_cpu_prefer_vector_width", 512),)
        return ()


PLAIN = Forms()  # every backend's forms but XLA:CPU's, and a CPU's with FLAXCHAT_CPU_PATHS=0


def forms_for(dtype=None, backend: str | None = None) -> Forms:
    """The forms of a model of compute dtype `dtype` on `backend` (default: JAX's): on the CPU backend every path
    FLAXCHAT_CPU_PATHS leaves on, elsewhere PLAIN. GPT calls this once, when it is built."""
    if (backend or jax.default_backend()) != "cpu":
        return PLAIN
    off = switched_off()
    on = {name: name not in off for name in PATHS}
    bf16 = dtype is not None and jnp.dtype(dtype) == jnp.bfloat16
    return Forms(**on, products=jnp.dtype(jnp.bfloat16) if on["bf16_products"] and bf16 else None)


def forms_of(model) -> Forms:
    """A model's forms: a GPT's own, this backend's for any other model (a stand-in in the tests)."""
    return getattr(model, "forms", None) or forms_for()


def int8_options(params) -> tuple:
    """Forms.int8_options of this process's forms (`forms_for()`), for generation code that holds parameters rather
    than a model: XLA options for generation programs over these parameters, as (name, value) pairs."""
    return forms_for().int8_options(params)


# -----------------------------------------------------------------------------
# bf16 products beside fp32 activations


def split_in_two(x, axis: int):
    """x with `axis` (of even length) split into two axes (2, n/2), to contract over both.

    A bf16 product that contracts the leading (row) axis of both operands (a weight gradient) or a stacked
    product of a matrix with its own transpose is one XLA:CPU's bf16 kernels do not take: XLA converts the
    operands and multiplies at the fp32 rate. Contracting over two axes instead, XLA first lays the operand out
    for the library's bf16 kernel (a transposing copy) and the product runs at the bf16 rate."""
    axis = axis % x.ndim
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1 :])


def einsum(spec: str, a, b, out_dtype=None):
    """jnp.einsum(spec, a, b); out_dtype defaults to a's dtype. bf16 operands multiply into fp32 and round once to
    out_dtype (bf16_products' form), and so do both gradients (the cotangent is rounded to bf16 first, as in a bf16
    backward pass): JAX's own transpose of such a product would multiply in fp32. The result equals a bf16
    product's (one rounding of an fp32 accumulation) up to summation order."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if a.dtype == b.dtype == jnp.bfloat16:
        return _widened_einsum(spec, out_dtype, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _widened_einsum(spec, out_dtype, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _widened_einsum_fwd(spec, out_dtype, a, b):
    return _widened_einsum(spec, out_dtype, a, b), (a, b)


def _widened_einsum_bwd(spec, out_dtype, res, g):
    a, b = res
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32).astype(a.dtype)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32).astype(b.dtype)
    return da, db


_widened_einsum.defvjp(_widened_einsum_fwd, _widened_einsum_bwd)


@jax.custom_jvp
def bf16_grid(x):
    """fp32 x rounded to the nearest bf16 value (ties to even), kept in fp32: the same numbers as
    x.astype(bf16).astype(fp32) for 0 and every finite |x| >= 2**-109 (checked for each such fp32 value); NaN
    stays NaN, +-inf becomes NaN, and a smaller |x| lands within 2**-109 of its bf16 value.

    Veltkamp's split with sigma = 2**16 + 1 leaves 24 - 16 = 8 significant bits; x is scaled by 2**-17 around it
    so that sigma * x cannot overflow. Products and sums only, which XLA:CPU runs at the speed of the fusion
    around them; its own conversion to bf16 (and as much as a clip or a select beside the soft-cap's tanh) makes
    the loss's soft-cap and gradient passes several times slower than in fp32. Gradients pass through unchanged
    (the product's own backward rounds them to bf16)."""
    s = x * 2.0**-17
    t = s * 65537.0
    return (t - (t - s)) * 2.0**17


bf16_grid.defjvp(lambda primals, tangents: (bf16_grid(primals[0]), tangents[0]))


def to_bf16(x):
    """x.astype(bf16) for fp32 x, 0 or finite with |x| >= 2**-109 (see bf16_grid): the high 16 bits of its bf16
    value, taken as a bf16 array."""
    bits = jax.lax.bitcast_convert_type(bf16_grid(x), jnp.uint32) >> 16
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


# -----------------------------------------------------------------------------
# Chunked causal attention


# chunked attention: scores per chunk of rows at most this many bytes (about half a core's L2 cache), query blocks
# of _query_block rows
CHUNK_SCORE_BYTES = 512 * 2**10
# bf16 products gain on larger batches than fp32 ones, so the bf16 path's chunks are larger
BF16_CHUNK_SCORE_BYTES = 2 * 2**20


def _query_block(T: int, head_dim: int) -> int:
    return min(T, 64 if head_dim <= 64 else 128)


def _query_blocks(T: int, head_dim: int, window: int):
    """(start, stop, lo) of each query block: queries [start, stop) over the keys they can see, [lo, stop)."""
    block = _query_block(T, head_dim)
    return [(a, min(T, a + block), max(0, a - window)) for a in range(0, T, block)]


def _rows_per_chunk(rows: int, heads: int, T: int, head_dim: int, window: int, score_bytes: int) -> int:
    """The most rows (a divisor of `rows`) whose fp32 scores for one query block fit in score_bytes."""
    block = _query_block(T, head_dim)
    n = max(1, min(rows, score_bytes // (4 * heads * block * min(T, window + block))))
    while rows % n:
        n -= 1
    return n


def _visible(start, stop, lo, window):
    """(stop - start, stop - lo) mask: which of the keys [lo, stop) queries [start, stop) may see (causal, within
    the window)."""
    qpos, kpos = jnp.arange(start, stop)[:, None], jnp.arange(lo, stop)[None, :]
    return (kpos <= qpos) & (qpos - kpos <= window)


def _window_softmax(s, start, stop, lo, window, dtype):
    """Softmax over the keys [lo, stop) that queries [start, stop) may see."""
    s = jnp.where(_visible(start, stop, lo, window), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def _attend_block(q, k, v, window, start, stop, lo, heads_major=False):
    """Queries [start, stop) over the keys they can see, [lo, stop) (_query_blocks); GQA by grouping.
    q, k, v: (B, T, H, D), or one row's (T, H, D); the output likewise. heads_major: they come as (B, H, T, D) or
    (H, T, D) (no GQA), the output too."""
    b = "b" if q.ndim == 4 else ""  # a batch of rows, or one row without a row axis
    if heads_major:
        s = jnp.einsum(
            f"{b}ktd,{b}ksd->{b}kts", q[..., start:stop, :], k[..., lo:stop, :], preferred_element_type=jnp.float32
        )
        p = _window_softmax(s * q.shape[-1] ** -0.5, start, stop, lo, window, q.dtype)
        return jnp.einsum(f"{b}kts,{b}ksd->{b}ktd", p, v[..., lo:stop, :])
    *rows, _, H, D = q.shape
    Hkv = k.shape[-2]
    # without GQA the group axis is left out: XLA:CPU's fused reductions over (..., 1, t, s) scores run several
    # times slower than over (..., t, s) ones
    flat = H == Hkv
    qb = q[..., start:stop, :, :]
    qb = qb if flat else qb.reshape(*rows, stop - start, Hkv, H // Hkv, D)
    g = "" if flat else "g"
    s = jnp.einsum(f"{b}tk{g}d,{b}skd->{b}k{g}ts", qb, k[..., lo:stop, :, :], preferred_element_type=jnp.float32)
    p = _window_softmax(s * D**-0.5, start, stop, lo, window, q.dtype)
    return jnp.einsum(f"{b}k{g}ts,{b}skd->{b}tk{g}d", p, v[..., lo:stop, :, :]).reshape(*rows, stop - start, H, D)


def chunked_attention(q, k, v, window, forms: Forms = PLAIN):
    """Causal windowed attention equal to the dense path: rows in chunks whose scores fit in cache (lax.map), each
    chunk's queries in blocks that see only the keys causality and the window allow, and each chunk recomputed in
    the backward pass (jax.checkpoint) so no (B, H, T, T) tensor ever reaches memory; runs per shard on a mesh.
    Beside wider activations (forms.products) q, k and v are rounded to the products' dtype first, as nanochat's
    bf16 attention, and the output stays in it; bf16 q, k and v under bf16_products take the flash-style path
    below (_bf16_chunks)."""
    if forms.products is not None:
        q, k, v = (t.astype(forms.products) for t in (q, k, v))
    if forms.widened(q, k, v):
        return sharding.per_shard_heads(functools.partial(_bf16_chunks, window=window), q, k, v)
    B, T, H, D = q.shape
    # heads-major without GQA: q, k and v transposed once per layer instead of every block's key and value slices
    # once per block
    heads_major = H == k.shape[2]

    def rows(q, k, v):
        blocks = [_attend_block(q, k, v, window, *span, heads_major) for span in _query_blocks(T, D, window)]
        return jnp.concatenate(blocks, axis=-2 if heads_major else -3)

    def local(q, k, v):
        b = q.shape[0]
        n = _rows_per_chunk(b, q.shape[2], T, D, window, CHUNK_SCORE_BYTES)
        if heads_major:
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        # one row a chunk goes without a row axis: XLA:CPU's fused reductions over a size-1 axis run several times
        # slower
        split = (lambda x: x) if n == 1 else (lambda x: x.reshape(b // n, n, *x.shape[1:]))
        out = jax.lax.map(jax.checkpoint(lambda a: rows(*a)), (split(q), split(k), split(v)))
        out = out.reshape(q.shape)  # q as attended: heads-major or not
        return out.transpose(0, 2, 1, 3) if heads_major else out

    return sharding.per_shard_heads(local, q, k, v)


# bf16 (q, k and v rounded to bf16, as in nanochat's bf16 attention): the same query blocks, flash style. Products
# multiply bf16 into fp32, the softmax is fp32, and the backward is written out (_bf16_flash_bwd): it keeps each
# row's log-sum-exp instead of recomputing the chunk, and the key and value gradients, which contract the query
# axis, split it in two so that XLA:CPU's bf16 kernel takes them (split_in_two; autodiff's form of those products
# runs at its fp32 rate or below).


def _bf16_chunks(q, k, v, window):
    """The bf16 path's chunks of rows: (B, T, H, D) q and (B, T, Hkv, D) k, v in bf16 -> (B, T, H, D) bf16."""
    B, T, H, D = q.shape
    Hkv = k.shape[2]
    n = _rows_per_chunk(B, H, T, D, window, BF16_CHUNK_SCORE_BYTES)
    # heads-major, each chunk's rows and kv heads on one axis; GQA's query heads grouped under their kv head (no
    # group axis without GQA: XLA:CPU's reductions over a size-1 axis are slow, see _attend_block)
    group = (H // Hkv,) if H != Hkv else ()
    q = q.transpose(0, 2, 1, 3).reshape(B // n, n * Hkv, *group, T, D)
    k, v = (x.transpose(0, 2, 1, 3).reshape(B // n, n * Hkv, T, D) for x in (k, v))
    if B == n:
        out = _bf16_flash(*(x.reshape(x.shape[1:]) for x in (q, k, v)), window)
    else:
        out = jax.lax.map(lambda a: _bf16_flash(*a, window), (q, k, v))
    return out.reshape(B, H, T, D).transpose(0, 2, 1, 3)


def _widened(spec, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _bf16_scores(q, k, start, stop, lo):
    """Queries [start, stop)'s scaled fp32 scores over keys [lo, stop): (N, [G,] stop - start, stop - lo)."""
    g = "g" if q.ndim == 4 else ""
    return _widened(f"n{g}td,nsd->n{g}ts", q[..., start:stop, :], k[:, lo:stop]) * q.shape[-1] ** -0.5


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _bf16_flash(q, k, v, window):
    """Causal windowed attention in bf16: q (N, T, D), or (N, G, T, D) with G query heads a kv head (GQA); k, v
    (N, T, D), N a chunk's rows times kv heads. The output is q's shape, bf16."""
    return _bf16_flash_fwd(q, k, v, window)[0]


def _bf16_flash_fwd(q, k, v, window):
    T, D = q.shape[-2:]
    g = "g" if q.ndim == 4 else ""
    outs, lses = [], []
    for start, stop, lo in _query_blocks(T, D, window):
        s = jnp.where(_visible(start, stop, lo, window), _bf16_scores(q, k, start, stop, lo), -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        p = jnp.exp(s - m)
        total = jnp.sum(p, axis=-1, keepdims=True)
        p = (p / total).astype(q.dtype)
        outs.append(_widened(f"n{g}ts,nsd->n{g}td", p, v[:, lo:stop]).astype(q.dtype))
        lses.append(m + jnp.log(total))
    out = jnp.concatenate(outs, axis=-2)
    return out, (q, k, v, out, jnp.concatenate(lses, axis=-2))


def _bf16_flash_bwd(window, res, dout):
    q, k, v, out, lse = res
    T, D = q.shape[-2:]
    g = "g" if q.ndim == 4 else ""
    dout = dout.astype(q.dtype)
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)  # rowsum(dO * O)
    dq, dk, dv = [], jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)
    for start, stop, lo in _query_blocks(T, D, window):
        rows = slice(start, stop)
        s = _bf16_scores(q, k, start, stop, lo)
        p = jnp.where(_visible(start, stop, lo, window), jnp.exp(s - lse[..., rows, :]), 0.0)
        dp = _widened(f"n{g}td,nsd->n{g}ts", dout[..., rows, :], v[:, lo:stop])
        ds = (p * (dp - delta[..., rows, :]) * D**-0.5).astype(q.dtype)
        p = p.astype(q.dtype)
        dq.append(_widened(f"n{g}ts,nsd->n{g}td", ds, k[:, lo:stop]))
        qb, gb = q[..., rows, :], dout[..., rows, :]
        spec = f"n{g}ts,n{g}td->nsd"
        if (stop - start) % 2 == 0:  # the query axis contracted as two axes (split_in_two)
            ds, p, qb, gb = (split_in_two(x, -2) for x in (ds, p, qb, gb))
            spec = f"n{g}bts,n{g}btd->nsd"
        dk = dk.at[:, lo:stop].add(_widened(spec, ds, qb))
        dv = dv.at[:, lo:stop].add(_widened(spec, p, gb))
    return jnp.concatenate(dq, axis=-2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_bf16_flash.defvjp(_bf16_flash_fwd, _bf16_flash_bwd)


# -----------------------------------------------------------------------------
# The fused loss

# A chunk takes at most this many rows: at small vocabularies its logits then stay in the last-level cache for the
# soft-cap, softmax and gradient passes, while the products stay large enough for full-rate kernels
LOSS_CHUNK_ROWS = 512
LOSS_CHUNK_BYTES = 64 * 2**20  # and at most this many bytes of fp32 logits


@dataclasses.dataclass(frozen=True)
class LmHeadGrad:
    """How the fused loss sums its chunks' lm_head gradients dlogits^T x in fp32: as (Vp, C), or `transposed` as
    (C, Vp) with the rows split in two (loss_chunks): XLA:CPU's kernels take that product, which contracts the rows
    of both operands, at about the rate of the other two after one transposing copy of each chunk; as (Vp, C) it
    runs slower."""

    transposed: bool = False

    def zeros(self, shape):
        """The sum's start for an lm_head of `shape` (Vp, C)."""
        return jnp.zeros(shape[::-1] if self.transposed else shape, jnp.float32)

    def add(self, dw, x, dlogits):
        """dw plus one chunk's gradient: x (n, C), dlogits (n, Vp)."""
        f32 = dict(preferred_element_type=jnp.float32)
        if self.transposed:
            return dw + jnp.einsum("bnc,bnv->cv", split_in_two(x, 0), split_in_two(dlogits, 0), **f32)
        return dw + jnp.einsum("nv,nc->vc", dlogits, x, **f32)

    def total(self, dw):
        """The sum as (Vp, C). The barrier keeps XLA from folding the transpose into a lone chunk's product (a scan
        of one step is unrolled), which makes a dot XLA:CPU has no bf16 kernel for ("Unsupported element type for
        DotThunk")."""
        return jax.lax.optimization_barrier(dw).T if self.transposed else dw


# -----------------------------------------------------------------------------
# Sub-batches: a micro-batch's rows a few at a time, so that a layer's activations stay near the caches

CPU_SUB_BATCH_TOKENS = 2048


def in_sub_batches(model, f, *arrays):
    """f(model, *arrays) for a forward pass whose rows are independent (evaluation): arrays' and f's results'
    leading axis is the batch's rows, and the first array is (rows, T) tokens. Each device's rows run in the
    sub-batches the model's forms ask for (Forms.n_sub_batches), in turns of a lax.map, as the training step runs its
    micro-batches. The results are one pass's but for the products' rounding (XLA may block a smaller product
    differently)."""
    rows_total, T = arrays[0].shape[:2]
    axes = sharding.free_axes(sharding.REPLICA_AXES)
    devices = sharding.axes_size(axes)
    rows = rows_total // devices
    k = forms_of(model).n_sub_batches(rows, T, splits_model=bool(sharding.free_axes(sharding.MODEL_AXES)))
    if k == 1 or rows * devices != rows_total:  # (rows the devices do not share evenly: whole)
        return f(model, *arrays)
    graphdef, state = nnx.split(model)

    def local(state, *local_arrays):  # one device's rows
        split = lambda a: a.reshape(k, rows // k, *a.shape[1:])
        out = jax.lax.map(lambda parts: f(nnx.merge(graphdef, state), *parts), tuple(map(split, local_arrays)))
        return jax.tree.map(lambda o: o.reshape(rows, *o.shape[2:]), out)

    spec = P(axes)
    return sharding.per_shard(local, axes, (P(), *[spec] * len(arrays)), spec)(state, *arrays)
