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
