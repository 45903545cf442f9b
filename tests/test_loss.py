"""The fused, chunked loss (flaxchat.model.loss): chunk sizes, and values and gradients against autodiff."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxchat.model import cpu
from flaxchat.model import loss as fl

CPU = cpu.forms_for(backend="cpu")  # a CPU's forms (every path on), whatever runs the tests


def test_cpu_loss_chunks_are_at_most_512_rows_within_the_byte_budget():
    assert fl.chunk_rows(4096, 4096, CPU) == cpu.LOSS_CHUNK_ROWS == 512  # 64 MB would allow all 4096
    assert fl.chunk_rows(300, 4096, CPU) == 300
    assert fl.chunk_rows(4096, 262144, CPU) == cpu.LOSS_CHUNK_BYTES // (4 * 262144)  # 64 rows


@pytest.mark.parametrize("chunk_rows", [16, 9])  # even chunks take the (C, V) gradient path, odd ones the plain one
def test_chunked_loss_gradients_equal_autodiff(monkeypatch, chunk_rows, users_codegen):
    """loss_sum over several chunks (the last one padded) against autodiff through the plain softcapped
    cross-entropy; on a CPU with even chunks lm_head's gradient is accumulated as (C, V) and no product
    yields a (V, C) result: XLA:CPU runs the transposed accumulation at about the rate of the loss's other
    two products, the (V, C) one over the rows at about half."""
    n, C, V, Vp = 40, 32, 200, 256
    monkeypatch.setattr(cpu, "LOSS_CHUNK_BYTES", 4 * V * chunk_rows)
    kx, kw, kt = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (n, C))
    w = jax.random.normal(kw, (Vp, C)) * 0.3
    t = jax.random.randint(kt, (n,), 0, V).at[:3].set(-1)

    def plain(x, w):
        z = fl.SOFTCAP * jnp.tanh((x @ w.T)[:, :V] / fl.SOFTCAP)
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(t >= 0, nll, 0.0))

    fused = jax.jit(jax.value_and_grad(lambda x, w: fl.loss_sum(x, w, t, V, CPU), argnums=(0, 1)))
    (got, (gx, gw)), (want, (wx, ww)) = fused(x, w), jax.value_and_grad(plain, argnums=(0, 1))(x, w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(wx), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ww), atol=1e-5, rtol=1e-5)
    program = fused.lower(x, w).compile(compiler_options=users_codegen).as_text()
    results = re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} (?:dot|fusion)\([^\n]*dot_general", program)  # products' shapes
    assert ((str(C), str(Vp)) in results) == (chunk_rows % 2 == 0)
    assert ((str(Vp), str(C)) in results) == (chunk_rows % 2 == 1)
    # the logits stay Vp wide, padded columns masked: no crop to V and pad back to Vp (a copy of every chunk)
    assert not re.search(rf"f32\[\d+,{Vp}\]\S* pad\(", program)


def test_bf16_logits_are_rounded_to_bf16_before_the_fp32_softcap_as_nanochats_head():
    """nanochat's lm_head returns bf16 logits in a bf16 run (then .float() and the soft-cap): so do the training
    loss's and the generation head's."""
    from flax import nnx

    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (8, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (128, 64)) * 0.5
    z = fl.softcapped_logits(x, w, 100, CPU)
    product = jnp.einsum("nc,vc->nv", x.astype(jnp.float32), w.astype(jnp.bfloat16).astype(jnp.float32))[:, :100]
    rounded = product.astype(jnp.bfloat16).astype(jnp.float32)
    assert z.dtype == jnp.float32 and z.shape == (8, 100)
    ref = fl.SOFTCAP * jnp.tanh(rounded / fl.SOFTCAP)
    # the same bf16 values (a sum's last bit may round the other way: one bf16 step at most, in rare places)
    assert np.mean(np.asarray(z) == np.asarray(ref)) > 0.98
    np.testing.assert_allclose(z, ref, atol=0.07)
    unrounded = fl.SOFTCAP * jnp.tanh(product / fl.SOFTCAP)
    assert np.mean(np.asarray(z) == np.asarray(unrounded)) < 0.1  # fp32 logits would differ almost everywhere

    cfg = GPTConfig(sequence_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    idx = jax.random.randint(jax.random.key(1), (2, 8), 0, 64)
    logits, _ = model.forward_cached(idx, model.init_cache(2, 16))
    np.testing.assert_allclose(logits, model(idx), atol=0.07)  # generation's head rounds the same way
    pre = fl.SOFTCAP * np.arctanh(np.asarray(logits, np.float64) / fl.SOFTCAP)
    assert np.mean(np.abs(pre - pre.astype(jnp.bfloat16).astype(np.float64)) < 1e-4) > 0.98


def _finite_floats_from_2_to_the_minus_109():
    """Every sign, exponent (finite, 2**-109 and up) and top 7 mantissa bits of fp32, each with low 16 bits at
    the rounding boundaries (0, 1, just below a tie, the tie, just above, all ones) and one random pattern."""
    hi = np.arange(2**16, dtype=np.uint32)
    exponent = (hi >> 7) & 0xFF
    hi = hi[(exponent >= 127 - 109) & (exponent < 255)]
    low = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)
    rand = np.random.default_rng(0).integers(0, 2**16, hi.size, dtype=np.uint32)
    bits = np.concatenate([(hi[:, None] << 16 | low[None, :]).ravel(), hi << 16 | rand])
    return bits.view(np.float32)


@pytest.mark.parametrize("codegen", ["tests", "users"])
def test_bf16_grid_rounds_as_a_conversion_to_bf16(codegen, users_codegen):
    """cpu.bf16_grid (Veltkamp's split, in fp32) and cpu.to_bf16 give the same numbers as XLA's own rounding to bf16
    (nearest, ties to even) for every finite magnitude from 2**-109 up, ties, near-ties and the largest fp32 values
    (which round to inf) included; 0 keeps its sign and NaN stays NaN. Compiled as the suite compiles and as
    users' programs are."""
    x = np.concatenate([_finite_floats_from_2_to_the_minus_109(), np.array([0.0, -0.0, np.nan], np.float32)])
    x = jnp.asarray(x)
    options = users_codegen if codegen == "users" else None
    grid = jax.jit(cpu.bf16_grid).lower(x).compile(compiler_options=options)(x)
    as_bf16 = jax.jit(cpu.to_bf16).lower(x).compile(compiler_options=options)(x)
    want = np.asarray(x.astype(jnp.bfloat16))
    assert as_bf16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(as_bf16).view(np.uint16)[:-1], want.view(np.uint16)[:-1])
    np.testing.assert_array_equal(np.asarray(grid).view(np.uint32)[:-1], want.astype(np.float32).view(np.uint32)[:-1])
    assert np.isnan(np.asarray(grid)[-1]) and np.isnan(np.asarray(as_bf16, np.float32)[-1])
    # the gradient passes through unrounded (the product's backward rounds it)
    np.testing.assert_array_equal(
        jax.grad(lambda v: jnp.sum(cpu.bf16_grid(v) * 1.2345678))(x[:5]), np.float32(1.2345678)
    )


@pytest.mark.parametrize("n", [512, 40])
def test_a_bf16_loss_of_one_chunk_runs_on_a_cpu(n):
    """With no more rows than one chunk the loss's scan is a single step, which XLA unrolls; it folded the
    transposed lm_head gradient into that step's product, one XLA:CPU has no bf16 kernel for. Values and
    gradients against the plain soft-capped cross-entropy over the same bf16 operands and bf16 logits."""
    C, V, Vp = 64, 200, 256
    kx, kw, kt = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(kx, (n, C)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (Vp, C)) * 0.3
    t = jax.random.randint(kt, (n,), 0, V).at[:3].set(-1)

    def plain(x, w):
        logits = (x.astype(jnp.float32) @ w.astype(jnp.bfloat16).astype(jnp.float32).T)[:, :V]
        z = fl.SOFTCAP * jnp.tanh(logits.astype(jnp.bfloat16).astype(jnp.float32) / fl.SOFTCAP)
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(t >= 0, nll, 0.0))

    (got, (gx, gw)) = jax.jit(jax.value_and_grad(lambda x, w: fl.loss_sum(x, w, t, V, CPU), argnums=(0, 1)))(x, w)
    (want, (wx, ww)) = jax.value_and_grad(plain, argnums=(0, 1))(x.astype(jnp.float32), w)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-3)
    np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(wx), atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(gw), np.asarray(ww), atol=2e-2, rtol=2e-2)


def test_the_bf16_loss_on_a_cpu_rounds_its_logits_without_xlas_conversion(users_codegen):
    """XLA:CPU's own conversion to bf16 inside the loss's passes made them ~4x slower than in fp32; the chunk's
    (rows, Vp) logits and their gradient are rounded by cpu.bf16_grid instead (no f32 -> bf16 convert of that shape)."""
    n, C, Vp = 1024, 64, 256
    x = jnp.zeros((n, C), jnp.bfloat16)
    w = jnp.zeros((Vp, C))
    t = jnp.zeros((n,), jnp.int32)
    program = (
        jax.jit(jax.grad(lambda x, w: fl.loss_sum(x, w, t, Vp, CPU), argnums=(0, 1)))
        .lower(x, w)
        .compile(compiler_options=users_codegen)
        .as_text()
    )
    rows = fl.chunk_rows(n, Vp, CPU)
    assert re.search(rf"bf16\[{rows},{Vp}\]", program)  # the gradients' bf16 operand is there
    assert not re.search(rf"= bf16\[{rows},{Vp}\]\S* convert\(", program)  # but made by bit operations
