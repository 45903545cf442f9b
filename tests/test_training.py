import time

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import Schedule, build_optimizer, optimizer_stats
from flaxchat.training import FlatStep, InFlight, in_flight_depth, train_step


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
    batches = [((jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),),
                (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),)) for _ in range(6)]

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
