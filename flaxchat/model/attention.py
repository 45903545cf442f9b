"""Attention kernels for the GPT: causal attention with a left window, in training and in cached decoding.

`attention` is the training (and full-forward) path, one function over four kernels that all compute the same
thing: "xla" (dense scores), "chunked" (the CPU path: scores a cache-sized chunk of rows at a time), "cudnn"
(GPU) and "splash" (TPU, Pallas); `resolve_attention` picks one for the backend. `cached_attention` and
`write_cache` are the decode-time halves: new queries over a KV cache, then the new keys and values written into
it in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.model.cpu import einsum, split_in_two, widened_products

ATTENTION_IMPLEMENTATIONS = ("auto", "chunked", "xla", "cudnn", "splash")


def resolve_attention(name: str = "auto", backend: str | None = None, dtype=jnp.bfloat16, head_dim: int = 128) -> str:
    """The attention kernel to use: "auto" picks cuDNN's fused kernel on GPU (bf16/fp16, head_dim <= 256),
    Splash on TPU, XLA elsewhere. Asking for a kernel that cannot run here is an error."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    backend = backend or jax.default_backend()
    cudnn_ok = backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 256 and head_dim % 8 == 0
    if name == "auto":
        return "cudnn" if cudnn_ok else "splash" if backend == "tpu" else "chunked" if backend == "cpu" else "xla"
    if name == "cudnn" and not cudnn_ok:
        raise ValueError(f"cuDNN attention needs a GPU, bf16/fp16 and head_dim <= 256 (a multiple of 8); "
                         f"here: {backend}, {jnp.dtype(dtype).name}, head_dim {head_dim}")
    return name  # "splash" off a TPU runs Pallas' interpreter: correct, slow (tests use it)


def attention(q, k, v, window, implementation="xla"):
    """Causal attention with a left window (training and full forwards). q (B,T,H,D), k/v (B,T,Hkv,D) -> (B,T,H,D).

    Key j is visible to query i iff i - window <= j <= i. "xla" materialises the (B, H, T, T) scores; "chunked"
    computes them a few rows and query blocks at a time (the CPU path); "cudnn" and "splash" are fused kernels
    that never materialise them. All but "xla" skip the blocks that causality and a sliding window mask out.
    """
    T = q.shape[1]
    local = None if window >= T else (window, 0)
    if implementation == "splash":
        return splash_attention(q, k, v, window)
    if implementation == "chunked":
        return chunked_attention(q, k, v, window)
    impl = "cudnn" if implementation == "cudnn" else "xla"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, implementation=impl)


# chunked attention: scores per chunk of rows at most this many bytes (about half a core's L2 cache; the attention
# alone runs ~1.5x faster than with 4 MB chunks at nanochat's small CPU shapes), query blocks of this size
CHUNK_SCORE_BYTES = 512 * 2**10


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
        s = einsum(f"{b}ktd,{b}ksd->{b}kts", q[..., start:stop, :], k[..., lo:stop, :], jnp.float32)
        p = _window_softmax(s * q.shape[-1] ** -0.5, start, stop, lo, window, q.dtype)
        return einsum(f"{b}kts,{b}ksd->{b}ktd", p, v[..., lo:stop, :])
    *rows, _, H, D = q.shape
    Hkv = k.shape[-2]
    # without GQA the group axis is left out: XLA:CPU's fused reductions over (..., 1, t, s) scores run several
    # times slower than over (..., t, s) ones (the softmax backward's row sums: ~8x at nanochat's small shapes)
    flat = H == Hkv
    qb = q[..., start:stop, :, :]
    qb = qb if flat else qb.reshape(*rows, stop - start, Hkv, H // Hkv, D)
    g = "" if flat else "g"
    s = einsum(f"{b}tk{g}d,{b}skd->{b}k{g}ts", qb, k[..., lo:stop, :, :], jnp.float32) * D**-0.5
    p = _window_softmax(s, start, stop, lo, window, q.dtype)
    return einsum(f"{b}k{g}ts,{b}skd->{b}tk{g}d", p, v[..., lo:stop, :, :]).reshape(*rows, stop - start, H, D)


def chunked_attention(q, k, v, window):
    """Causal windowed attention for CPUs, equal to the dense path: rows in chunks whose scores fit in cache
    (lax.map), each chunk's queries in blocks that see only the keys causality and the window allow, and each
    chunk recomputed in the backward pass (jax.checkpoint) so no (B, H, T, T) tensor ever reaches memory.
    About 2x faster than XLA's dense attention on a CPU at nanochat's small shapes; runs per shard on a mesh.
    bf16 q, k and v on a CPU take the flash-style path below (_bf16_chunks).
    """
    if widened_products(q, k, v):
        return _per_shard_heads(functools.partial(_bf16_chunks, window=window), q, k, v)
    B, T, H, D = q.shape
    # heads-major without GQA: q, k and v transposed once per layer instead of every block's key and value
    # slices once per block (window 128 at T=256, forward and backward of a layer on two cores: 26 -> 21 ms; d6's
    # full-window layers, one row a chunk: the whole step +8%; the small shape's full-window layers: no change)
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
        # slower (d6's layers, one 512-token row a chunk: attention forward and backward 1,047 -> 672 ms a layer)
        split = (lambda x: x) if n == 1 else (lambda x: x.reshape(b // n, n, *x.shape[1:]))
        out = jax.lax.map(jax.checkpoint(lambda a: rows(*a)), (split(q), split(k), split(v)))
        out = out.reshape(q.shape)  # q as attended: heads-major or not
        return out.transpose(0, 2, 1, 3) if heads_major else out

    return _per_shard_heads(local, q, k, v)


# bf16 on a CPU (q, k and v rounded to bf16, as in nanochat's bf16 attention): the same query blocks, flash
# style. Products multiply bf16 into fp32 (common.widened_products), the softmax is fp32, and the backward is
# written out (_bf16_flash_bwd): it keeps each row's log-sum-exp instead of recomputing the chunk, and the key and
# value gradients, which contract the query axis, split it in two so that XLA:CPU's bf16 kernel takes them
# (common.split_in_two; autodiff's form of those products runs at its fp32 rate or below). bf16 products gain on
# larger batches than fp32 ones, so the chunks are larger: a whole sub-batch at nanochat's small shapes. A layer's
# forward and backward over 8 rows of 256 tokens (4 heads of 64, on a 2-core Xeon with AMX): 7.8 ms against
# 10.6 for fp32 attention over the same q, k, v (window 128), 8.6 against 13.4 (full).
BF16_CHUNK_SCORE_BYTES = 2 * 2**20


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
        if (stop - start) % 2 == 0:  # the query axis contracted as two axes (common.split_in_two)
            ds, p, qb, gb = (split_in_two(x, -2) for x in (ds, p, qb, gb))
            spec = f"n{g}bts,n{g}btd->nsd"
        dk = dk.at[:, lo:stop].add(_widened(spec, ds, qb))
        dv = dv.at[:, lo:stop].add(_widened(spec, p, gb))
    return jnp.concatenate(dq, axis=-2).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_bf16_flash.defvjp(_bf16_flash_fwd, _bf16_flash_bwd)


def _per_shard_heads(local, q, k, v):
    """local(q, k, v) per shard of the batch axes (and of the heads over 'tensor' when the kv heads divide)."""
    Hkv = k.shape[2]
    heads = sharding.split_axes("kv_heads")
    heads = heads if Hkv % sharding.axes_size(heads) == 0 and heads == sharding.split_axes("heads") else ()
    axes = sharding.free_axes(sharding.BATCH_AXES)
    spec = P(axes or None, None, heads or None, None)
    return sharding.per_shard(local, axes + heads, (spec, spec, spec), spec)(q, k, v)


def _splash_block(T: int) -> int:
    return next((b for b in (512, 256, 128) if T % b == 0), T)


def splash_attention(q, k, v, window):
    """Splash attention (Pallas, TPU) with causal + local masks; GQA as one multi-query kernel per kv head.

    On a mesh it runs per shard of the batch axes (and of the heads over 'tensor' when they divide): a Pallas
    kernel is opaque to XLA's partitioner. Off a TPU it runs in Pallas' interpreter.
    """
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, H, D = q.shape

    def local(q, k, v):
        b, _, hkv, _ = k.shape
        g = q.shape[2] // hkv
        mask = sm.CausalMask((T, T)) if window >= T else sm.LocalMask((T, T), (window, 0), 0)
        blk = _splash_block(T)
        sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
                              block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk)
        kernel = sk.make_splash_mqa(sm.MultiHeadMask([mask] * g), block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=jax.default_backend() != "tpu")
        qg = (q * D**-0.5).reshape(b, T, hkv, g, D).transpose(0, 2, 3, 1, 4)  # (B, Hkv, G, T, D)
        out = jax.vmap(jax.vmap(kernel))(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return out.transpose(0, 3, 1, 2, 4).reshape(b, T, hkv * g, D)

    return _per_shard_heads(local, q, k, v)


def cached_attention(q, k, v, k_cache, v_cache, pos, window):
    """Attention of T new queries over the cache's first pos (B,) positions and over the T new keys themselves.

    q (B,T,H,D) and the new k/v (B,T,Hkv,D) sit at positions pos..pos+T-1; k_cache (B,Hkv,S,D) and v_cache
    (B,Hkv,D,S) hold the keys/values before them (entries at pos and later are stale and never read). Key j is
    visible to a query at position p iff j <= p and p - j <= window.

    Layouts for a CPU decode step: each (row, kv head) reads K as one contiguous (S, D) block and V as one
    (D, S) block, so both products are matrix-vector products over the block's minor axis (XLA:CPU would
    otherwise transpose V every step). The cache is read before this call writes it (see write_cache).
    """
    B, T, H, D = q.shape
    Hkv, S = k_cache.shape[1], k_cache.shape[2]
    qg = q.reshape(B, T, Hkv, H // Hkv, D)  # query heads grouped by the kv head they share (GQA)
    f32 = dict(preferred_element_type=jnp.float32)
    old = jnp.einsum("btkgd,bksd->bkgts", qg, k_cache.astype(q.dtype), **f32)  # (B, Hkv, G, T, S)
    new = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(q.dtype), **f32)  # (B, Hkv, G, T, T)
    qpos = pos[:, None, None] + jnp.arange(T)[None, :, None]  # (B, T, 1)
    kpos = jnp.arange(S)[None, None, :]
    seen = (kpos < pos[:, None, None]) & (qpos - kpos <= window)  # (B, T, S)
    i, j = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    causal = (j <= i) & (i - j <= window)  # (T, T)
    scores = jnp.concatenate([jnp.where(seen[:, None, None], old, -jnp.inf), jnp.where(causal, new, -jnp.inf)], -1)
    probs = jax.nn.softmax(scores * D**-0.5, axis=-1).astype(q.dtype)
    y = jnp.einsum("bkgts,bkds->btkgd", probs[..., :S], v_cache.astype(q.dtype))
    y = y + jnp.einsum("bkgts,bskd->btkgd", probs[..., S:], v.astype(q.dtype))
    return y.reshape(B, T, H, D)


def write_cache(cache, new, pos, axis: int, after=None):
    """Write new (B, T, Hkv, D) into a cache at each row's position pos (B,) along `axis` (2: a (B,Hkv,S,D) key
    cache, 3: a (B,Hkv,D,S) value cache); positions past the end are dropped. In place under jit.

    after: an array computed from the cache's old contents (the attention output). The write takes an exact zero
    derived from it, so XLA orders the write after those reads; without the dependency XLA:CPU copies the whole
    cache (twice) every decode step to keep the old contents alive for them.
    """
    B, T = new.shape[:2]
    if after is not None:
        new = new + (0.0 * jnp.nan_to_num(after.ravel()[0])).astype(new.dtype)
    rows = jnp.arange(B)[:, None]
    cols = pos[:, None] + jnp.arange(T)[None, :]  # (B, T)
    index = (rows, slice(None), cols) if axis == 2 else (rows, slice(None), slice(None), cols)
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")
