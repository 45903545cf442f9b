import time

import jax
import pytest
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.config import GPTConfig
from flaxchat.gpt import GPT
from flaxchat.optim import Schedule, build_optimizer, optimizer_stats
from flaxchat.training import InFlight, train_step


def _model_and_optimizer():
    model = GPT(GPTConfig.from_depth(2, max_seq_len=32, vocab_size=128), rngs=nnx.Rngs(0))
    return model, build_optimizer(model, schedule=Schedule(6, 2, 0.5, 0.0), verbose=False)


@pytest.mark.parametrize("depth", [0, 1])
def test_in_flight_loop_logs_what_steps_run_one_at_a_time_log(depth):
    """InFlight's losses and optimizer stats (at depth 1 read after the next step donated the optimizer's
    buffers) and its final parameters equal those of steps run and read one at a time; at depth 0 submit hands
    back the step itself, at depth 1 the step before it."""
    rng = np.random.default_rng(0)
    batches = [((jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),),
                (jnp.asarray(rng.integers(0, 128, (2, 32), dtype=np.int32)),)) for _ in range(6)]

    model, optimizer = _model_and_optimizer()
    expected = []
    for xs, ys in batches:
        loss = float(train_step(model, optimizer, xs, ys))
        expected.append((loss, {k: float(v) for k, v in optimizer_stats(optimizer).items()}))

    model2, optimizer2 = _model_and_optimizer()
    step = nnx.cached_partial(train_step, model2, optimizer2)
    in_flight, got = InFlight(depth), []
    assert in_flight.finish() is None
    for i, (xs, ys) in enumerate(batches):
        started = time.perf_counter()
        done = in_flight.submit((step(xs, ys), optimizer_stats(optimizer2)), i, started)
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


def test_in_flight_depth_is_zero_or_one():
    with pytest.raises(ValueError, match="depth is 0"):
        InFlight(2)
