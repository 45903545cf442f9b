"""Attention kernels for the GPT: causal attention with a left window, in training and in cached decoding.

`attention` is the training (and full-forward) path, one function over four kernels that all compute the same
thing: "xla" (dense scores, jax.nn.dot_product_attention), "cudnn" (GPU), "splash" (TPU, Pallas) and "chunked"
(a CPU path, in model/cpu.py); `resolve_attention` picks one for the backend and the model's forms.
`cached_attention` and `write_cache` are the decode-time halves: new queries over a KV cache, then the new keys and
values written into it in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flaxchat import sharding
from flaxchat.model import cpu

ATTENTION_IMPLEMENTATIONS = ("auto", "chunked", "xla", "cudnn", "splash")


def resolve_attention(
    name: str = "auto", backend: str | None = None, dtype=jnp.bfloat16, head_dim: int = 128, forms=None
) -> str:
    """The attention kernel to use: "auto" picks cuDNN's fused kernel on GPU (bf16/fp16, head_dim <= 256),
    Splash on TPU, chunked where the forms have chunked_attention (a CPU's, model/cpu.py), XLA elsewhere. forms:
    the model's (default: the backend's, cpu.forms_for). Asking for a kernel that cannot run here is an error."""
    if name not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attention {name!r}; choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    backend = backend or jax.default_backend()
    forms = forms if forms is not None else cpu.forms_for(dtype, backend)
    cudnn_ok = (
        backend == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 256 and head_dim % 8 == 0
    )
    if name == "auto":
        if cudnn_ok:
            return "cudnn"
        return "splash" if backend == "tpu" else "chunked" if forms.chunked_attention else "xla"
    if name == "cudnn" and not cudnn_ok:
        raise ValueError(
            f"cuDNN attention needs a GPU, bf16/fp16 and head_dim <= 256 (a multiple of 8); "
            f"here: {backend}, {jnp.dtype(dtype).name}, head_dim {head_dim}"
        )
    return name  # "splash" off a TPU runs Pallas' interpreter: correct, slow (tests use it)


def attention(q, k, v, window, implementation="xla", forms=cpu.PLAIN):
    """Causal attention with a left window (training and full forwards). q (B,T,H,D), k/v (B,T,Hkv,D) -> (B,T,H,D).

    Key j is visible to query i iff i - window <= j <= i. "xla" materialises the (B, H, T, T) scores; "cudnn" and
    "splash" are fused kernels that never materialise them, and "chunked" (cpu.chunked_attention) computes them
    a few rows and query blocks at a time, in the model's `forms` (a CPU's bf16 products). All but "xla" skip the
    blocks that causality and a window mask out.
    """
    T = q.shape[1]
    local = None if window >= T else (window, 0)
    if implementation == "splash":
        return splash_attention(q, k, v, window)
    if implementation == "chunked":
        return cpu.chunked_attention(q, k, v, window, forms)
    impl = "cudnn" if implementation == "cudnn" else "xla"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=local, implementation=impl)


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
        sizes = sk.BlockSizes(
            block_q=blk,
            block_kv=blk,
            block_kv_compute=blk,
            block_q_dkv=blk,
            block_kv_dkv=blk,
            block_kv_dkv_compute=blk,
            block_q_dq=blk,
            block_kv_dq=blk,
        )
        kernel = sk.make_splash_mqa(
            sm.MultiHeadMask([mask] * g),
            block_sizes=sizes,
            head_shards=1,
            q_seq_shards=1,
            interpret=jax.default_backend() != "tpu",
        )
        qg = (q * D**-0.5).reshape(b, T, hkv, g, D).transpose(0, 2, 3, 1, 4)  # (B, Hkv, G, T, D)
        out = jax.vmap(jax.vmap(kernel))(qg, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return out.transpose(0, 3, 1, 2, 4).reshape(b, T, hkv * g, D)

    return sharding.per_shard_heads(local, q, k, v)


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
