"""The training step shared by pretraining, SFT and the benchmarks: one jit, gradient accumulation inside.

On a mesh with a pure data-parallel axis ('data': parameters are whole copies along it) the micro-step loop
runs per shard of that axis (shard_map): each device accumulates the gradients of its own rows locally and
they are summed across devices once, after the last micro-step, instead of once per micro-step. The other
axes ('fsdp', 'tensor') stay with XLA's automatic partitioner, which gathers FSDP-sharded weights as layers
need them and reduce-scatters their gradients.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from flaxchat import sharding
from flaxchat.model.gpt import GPT
from flaxchat.train.checkpoint import abstract_state
from flaxchat.train.optim import build_optimizer, optimizer_stats


def accumulate_grads(model, xs, ys, wrt=nnx.Param):
    """Mean loss and mean gradient of the `wrt` parameters over micro-batches xs/ys (A, B, T), via lax.scan
    (one compile for any A).

    Each micro-step's loss is its mean over the non-ignored targets of the whole (global) micro-batch, and
    the step's loss and gradient are the means over micro-steps, as nanochat's loss / grad_accum_steps. A
    micro-batch with no target at all (SFT at small batches: every row a prompt) adds nothing and counts nothing:
    the means are over the micro-steps that have targets (nanochat's 0/0 would make the step NaN). On a CPU
    a micro-batch runs in the sub-batches the model's forms ask for (model.cpu.Forms.n_sub_batches): each sub-batch's
    summed loss is divided by its whole micro-batch's count, so the sub-batches add up to the micro-step's loss and
    gradient.
    """
    graphdef, params, rest = nnx.split(model, wrt, ...)
    axes = sharding.free_axes(sharding.REPLICA_AXES)

    def local(params, rest, xs, ys):
        counts = sharding.psum(jnp.sum(ys >= 0, axis=(1, 2)), axes)  # (A,) valid targets per global micro-batch

        def loss_fn(p, x, y, n):
            # copy=True: fresh Variables for this trace; with a frozen part in `rest` (LoRA's base weights) the
            # originals belong to the outer trace, and nnx.remat (--remat) may not write to those
            return nnx.merge(graphdef, p, rest, copy=True)(x, y, loss_reduction="sum") / jnp.maximum(n, 1)

        def micro(acc, xyn):
            loss, g = jax.value_and_grad(loss_fn)(params, *xyn)
            return jax.tree.map(jnp.add, acc, g), loss

        # fp32 accumulators, also for bf16 parameters (the embeddings): sums of many micro-steps' bf16
        # gradients would round away small contributions (and XLA's CPU compiler rejects bf16 all-reduces)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
        n, batch, T = xs.shape
        # n * k loop turns, each with its micro-batch's count. Not under FSDP or tensor parallelism, whose weight
        # gathers and activation sums would then run once per sub-batch
        k = model.forms.n_sub_batches(batch, T, splits_model=bool(sharding.free_axes(sharding.MODEL_AXES)))
        split = lambda a: a.reshape(n * k, batch // k, T)
        grads, losses = jax.lax.scan(micro, zeros, (split(xs), split(ys), jnp.repeat(counts, k)))
        losses = losses.reshape(n, k).sum(axis=1)
        steps = jnp.maximum(jnp.sum(counts > 0), 1).astype(jnp.float32)  # micro-steps with targets (counts: global)
        loss = sharding.psum(jnp.sum(losses), axes) / steps
        return loss, jax.tree.map(lambda g: g / steps, sharding.psum(grads, axes))

    rows = P(None, axes)
    return sharding.per_shard(local, axes, (P(), P(), rows, rows), (P(), P()))(params, rest, xs, ys)


def _train_step(model, optimizer, xs, ys):
    """One optimizer step over micro-batches: xs, ys are sequences of (B, T) arrays (inputs, targets -1 = ignore).

    Returns the mean loss. Run it under `jax.set_mesh(mesh)` when the arrays live on a mesh. Gradients are taken of
    the optimizer's `wrt` parameters only (all nnx.Params; for LoRA its adapters and --lora-full weights: the frozen
    rest gets none). Jitted two ways: train_step (nnx.jit, the model and optimizer buffers donated) and FlatStep,
    which the training loops call.
    """
    loss, grads = accumulate_grads(model, jnp.stack(xs), jnp.stack(ys), optimizer.wrt)
    optimizer.update(model, grads)
    sharding.pin_state(optimizer)
    return loss


train_step = nnx.jit(_train_step, donate_argnums=(0, 1))


class FlatStep:
    """train_step bound to one model and optimizer, as the training loops call it: `step(xs, ys)` returns
    (loss, optim.optimizer_stats) of the step.

    One jax.jit over the flat list of the model's and optimizer's arrays, donated and returned, so a call costs the
    host what jax.jit's own dispatch of a list does. nnx.jit, even through nnx.cached_partial, walks and compares
    both objects' graphs on every call, several times the host time of this dispatch, time in which a GPU that
    waits for the next step idles. Each call reads the arrays the Variables hold
    (so changes made between steps count, e.g. SFT's learning rate set from the host) and, while the device runs
    the step, puts the new ones in their place: evaluation, sampling and checkpoints read the model as before.
    """

    def __init__(self, model, optimizer):
        graphdef, state = nnx.split((model, optimizer))
        self._variables = [v for _, v in nnx.to_flat_state(state)]
        treedef = jax.tree.structure(state)
        if treedef.num_leaves != len(self._variables):
            raise ValueError(
                f"FlatStep needs one array per Variable: {len(self._variables)} Variables hold "
                f"{treedef.num_leaves} arrays"
            )

        def train_step(arrays, xs, ys):  # the name XLA's module and profiles carry ("jit_train_step")
            model, optimizer = nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))
            loss = _train_step(model, optimizer, xs, ys)
            return jax.tree.leaves(nnx.state((model, optimizer))), (loss, optimizer_stats(optimizer))

        self._step = jax.jit(train_step, donate_argnums=0)

    def _arrays(self) -> list:
        return [v.get_raw_value() for v in self._variables]

    def __call__(self, xs, ys):
        arrays, outputs = self._step(self._arrays(), xs, ys)
        for variable, array in zip(self._variables, arrays):
            variable.set_raw_value(array)
        return outputs

    def lower(self, xs, ys):
        """The step lowered for these batches (or jax.ShapeDtypeStructs of them): `.compile().as_text()` is the
        program a call runs."""
        return self._step.lower(self._arrays(), xs, ys)


def compile_train_step(
    config, mesh, batch_size: int, grad_accum: int = 1, dtype=None, compiler_options=None, **model_kwargs
):
    """The train step for a GPT of `config` compiled on `mesh` from abstract arrays (nothing is allocated).

    batch_size is global (rows per micro-step); compiler_options go to XLA (`.compile(compiler_options)`);
    model_kwargs go to GPT (attention, remat). For reading the program XLA makes at any scale on any
    machine: `.as_text()` (see `perf.hlo.program_stats`), `.cost_analysis()`, `.memory_analysis()`.
    """
    model = nnx.eval_shape(lambda: GPT(config, rngs=nnx.Rngs(0), dtype=dtype, **model_kwargs))
    polar_dtype = jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float32
    optimizer = nnx.eval_shape(lambda m: build_optimizer(m, polar_dtype=polar_dtype, verbose=False), model)
    nnx.update(model, abstract_state(model, mesh))
    nnx.update(optimizer, abstract_state(optimizer, mesh))
    x = jax.ShapeDtypeStruct((batch_size, config.sequence_len), jnp.int32, sharding=sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        return FlatStep(model, optimizer).lower((x,) * grad_accum, (x,) * grad_accum).compile(compiler_options)


_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))  # one dispatch for a whole tree of small arrays


class InFlight:
    """Runs training steps one at a time (depth 0) or keeps one in flight (depth 1): the host then fetches and
    dispatches step k+1 before it waits for step k.

    JAX dispatches asynchronously, so with depth 1 the device can start step k+1 as soon as step k ends while
    the host reads step k's loss, logs it and loads the next batches: on a GPU the host's work then no longer sits
    between two steps' kernels (a few percent of a step, docs/LOG.md). On a CPU the host's work shares the cores
    with XLA's threads and nothing is gained. So the loops keep one step in flight on GPUs and TPUs and wait for
    each on a CPU (`in_flight_depth`).

    `submit(outputs, info, started)` takes a step just dispatched (outputs: a pytree of arrays; at depth 1 copied on
    the device at once, so a later step may donate the buffers they are, e.g. the optimizer's state; info: anything;
    started: time.perf_counter() when its host work began) and returns a finished step or None: at depth 0 the
    step itself, at depth 1 the step before it. `finish()` returns the step still in flight (None if none), e.g.
    before an evaluation or a checkpoint. A finished step is (outputs on the host as numpy, info, seconds): from
    when the step began (its host work, or the end of the step before, whichever was later) to when its outputs
    were ready; at depth 1 and steady state, the time between the ends of two steps.
    """

    def __init__(self, depth: int = 0):
        if depth not in (0, 1):
            raise ValueError(f"InFlight depth is 0 (one step at a time) or 1 (one step in flight), got {depth}")
        self.depth, self.pending, self.last_end = depth, None, 0.0

    def submit(self, outputs, info, started: float):
        if self.depth == 0:  # read before any later step runs: nothing to copy
            self.pending = (outputs, info, started)
            return self.finish()
        outputs = _copy(outputs)  # queued behind the step, before any later step can donate them
        done = self.finish()
        self.pending = (outputs, info, started)
        return done

    def finish(self):
        if self.pending is None:
            return None
        outputs, info, started = self.pending
        self.pending = None
        outputs = jax.device_get(outputs)  # waits for the step
        end = time.perf_counter()
        seconds, self.last_end = end - max(started, self.last_end), end
        return outputs, info, seconds


IN_FLIGHT_CHOICES = ("auto", "on", "off")


def add_in_flight_flag(parser) -> None:
    """--in-flight {auto,on,off} on a training script's parser (in_flight_depth reads it)."""
    parser.add_argument(
        "--in-flight",
        choices=IN_FLIGHT_CHOICES,
        default="auto",
        help="keep one training step in flight: the next step's batches are read and the step "
        "dispatched before this one's loss is read (auto: on for GPUs and TPUs, where the host's "
        "work then overlaps the device's; off on a CPU, where it shares the cores)",
    )


def in_flight_depth(choice: str, backend: str) -> int:
    """InFlight's depth for --in-flight {auto,on,off} on a JAX backend ("cpu", "gpu", "tpu")."""
    if choice not in IN_FLIGHT_CHOICES:
        raise ValueError(f"--in-flight is one of {', '.join(IN_FLIGHT_CHOICES)}, got {choice!r}")
    return int(choice == "on" or (choice == "auto" and backend != "cpu"))
