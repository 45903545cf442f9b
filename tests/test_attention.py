"""The attention kernels (flaxchat.model.attention): dispatch, and every kernel against a plain reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.model import cpu
from flaxchat.model.attention import attention, resolve_attention
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT

TINY = GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
FORMS = cpu.forms_for()  # a model's forms here: on a CPU, bf16 q, k and v take the chunked kernel's bf16 path


def test_attention_dispatch_picks_the_backend_kernel():
    assert resolve_attention("auto", "gpu", jnp.bfloat16, 128) == "cudnn"
    assert resolve_attention("auto", "gpu", jnp.float32, 128) == "xla"  # cuDNN's fused kernel needs bf16/fp16
    assert resolve_attention("auto", "gpu", jnp.bfloat16, 512) == "xla"
    assert resolve_attention("auto", "tpu", jnp.bfloat16, 128) == "splash"
    assert resolve_attention("auto", "cpu", jnp.float32, 128) == "chunked"
    assert resolve_attention("splash", "cpu", jnp.float32, 64) == "splash"  # Pallas' interpreter off a TPU
    with pytest.raises(ValueError, match="cuDNN attention needs a GPU"):
        resolve_attention("cudnn", "cpu", jnp.bfloat16, 128)
    with pytest.raises(ValueError, match="unknown attention"):
        resolve_attention("flash", "gpu")
    assert GPT(TINY, rngs=nnx.Rngs(0)).attention == "chunked"  # this machine


def reference_attention(q, k, v, window):
    """Plain numpy: key j visible to query i iff i - window <= j <= i; kv heads shared by groups of query heads."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, H, D = q.shape
    g = H // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & (i - j <= window), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def qkv_example(B=2, T=128, H=4, Hkv=2, D=32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=(B, T, h, D)), jnp.float32) for h in (H, Hkv, Hkv))


@pytest.mark.parametrize("window", [16, 40, 128, 1000])
def test_xla_attention_equals_reference(window):
    q, k, v = qkv_example()
    np.testing.assert_allclose(
        np.asarray(attention(q, k, v, window, "xla")), reference_attention(q, k, v, window), atol=2e-5
    )


# 64 KB of scores: one row a chunk (the blocks then have no row axis); 256 KB: two rows a chunk
@pytest.mark.parametrize(
    ("window", "T", "score_bytes"),
    [
        *((w, t, 2**16) for w in (16, 40, 128, 1000) for t in (128, 100)),  # 100: the last query block is short
        (40, 100, 2**18),
        (1000, 100, 2**18),
    ],
)
@pytest.mark.parametrize("Hkv", [2, 4])  # 4: no GQA, heads-major, the scores without a group axis
def test_chunked_attention_equals_reference_forward_and_backward(window, T, score_bytes, Hkv, monkeypatch):
    """The CPU path: chunks of rows, query blocks over the keys they see, recomputed in the backward pass."""
    monkeypatch.setattr(cpu, "CHUNK_SCORE_BYTES", score_bytes)  # several chunks of rows even at this size
    q, k, v = qkv_example(B=4, T=T, Hkv=Hkv)
    np.testing.assert_allclose(
        np.asarray(attention(q, k, v, window, "chunked")), reference_attention(q, k, v, window), atol=2e-5
    )
    f = lambda impl: jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, window, impl))), argnums=(0, 1, 2))
    )
    (val_c, grads_c), (val_x, grads_x) = f("chunked")(q, k, v), f("xla")(q, k, v)
    np.testing.assert_allclose(float(val_c), float(val_x), rtol=2e-4)  # a sum of 50k terms
    for a, b in zip(grads_c, grads_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)


# bf16 on a CPU: the flash-style path. 64 KB of scores a chunk: one row, several chunks (lax.map); T=99: the last
# query block has an odd length (its key and value gradients contract the query axis whole)
@pytest.mark.parametrize(("window", "T", "score_bytes"), [(40, 128, 2**16), (1000, 99, 2**16), (16, 128, 2**21)])
@pytest.mark.parametrize("Hkv", [2, 4])
def test_bf16_chunked_attention_on_a_cpu_equals_fp32_attention(window, T, score_bytes, Hkv, monkeypatch):
    """bf16 q, k and v on a CPU take the flash-style path (its own backward, bf16 products into fp32): values and
    gradients as fp32 attention over the same bf16-rounded inputs, up to bf16's rounding of the probabilities and
    score gradients."""
    if jax.default_backend() != "cpu":
        pytest.skip("the bf16 path is the CPU's")
    monkeypatch.setattr(cpu, "BF16_CHUNK_SCORE_BYTES", score_bytes)
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv_example(B=4, T=T, Hkv=Hkv))
    out = attention(q, k, v, window, "chunked", FORMS)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), reference_attention(q, k, v, window), atol=2e-2)
    w = jax.random.normal(jax.random.key(1), out.shape)  # a loss that weighs every output differently
    loss = lambda q, k, v: jnp.sum(attention(q, k, v, window, "chunked", FORMS).astype(jnp.float32) * w)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for g, r in zip(grads, want):
        assert g.dtype == jnp.bfloat16
        g, r = np.asarray(g, np.float32), np.asarray(r)
        assert np.linalg.norm(g - r) <= 0.02 * np.linalg.norm(r)


def test_bf16_chunked_attention_multiplies_bf16_into_fp32():
    """Every product of the bf16 path, forward and backward, takes bf16 operands and an fp32 result (XLA:CPU's bf16
    kernels); the key and value gradients contract the query axis as two axes (cpu.split_in_two)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the bf16 path is the CPU's")
    from flaxchat.perf.hlo import dot_types

    q, k, v = (x.astype(jnp.bfloat16) for x in qkv_example(B=2, T=128, Hkv=4))
    f = jax.jit(
        jax.grad(
            lambda q, k, v: jnp.sum(attention(q, k, v, 40, "chunked", FORMS).astype(jnp.float32) ** 2),
            argnums=(0, 1, 2),
        )
    )
    dots = dot_types(f.lower(q, k, v).compile().as_text())
    assert len(dots) >= 5 * 2 and {(lhs, rhs) for lhs, rhs, _ in dots} == {("bf16", "bf16")}


@pytest.mark.eight_devices
@pytest.mark.parametrize(
    ("impl", "dtype"), [("chunked", jnp.float32), ("chunked", jnp.bfloat16), ("splash", jnp.float32)]
)
def test_attention_kernels_on_a_mesh_run_per_shard(impl, dtype):
    q, k, v = (x.astype(dtype) for x in qkv_example(B=4))
    mesh = sharding.make_mesh(2, 2, 2)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None, "tensor", None))
    with jax.set_mesh(mesh):
        f = jax.jit(lambda q, k, v: attention(q, k, v, 40, impl, FORMS))
        args = [jax.device_put(a, rows) for a in (q, k, v)]
        out = f(*args)
        hlo = f.lower(*args).compile().as_text()
    atol = 2e-2 if dtype == jnp.bfloat16 else 2e-5  # bf16: the probabilities rounded before their product
    np.testing.assert_allclose(np.asarray(out, np.float32), reference_attention(q, k, v, 40), atol=atol)
    assert "all-gather" not in hlo and "all-reduce" not in hlo  # each device attends over its own rows and heads


@pytest.mark.parametrize("window", [40, 128])
def test_splash_attention_equals_xla_forward_and_backward(window):
    """The TPU kernel, run by Pallas' interpreter on the CPU: same values and gradients as the XLA path."""
    q, k, v = qkv_example()
    f = lambda impl: jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v, window, impl))), argnums=(0, 1, 2))
    )
    (val_s, grads_s), (val_x, grads_x) = f("splash")(q, k, v), f("xla")(q, k, v)
    np.testing.assert_allclose(float(val_s), float(val_x), rtol=1e-5)
    for a, b in zip(grads_s, grads_x):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-5)
