"""Attention kernels for the GPT: causal attention with a left window, in training and in cached decoding.

`attention` is the training (and full-forward) path, one function over four kernels that all compute the same
thing: "xla" (dense scores), "chunked" (the CPU path: scores a cache-sized chunk of rows at a time), "cudnn"
(GPU) and "splash" (TPU, Pallas); `resolve_attention` picks one for the backend. `cached_attention` and
`write_cache` are the decode-time halves: new queries over a KV cache, then the new keys and values written into
it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.common import einsum, widened_products

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


def _window_softmax(s, start, stop, lo, window, dtype):
    """Softmax over the keys [lo, stop) that queries [start, stop) may see (causal, within the window)."""
    qpos, kpos = jnp.arange(start, stop)[:, None], jnp.arange(lo, stop)[None, :]
    s = jnp.where((kpos <= qpos) & (qpos - kpos <= window), s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1).astype(dtype)


def _attend_block(q, k, v, window, start, stop, heads_major=False):
    """Queries [start, stop) over the keys they can see, [max(0, start - window), stop); GQA by grouping.
    q, k, v: (B, T, H, D), or one row's (T, H, D); the output likewise. heads_major: they come as (B, H, T, D) or
    (H, T, D) (no GQA, fp32), the output too."""
    lo = max(0, start - window)
    b = "b" if q.ndim == 4 else ""  # a batch of rows, or one row without a row axis
    if heads_major:
        s = einsum(f"{b}ktd,{b}ksd->{b}kts", q[..., start:stop, :], k[..., lo:stop, :], jnp.float32)
        p = _window_softmax(s * q.shape[-1] ** -0.5, start, stop, lo, window, q.dtype)
        return einsum(f"{b}kts,{b}ksd->{b}ktd", p, v[..., lo:stop, :])
    *rows, _, H, D = q.shape
    Hkv = k.shape[-2]
    # without GQA the group axis is left out in fp32: XLA:CPU's fused reductions over (..., 1, t, s) scores run
    # several times slower than over (..., t, s) ones (the softmax backward's row sums: ~8x at nanochat's small
    # shapes); its bf16 -> fp32 products take only the grouped form
    flat = H == Hkv and not widened_products(q, k)
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
    """
    B, T, H, D = q.shape
    block = _query_block(T, D)
    # heads-major without GQA in fp32: q, k and v transposed once per layer instead of every block's key and value
    # slices once per block (window 128 at T=256, forward and backward of a layer on two cores: 26 -> 21 ms; d6's
    # full-window layers, one row a chunk: the whole step +8%; the small shape's full-window layers: no change)
    heads_major = H == k.shape[2] and not widened_products(q, k)

    def rows(q, k, v):
        blocks = [_attend_block(q, k, v, window, a, min(T, a + block), heads_major) for a in range(0, T, block)]
        return jnp.concatenate(blocks, axis=-2 if heads_major else -3)

    def local(q, k, v):
        b, h = q.shape[0], q.shape[2]
        n = max(1, min(b, CHUNK_SCORE_BYTES // (4 * h * block * min(T, window + block))))
        while b % n:
            n -= 1
        if heads_major:
            q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
        # one row a chunk goes without a row axis: XLA:CPU's fused reductions over a size-1 axis run several times
        # slower (d6's layers, one 512-token row a chunk: attention forward and backward 1,047 -> 672 ms a layer)
        split = (lambda x: x) if n == 1 else (lambda x: x.reshape(b // n, n, *x.shape[1:]))
        out = jax.lax.map(jax.checkpoint(lambda a: rows(*a)), (split(q), split(k), split(v)))
        out = out.reshape(q.shape)  # q as attended: heads-major or not
        return out.transpose(0, 2, 1, 3) if heads_major else out

    return _per_shard_heads(local, q, k, v)


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
