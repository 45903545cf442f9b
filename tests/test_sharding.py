"""Scale-out on the 8-device CPU mesh: the compiled train step does the work split, with the collectives one expects.

Equal values hide wasted work, so these tests read the optimised HLO (flaxchat.perf.hlo): which collectives run per
step, how often, and how many matmul FLOPs each device does.
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.model import cpu
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.model.loss import loss_sum, token_losses
from flaxchat.perf.hlo import program_stats
from flaxchat.train import muon, optim
from flaxchat.train.optim import Schedule, build_optimizer
from flaxchat.train.step import compile_train_step, train_step

pytestmark = pytest.mark.eight_devices

# 4 heads so that tensor=2 splits heads; vocab large enough that the loss runs in several chunks
CONFIG = GPTConfig(sequence_len=64, vocab_size=4096, n_layer=2, n_head=4, n_kv_head=4, n_embd=128)
MESHES = {"dp": (8, 1, 1), "fsdp": (1, 8, 1), "dp_tp": (4, 1, 2)}
FORMS = cpu.forms_for()  # the loss's forms in a model built here


def compiled_step(mesh_shape, grad_accum, capfd=None):
    mesh = sharding.make_mesh(*mesh_shape)
    rows = 2 * mesh.shape["data"] * mesh.shape["fsdp"]
    compiled = compile_train_step(CONFIG, mesh, rows, grad_accum, jnp.float32)
    log = capfd.readouterr().err if capfd is not None else ""
    return program_stats(compiled.as_text()), log


def gradient_reductions(stats):
    """All-reduces / reduce-scatters carrying float tensors of parameter size (not counts or finiteness flags)."""
    big = lambda shape: any(
        np.prod([int(d) for d in dims.split(",") if d]) >= CONFIG.n_embd**2 // 4
        for t, dims in __import__("re").findall(r"\b(f32|bf16)\[([0-9,]*)\]", shape)
    )
    return [(k, s, n, op) for k, s, n, op in stats["ops"] if k in ("all-reduce", "reduce-scatter") and big(s)]


def test_data_parallel_step_reduces_gradients_once_per_step(capfd):
    stats, log = compiled_step(MESHES["dp"], grad_accum=3, capfd=capfd)
    assert "Involuntary full rematerialization" not in log
    grads = gradient_reductions(stats)
    assert len(grads) == 1 and grads[0][2] == 1, grads  # one (combined) all-reduce, run once, not per micro-step
    # nothing row-sized crosses devices: no all-gather or all-to-all of activations anywhere in the step
    moved = {k for k, _, _, op in stats["ops"] if "while" in op}
    assert not moved, [o for o in stats["ops"] if "while" in o[3]]


def test_fsdp_step_moves_weights_not_activations(capfd):
    stats, log = compiled_step(MESHES["fsdp"], grad_accum=1, capfd=capfd)
    assert "Involuntary full rematerialization" not in log
    model = nnx.eval_shape(lambda: GPT(CONFIG, rngs=nnx.Rngs(0)))
    param_shapes = {tuple(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param))}
    gathered = {
        tuple(int(d) for d in s[s.index("[") + 1 : s.index("]")].split(",") if d)
        for k, s, _, _ in stats["ops"]
        if k == "all-gather"
    }
    # every gather is a weight (or a stack of Muon updates, a leading stack axis), never a (rows, width) activation
    assert all(
        g in param_shapes
        or g[1:] in param_shapes
        or g[1:] in {(s[0], 1) for s in param_shapes}
        or g[1:] in {(1, s[1]) for s in param_shapes if len(s) == 2}
        for g in gathered
    ), gathered
    assert len(gradient_reductions(stats)) == 1
    # Muon's all-to-alls move its stacks of directions to their split along the stack and the updates back (plus
    # NorMuon's one-column buffers): the parameters stay where they live (the weight decay's sign test reads them
    # leaf by leaf), so the traffic is two trips of the padded direction stacks, not three
    axes = optim.param_axes(model)
    with jax.set_mesh(sharding.make_mesh(*MESHES["fsdp"])):  # matrices that travel alike share a stack
        groups = collections.Counter(
            (shape, tuple(sharding.stack_layouts(axes[path])))
            for path, shape in optim_matrices(model)
            if np.prod(shape) >= muon.SHARE_OUT_MIN_SIZE
        )
    stacks = sum(-(-n // 8) * 8 * 4 * np.prod(shape) for (shape, _), n in groups.items())
    trip = 7 / 8 * stacks / 8  # an all-to-all of one device's eighth of the stacks, ring model
    assert 2 * trip <= stats["by_kind"]["all-to-all"]["bytes"] <= 2.01 * trip, (stats["by_kind"], trip)


def optim_matrices(model):
    """(path, shape) of every parameter Muon updates."""
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param), is_leaf=muon.is_variable)[0]
    paths = [(muon.path_names(path), tuple(v.shape)) for path, v in leaves]
    return [(path, shape) for path, shape in paths if optim.param_group(path) == "matrix"]


def test_data_x_tensor_step_compiles_without_rematerialisation(capfd):
    stats, log = compiled_step(MESHES["dp_tp"], grad_accum=2, capfd=capfd)
    assert "Involuntary full rematerialization" not in log
    assert stats["unknown_trip_counts"] == 0
    # the data-parallel gradient all-reduce still happens once per step, after the micro-steps (the others
    # are tensor parallelism's activation sums, once per micro-step by design)
    assert [n for _, _, n, op in gradient_reductions(stats) if op.endswith("shard_map/psum")] == [1]


@pytest.mark.parametrize("mesh_shape", [MESHES["dp"], MESHES["fsdp"]], ids=["dp", "fsdp"])
def test_loss_flops_per_device_are_an_eighth(mesh_shape):
    N, C, V = 8 * 512, 64, 4096
    f = jax.jit(lambda x, w, t: jax.value_and_grad(loss_sum, argnums=(0, 1))(x, w, t, V, FORMS))

    def flops(mesh, rows):
        arg = lambda shape, dtype, spec: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))
        with jax.set_mesh(mesh):
            compiled = f.lower(
                arg((N, C), jnp.float32, rows), arg((V, C), jnp.float32, P()), arg((N,), jnp.int32, rows)
            ).compile()
        return program_stats(compiled.as_text())

    one = flops(sharding.make_mesh(devices=jax.devices()[:1]), P())
    eight = flops(sharding.make_mesh(*mesh_shape), P(("data", "fsdp")))
    assert one["matmul_flops"] == 3 * 2 * N * C * V  # logits, dx, dw
    assert eight["matmul_flops"] == one["matmul_flops"] // 8
    assert [k for k, _, _, _ in eight["ops"]] == ["all-reduce"]  # the loss and lm_head gradient sums, together


def test_sharded_loss_equals_unsharded():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(512, 64)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(1000, 64)) * 0.1, jnp.float32)
    t = jnp.asarray(rng.integers(-1, 1000, 512), jnp.int32)
    f = jax.jit(
        lambda x, w, t: (
            jax.value_and_grad(loss_sum, argnums=(0, 1))(x, w, t, 1000, FORMS),
            token_losses(x, w, t, 1000, FORMS),
        )
    )
    (ref, (dx_ref, dw_ref)), per_ref = f(x, w, t)
    mesh = sharding.make_mesh(2, 2, 2)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.set_mesh(mesh):
        (val, (dx, dw)), per = f(jax.device_put(x, rows), w, jax.device_put(t, rows))
    np.testing.assert_allclose(float(val), float(ref), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(per), np.asarray(per_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(dx_ref), atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_ref), atol=1e-5)


def _batches(n_steps, grad_accum, rows, seq, vocab, seed=0):
    """Learnable sequences (arithmetic progressions mod vocab) with some ignored targets."""
    rng = np.random.default_rng(seed)

    def micro():
        start = rng.integers(0, vocab, (rows, 1))
        seqs = (start + np.arange(seq + 1)[None] * rng.integers(1, 4, (rows, 1))) % vocab
        y = seqs[:, 1:].copy()
        y[rng.random(y.shape) < 0.2] = -1
        return seqs[:, :-1].astype(np.int32), y.astype(np.int32)

    return [[micro() for _ in range(grad_accum)] for _ in range(n_steps)]


def _train(mesh, batches, config):
    make = lambda: GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    model = make() if mesh is None else sharding.create_sharded(make, mesh)
    put = (lambda a: jnp.asarray(a)) if mesh is None else (lambda a: jax.device_put(a, sharding.batch_sharding(mesh)))
    losses = []
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
        optimizer = build_optimizer(model, schedule=Schedule(len(batches), warmup_steps=2), verbose=False)
        for micro in batches:
            xs, ys = tuple(put(x) for x, _ in micro), tuple(put(y) for _, y in micro)
            losses.append(float(train_step(model, optimizer, xs, ys)))
    return np.array(losses), model


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.slow
def test_six_steps_match_one_device_for_dp_fsdp_and_dp_x_tp():
    config = GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    batches = _batches(6, 2, 16, 32, 300)
    ref, ref_model = _train(None, batches, config)
    assert ref[-1] < ref[0] - 1.0  # it learns, so the comparison is over a real trajectory
    for name, shape in MESHES.items():
        losses, model = _train(sharding.make_mesh(*shape), batches, config)
        # fp32 sums in another order; Muon amplifies the differences a little each step
        np.testing.assert_allclose(losses, ref, rtol=2e-3, err_msg=name)
        blocks = lambda m: jax.tree.leaves(nnx.state(m.transformer.h, nnx.Param))
        for a, b in zip(blocks(model), blocks(ref_model)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-3, err_msg=name)


def test_stack_layouts_move_one_mesh_axis_at_a_time():
    with jax.set_mesh(sharding.make_mesh(2, 2, 2)):
        chain = sharding.stack_layouts(("heads", "embed"))  # a matrix split (tensor, fsdp)
        assert chain == [
            P(None, "tensor", "fsdp"),
            P(("data",), "tensor", "fsdp"),
            P(("data", "tensor"), None, "fsdp"),
            P(("data", "tensor", "fsdp"), None, None),
        ]
        assert sharding.stack_size() == 8
    with jax.set_mesh(sharding.make_mesh(8, 1, 1)):
        assert sharding.stack_layouts(("heads", "embed")) == [P(None, None, None), P(("data",), None, None)]
    assert sharding.stack_layouts(("heads", "embed")) == [] and sharding.stack_size() == 1  # no mesh


def test_program_stats_counts_loop_iterations_and_bytes():
    mesh = sharding.make_mesh(8, 1, 1)

    def body(c, x):
        return c + jax.lax.psum(x @ x.T, "data"), None

    f = jax.shard_map(
        lambda xs: jax.lax.scan(body, jnp.zeros((16, 16)), xs)[0],
        in_specs=P(None, "data"),
        out_specs=P(),
        axis_names={"data"},
    )
    xs = jax.ShapeDtypeStruct((5, 128, 32), jnp.float32, sharding=NamedSharding(mesh, P(None, "data")))
    with jax.set_mesh(mesh):
        stats = program_stats(jax.jit(f).lower(xs).compile().as_text())
    assert stats["by_kind"]["all-reduce"]["count"] == 5  # once per scan iteration
    assert stats["by_kind"]["all-reduce"]["bytes"] == pytest.approx(5 * 2 * 7 / 8 * 16 * 16 * 4)  # ring all-reduce
    assert stats["matmul_flops"] == 5 * 2 * 16 * 16 * 32


def test_bfloat16_data_parallel_step_accumulates_and_reduces_in_float32():
    """bf16 embeddings' gradients are summed over micro-steps and devices in fp32 (XLA's CPU compiler also
    rejects bf16 all-reduces)."""
    mesh = sharding.make_mesh(*MESHES["dp"])
    stats = program_stats(compile_train_step(CONFIG, mesh, 16, 2, jnp.bfloat16).as_text())
    grads = gradient_reductions(stats)
    assert len(grads) == 1 and grads[0][2] == 1 and "bf16" not in grads[0][1]


def test_train_step_compiles_once_on_a_mixed_mesh(caplog):
    """The step hands back the model and optimizer laid out as they came in, so later steps run the first
    step's program (NorMuon's buffers used to come back split the way XLA chose: a second compilation)."""
    config = GPTConfig(sequence_len=32, vocab_size=300, n_layer=2, n_head=4, n_kv_head=2, n_embd=64)
    mesh = sharding.make_mesh(2, 2, 2)
    model = sharding.create_sharded(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32), mesh)
    put = lambda a: jax.device_put(a, sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        optimizer = build_optimizer(model, schedule=Schedule(3, warmup_steps=1), verbose=False)
        for step, ((x, y),) in enumerate(_batches(3, 1, 8, 32, 300)):
            with jax.log_compiles(step > 0), caplog.at_level("WARNING", logger="jax._src.interpreters.pxla"):
                assert np.isfinite(float(train_step(model, optimizer, (put(x),), (put(y),))))
    assert not [r for r in caplog.records if "Compiling jit(train_step)" in r.getMessage()]
