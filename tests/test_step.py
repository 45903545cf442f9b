import contextlib
import time

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
from flaxchat.perf.hlo import jaxpr_equations
from flaxchat.train.optim import Schedule, build_optimizer, optimizer_stats
from flaxchat.train.step import FlatStep, InFlight, accumulate_grads, in_flight_depth, train_step


def _model_and_optimizer():
    model = GPT(GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128), rngs=nnx.Rngs(0))
    return model, build_optimizer(model, schedule=Schedule(6, 2, 0.5, 0.0), verbose=False)


@pytest.mark.parametrize("depth", [0, 1])
def test_in_flight_loop_logs_what_steps_run_one_at_a_time_log(depth):
    """A FlatStep's steps equal nnx.jit's train_step on the model and optimizer. InFlight's losses and optimizer
    stats (at depth 1 read after the next step donated the optimizer's buffers) and its final parameters equal
    those of steps run and read one at a time; at depth 0 submit hands back the step itself, at depth 1 the step
    before it."""
    rng = np.random.default_rng(0)
    batches = [
        (
            (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),),
            (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),),
        )
        for _ in range(6)
    ]

    model, optimizer = _model_and_optimizer()
    expected = []
    for xs, ys in batches:
        loss = float(train_step(model, optimizer, xs, ys))
        expected.append((loss, {k: float(v) for k, v in optimizer_stats(optimizer).items()}))

    model2, optimizer2 = _model_and_optimizer()
    step = FlatStep(model2, optimizer2)  # as the training loops call it: (loss, optimizer_stats)
    in_flight, got = InFlight(depth), []
    assert in_flight.finish() is None
    for i, (xs, ys) in enumerate(batches):
        started = time.perf_counter()
        done = in_flight.submit(step(xs, ys), i, started)
        assert (done is None) == (depth == 1 and i == 0)
        assert done is None or done[1] == i - depth
        if done is not None:
            got.append(done)
    if depth == 1:
        got.append(in_flight.finish())
    assert in_flight.finish() is None

    assert [info for _, info, _ in got] == list(range(6))
    assert all(seconds > 0 for _, _, seconds in got)
    for ((loss, stats), _, _), (want_loss, want_stats) in zip(got, expected):
        assert float(loss) == want_loss
        assert {k: float(v) for k, v in stats.items()} == want_stats
    assert len({s["lr_multiplier"] for _, s in expected}) > 1  # the schedule moved: the stats are per step
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(model2, nnx.Param))):
        np.testing.assert_array_equal(a, b)


def test_flat_step_reads_what_the_host_changed_and_leaves_the_new_arrays_in_the_model():
    """A FlatStep takes the arrays the Variables hold at each call (a learning rate written between steps, as SFT
    does, counts), leaves the new ones in the model and optimizer (their forward pass and state are train_step's),
    and its program is the one a profile names train_step."""
    rng = np.random.default_rng(1)
    xs = (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),)
    ys = (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),)

    def unscheduled():  # as SFT builds it: the learning rate is the host's
        model = GPT(GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128), rngs=nnx.Rngs(0))
        return model, build_optimizer(model, verbose=False)

    runs = []
    for flat in (False, True):
        model, optimizer = unscheduled()
        step = FlatStep(model, optimizer) if flat else None
        losses = []
        for lr in (1.0, 0.25, 0.0):
            optimizer.opt_state.hyperparams["lr_multiplier"][...] = jnp.float32(lr)
            losses.append(float(step(xs, ys)[0] if flat else train_step(model, optimizer, xs, ys)))
        runs.append((losses, model(xs[0]), nnx.state(optimizer)))
    (want_losses, want_logits, want_opt), (losses, logits, opt) = runs
    assert losses == want_losses and len(set(losses)) == 3
    np.testing.assert_array_equal(logits, want_logits)
    for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(want_opt)):
        np.testing.assert_array_equal(a, b)
    # at learning rate 0 the weights stay as they were
    model, optimizer = unscheduled()
    step = FlatStep(model, optimizer)
    step(xs, ys)
    before = [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    optimizer.opt_state.hyperparams["lr_multiplier"][...] = jnp.float32(0.0)
    assert float(step(xs, ys)[1]["lr_multiplier"]) == 0.0
    for a, b in zip(before, jax.tree.leaves(nnx.state(model, nnx.Param))):
        np.testing.assert_array_equal(a, b)
    assert "train_step" in step.lower(xs, ys).compile().as_text().split("\n", 1)[0]


def test_in_flight_depth_is_zero_or_one():
    with pytest.raises(ValueError, match="depth is 0"):
        InFlight(2)


def test_in_flight_is_on_for_accelerators_unless_told():
    assert [in_flight_depth("auto", b) for b in ("cpu", "gpu", "tpu")] == [0, 1, 1]
    assert [in_flight_depth(c, "cpu") for c in ("on", "off")] == [1, 0]
    assert [in_flight_depth(c, "gpu") for c in ("on", "off")] == [1, 0]
    with pytest.raises(ValueError, match="auto, on, off"):
        in_flight_depth("yes", "gpu")


@pytest.mark.eight_devices
def test_sub_batches_keep_a_cpu_devices_rows_within_the_token_budget():
    on_cpu, off_cpu = cpu.forms_for(backend="cpu").n_sub_batches, cpu.forms_for(backend="gpu").n_sub_batches
    assert cpu.CPU_SUB_BATCH_TOKENS == 2048
    assert on_cpu(16, 256) == 2  # 16 rows of 256 (the demo's SFT micro-batch): two turns of 8
    assert on_cpu(32, 512) == 8 and on_cpu(8, 512) == 2
    assert on_cpu(8, 256) == 1  # 2,048 tokens: whole
    assert on_cpu(6, 512) == 2  # 3 rows of 512 fit; 6 / 4 would not divide
    assert on_cpu(5, 512) == 5  # 5 is prime: one row a turn
    assert on_cpu(3, 4096) == 3  # a row alone beyond the budget still runs, one a turn
    assert off_cpu(32, 512) == cpu.forms_for(backend="tpu").n_sub_batches(32, 512) == 1
    assert on_cpu(32, 512, splits_model=True) == 1
    # the training loops' micro-batch line says so
    note = cpu.forms_for(backend="cpu").sub_batch_note
    one = sharding.make_mesh(devices=jax.devices()[:1])
    assert note(16, 256, one) == (
        " | on this CPU each device's 16 rows run as 2 sub-batches of 8 (model.cpu.CPU_SUB_BATCH_TOKENS)"
    )
    assert note(8, 256, one) == ""
    assert note(16, 256, sharding.make_mesh(1, 8, 1)) == ""  # FSDP: whole
    assert note(16, 256, sharding.make_mesh(8, 1, 1)) != ""  # data parallel: 16 rows a device


def _micro_batches(A, B, T, vocab, seed=0):
    rng = np.random.default_rng(seed)
    xs = jnp.asarray(rng.integers(0, vocab, (A, B, T)), jnp.int32)
    ys = rng.integers(0, vocab, (A, B, T))
    ys[rng.random(ys.shape) < 0.3] = -1  # ignored targets, unevenly over rows: each row's share of the count differs
    ys[0, 0] = -1  # a whole row ignored
    return xs, jnp.asarray(ys, jnp.int32)


def _accumulated(config, mesh, xs, ys):
    """accumulate_grads of a fresh fp32 model of `config` over xs, ys (their rows spread over the mesh's batch axes
    when there is one): (loss, gradient leaves, the traced jaxpr)."""
    make = lambda: GPT(config, rngs=nnx.Rngs(0), dtype=jnp.float32)
    model = make() if mesh is None else sharding.create_sharded(make, mesh)
    if mesh is not None:
        xs, ys = (jax.device_put(a, NamedSharding(mesh, P(None, ("data", "fsdp")))) for a in (xs, ys))
    f = lambda x, y: accumulate_grads(model, x, y)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        jaxpr = jax.make_jaxpr(f)(xs, ys).jaxpr
        loss, grads = jax.jit(f)(xs, ys)
    return float(loss), jax.tree.leaves(grads), jaxpr


def _scan_lengths(jaxpr) -> list[int]:
    """The lengths of every lax.scan in a jaxpr, nested ones (inside shard_map, jit, checkpoint) included."""
    return [eqn.params["length"] for eqn, _ in jaxpr_equations(jaxpr) if eqn.primitive.name == "scan"]


@pytest.mark.parametrize(
    "mesh_shape", [None, pytest.param((8, 1, 1), marks=pytest.mark.eight_devices)], ids=["one_device", "data_parallel"]
)
def test_sub_batched_micro_steps_sum_to_the_whole_micro_batch(monkeypatch, mesh_shape):
    """Run in sub-batches (a budget of one row's tokens: each micro-batch's rows one at a time on each device), the
    step's loss and gradients equal one pass over each whole micro-batch: each turn divides by its micro-batch's
    count of targets, not its own."""
    config = GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128)
    rows = 4 if mesh_shape is None else 32  # 4 rows on each device
    xs, ys = _micro_batches(2, rows, 32, 128)
    mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None

    def run(budget):
        monkeypatch.setattr(cpu, "CPU_SUB_BATCH_TOKENS", budget)
        loss, grads, jaxpr = _accumulated(config, mesh, xs, ys)
        return loss, grads, [n for n in _scan_lengths(jaxpr) if n in (2, 8)]

    whole, whole_grads, whole_loops = run(10**9)
    split, split_grads, split_loops = run(32)
    assert whole_loops == [2] and split_loops == [8]  # the micro-step loop: 2 micro-batches, then 2 x 4 turns
    assert abs(split - whole) <= 1e-6 * abs(whole)
    for a, b in zip(split_grads, whole_grads):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


@pytest.mark.eight_devices
def test_model_splitting_meshes_run_micro_batches_whole(monkeypatch):
    """Under FSDP the weights are gathered in every turn of the micro-step loop: no sub-batches there."""
    monkeypatch.setattr(cpu, "CPU_SUB_BATCH_TOKENS", 32)
    mesh = sharding.make_mesh(1, 8, 1)
    model = sharding.create_sharded(
        lambda: GPT(GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128), rngs=nnx.Rngs(0), dtype=jnp.float32), mesh
    )
    xs, ys = (jax.device_put(a, NamedSharding(mesh, P(None, "fsdp"))) for a in _micro_batches(2, 32, 32, 128))
    with jax.set_mesh(mesh):
        jaxpr = jax.make_jaxpr(lambda x, y: accumulate_grads(model, x, y))(xs, ys).jaxpr
    assert 2 in _scan_lengths(jaxpr) and not {8, 64} & set(_scan_lengths(jaxpr))


def test_a_micro_batch_without_targets_adds_nothing_and_counts_nothing():
    """SFT at small batches can draw a micro-batch whose every target is masked: the step's loss and gradient are
    those of the other micro-steps alone, never NaN."""
    config = GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128)
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.integers(0, 128, (3, 2, 32), dtype=np.int32))
    ys = jnp.asarray(rng.integers(0, 128, (3, 2, 32), dtype=np.int32)).at[:, :, :8].set(-1)
    empty = ys.at[1].set(-1)  # the middle micro-batch: prompts only
    loss, grads, _ = _accumulated(config, None, xs, empty)
    kept = jnp.array([0, 2])
    expected_loss, expected, _ = _accumulated(config, None, xs[kept], ys[kept])
    assert np.isfinite(loss) and loss == pytest.approx(expected_loss, rel=1e-6)
    for g, e in zip(grads, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=1e-7)
    nothing, zero, _ = _accumulated(config, None, xs, jnp.full_like(ys, -1))
    assert nothing == 0.0 and all(not np.any(np.asarray(g)) for g in zero)
