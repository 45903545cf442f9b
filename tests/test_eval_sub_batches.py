"""Evaluation's forward passes in sub-batches of rows on a CPU (cpu.in_sub_batches): val bpb, CORE's span
losses and greedy checks, the categorical evals' logits at one position a row (GPT's logits_at)."""

import collections
import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.eval import bpb as loss_eval
from flaxchat.eval import chat as chat_eval
from flaxchat.eval import core as core_eval
from flaxchat.model import cpu
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.perf.hlo import jaxpr_equations

VOCAB, T = 128, 32


def _batch(rows, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (rows, T))
    y = rng.integers(0, VOCAB, (rows, T))
    y[rng.random(y.shape) < 0.3] = -1  # ignored targets
    y[1] = -1  # a whole row ignored
    at = rng.integers(0, T, rows)
    return jnp.asarray(x, jnp.int32), jnp.asarray(y, jnp.int32), jnp.asarray(at, jnp.int32)


def _model(mesh):
    make = lambda: GPT(GPTConfig.from_depth(2, max_seq_len=T, vocab_size=VOCAB), rngs=nnx.Rngs(0), dtype=jnp.float32)
    return make() if mesh is None else sharding.create_sharded(make, mesh)


def _loop_lengths(f, *args) -> collections.Counter:
    """The lengths of the loops (scans, lax.map's included) in f's jaxpr, nested ones included."""
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    return collections.Counter(
        eqn.params["length"] for eqn, _ in jaxpr_equations(jaxpr) if eqn.primitive.name == "scan"
    )


@pytest.mark.parametrize(
    "mesh_shape",
    [
        None,
        pytest.param((8, 1, 1), marks=pytest.mark.eight_devices),
        pytest.param((1, 8, 1), marks=pytest.mark.eight_devices),
    ],
    ids=["one_device", "data_parallel", "fsdp"],
)
def test_eval_in_sub_batches_equals_one_pass_over_the_batch(monkeypatch, mesh_shape):
    """With a budget of one row's tokens each device's 4 rows run one at a time: per-token losses (0 where
    ignored), logits at one position a row and greedy predictions match one pass over the whole batch, and val
    bpb follows from the losses. A mesh that splits the model (FSDP) runs the batch whole."""
    mesh = sharding.make_mesh(*mesh_shape) if mesh_shape else None
    rows = 4 if mesh is None else 32  # 4 rows a device
    x, y, at = _batch(rows)
    model = _model(mesh)
    if mesh is not None:
        x, y, at = (jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp")))) for a in (x, y, at))
    losses = lambda m, x, y: m(x, y, loss_reduction="none")
    split = lambda x, y: cpu.in_sub_batches(model, losses, x, y)
    monkeypatch.setattr(cpu, "CPU_SUB_BATCH_TOKENS", T)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        expected, got = np.asarray(jax.jit(lambda x, y: losses(model, x, y))(x, y)), np.asarray(jax.jit(split)(x, y))
        added = _loop_lengths(split, x, y) - _loop_lengths(lambda x, y: losses(model, x, y), x, y)
        token_bytes = np.arange(VOCAB) % 4  # some tokens stand for no bytes (as special tokens do)
        bpb = loss_eval.evaluate_bpb(model, [(x, y)], 1, token_bytes)
        logits = np.asarray(jax.jit(lambda x: model(x))(x))
        at_logits = np.asarray(chat_eval.logits_at_positions(model, x, at))
        # greedy checks of one token after each row's position `at`: the model's own choice in even rows, another
        # token in odd rows (a later token cannot change the logits at `at`)
        p = np.minimum(np.asarray(at), T - 2)
        choice = np.argmax(logits[np.arange(rows), p], -1)
        x2 = np.asarray(x).copy()
        x2[np.arange(rows), p + 1] = np.where(np.arange(rows) % 2 == 0, choice, (choice + 1) % VOCAB)
        x2, starts = (jax.device_put(a, x.sharding) for a in (jnp.asarray(x2), jnp.asarray(p + 1, jnp.int32)))
        greedy = np.asarray(core_eval.span_all_argmax(model, x2, starts, starts + 1))
    assert list(added.elements()) == ([] if mesh_shape == (1, 8, 1) else [4])  # the sub-batch loop: 4 turns
    assert got.shape == (rows, T) and np.all(got[np.asarray(y) < 0] == 0)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    nbytes = np.where(np.asarray(y) >= 0, token_bytes[np.maximum(np.asarray(y), 0)], 0)
    assert bpb == pytest.approx(np.sum(np.where(nbytes > 0, expected, 0)) / (math.log(2) * nbytes.sum()), rel=1e-5)
    np.testing.assert_allclose(at_logits, logits[np.arange(rows), np.asarray(at)], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(greedy, np.arange(rows) % 2 == 0)


def test_eval_batches_within_the_budget_run_whole():
    """A device's rows within CPU_SUB_BATCH_TOKENS (and any batch off a CPU): the plain forward, no loop added."""
    x, y, _ = _batch(4)
    model = _model(None)
    losses = lambda m, x, y: m(x, y, loss_reduction="none")
    assert model.forms.n_sub_batches(4, T) == 1
    assert _loop_lengths(lambda x, y: cpu.in_sub_batches(model, losses, x, y), x, y) == _loop_lengths(
        lambda x, y: losses(model, x, y), x, y
    )


def test_logits_at_are_the_full_logits_at_those_positions():
    """GPT(idx, logits_at=positions): each row's logits at its position, (B, vocab), as the full (B, T, vocab)
    logits have them; only those rows go through the lm_head."""
    x, _, at = _batch(4)
    model = _model(None)
    full = np.asarray(model(x))
    got = model(x, logits_at=at)
    assert got.shape == (4, VOCAB) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), full[np.arange(4), np.asarray(at)], rtol=1e-5, atol=1e-6)
    jaxpr = jax.make_jaxpr(lambda x, at: model(x, logits_at=at))(x, at).jaxpr
    shapes = {eqn.outvars[0].aval.shape for eqn, _ in jaxpr_equations(jaxpr) if eqn.primitive.name == "dot_general"}
    padded = model.config.padded_vocab_size
    assert (4, padded) in shapes and (4 * T, padded) not in shapes
