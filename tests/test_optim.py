"""MuonAdamW pieces against plain-numpy references (nanochat's formulas, float64), the combined
optimizer against a numpy MuonAdamW, non-finite skipping, schedules, and the depth-derived plan."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat.model import cpu
from flaxchat.model.config import GPTConfig, derive_training
from flaxchat.model.gpt import GPT
from flaxchat.train import muon, optim

# -----------------------------------------------------------------------------
# numpy references, written from nanochat's optim.py formulas


def np_lerp(a, b, w):
    return a + w * (b - a)


def np_nesterov(g, buf, m):
    buf = np_lerp(buf, g, 1 - m)
    return np_lerp(g, buf, m), buf


def np_fro(x):
    return np.sqrt((x * x).sum(axis=(-2, -1), keepdims=True))


def np_equilibrate(x):
    target = np_fro(x) / math.sqrt(x.shape[-2])
    return x * target / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-6)


def np_polar(x, steps=5):
    x = x / (np_fro(x) * 1.01 + 1e-6)
    for a, b, c in muon.POLAR_EXPRESS_COEFFS[:steps]:
        if x.shape[-2] > x.shape[-1]:
            gram = np.swapaxes(x, -1, -2) @ x
            x = a * x + x @ (b * gram + c * gram @ gram)
        else:
            gram = x @ np.swapaxes(x, -1, -2)
            x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def np_renorm(x):
    return x * (min(x.shape[-2:]) ** 0.5 / np.maximum(np_fro(x), 1e-6))


def np_normuon(g, v, beta2):
    axis = -1 if g.shape[-2] >= g.shape[-1] else -2
    n = g.shape[axis]
    v_mean = (g * g).mean(axis=axis, keepdims=True)
    v_norm = np.sqrt(v_mean.sum(axis=(-2, -1), keepdims=True) * n)
    v = np_lerp(v, v_mean, 1 - beta2)
    step = 1 / np.sqrt(np.maximum(v, 1e-10))
    v_norm_new = np.sqrt((v_mean * n * step**2).sum(axis=(-2, -1), keepdims=True))
    return g * step * (v_norm / np.maximum(v_norm_new, 1e-10)), v


def np_muon_step(p, g, buf, v, lr, momentum, wd, beta2=0.9):
    """One nanochat Muon step; also returns which elements sit on the cautious mask's edge."""
    u, buf = np_nesterov(g, buf, momentum)
    u = np_renorm(np_polar(np_equilibrate(u)))
    u, v = np_normuon(u, v, beta2)
    lr = lr * max(1.0, p.shape[-2] / p.shape[-1]) ** 0.5
    new_p = p - (lr * u + lr * wd * p * ((u * p) >= 0))
    # Where u*p is ~0 the fp32 and fp64 signs may disagree and decay is applied in one only.
    edge = np.abs(u) < 1e-4 * np.sqrt((u * u).mean())
    return new_p, buf, v, edge


def np_adamw_step(p, g, m, v, t, lr, b1, b2, eps, wd):
    """nanochat's adamw_step_fused: decay first, then the bias-corrected step."""
    p = p * (1 - lr * wd)
    m, v = np_lerp(m, g, 1 - b1), np_lerp(v, g * g, 1 - b2)
    # nanochat forms 1 - beta**step from fp32 scalars; with beta2 = 0.995 that cancellation costs
    # ~1e-6 relative, so the reference does the same to compare at fp32 precision.
    bias1, bias2 = (float(np.float32(1) - np.float32(b) ** np.float32(t)) for b in (b1, b2))
    p = p - (lr / bias1) * m / (np.sqrt(v / bias2) + eps)
    return p, m, v


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


SHAPES = [(48, 48), (96, 32), (32, 96), (3, 40, 24)]  # square, tall, wide, stacked wide


# -----------------------------------------------------------------------------
# Muon pieces


def test_lerp_follows_torch_on_both_branches():
    rng = np.random.default_rng(0)
    a, b = rand(rng, 64), rand(rng, 64)
    for w in (0.0, 0.05, 0.5, 0.95, 1.0):
        out = np.asarray(muon.lerp(jnp.asarray(a), jnp.asarray(b), jnp.float32(w)))
        np.testing.assert_allclose(out, np_lerp(a.astype(np.float64), b, w), atol=1e-6)
    # the two branches make both endpoints exact
    assert np.array_equal(np.asarray(muon.lerp(jnp.asarray(a), jnp.asarray(b), jnp.float32(0.0))), a)
    assert np.array_equal(np.asarray(muon.lerp(jnp.asarray(a), jnp.asarray(b), jnp.float32(1.0))), b)


def test_nesterov_momentum_matches_numpy():
    rng = np.random.default_rng(1)
    g, buf = rand(rng, 32, 16), rand(rng, 32, 16)
    u, new_buf = muon.nesterov_momentum(jnp.asarray(g), jnp.asarray(buf), 0.9)
    ref_u, ref_buf = np_nesterov(g.astype(np.float64), buf, 0.9)
    np.testing.assert_allclose(np.asarray(new_buf), ref_buf, atol=1e-6)
    np.testing.assert_allclose(np.asarray(u), ref_u, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_equilibrate_rows_matches_numpy(shape):
    x = rand(np.random.default_rng(2), *shape)
    out = np.asarray(muon.equilibrate_rows(jnp.asarray(x)))
    np.testing.assert_allclose(out, np_equilibrate(x.astype(np.float64)), rtol=1e-5, atol=1e-6)
    rows = np.linalg.norm(out, axis=-1)
    np.testing.assert_allclose(rows, np.broadcast_to(rows.mean(axis=-1, keepdims=True), rows.shape), rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_polar_express_matches_numpy_and_orthogonalises(shape):
    x = rand(np.random.default_rng(3), *shape)
    out = np.asarray(muon.polar_express(jnp.asarray(x)))
    np.testing.assert_allclose(out, np_polar(x.astype(np.float64)), atol=2e-5)
    # with singular values spread over a decade (a random square matrix has some near 0, which
    # five iterations cannot lift), all come out near 1
    rng = np.random.default_rng(30)
    u = np.linalg.qr(rng.standard_normal((*shape[:-2], shape[-2], shape[-2])))[0][..., : min(shape[-2:])]
    v = np.linalg.qr(rng.standard_normal((*shape[:-2], shape[-1], shape[-1])))[0][..., : min(shape[-2:])]
    x = (u * np.linspace(0.1, 1.0, min(shape[-2:]))) @ np.swapaxes(v, -1, -2)
    s = np.linalg.svd(np.asarray(muon.polar_express(jnp.asarray(x, jnp.float32))), compute_uv=False)
    assert s.min() > 0.7 and s.max() < 1.25, (s.min(), s.max())


@pytest.mark.parametrize("shape", SHAPES)
def test_renormalize_matches_numpy(shape):
    x = rand(np.random.default_rng(4), *shape, scale=0.3)
    out = np.asarray(muon.renormalize(jnp.asarray(x)))
    np.testing.assert_allclose(out, np_renorm(x.astype(np.float64)), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np_fro(out.astype(np.float64)), min(shape[-2:]) ** 0.5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_normuon_matches_numpy_over_two_steps(shape):
    rng = np.random.default_rng(5)
    v = np.zeros(muon.normuon_state_shape(shape), np.float32)
    v_ref = v.astype(np.float64)
    for _ in range(2):
        g = rand(rng, *shape)
        out, v = muon.normuon_variance_reduction(jnp.asarray(g), jnp.asarray(v), 0.9)
        ref, v_ref = np_normuon(g.astype(np.float64), v_ref, 0.9)
        np.testing.assert_allclose(np.asarray(v), v_ref, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-6)
        # per-neuron rescaling keeps the overall Frobenius norm
        np.testing.assert_allclose(np_fro(np.asarray(out, np.float64)), np_fro(g.astype(np.float64)), rtol=1e-5)


def test_cautious_weight_decay_only_where_signs_agree():
    g = jnp.array([[1.0, -1.0], [2.0, 0.0]])
    p = jnp.array([[0.5, 0.5], [-1.0, 3.0]])
    out = np.asarray(muon.cautious_weight_decay_update(g, p, 0.1, 0.5))
    # signs agree at [0,0] and [1,1] (0*3 >= 0): decay lr*wd*p there only
    np.testing.assert_allclose(out, [[-0.1 - 0.025, 0.1], [-0.2, -0.15]], atol=1e-7)


def test_muon_chain_matches_numpy_over_two_steps():
    rng = np.random.default_rng(6)
    params = {"tall": rand(rng, 64, 16, scale=0.1), "wide": rand(rng, 16, 64, scale=0.1)}
    tx = muon.muon(learning_rate=0.02, momentum=0.9, weight_decay=0.2)
    state, update = tx.init(params), jax.jit(tx.update)
    ref = {
        k: (p.astype(np.float64), np.zeros(p.shape), np.zeros(muon.normuon_state_shape(p.shape)))
        for k, p in params.items()
    }
    for _ in range(2):
        grads = {k: rand(rng, *p.shape) for k, p in params.items()}
        updates, state = update(grads, state, params)
        params = {k: np.asarray(params[k] + updates[k]) for k in params}
        for k in params:
            new_p, buf, v, edge = np_muon_step(*ref[k][:1], grads[k].astype(np.float64), *ref[k][1:], 0.02, 0.9, 0.2)
            ref[k] = (new_p, buf, v)
            np.testing.assert_allclose(params[k][~edge], new_p[~edge], atol=2e-6)
            assert edge.mean() < 0.01


# -----------------------------------------------------------------------------
# The combined optimizer on a stand-in with the model's parameter paths (and the real model)


class _Linear(nnx.Module):
    def __init__(self, fan_in, fan_out, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (fan_out, fan_in)) * fan_in**-0.5)


class _Embedding(nnx.Module):
    def __init__(self, num, dim, rngs):
        self.weight = nnx.Param(jax.random.normal(rngs.params(), (num, dim)))


class _Block(nnx.Module):
    def __init__(self, c, i, rngs):
        kv = c.n_kv_head * c.head_dim
        self.attn = nnx.Module()
        self.attn.c_q, self.attn.c_k = _Linear(c.n_embd, c.n_embd, rngs), _Linear(c.n_embd, kv, rngs)
        self.attn.c_v, self.attn.c_proj = _Linear(c.n_embd, kv, rngs), _Linear(c.n_embd, c.n_embd, rngs)
        if c.has_ve(i):
            self.attn.ve_gate = _Linear(12, c.n_kv_head, rngs)
        self.mlp = nnx.Module()
        self.mlp.c_fc, self.mlp.c_proj = _Linear(c.n_embd, 4 * c.n_embd, rngs), _Linear(4 * c.n_embd, c.n_embd, rngs)


class StandIn(nnx.Module):
    """Same parameter paths and shapes as nanochat's GPT state_dict."""

    def __init__(self, c: GPTConfig, rngs: nnx.Rngs):
        self.config = c
        self.transformer = nnx.Module()
        self.transformer.wte = _Embedding(c.padded_vocab_size, c.n_embd, rngs)
        self.transformer.h = nnx.List([_Block(c, i, rngs) for i in range(c.n_layer)])
        self.lm_head = _Linear(c.n_embd, c.padded_vocab_size, rngs)
        # explicit dtypes: a weak-typed parameter turns strong after its first update and the
        # jitted step would compile twice
        self.resid_lambdas = nnx.Param(jnp.linspace(1.15, 1.05, c.n_layer, dtype=jnp.float32))
        self.x0_lambdas = nnx.Param(jnp.linspace(0.2, 0.05, c.n_layer, dtype=jnp.float32))
        self.smear_gate = _Linear(24, 1, rngs)
        self.smear_lambda = nnx.Param(jnp.full((1,), 0.1, jnp.float32))
        self.backout_lambda = nnx.Param(jnp.full((1,), 0.2, jnp.float32))
        kv = c.n_kv_head * c.head_dim
        self.value_embeds = nnx.Dict(
            {str(i): _Embedding(c.padded_vocab_size, kv, rngs) for i in range(c.n_layer) if c.has_ve(i)}
        )


CONFIG = GPTConfig(sequence_len=64, vocab_size=100, n_layer=1, n_head=2, n_kv_head=1, n_embd=64)
KW = dict(unembedding_lr=0.008, embedding_lr=0.3, matrix_lr=0.02, weight_decay=0.2, scalar_lr=0.5)


def reference_groups(n_embd, unembedding_lr, embedding_lr, matrix_lr, weight_decay, scalar_lr):
    """nanochat's setup_optimizer table, typed out independently of flaxchat.train.optim."""
    s = (n_embd / 768) ** -0.5
    return {
        "lm_head": ("adamw", unembedding_lr * s, (0.8, 0.96), 0.01),
        "wte": ("adamw", embedding_lr * s, (0.8, 0.995), 0.001),
        "value_embeds": ("adamw", embedding_lr * s * 0.5, (0.8, 0.995), 0.01),
        "resid_lambdas": ("adamw", scalar_lr * 0.01, (0.8, 0.95), 0.05),
        "x0_lambdas": ("adamw", scalar_lr, (0.96, 0.95), 0.0),
        "smear": ("adamw", 0.2, (0.8, 0.95), 0.0),
        "matrix": ("muon", matrix_lr, None, weight_decay),
    }


def reference_group_of(name):
    if name.startswith("transformer.h."):
        return "matrix"
    if name.startswith("value_embeds."):
        return "value_embeds"
    if name in ("smear_gate.weight", "smear_lambda", "backout_lambda"):
        return "smear"
    return {"transformer.wte.weight": "wte", "lm_head.weight": "lm_head"}.get(name, name)


def flat_params(model):
    return {".".join(map(str, k)): np.asarray(v.get_value()) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def grads_like(model, arrays):
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return nnx.from_flat_state([(k, v.replace(jnp.asarray(arrays[".".join(map(str, k))]))) for k, v in flat])


# One jitted step for every test: same model/optimizer structure -> compiled once.
UPDATE = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))


def make_model():
    """flaxchat's GPT, depth 2, width 64."""
    return GPT(
        GPTConfig(sequence_len=64, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64), rngs=nnx.Rngs(0)
    )


@pytest.fixture(scope="module")
def fresh():
    """Returns reset() -> (model, optimizer), both back at their initial values (compiled once)."""
    model = nnx.jit(make_model)()  # one compile instead of many eager ops
    optimizer = optim.build_optimizer(model, **KW)
    initial = jax.tree.map(jnp.copy, nnx.state((model, optimizer)))

    def reset():
        nnx.update((model, optimizer), jax.tree.map(jnp.copy, initial))
        return model, optimizer

    return reset


def check_against_numpy_muon_adamw(model, optimizer, steps=2):
    """`steps` random-gradient updates next to a numpy MuonAdamW with nanochat's group table."""
    groups = reference_groups(model.config.n_embd, **KW)
    ref = {k: [p.astype(np.float64), np.zeros(p.shape), None] for k, p in flat_params(model).items()}
    rng = np.random.default_rng(7)
    for t in range(1, steps + 1):
        grads = {k: rand(rng, *p[0].shape, scale=0.01) for k, p in ref.items()}
        UPDATE(model, optimizer, grads_like(model, grads))
        got = flat_params(model)
        for k, (p, m, v) in ref.items():
            kind, lr, betas, wd = groups[reference_group_of(k)]
            g = grads[k].astype(np.float64)
            if kind == "muon":
                v = np.zeros(muon.normuon_state_shape(p.shape)) if v is None else v
                p, m, v, edge = np_muon_step(p, g, m, v, lr, 0.95, wd)
                assert edge.mean() < 0.01
                np.testing.assert_allclose(got[k][~edge], p[~edge], atol=2e-6, err_msg=k)
            else:
                p, m, v = np_adamw_step(p, g, m, np.zeros(p.shape) if v is None else v, t, lr, *betas, 1e-10, wd)
                np.testing.assert_allclose(got[k], p, rtol=1e-6, atol=5e-7, err_msg=k)
            ref[k] = [p, m, v]


def test_param_groups_follow_nanochat_table():
    model = nnx.eval_shape(lambda: StandIn(CONFIG, nnx.Rngs(0)))
    names = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(optim.param_labels(nnx.state(model, nnx.Param)))}
    expected = {
        "matrix": "matrix",
        "wte": "embedding",
        "lm_head": "unembedding",
        "value_embeds": "value_embeds",
        "resid_lambdas": "resid",
        "x0_lambdas": "x0",
        "smear": "smear",
    }
    assert len(names) == 15 and all(v == expected[reference_group_of(k)] for k, v in names.items())
    assert names["transformer.h.0.attn.ve_gate.weight"] == "matrix"
    with pytest.raises(ValueError, match="no optimizer group"):
        optim.param_group(("transformer", "ln_f", "weight"))


def test_real_model_parameters_all_have_a_group():
    config = GPTConfig(sequence_len=64, vocab_size=128, n_layer=2, n_head=2, n_kv_head=1, n_embd=64)
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    labels = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(optim.param_labels(nnx.state(model, nnx.Param)))}
    assert set(labels.values()) == {"matrix", "embedding", "unembedding", "value_embeds", "resid", "x0", "smear"}
    assert sum(v == "matrix" for v in labels.values()) == 2 * 6 + 1  # six per block + one ve_gate


def test_build_optimizer_matches_numpy_muon_adamw(fresh):
    """build_optimizer's update == nanochat's MuonAdamW (numpy), two steps, on flaxchat's GPT."""
    model, optimizer = fresh()
    check_against_numpy_muon_adamw(model, optimizer)
    stats = optim.optimizer_stats(optimizer)
    assert float(stats["lr_multiplier"]) == 1.0 and float(stats["muon_momentum"]) == pytest.approx(0.95)
    assert float(stats["muon_weight_decay"]) == pytest.approx(0.2) and int(stats["skipped_steps"]) == 0


def test_build_optimizer_traces_abstractly():
    abstract = nnx.eval_shape(lambda: StandIn(CONFIG, nnx.Rngs(0)))
    optimizer = nnx.eval_shape(lambda m: optim.build_optimizer(m, schedule=optim.Schedule(10)), abstract)
    assert isinstance(optimizer, nnx.Optimizer)


def test_polar_dtype_bfloat16_stays_close_to_float32():
    rng = np.random.default_rng(8)
    params, grads = {"w": rand(rng, 64, 32, scale=0.1)}, {"w": rand(rng, 64, 32)}
    updates = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        tx = muon.muon(0.02, polar_dtype=dtype)
        updates[dtype] = np.asarray(jax.jit(tx.update)(grads, tx.init(params), params)[0]["w"])
        assert updates[dtype].dtype == np.float32  # back in the parameter dtype
    a, b = updates[jnp.float32], updates[jnp.bfloat16]
    assert 0 < np.linalg.norm(a - b) < 0.08 * np.linalg.norm(a)


def test_bfloat16_polar_express_is_as_accurate_as_torch_bfloat16():
    """nanochat runs equilibration + Polar Express in bf16 on GPUs, where torch keeps the Python
    coefficients in fp32. Rounding them to bf16 (8.1566 -> 8.125) would double the error."""
    torch = pytest.importorskip("torch")

    def torch_reference(t):  # equilibrate + polar express, written with torch ops
        t = t * (t.float().norm() / t.size(0) ** 0.5 / t.float().norm(dim=1, keepdim=True).clamp_min(1e-6)).to(t.dtype)
        t = t / (t.norm() * 1.01 + 1e-6)
        for a, b, c in muon.POLAR_EXPRESS_COEFFS:
            if t.size(0) > t.size(1):
                gram = t.mT @ t
                t = a * t + t @ (b * gram + c * (gram @ gram))
            else:
                gram = t @ t.mT
                t = a * t + (b * gram + c * (gram @ gram)) @ t
        return t.float().numpy()

    forms = cpu.forms_for()  # as a model built here multiplies (on a CPU: bf16 products into fp32)
    ours = jax.jit(lambda x: muon.polar_express(muon.equilibrate_rows(x), forms=forms).astype(jnp.float32))
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
    errors = []
    for seed in range(4):
        x = rand(np.random.default_rng(10 + seed), 64, 32)
        exact = torch_reference(torch.from_numpy(x))
        assert rel(np.asarray(ours(jnp.asarray(x))), exact) < 1e-5  # fp32: same math
        bf16 = np.asarray(ours(jnp.asarray(x, jnp.bfloat16)))
        errors.append((rel(bf16, exact), rel(torch_reference(torch.from_numpy(x).bfloat16()), exact)))
    ours_err, torch_err = np.mean(errors, axis=0)
    assert 0.01 < ours_err < 1.5 * torch_err, (ours_err, torch_err)


# -----------------------------------------------------------------------------
# Non-finite steps and hand-set hyperparameters


def test_nonfinite_step_is_skipped_and_counted(fresh):
    model, optimizer = fresh()
    params0 = flat_params(model)
    inner0 = jax.tree.map(np.asarray, nnx.as_pure(optimizer.opt_state).inner_state.inner_state)
    rng = np.random.default_rng(9)
    bad = {k: rand(rng, *p.shape) for k, p in params0.items()}
    bad["transformer.h.0.mlp.c_fc.weight"][3, 5] = np.nan
    bad["lm_head.weight"][0, 0] = np.inf
    UPDATE(model, optimizer, grads_like(model, bad))

    assert int(optim.optimizer_stats(optimizer)["skipped_steps"]) == 1
    assert all(np.array_equal(params0[k], v) for k, v in flat_params(model).items())
    inner1 = nnx.as_pure(optimizer.opt_state).inner_state.inner_state
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, inner0, inner1)))

    # the next finite step is exactly a first step: nothing of the bad one leaked into the state
    good = {k: rand(rng, *p.shape) for k, p in params0.items()}
    UPDATE(model, optimizer, grads_like(model, good))
    after_skip = flat_params(model)
    assert int(optim.optimizer_stats(optimizer)["skipped_steps"]) == 1
    model, optimizer = fresh()
    UPDATE(model, optimizer, grads_like(model, good))
    assert all(np.array_equal(after_skip[k], v) for k, v in flat_params(model).items())


@pytest.mark.parametrize("scale", [1e14, 1e16, 1e30])
def test_gradients_beyond_the_limit_are_dropped(fresh, scale):
    """Gradients up to optim.GRADIENT_LIMIT make a finite step; beyond it (where Muon's norms and Adam's second
    moments may overflow: at 1e30 MuonEq's row scaling makes NaN) the step is dropped like a non-finite one."""
    model, optimizer = fresh()
    params0 = flat_params(model)
    rng = np.random.default_rng(3)
    grads = {k: np.clip(rand(rng, *p.shape), -5, 5) * np.float32(scale) for k, p in params0.items()}
    taken = scale * 5 <= optim.GRADIENT_LIMIT
    UPDATE(model, optimizer, grads_like(model, grads))
    assert int(optim.optimizer_stats(optimizer)["skipped_steps"]) == (0 if taken else 1)
    after = flat_params(model)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.as_pure(optimizer.opt_state)))
    assert all(np.isfinite(v).all() for v in after.values())
    for name in ("lm_head.weight", "transformer.h.0.mlp.c_fc.weight"):  # an Adam and a Muon parameter
        assert np.array_equal(after[name], params0[name]) != taken


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2e15, None], ids=["nan", "inf", "-inf", "too-large", "none"])
def test_gradient_check_sees_any_single_bad_element(bad):
    """One bad element anywhere (NaN, inf, or beyond the limit), in fp32 or bf16, fails the check, and nothing else
    does: values at the limit pass."""
    edge = np.full((64, 48), optim.GRADIENT_LIMIT, np.float32)
    tree = {"a": edge, "b": jnp.ones((3, 5), jnp.bfloat16), "c": np.zeros(7, np.float32)}
    check = jax.jit(lambda t: optim.all_within(t, optim.GRADIENT_LIMIT))
    assert bool(check(tree))
    if bad is None:
        return
    for leaf, index in (("a", (17, 40)), ("b", (2, 4)), ("c", (0,))):
        broken = dict(tree)
        x = np.array(tree[leaf], np.float32)
        x[index] = bad
        broken[leaf] = jnp.asarray(x, tree[leaf].dtype)
        assert not bool(check(broken)), (leaf, bad)


def test_skip_report_names_why_a_step_was_dropped():
    assert optim.skip_report(7, 2.5, 1, 1) is None  # nothing dropped this step
    assert (
        optim.skip_report(7, float("nan"), 1, 2) == "step 7: non-finite loss; the update was skipped (2 skipped so far)"
    )
    line = optim.skip_report(8, 2.5, 2, 3)  # a finite loss whose gradients were dropped
    assert line == "step 8: gradients not finite or beyond 1e+15; the update was skipped (3 skipped so far)"


def test_hyperparameters_can_be_set_by_hand(fresh):
    model, optimizer = fresh()
    optimizer.opt_state.hyperparams["lr_multiplier"][...] = 0.0
    before = flat_params(model)
    UPDATE(model, optimizer, grads_like(model, {k: np.ones(p.shape, np.float32) for k, p in before.items()}))
    assert all(np.array_equal(before[k], v) for k, v in flat_params(model).items())
    assert float(optim.optimizer_stats(optimizer)["lr_multiplier"]) == 0.0


# -----------------------------------------------------------------------------
# Schedules


def base_train_schedules(num_iterations, warmup_steps, warmdown_ratio, final_lr_frac):
    """base_train's get_lr_multiplier / get_muon_momentum / weight-decay cosine, in plain Python."""
    warmdown = round(warmdown_ratio * num_iterations)

    def lrm(it):
        if it < warmup_steps:
            return (it + 1) / warmup_steps
        if it <= num_iterations - warmdown:
            return 1.0
        progress = (num_iterations - it) / warmdown
        return progress + (1 - progress) * final_lr_frac

    def momentum(it):
        start = num_iterations - warmdown
        if it < 400:
            return (1 - it / 400) * 0.85 + it / 400 * 0.97
        if it >= start:
            progress = (it - start) / warmdown
            return 0.97 * (1 - progress) + 0.90 * progress
        return 0.97

    def wd(it):
        return 0.5 * (1 + math.cos(math.pi * it / num_iterations))

    return lrm, momentum, wd


@pytest.mark.parametrize("args", [(1000, 40, 0.65, 0.05), (300, 0, 0.5, 0.0), (50, 10, 0.0, 0.1), (800, 5, 1.0, 0.05)])
def test_schedule_matches_base_train(args):
    schedule = optim.Schedule(*args)
    steps = np.arange(args[0])
    for ours, theirs in zip(
        (schedule.lr_multiplier, schedule.muon_momentum, schedule.weight_decay_multiplier),
        base_train_schedules(*args),
    ):
        np.testing.assert_allclose(np.asarray(jax.vmap(ours)(steps)), [theirs(int(s)) for s in steps], atol=2e-6)


def test_schedule_rejects_bad_values():
    for bad in (
        dict(num_iterations=0),
        dict(num_iterations=10, warmdown_ratio=1.5),
        dict(num_iterations=10, warmup_steps=-1),
    ):
        with pytest.raises(ValueError):
            optim.Schedule(**bad)


class Tiny(nnx.Module):
    """Smallest model with a Muon matrix and an AdamW scalar: fast to compile."""

    def __init__(self, rngs):
        self.config = CONFIG
        block = nnx.Module()
        block.mlp = nnx.Module()
        block.mlp.c_fc = _Linear(16, 32, rngs)
        self.transformer = nnx.Module()
        self.transformer.h = nnx.List([block])
        self.resid_lambdas = nnx.Param(jnp.ones(2, jnp.float32))


def test_schedule_drives_hyperparameters_without_recompiling():
    model = Tiny(nnx.Rngs(0))
    optimizer = optim.build_optimizer(model, schedule=optim.Schedule(10, warmup_steps=3, warmdown_ratio=0.5), **KW)
    traces = []

    @nnx.jit
    def update(m, o, g):
        traces.append(1)
        o.update(m, g)

    lrm, momentum, wd = base_train_schedules(10, 3, 0.5, 0.05)
    grads = grads_like(model, {k: np.full(p.shape, 0.01, np.float32) for k, p in flat_params(model).items()})
    for step in range(6):
        update(model, optimizer, grads)
        stats = optim.optimizer_stats(optimizer)
        assert float(stats["lr_multiplier"]) == pytest.approx(lrm(step), abs=1e-6)
        assert float(stats["muon_momentum"]) == pytest.approx(momentum(step), abs=1e-6)
        assert float(stats["muon_weight_decay"]) == pytest.approx(0.2 * wd(step), abs=1e-6)
    assert len(traces) == 1 and int(optimizer.step[...]) == 6


# -----------------------------------------------------------------------------
# Depth-derived training plan, against numbers computed with nanochat's base_train rules

# num_scaling_params() of nanochat's GPT (vocab 32768, aspect 64, head_dim 128, seq 2048, SSSL)
COUNTS = {
    4: dict(
        wte=8388608, value_embeds=16777216, lm_head=8388608, transformer_matrices=3145776, scalars=34, total=36700242
    ),
    12: dict(
        wte=25165824,
        value_embeds=150994944,
        lm_head=25165824,
        transformer_matrices=84935088,
        scalars=50,
        total=286261730,
    ),
    20: dict(
        wte=41943040,
        value_embeds=419430400,
        lm_head=41943040,
        transformer_matrices=393217200,
        scalars=66,
        total=896533746,
    ),
    26: dict(
        wte=54525952,
        value_embeds=708837376,
        lm_head=54525952,
        transformer_matrices=863897580,
        scalars=78,
        total=1681786938,
    ),
}
FLOPS = {4: 80216496, 12: 759696048, 20: 2886212784, 26: 5991051288}


@pytest.mark.parametrize(
    "depth, flags, batch, iterations, wd, lr_scale",
    [
        (12, {}, 524288, 2520, 0.28, 1.0),
        (20, {}, 1048576, 4980, 0.1001877764255601, 2**0.5),
        (26, {}, 1048576, 10510, 0.04747018702740847, 2**0.5),
        (4, dict(target_flops=1e15), 262144, 48, 1.8899031293917847, 0.5**0.5),
        (20, dict(num_iterations=1000, total_batch_size=2**20), 1048576, 1000, 0.1001877764255601, 2**0.5),
        (4, dict(target_param_data_ratio=-1, num_iterations=50), 262144, 50, 1.8899031293917847, 0.5**0.5),
    ],
)
def test_derive_training_matches_nanochat(depth, flags, batch, iterations, wd, lr_scale):
    plan = derive_training(depth, COUNTS[depth], FLOPS[depth], COUNTS[12], **flags)
    assert plan.total_batch_size == batch and plan.num_iterations == iterations
    assert plan.weight_decay == pytest.approx(wd, rel=1e-12)
    assert plan.batch_lr_scale == pytest.approx(lr_scale, rel=1e-12)
    assert plan.matrix_lr == pytest.approx(0.02 * lr_scale) and plan.embedding_lr == pytest.approx(0.3 * lr_scale)
    assert plan.unembedding_lr == pytest.approx(0.008 * lr_scale) and plan.scalar_lr == pytest.approx(0.5 * lr_scale)
    text = plan.describe()
    assert f"{batch:,}" in text and f"iterations: {iterations:,}" in text


def test_derive_training_small_vocab_ratio_20():
    counts = dict(
        wte=3145728, value_embeds=9437184, lm_head=3145728, transformer_matrices=10616940, scalars=38, total=26345618
    )
    ref = dict(
        wte=6291456, value_embeds=37748736, lm_head=6291456, transformer_matrices=84935088, scalars=50, total=135266786
    )
    plan = derive_training(6, counts, 89654040, ref, target_param_data_ratio=20)
    assert (plan.total_batch_size, plan.num_iterations) == (262144, 1050)
    assert plan.weight_decay == pytest.approx(1.3123861018991105, rel=1e-12)


def test_derive_training_rejects_bad_flags():
    with pytest.raises(ValueError, match="no training horizon"):
        derive_training(12, COUNTS[12], FLOPS[12], COUNTS[12], target_param_data_ratio=-1)
    with pytest.raises(ValueError, match="0 iterations"):
        derive_training(4, COUNTS[4], FLOPS[4], COUNTS[12], target_flops=1e9)
    with pytest.raises(ValueError, match="total-batch-size"):
        derive_training(4, COUNTS[4], FLOPS[4], COUNTS[12], total_batch_size=0)


def test_bfloat16_gram_matrices_are_bfloat16_products_of_the_same_sums():
    """muon.gram_matrix splits the long side in two for bf16 on a CPU (one bf16 product instead of an fp32 one); the
    result is the plain Gram matrix, and the orthogonalisation compiles to bf16 products only."""
    from flaxchat.perf.hlo import dot_types

    rng = np.random.default_rng(3)
    mm = lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b, preferred_element_type=jnp.float32)
    for shape, tall in (((3, 32, 96), False), ((3, 96, 32), True)):
        x = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
        plain = mm(jnp.swapaxes(x, -1, -2), x) if tall else mm(x, jnp.swapaxes(x, -1, -2))
        gram = muon.gram_matrix(x, tall, mm, cpu.forms_for())
        np.testing.assert_allclose(np.asarray(gram.astype(jnp.float32)), np.asarray(plain), rtol=2**-7, atol=1e-3)
        program = jax.jit(lambda x: muon.polar_express(x, forms=cpu.forms_for())).lower(x).compile().as_text()
        assert {d[:2] for d in dot_types(program)} == {("bf16", "bf16")}


def test_the_orthogonalisation_dtype_follows_the_models(monkeypatch):
    """build_optimizer orthogonalises in bf16 for a bf16 model (as nanochat), also where the default compute
    dtype is fp32 (a CPU run with --dtype bfloat16)."""
    from flax import nnx

    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    seen = []
    original = optim.muon_adamw
    monkeypatch.setattr(
        optim,
        "muon_adamw",
        lambda groups, schedule, polar_dtype, axes, forms: (
            seen.append(jnp.dtype(polar_dtype).name),
            original(groups, schedule, polar_dtype, axes, forms),
        )[1],
    )
    config = GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, n_embd=64)
    for dtype in (jnp.float32, jnp.bfloat16):
        model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype))
        nnx.eval_shape(lambda m: optim.build_optimizer(m, verbose=False), model)
    assert seen == ["float32", "bfloat16"]


@pytest.mark.parametrize("shape, flops_ratio", [((2, 256, 64), 0.6), ((2, 64, 256), 0.6), ((96, 48), 0.9)])
def test_long_fp32_matrices_orthogonalise_in_the_gram_form_with_fewer_products(monkeypatch, shape, flops_ratio):
    """An fp32 matrix at least GRAM_FORM_MIN_ASPECT times as long as it is wide takes polar_express_gram: the
    same iterates (checked against the direct iteration in float64, as close as the direct fp32 form gets)
    for fewer matmul FLOPs: about half at nanochat's 4:1 MLP matrices."""
    from flaxchat.perf.hlo import program_stats

    x = rand(np.random.default_rng(31), *shape)
    exact = np_polar(x.astype(np.float64))
    ours = np.asarray(muon.polar_express(jnp.asarray(x)))
    with monkeypatch.context() as m:  # the direct fp32 iteration of the same matrix (eager: no cached trace)
        m.setattr(muon, "GRAM_FORM_MIN_ASPECT", float("inf"))
        direct = muon.polar_express(jnp.asarray(x))
    direct_error = np.abs(np.asarray(direct, np.float64) - exact).max()
    assert np.abs(ours - exact).max() <= max(2 * direct_error, 1e-6)
    long, short = max(shape[-2:]), min(shape[-2:])
    count = math.prod(shape[:-2])
    direct_flops = count * 5 * (2 * 2 * long * short**2 + 2 * short**3)
    flops = program_stats(jax.jit(muon.polar_express).lower(jnp.asarray(x)).compile().as_text())["matmul_flops"]
    assert 0 < flops <= flops_ratio * direct_flops, (flops, direct_flops)
