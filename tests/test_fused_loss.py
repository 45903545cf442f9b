"""The fused, chunked loss (flaxchat.fused_loss): chunk sizes, and values and gradients against autodiff."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxchat import fused_loss as fl


def test_cpu_loss_chunks_are_at_most_512_rows_within_the_byte_budget():
    assert fl._chunk_rows(4096, 4096) == fl.LOSS_CHUNK_ROWS_CPU == 512  # 64 MB would allow all 4096
    assert fl._chunk_rows(300, 4096) == 300
    assert fl._chunk_rows(4096, 262144) == fl.LOSS_CHUNK_BYTES["cpu"] // (4 * 262144)  # 64 rows


@pytest.mark.parametrize("chunk_rows", [16, 9])  # even chunks take the (C, V) gradient path, odd ones the plain one
def test_chunked_loss_gradients_equal_autodiff(monkeypatch, chunk_rows, users_codegen):
    """loss_sum over several chunks (the last one padded) against autodiff through the plain softcapped
    cross-entropy; on a CPU with even chunks lm_head's gradient is accumulated as (C, V) and no product
    yields a (V, C) result: XLA:CPU runs the transposed accumulation at about the rate of the loss's other
    two products, the (V, C) one over the rows at about half."""
    n, C, V, Vp = 40, 32, 200, 256
    monkeypatch.setitem(fl.LOSS_CHUNK_BYTES, "cpu", 4 * V * chunk_rows)
    kx, kw, kt = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(kx, (n, C))
    w = jax.random.normal(kw, (Vp, C)) * 0.3
    t = jax.random.randint(kt, (n,), 0, V).at[:3].set(-1)

    def plain(x, w):
        z = fl.SOFTCAP * jnp.tanh((x @ w.T)[:, :V] / fl.SOFTCAP)
        nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, jnp.maximum(t, 0)[:, None], axis=-1)[:, 0]
        return jnp.sum(jnp.where(t >= 0, nll, 0.0))

    fused = jax.jit(jax.value_and_grad(lambda x, w: fl.loss_sum(x, w, t, V), argnums=(0, 1)))
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
    from flaxchat.config import GPTConfig
    from flaxchat.gpt import GPT
    from flax import nnx

    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (8, 64)).astype(jnp.bfloat16)
    w = jax.random.normal(kw, (128, 64)) * 0.5
    z = fl.softcapped_logits(x, w, 100)
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
