"""The training step measured, for `scripts.bench`: timed as scripts.pretrain runs it (--what train, beside nanochat's
step with --nanochat) and read off its compiled program (--what comms).

The functions take bench's parsed flags (`args`): the shape flags of model.config.add_model_flags, --vocab-size, the
batch flags and the timing flags its --help documents. They return the JSON records bench prints.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import numpy as np
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_dtype, get_base_dir
from flaxchat.data.dataloader import make_loader
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.model.config import config_from_flags
from flaxchat.model.gpt import GPT
from flaxchat.perf.hlo import program_stats
from flaxchat.perf.machine import MachineLoad, peak_flops_per_device, peak_memory_gb
from flaxchat.perf.processes import time_nanochat
from flaxchat.perf.products import format_census, product_census
from flaxchat.perf.profiler import StepProfiler, profile_summary
from flaxchat.perf.trace import format_summary
from flaxchat.train.optim import build_optimizer
from flaxchat.train.step import FlatStep, InFlight, compile_train_step, in_flight_depth

# -----------------------------------------------------------------------------
# Batches: the Grain loader's (--real-data, --cycle-batches) or random tokens (--fresh-batches)


def loader_batches(args, mesh, tokenizer):
    """(take, loader, what): take() gives one step's (inputs, targets) micro-batches from the Grain loader over the
    base dir's shards; with --cycle-batches the first N steps' batches, read once and cycled (loader: None)."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    loader = make_loader(tokenizer, args.device_batch_size * dp, args.max_seq_len, "train", mesh=mesh)
    take = lambda: tuple(zip(*(next(loader) for _ in range(args.grad_accum))))
    if not args.cycle_batches:
        return take, loader, "grain loader"
    # the loader's text, read once: no loader threads or host-to-device copies per step
    cycled, counter = [take() for _ in range(args.cycle_batches)], iter(range(10**9))
    loader.close()
    return lambda: cycled[next(counter) % len(cycled)], None, f"grain loader's first {len(cycled)} steps, cycled"


def random_batches(args, mesh, vocab_size: int, rows: int):
    """(take, what): random tokens as inputs and targets; two steps' batches placed once and alternated, or with
    --fresh-batches new host arrays placed every step, as the loader's batches arrive."""
    rng, counter = np.random.default_rng(0), iter(range(10**9))
    put = lambda a: jax.device_put(a, sharding.batch_sharding(mesh))
    draw = lambda: tuple(
        put(rng.integers(0, vocab_size, (rows, args.max_seq_len), dtype=np.int32)) for _ in range(args.grad_accum)
    )
    if args.fresh_batches:
        return lambda: (draw(),) * 2, "random tokens, new arrays every step"
    batches = [draw() for _ in range(2)]
    return lambda: (batches[next(counter) % 2],) * 2, "random tokens"


# -----------------------------------------------------------------------------
# The training step, timed


def bench_train(args, mesh) -> dict:
    """flaxchat's training step: the median of --steps timed steps after compilation and --warmup steps, in
    --rounds rounds. With --nanochat, each round first times nanochat's step on the same shape (time_nanochat),
    so every pair of numbers comes from the same minutes of a machine whose speed may drift."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    B, T, A = args.device_batch_size * dp, args.max_seq_len, args.grad_accum
    tokenizer = get_tokenizer() if args.real_data else None
    if tokenizer is not None:
        args.vocab_size = tokenizer.get_vocab_size()
    config = config_from_flags(args, args.vocab_size)
    theirs = [time_nanochat(args, config, B)] if args.nanochat else []  # before the loader's threads start
    take, loader, data = loader_batches(args, mesh, tokenizer) if tokenizer is not None else (None, None, None)
    model = sharding.create_sharded(
        lambda: GPT(
            config, rngs=nnx.Rngs(0), dtype=compute_dtype(args.dtype), attention=args.attention, remat=args.remat
        ),
        mesh,
    )
    with jax.set_mesh(mesh):
        optimizer = build_optimizer(model, verbose=False)
    if tokenizer is None:
        take, data = random_batches(args, mesh, config.vocab_size, B)

    profiler = StepProfiler(args.profile_steps, args.profile_dir or os.path.join(get_base_dir(), "profile", "bench"))
    optimizer_step = FlatStep(model, optimizer)  # as pretrain calls it
    steps, last, in_flight = iter(range(10**9)), {}, InFlight(in_flight_depth(args.in_flight, jax.default_backend()))

    def dispatch():
        xs, ys = last["batch"] = take()  # real data: reading the next batches is part of the step, as in pretrain
        with jax.set_mesh(mesh):
            return optimizer_step(xs, ys), None

    step = lambda: profiler.dispatch(next(steps), in_flight, dispatch)  # the steps that finished meanwhile

    t0 = time.perf_counter()
    step()
    in_flight.finish()
    first_step_s = time.perf_counter() - t0  # tracing + compilation + one step
    for _ in range(args.warmup):
        step()
    in_flight.finish()
    rounds = timed_rounds(args, step, in_flight, B * T * A, theirs, lambda: time_nanochat(args, config, B))
    profiler.close()
    if loader is not None:
        loader.close()
    where = profile_summary(profiler, optimizer_step, last["batch"], mesh) if args.profile_steps else None
    census = product_census(model, optimizer, last["batch"], mesh) if args.products else None
    if where is not None:
        print(format_summary(where, "flaxchat's profiled steps: "), file=sys.stderr)
    out = train_record(args, model, rounds, theirs, B * T * A, first_step_s, data, bool(in_flight.depth))
    if where is not None:
        out["profile"] = where
    if census is not None:
        out["products"] = {**census, "share_of_step": census["alone_s"] / out["step_s"]}
        print(format_census(out["products"], out["step_s"]), file=sys.stderr)
    return out


def timed_rounds(args, step, in_flight, tokens: int, theirs: list, nanochat) -> list[dict]:
    """--rounds rounds of --steps timed steps (`step()` dispatches one and returns those that finished); with
    --nanochat, nanochat() times its step first from the second round on (the first's is in `theirs`). Each round:
    tok/s, median step, how busy the machine was, every step's time; `noisy` where the VM's host took CPU time."""
    rounds = []
    for r in range(args.rounds):
        if args.nanochat and r > 0:
            theirs.append(nanochat())
        times, load = [], MachineLoad()
        for _ in range(args.steps):
            times += [seconds for _, _, seconds in step()]
        final = in_flight.finish()  # the step still in flight (--in-flight, unless it was profiled: it ran alone)
        times += [final[2]] if final else []
        rounds.append(
            {
                "tok_per_s": tokens / statistics.median(times),
                "step_s": statistics.median(times),
                "machine": load.stop(),
                "times": times,
            }
        )  # machine: how busy, while they were timed
        if theirs:
            rounds[-1].update(nanochat=theirs[-1], vs_nanochat=rounds[-1]["tok_per_s"] / theirs[-1]["tok_per_s"])
        stolen = [
            who
            for who, record in (("flaxchat", rounds[-1]), ("nanochat", rounds[-1].get("nanochat")))
            if record and MachineLoad.noisy(record["machine"])
        ]
        if stolen:  # the VM's host was busy: the round's numbers say more about the neighbours than the programs
            rounds[-1]["noisy"] = True
            print(
                f"warning: round {r + 1}: other guests of this VM's host took over "
                f"{MachineLoad.NOISY_STEAL_PCT:g}% of the CPU time while {' and '.join(stolen)} ran (steal); the "
                "results leave this round out unless every round is so",
                file=sys.stderr,
            )
    return rounds


def train_record(args, model, rounds, theirs, tokens: int, first_step_s: float, data: str, in_flight: bool) -> dict:
    """The JSON record of the timed rounds: tok/s, median and fastest step, MFU against the peak, compile time,
    memory, the model, the batches (`data`); with --nanochat its median tok/s and the median of the rounds' ratios.
    Noisy rounds are left out of the results unless every round was."""
    quiet = [r for r in rounds if not r.get("noisy")] or rounds  # the rounds the results come from
    times = [t for r in quiet for t in r["times"]]
    for r in rounds:
        del r["times"]
    step_s = statistics.median(times)
    peak, source = peak_flops_per_device(model.dtype)
    flops = model.estimate_flops() * tokens / step_s
    out = {
        "what": "train",
        "tok_per_s": tokens / step_s,
        "step_s": step_s,
        "step_s_min": min(times),
        "mfu": 100 * flops / (peak * jax.device_count()),
        "model_flops_per_s": flops,
        "peak_flops": peak * jax.device_count(),
        "peak_flops_source": source,
        "compile_s": max(first_step_s - step_s, 0.0),
        "first_step_s": first_step_s,
        "peak_mem_gb": peak_memory_gb(),
        "tokens_per_step": tokens,
        "flops_per_token": model.estimate_flops(),
        "num_params": model.num_scaling_params()["total"],
        "attention": model.attention,
        "remat": model.remat,
        "data": data,
        "grad_accum": args.grad_accum,
        "in_flight": in_flight,
        "machine": rounds[0]["machine"],  # how busy the machine was in the first round (perf.machine.MachineLoad)
        "times_s": times,  # every timed step in order: a run whose steps slow down as it goes shows it here
    }
    if theirs:  # over several rounds: nanochat's median tok/s and the median of the rounds' ratios
        median = statistics.median(r["nanochat"]["tok_per_s"] for r in quiet)
        out["nanochat"] = (
            theirs[0]
            if len(theirs) == 1
            else {
                "tok_per_s": median,
                **{k: theirs[0][k] for k in ("torch", "threads", "dtype")},
                **{k: theirs[-1][k] for k in ("profile",) if k in theirs[-1]},
            }
        )  # each round's is in its own record
        out["vs_nanochat"] = statistics.median(r["vs_nanochat"] for r in quiet)
    if any(r.get("noisy") for r in rounds):  # left out of the results unless every round was noisy
        out["noisy_rounds"] = [i + 1 for i, r in enumerate(rounds) if r.get("noisy")]
    if args.rounds > 1:
        out["rounds"] = rounds
    return out


# -----------------------------------------------------------------------------
# The compiled step's communication (--what comms)


def bench_comms(args, mesh) -> dict:
    """Compile the train step from abstract arrays and read its collectives and per-device FLOPs."""
    config = config_from_flags(args, args.vocab_size)
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    t0 = time.perf_counter()
    compiled = compile_train_step(
        config,
        mesh,
        args.device_batch_size * dp,
        args.grad_accum,
        compute_dtype(args.dtype),
        attention=args.attention,
        remat=args.remat,
    )
    compile_s = time.perf_counter() - t0
    stats = program_stats(compiled.as_text())
    out = {
        "what": "comms",
        "mesh": dict(mesh.shape),
        "grad_accum": args.grad_accum,
        "compile_s": compile_s,
        "collectives_per_step": stats["collectives"],
        "bytes_sent_per_device": stats["bytes"],
        "by_kind": {k: v for k, v in stats["by_kind"].items() if v["count"]},
        "matmul_flops_per_device": stats["matmul_flops"],
        "unknown_trip_counts": stats["unknown_trip_counts"],
    }
    if args.show_ops:
        out["ops"] = [{"kind": k, "shape": s, "times": n, "op": op} for k, s, n, op in stats["ops"]]
    return out
