import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from flaxchat import sharding
from flaxchat.export.nanochat import from_nanochat_state_dict, to_nanochat_state_dict
from flaxchat.model import cpu
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT, CausalSelfAttention, init_table, rotary_cos_sin, stacked_product

TINY = GPTConfig(sequence_len=64, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)


def randomize(model, seed=0, scale=0.05):
    """Perturb every parameter: zero-initialised projections would otherwise hide whole paths."""
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def make(config=TINY, seed=0):
    return randomize(GPT(config, rngs=nnx.Rngs(seed)), seed)


def naive_loss(model, idx, targets):
    logits = model(idx)  # (B, T, V) soft-capped fp32
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
    valid = targets >= 0
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.sum(valid)


def test_loss_at_init_is_log_vocab():
    model = GPT(TINY, rngs=nnx.Rngs(0))
    idx = jax.random.randint(jax.random.key(0), (2, 64), 0, TINY.vocab_size)
    assert abs(float(model(idx, idx)) - np.log(TINY.vocab_size)) < 0.02


def test_logits_shape_and_softcap():
    model = make()
    logits = model(jnp.zeros((3, 16), jnp.int32))
    assert logits.shape == (3, 16, TINY.vocab_size) and logits.dtype == jnp.float32  # padding cropped
    assert float(jnp.abs(logits).max()) < 15.0


def test_fused_loss_and_grads_equal_naive():
    model = make()
    idx = jax.random.randint(jax.random.key(1), (2, 64), 0, TINY.vocab_size)
    targets = idx.at[0, :5].set(-1)
    fused, g1 = nnx.value_and_grad(lambda m: m(idx, targets))(model)
    naive, g2 = nnx.value_and_grad(lambda m: naive_loss(m, idx, targets))(model)
    np.testing.assert_allclose(float(fused), float(naive), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=1e-4)


def test_loss_reductions():
    model = make()
    idx = jax.random.randint(jax.random.key(2), (2, 32), 0, TINY.vocab_size)
    targets = idx.at[1, 3:9].set(-1)
    per_tok = model(idx, targets, loss_reduction="none")
    assert per_tok.shape == (2, 32) and float(jnp.abs(per_tok[1, 3:9]).max()) == 0.0
    n = int(jnp.sum(targets >= 0))
    np.testing.assert_allclose(float(model(idx, targets, loss_reduction="sum")), float(per_tok.sum()), rtol=1e-5)
    np.testing.assert_allclose(float(model(idx, targets)), float(per_tok.sum()) / n, rtol=1e-5)
    with pytest.raises(ValueError, match="loss_reduction"):
        model(idx, targets, loss_reduction="max")


def test_causality_by_gradient():
    """d(loss at t)/d(embedding at t') is exactly 0 for t' > t (both the token and the value embeddings)."""
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, n_embd=64, window_pattern="L")
    model = make(config)
    T, t = 32, 13
    idx = jnp.arange(T)[None, :]  # distinct tokens: wte row j is "the embedding at position j"

    def loss_at_t(m):
        return m(idx, idx, loss_reduction="none")[0, t]

    grads = nnx.grad(loss_at_t)(model)
    for table in [grads.transformer.wte.weight[...]] + [ve.weight[...] for ve in grads.value_embeds.values()]:
        row_norm = np.abs(np.asarray(table[:T])).sum(axis=1)
        assert np.all(row_norm[t + 1 :] == 0.0)
        assert np.all(row_norm[: t + 1] > 0.0)


def test_sliding_window_layer_ignores_tokens_outside_window():
    config = GPTConfig(sequence_len=32, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=64)
    attn = CausalSelfAttention(config, 0, init_table(config), nnx.Rngs(0), cpu.forms_for())
    randomize(attn)
    T, t, window = 32, 20, 6
    x = jax.random.normal(jax.random.key(3), (1, T, 64))
    cos, sin = rotary_cos_sin(jnp.arange(T), config.head_dim, jnp.float32)
    cos, sin = cos[None, :, None], sin[None, :, None]

    def out_t(x):
        y, _ = attn(x, None, cos, sin, window)
        return jnp.sum(y[0, t])

    g = np.abs(np.asarray(jax.grad(out_t)(x)[0])).sum(axis=1)  # (T,)
    assert np.all(g[: t - window] == 0.0) and np.all(g[t + 1 :] == 0.0)
    assert np.all(g[t - window : t + 1] > 0.0)


def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    mha_cfg = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=4, n_kv_head=4, n_embd=64)
    gqa = make(gqa_cfg)
    D, rep = gqa_cfg.head_dim, 2
    sd = to_nanochat_state_dict(gqa)
    for name, w in sd.items():
        if name.endswith(("attn.c_k.weight", "attn.c_v.weight")):  # (Hkv*D, C) -> (H*D, C)
            sd[name] = np.repeat(w.reshape(gqa_cfg.n_kv_head, D, -1), rep, axis=0).reshape(-1, w.shape[-1])
        elif name.endswith("ve_gate.weight"):  # (Hkv, 12) -> (H, 12)
            sd[name] = np.repeat(w, rep, axis=0)
        elif name.startswith("value_embeds."):  # (V, Hkv*D) -> (V, H*D)
            sd[name] = np.repeat(w.reshape(w.shape[0], gqa_cfg.n_kv_head, D), rep, axis=1).reshape(w.shape[0], -1)
    mha = from_nanochat_state_dict(sd, mha_cfg)
    idx = jax.random.randint(jax.random.key(4), (2, 32), 0, 100)
    np.testing.assert_allclose(np.asarray(gqa(idx)), np.asarray(mha(idx)), atol=1e-5)


def test_cached_decode_equals_full_forward():
    """At every step, logits from the KV cache (a fresh prefill, a 5-token chunk over a filled cache, then one
    token at a time) equal a full forward."""
    config = GPTConfig(
        sequence_len=48, vocab_size=100, n_layer=3, n_head=2, n_kv_head=1, n_embd=64, window_pattern="SL"
    )
    config = GPTConfig(**{**config.to_dict(), "sequence_len": 48})
    model = make(config)
    # short window so the cached path must honour it: force S windows of 8
    model.window_sizes = [8, 48, 48]
    idx = jax.random.randint(jax.random.key(5), (2, 40), 0, 100)
    full = model(idx)
    cache = model.init_cache(2, 48)
    logits, cache = model.forward_cached(idx[:, :10], cache, fresh=True)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, :10]), atol=1e-5)
    logits, cache = model.forward_cached(idx[:, 10:15], cache)  # sees the cache and itself, causally
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full[:, 10:15]), atol=1e-5)
    step = nnx.jit(lambda m, tok, c: m.forward_cached(tok, c))
    for t in range(15, 40):
        logits, cache = step(model, idx[:, t : t + 1], cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), np.asarray(full[:, t]), atol=1e-5)
    assert np.all(np.asarray(cache.pos) == 40)


def test_cached_logits_at_selects_each_rows_position():
    """forward_cached(..., logits_at=i) returns exactly row b's logits at index i[b] (prefill without (T, V) logits)."""
    config = GPTConfig(sequence_len=32, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=64, window_pattern="L")
    model = make(config)
    idx = jax.random.randint(jax.random.key(7), (3, 12), 0, 100)
    full, cache_full = model.forward_cached(idx, model.init_cache(3, 24))
    at = jnp.array([11, 4, 0], jnp.int32)
    picked, cache = model.forward_cached(idx, model.init_cache(3, 24), logits_at=at)
    np.testing.assert_allclose(np.asarray(picked), np.asarray(full[jnp.arange(3), at]), atol=1e-6)
    for a, b in zip(cache.k + cache.v, cache_full.k + cache_full.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cache.k[0].shape == (3, 1, 24, 32) and cache.v[0].shape == (3, 1, 32, 24)  # (B, Hkv, S, D), (B, Hkv, D, S)
    fresh, cache_fresh = model.forward_cached(idx, model.init_cache(3, 24), logits_at=at, fresh=True)
    np.testing.assert_allclose(np.asarray(fresh), np.asarray(picked), atol=1e-5)
    for a, b in zip(cache_fresh.k + cache_fresh.v, cache.k + cache.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_estimate_flops_and_param_counts():
    config = GPTConfig.from_depth(4, max_seq_len=512, vocab_size=1000)  # C=256, H=2, D=128, SSSL
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0)))
    C, L, Vp = 256, 4, config.padded_vocab_size
    block = 4 * C * C + 8 * C * C  # q,k,v,proj + fc,proj
    ve_layers = [i for i in range(L) if config.has_ve(i)]
    matmul = L * block + len(ve_layers) * 12 * 2 + Vp * C + 24
    assert model.num_matmul_params() == matmul
    attn = sum(12 * 2 * 128 * w for w in [128, 128, 128, 512])
    assert model.estimate_flops() == 6 * matmul + attn
    counts = model.num_scaling_params()
    assert counts["wte"] == Vp * C and counts["lm_head"] == Vp * C
    assert counts["value_embeds"] == len(ve_layers) * Vp * C
    assert counts["scalars"] == 2 * L + 24 + 2
    assert counts["total"] == sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.eight_devices
def test_sharded_equals_unsharded_on_8_devices():
    config = GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    single = make(config)
    sharded = make(config)
    sharding.shard_model(sharded, mesh)
    assert sharded.transformer.h[0].mlp.c_fc.weight[...].sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    idx = jax.random.randint(jax.random.key(6), (8, 32), 0, 300)
    f = nnx.jit(lambda m, i: nnx.value_and_grad(lambda q: q(i, i))(m))
    with jax.set_mesh(mesh):
        loss_s, grads_s = f(sharded, jax.device_put(idx, sharding.batch_sharding(mesh)))
        logits_s = nnx.jit(lambda m, i: m(i))(sharded, idx)
    loss_1, grads_1 = f(single, idx)
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(single(idx)), atol=1e-5)
    assert abs(float(loss_s) - float(loss_1)) < 1e-5
    for a, b in zip(jax.tree.leaves(grads_s), jax.tree.leaves(grads_1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


@pytest.mark.eight_devices
def test_create_sharded_model_is_born_sharded():
    mesh = sharding.make_mesh(data=-1, fsdp=4, tensor=2)
    model = sharding.create_sharded(lambda: GPT(TINY, rngs=nnx.Rngs(0)), mesh)
    w = model.transformer.wte.weight[...]
    assert w.sharding.spec == jax.sharding.PartitionSpec("tensor", "fsdp")
    np.testing.assert_allclose(
        np.asarray(w), np.asarray(GPT(TINY, rngs=nnx.Rngs(0)).transformer.wte.weight[...]), atol=1e-6
    )


def test_make_mesh_errors():
    with pytest.raises(ValueError, match="divide"):
        sharding.make_mesh(data=3, fsdp=1, tensor=1, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match="at most one"):
        sharding.make_mesh(data=-1, fsdp=-1)
    assert sharding.make_mesh(devices=jax.devices()[:1]).shape == {"data": 1, "fsdp": 1, "tensor": 1}


# -----------------------------------------------------------------------------
# Remat, low-precision storage, products


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_keeps_loss_and_gradients(remat):
    idx = jax.random.randint(jax.random.key(1), (2, 64), 0, TINY.vocab_size)
    plain, rematted = make(), make()
    rematted.remat = remat
    f = nnx.jit(lambda m: nnx.value_and_grad(lambda m: m(idx, idx))(m))
    (l1, g1), (l2, g2) = f(plain), f(rematted)
    assert float(l1) == pytest.approx(float(l2), rel=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    with pytest.raises(ValueError, match="unknown remat"):
        GPT(TINY, rngs=nnx.Rngs(0), remat="some")


@pytest.mark.slow
def test_bfloat16_model_stores_embeddings_in_bfloat16_and_trains():
    """As nanochat: wte and value embeddings in the compute dtype, AdamW math in fp32 with bf16 moments."""
    from flaxchat.train.optim import build_optimizer
    from flaxchat.train.step import train_step

    config = GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert model.transformer.wte.weight[...].dtype == jnp.bfloat16
    assert model.value_embeds["1"].weight[...].dtype == jnp.bfloat16
    assert (
        model.lm_head.weight[...].dtype == jnp.float32
        and model.transformer.h[0].attn.c_q.weight[...].dtype == jnp.float32
    )
    reference = GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    rng = np.random.default_rng(0)
    seqs = (rng.integers(0, 300, (8, 1)) + np.arange(33)[None]) % 300  # learnable: +1 each position
    x, y = jnp.asarray(seqs[:, :-1], jnp.int32), jnp.asarray(seqs[:, 1:], jnp.int32)
    losses = {}
    for name, m in (("bf16", model), ("fp32", reference)):
        opt = build_optimizer(m, polar_dtype=m.dtype, verbose=False)
        losses[name] = [float(train_step(m, opt, (x,), (y,))) for _ in range(8)]
    mu = nnx.as_pure(opt.opt_state)  # the fp32 run's optimizer: moments fp32
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.5
    np.testing.assert_allclose(losses["bf16"], losses["fp32"], rtol=0.03)
    assert model.transformer.wte.weight[...].dtype == jnp.bfloat16  # updates did not promote the storage
    del mu


def _primitives_by_output_dtype(jaxpr, seen=None):
    """{(primitive name, output dtype)} over a jaxpr and every jaxpr nested in its equations (but a scatter's
    scalar update computation)."""
    seen = set() if seen is None else seen
    for eqn in jaxpr.eqns:
        seen.update((eqn.primitive.name, str(v.aval.dtype)) for v in eqn.outvars if hasattr(v.aval, "dtype"))
        for name, param in eqn.params.items():
            if name == "update_jaxpr":
                continue
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    _primitives_by_output_dtype(inner, seen)
    return seen


def test_a_bfloat16_model_on_a_cpu_multiplies_bfloat16_and_keeps_activations_float32():
    """On a CPU a bf16 model's training forward and backward round only the products' operands to bf16: no norm,
    rotary, softmax, soft-cap or residual arithmetic (nor its gradient) runs on bf16 values, which XLA:CPU would
    round after every op and run ~4x slower. Loss and gradients stay close to an fp32 model's with the same
    weights; generation's forward keeps bf16 activations."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    model = GPT(TINY, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    assert model.activation_dtype == jnp.float32 and model.transformer.h[0].mlp.c_fc.forms.products == jnp.bfloat16
    reference = GPT(TINY, rngs=nnx.Rngs(0), dtype=jnp.float32)
    nnx.update(reference, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(model, nnx.Param)))
    rng = np.random.default_rng(0)
    idx = jnp.asarray(rng.integers(0, 300, (4, 64)), jnp.int32)
    targets = jnp.asarray(rng.integers(0, 300, (4, 64)), jnp.int32)

    def loss_and_grads(m):
        graphdef, params = nnx.split(m, nnx.Param)
        f = jax.value_and_grad(lambda p: nnx.merge(graphdef, p)(idx, targets))
        return f, params

    f, params = loss_and_grads(model)
    arithmetic = {
        "mul",
        "add",
        "sub",
        "div",
        "exp",
        "tanh",
        "logistic",
        "rsqrt",
        "integer_pow",
        "square",
        "max",
        "reduce_sum",
        "reduce_max",
        "add_any",
        "neg",
        "select_n",
        "log",
    }
    ops = _primitives_by_output_dtype(jax.make_jaxpr(f)(params).jaxpr)
    assert ("dot_general", "bfloat16") not in ops and ("dot_general", "float32") in ops
    assert sorted(name for name, dtype in ops if dtype == "bfloat16" and name in arithmetic) == []
    loss, grads = f(params)
    want_loss, want_grads = loss_and_grads(reference)[0](nnx.state(reference, nnx.Param))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-3)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        assert np.linalg.norm(g - w) <= 0.05 * np.linalg.norm(w) + 1e-6
    cache = model.init_cache(4, 64)
    assert cache.k[0].dtype == jnp.bfloat16


def test_rotary_table_constants_equal_the_traced_tables():
    from flaxchat.model.gpt import rotary_table

    for head_dim in (32, 64, 128):
        table = rotary_table(4096, head_dim, jnp.float32)
        traced = rotary_cos_sin(jnp.arange(4096), head_dim, jnp.float32)
        for a, b in zip(table, traced):
            assert isinstance(a, np.ndarray)
            np.testing.assert_allclose(a, np.asarray(b), atol=1.2e-7, rtol=0)  # an ulp or so of fp32 cos/sin


def test_stacked_product_equals_the_layers_one_by_one():
    """Decode steps run q, k and v as one matmul over stacked weights; plain fp32 layers stack, the others run
    one by one, and either way each output is its own layer's."""
    from flaxchat.model.quantize import quantize_for_generation

    config = GPTConfig(sequence_len=32, vocab_size=128, n_layer=1, n_head=4, n_kv_head=2, n_embd=64)
    x = jax.random.normal(jax.random.key(0), (3, 1, 64))
    for mode in ("none", "int8", "bf16"):
        attn = quantize_for_generation(GPT(config, rngs=nnx.Rngs(1)), mode).transformer.h[0].attn
        layers = (attn.c_q, attn.c_k, attn.c_v)
        f = jax.jit(lambda x: stacked_product(x, layers))
        stacked = f(x)
        assert [y.shape for y in stacked] == [(3, 1, 64), (3, 1, 32), (3, 1, 32)]
        for y, m in zip(stacked, layers):
            np.testing.assert_allclose(y, m(x), rtol=1e-5, atol=1e-5)
        # fp32: one stacked product; int8 layers, and bf16 weights under fp32 inputs: one product per layer
        assert f.lower(x).as_text().count("dot_general") == {"none": 1, "int8": 3, "bf16": 3}[mode]


def test_a_bfloat16_embedding_sums_its_gradient_in_float32():
    """A token that fills a batch gets the whole sum of its gradients, rounded to bf16 once (as torch's embedding
    backward): a scatter-add into the bf16 table rounded after every add and stalled at 256."""
    from flaxchat.model.gpt import Embedding

    table = Embedding(
        8, 4, init=lambda key, shape: jnp.zeros(shape), axes=("vocab", "embed"), rngs=nnx.Rngs(0), dtype=jnp.bfloat16
    )
    idx = jnp.asarray([0] * 5000 + [3] * 7, jnp.int32)
    grad = nnx.grad(lambda m: m(idx, jnp.bfloat16).astype(jnp.float32).sum())(table)["weight"][...]
    assert grad.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(grad, np.float32)[[0, 3, 1]], [[float(jnp.bfloat16(5000))] * 4, [7.0] * 4, [0.0] * 4]
    )


@pytest.fixture(scope="module")
def bf16_train_program(users_codegen):
    from flaxchat.train.step import compile_train_step

    B, T, H, D = 8, 64, 2, 64
    config = GPTConfig(sequence_len=T, vocab_size=512, n_layer=2, n_head=H, n_kv_head=H, n_embd=H * D)
    mesh = sharding.make_mesh(devices=jax.devices()[:1])
    return config, B, compile_train_step(config, mesh, B, dtype=jnp.bfloat16, compiler_options=users_codegen).as_text()


def test_a_bfloat16_train_step_adds_embedding_gradients_in_float32(bf16_train_program):
    """The compiled step's scatter-adds (wte's and the value embeddings' gradients) are lone fp32 adds, which a GPU
    runs as atomic adds; an add rounded through bf16 is a compare-and-swap loop there, slow where tokens repeat."""
    from flaxchat.perf.hlo import scatter_combiners

    *_, program = bf16_train_program
    combiners = scatter_combiners(program)
    assert len(combiners) >= 2 and set(combiners) == {("f32", ("add",))}


def test_a_bfloat16_train_step_multiplies_bfloat16_on_a_cpu(bf16_train_program):
    """Every sizeable product in a bf16 model's compiled CPU train step (forward, backward, attention, fused loss,
    Muon) takes bf16 operands: XLA:CPU runs a product its bf16 kernels do not take (a bf16 result, a weight
    gradient over the rows, a stacked Gram matrix, attention's key and value gradients over the queries) in fp32,
    at half the rate. Only the smear and value-embedding gates' tiny products stay fp32, with the fp32
    activations (model.cpu.Forms.activation_dtype)."""
    from flaxchat.perf.hlo import dot_types

    config, B, program = bf16_train_program
    dots = dot_types(program)
    assert sum(lhs == rhs == "bf16" for lhs, rhs, _ in dots) >= 30
    assert [flops for lhs, rhs, flops in dots if (lhs, rhs) != ("bf16", "bf16") and flops > 10**5] == []
