"""flaxchat/model/cpu.py: the XLA:CPU-only fast paths."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxchat.model import cpu


def test_bf16_einsum_rounds_one_fp32_sum_and_its_gradients_multiply_bf16():
    """cpu.einsum (bf16_products' form): bf16 operands give the fp32 sum of their products rounded once to bf16, both
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


def test_a_cpus_forms_widen_bfloat16_activations_only():
    bf16 = jnp.bfloat16
    on_cpu = cpu.forms_for(bf16, "cpu")
    assert on_cpu.products == bf16 and on_cpu.activation_dtype(bf16) == jnp.float32
    for backend in ("gpu", "tpu"):
        assert cpu.forms_for(bf16, backend) == cpu.PLAIN and cpu.PLAIN.activation_dtype(bf16) == bf16
    for dtype in (jnp.float32, jnp.float16):
        forms = cpu.forms_for(dtype, "cpu")
        assert forms.products is None and forms.activation_dtype(dtype) == dtype and forms.bf16_products
    with pytest.raises(ValueError, match="need bf16_products"):
        cpu.Forms(products=bf16)


def test_the_switch_reads_all_none_or_named_paths(monkeypatch):
    monkeypatch.delenv(cpu.SWITCH, raising=False)
    assert cpu.switched_off() == set() and cpu.forms_for(backend="cpu").paths == cpu.PATHS
    assert cpu.forms_for(backend="gpu") == cpu.forms_for(backend="tpu") == cpu.PLAIN and cpu.PLAIN.paths == ()
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert cpu.switched_off() == set(cpu.PATHS) and cpu.forms_for(jnp.bfloat16, "cpu") == cpu.PLAIN
    monkeypatch.setenv(cpu.SWITCH, "-loss_chunks,-sub_batches")
    assert cpu.switched_off() == {"loss_chunks", "sub_batches"}
    assert cpu.forms_for(backend="cpu").paths == ("chunked_attention", "bf16_products", "matmul_form", "int8_vectors")
    monkeypatch.setenv(cpu.SWITCH, "-sub_batchess")
    with pytest.raises(ValueError, match="FLAXCHAT_CPU_PATHS"):
        cpu.forms_for(backend="cpu")


def test_a_model_keeps_the_forms_it_was_built_with(monkeypatch):
    """The switch is read once, when a model is built: its Linears and attention hold the model's forms, and the
    program its loss and gradients compile to does not change when the switch does afterwards; a model built with
    the switch off compiles another one."""
    from flax import nnx

    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT, Linear

    config = GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    idx = jnp.zeros((16, 64), jnp.int32)

    def program(model):  # the loss's gradient, lowered
        graphdef, state = nnx.split(model)
        return jax.jit(jax.grad(lambda s: nnx.merge(graphdef, s)(idx, idx))).lower(state).as_text()

    monkeypatch.delenv(cpu.SWITCH, raising=False)
    model = GPT(config, rngs=nnx.Rngs(0))
    assert model.forms == (cpu.forms_for(model.dtype, "cpu") if jax.default_backend() == "cpu" else cpu.PLAIN)
    assert all(m.forms is model.forms for _, m in nnx.iter_graph(model) if isinstance(m, Linear))
    before = program(model)
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert program(model) == before
    assert nnx.merge(*nnx.split(model)).forms == model.forms
    if jax.default_backend() == "cpu":
        assert program(GPT(config, rngs=nnx.Rngs(0))) != before


def _run_everything(dtype):
    """A GPT's loss, gradients, an evaluation forward in sub-batches and three cached decode steps, each traced
    afresh, so the CPU paths in effect now are the ones compiled."""
    from flax import nnx

    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    # GQA, a sliding window, value embeddings on alternating layers, a vocabulary that pads
    config = GPTConfig(
        sequence_len=64, vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, n_embd=64, window_pattern="SL"
    )
    model = GPT(config, rngs=nnx.Rngs(0), dtype=dtype)
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(
        model,
        jax.tree.unflatten(treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]),
    )
    idx = jax.random.randint(jax.random.key(2), (16, 64), 0, config.vocab_size)
    targets = jnp.roll(idx, -1, axis=1).at[:, -3:].set(-1)
    loss, grads = nnx.jit(nnx.value_and_grad(lambda m: m(idx, targets)))(model)
    graphdef, state = nnx.split(model)
    token_losses = jax.jit(
        lambda s: cpu.in_sub_batches(
            nnx.merge(graphdef, s), lambda m, x, y: m(x, y, loss_reduction="none"), idx, targets
        )
    )(state)

    def decode(s):
        m = nnx.merge(graphdef, s)
        cache = m.init_cache(2, 64)
        logits, cache = m.forward_cached(idx[:2, :8], cache, fresh=True)
        steps = [logits[:, -1]]
        for t in range(3):
            logits, cache = m.forward_cached(idx[:2, 8 + t : 9 + t], cache)
            steps.append(logits[:, -1])
        one, _ = m.forward_cached(idx[:1, :1], m.init_cache(1, 64))  # one row: matmul_form
        return jnp.stack(steps), one

    decoded, one_row = jax.jit(decode)(state)
    flat = [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)]
    return float(loss), flat, np.asarray(token_losses), np.asarray(decoded), np.asarray(one_row)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_every_cpu_path_gives_the_plain_versions_numbers(monkeypatch, dtype):
    """FLAXCHAT_CPU_PATHS=0 (the plain model, as on an accelerator) and every path on: the same loss, gradients,
    evaluation losses and decoded logits. fp32 to rounding; bf16 to bf16's precision (the plain bf16 model keeps
    its activations in bf16, the CPU path in fp32), its per-layer scalars left out: each one's gradient is a sum
    over every activation of the batch, which bf16 activations round differently from fp32 ones."""
    if jax.default_backend() != "cpu":
        pytest.skip("the CPU paths run on a CPU only")
    monkeypatch.delenv(cpu.SWITCH, raising=False)
    assert cpu.forms_for().paths == cpu.PATHS
    on = _run_everything(dtype)
    monkeypatch.setenv(cpu.SWITCH, "0")
    assert cpu.forms_for() == cpu.PLAIN
    off = _run_everything(dtype)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == jnp.float32 else dict(rtol=5e-2, atol=3e-2)
    np.testing.assert_allclose(on[0], off[0], **tol)
    for a, b in zip(on[1], off[1]):
        if dtype == jnp.bfloat16 and b.size <= 3:
            continue
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a / scale, b / scale, **tol)
    for a, b in zip(on[2:], off[2:]):
        np.testing.assert_allclose(a, b, **tol)
