"""flaxchat/model/cpu.py: the XLA:CPU-only fast paths."""

import jax

from flaxchat.model import cpu


def test_bf16_einsum_rounds_one_fp32_sum_and_its_gradients_multiply_bf16():
    """cpu.einsum: bf16 operands on a CPU give the fp32 sum of their products rounded once to bf16, both
    gradients the same of a bf16 cotangent, and the compiled gradient multiplies bf16 only (JAX's own transpose
    of an fp32-result product would multiply in fp32). fp32 operands are plain jnp.einsum."""
    import jax.numpy as jnp
    import numpy as np

    from flaxchat.perf.hlo import dot_types

    bf, f32 = jnp.bfloat16, jnp.float32
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((2, 48, 64)), bf)
    b = jnp.asarray(rng.standard_normal((96, 64)), bf)
    c = jnp.asarray(rng.standard_normal((2, 48, 96)), bf)  # the cotangent, exactly bf16
    exact = lambda spec, x, y: np.einsum(spec, np.asarray(x, np.float64), np.asarray(y, np.float64))
    to_bf16 = lambda x: np.asarray(jnp.asarray(x, f32).astype(bf), np.float32)

    spec = "...i,oi->...o"
    y = cpu.einsum(spec, a, b)
    assert y.dtype == bf
    close = lambda x, want: np.testing.assert_allclose(np.asarray(x, np.float32), to_bf16(want), rtol=2**-7, atol=1e-6)
    close(y, exact("bti,oi->bto", a, b))  # within one bf16 step of the exact sum (summation order)
    assert cpu.einsum(spec, a, b, f32).dtype == f32

    loss = lambda a, b: jnp.sum(cpu.einsum(spec, a, b).astype(f32) * c.astype(f32))
    da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    assert da.dtype == db.dtype == bf
    close(da, exact("bto,oi->bti", c, b))
    close(db, exact("bti,bto->oi", a, c))
    program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, b).compile().as_text()
    assert {(lhs, rhs) for lhs, rhs, _ in dot_types(program)} == {("bf16", "bf16")}

    a32, b32 = a.astype(f32), b.astype(f32)
    np.testing.assert_array_equal(cpu.einsum(spec, a32, b32), jnp.einsum(spec, a32, b32))


def test_split_in_two_halves_an_axis():
    import jax.numpy as jnp

    x = jnp.arange(2 * 6 * 3).reshape(2, 6, 3)
    assert cpu.split_in_two(x, 1).shape == (2, 2, 3, 3) and cpu.split_in_two(x, -3).shape == (2, 1, 6, 3)
    assert (cpu.split_in_two(x, 1)[:, 1] == x[:, 3:]).all()


def test_activation_dtype_widens_bfloat16_on_a_cpu_only():
    import jax.numpy as jnp

    assert cpu.activation_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert cpu.activation_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert cpu.activation_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16
    for dtype in (jnp.float32, jnp.float16):
        assert cpu.activation_dtype(dtype, "cpu") == dtype
    assert cpu.activation_dtype(jnp.bfloat16) == (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)

