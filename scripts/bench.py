"""Benchmarks: print one JSON object (tokens/s, MFU against a measured peak, compile time, memory).

Training step (random tokens, the real optimizer, median of --steps timed steps after warm-up), on the mesh
the --data/--fsdp/--tensor flags build (as scripts.pretrain does; default: data parallel over every device):
    python -m scripts.bench --what train --depth 4 --max-seq-len 512 --device-batch-size 8 \
        --window-pattern SSSL --vocab-size 32768
Communication of the compiled train step (nothing runs; works for any model size on any machine, e.g. d20 on
8 fake CPU devices): collectives per step, bytes each device sends, FLOPs per device:
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m scripts.bench --what comms --depth 20 \
        --max-seq-len 2048 --device-batch-size 32 --vocab-size 65536 --dtype bfloat16 --fsdp 8
Generation (KV-cache engine; batch 1 and 32 are the usual points):
    python -m scripts.bench --what generate --depth 4 --max-seq-len 512 --window-pattern SSSL \
        --vocab-size 32768 --prompt-len 16 --max-new-tokens 256 --batch-size 1
    (add --quantize bf16|int8 to decode from weight-only quantized matmul weights, as chat_cli/eval can)
Speculative sampling, a trained model and a trained draft (plain vs speculative, acceptance rate):
    python -m scripts.bench --what generate --checkpoint sft:d12 --draft-model d4 --max-new-tokens 128 -t 0
Data loader (needs a tokenizer and parquet shards in $FLAXCHAT_BASE_DIR):
    python -m scripts.bench --what data --device-batch-size 8 --max-seq-len 512
How much of a step its matrix products are (each of the step's products timed alone, one device; the JSON adds
"products", stderr the slowest with their source lines and every line's products summed, with their rate):
    python -m scripts.bench --what train --depth 4 --head-dim 64 --window-pattern SL --max-seq-len 256 \
        --device-batch-size 16 --vocab-size 4096 --products
The CPU suite (the shapes compared with nanochat; one JSON line per shape; the "real" row needs a tokenizer and
shards in $FLAXCHAT_BASE_DIR):
    python -m scripts.bench --what train --suite cpu
Side by side with nanochat (a checkout of github.com/karpathy/nanochat and PyTorch installed): each row first
times nanochat's own step (its GPT, MuonAdamW and torch.compile, in a process of its own; scripts.nanochat_bench),
then flaxchat's, and adds "nanochat" and "vs_nanochat" (flaxchat tok/s over nanochat's) to the JSON:
    python -m scripts.bench --what train --suite cpu --nanochat ~/src/nanochat
    nanochat's record gives the rate of its PyTorch's own matmul (matmul_peak_flops); on an AMD CPU, where the stock
    wheel's MKL runs its AVX2 kernels, add --nanochat-mkl avx512 for the AVX-512 ones an Intel Xeon gets.
    On one CUDA GPU (PyTorch with CUDA; --rounds 1; JAX then grows its memory as it needs it instead of taking
    most of it at the start, so that nanochat's process, which runs first, has room):
    python -m scripts.bench --what train --depth 12 --max-seq-len 2048 --device-batch-size 32 \
        --vocab-size 32768 --dtype bfloat16 --nanochat ~/src/nanochat --expect-backend gpu
A real pretraining run (`scripts.pretrain`: the Grain loader over $FLAXCHAT_BASE_DIR's tokenizer and shards,
accumulation, the optimizer's schedules) and, with --nanochat, nanochat's own `scripts/base_train.py` first with
the same flags on the same tokenizer and shards; the median step of steps 11-150 of each (stdout: JSON; both runs'
progress on stderr and in $FLAXCHAT_BASE_DIR/bench_run/, where each trainer has a base dir of its own: your runs'
checkpoints and report are left alone). One device, as base_train runs in one process (on a machine with several
GPUs: CUDA_VISIBLE_DEVICES=0):
    python -m scripts.bench --what run --depth 4 --head-dim 64 --window-pattern SL --max-seq-len 256 \
        --device-batch-size 16 --grad-accum 2 --steps 150 --warmup 9 --nanochat ~/src/nanochat
The chat server as a new user meets it (scripts.chat_web started with an empty compilation cache; a streamed reply
asked for as soon as /health answers, one as soon as the background compiles are done, then steady ones: each
reply's pace, seconds to its first token, tokens per SSE chunk and the largest gap between chunks), then a growing
conversation's time to first token turn by turn against its last message alone, and 16 clients chatting at once
(prefix reuse's hits and tokens saved):
    python -m scripts.bench --what serve --depth 12 --max-seq-len 2048 --max-new-tokens 96
    python -m scripts.bench --what serve --checkpoint sft:d4 --max-new-tokens 96
Everything:
    python -m scripts.bench --what all --depth 4 --max-seq-len 512
On a GPU or TPU add --expect-backend gpu|tpu so a silent fall-back to the CPU stops the run at once.
"""

import argparse
import importlib.util
import json
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat import sharding
from flaxchat.common import compute_dtype, get_base_dir, parse_args, quiet_library_logs
from flaxchat.data.dataloader import make_loader
from flaxchat.data.dataset import default_data_dir, list_parquet_files
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.eval.report import read_jsonl
from flaxchat.export.nanochat import save_nanochat_tokenizer
from flaxchat.generate.speculative import add_draft_flags
from flaxchat.model.config import GPTConfig, add_model_flags, config_from_flags
from flaxchat.model.gpt import GPT, add_kernel_flags
from flaxchat.model.quantize import add_quantize_flag, quantize_for_generation, weight_bytes
from flaxchat.perf.hlo import program_stats
from flaxchat.perf.machine import MachineLoad, huge_pages_active, malloc_library, peak_flops_per_device
from flaxchat.perf.measure import measure_generation, measure_speculative, measure_throughput
from flaxchat.perf.processes import (
    NANOCHAT_MKL,
    failure_line,
    link,
    nanochat_env,
    nanochat_step_times,
    run_trainer,
    step_times,
)
from flaxchat.perf.products import format_census, product_census
from flaxchat.perf.profiler import StepProfiler, profile_summary
from flaxchat.perf.serving import measure as measure_serving
from flaxchat.perf.trace import format_summary
from flaxchat.train.checkpoint import checkpoint_dir, load_named_model
from flaxchat.train.flags import add_batch_flags, add_dtype_flag
from flaxchat.train.optim import build_optimizer
from flaxchat.train.step import IN_FLIGHT_CHOICES, FlatStep, InFlight, compile_train_step, in_flight_depth

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: scripts.* run from here


# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="Benchmark training, generation or data loading; prints JSON.")
    p.add_argument(
        "--what",
        choices=["train", "comms", "generate", "data", "run", "serve", "all"],
        default="train",
        help="what to measure (all = train, generate, data; run = a real scripts.pretrain run of --steps "
        "steps on one device, beside nanochat's base_train with --nanochat; serve = scripts.chat_web "
        "started cold, a streamed reply at once, after its background compiles and steady)",
    )
    add_model_flags(p, depth=4, max_seq_len=512)
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size (random tokens)")
    add_batch_flags(p, device_batch_size=8)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per training step")
    p.add_argument(
        "--steps",
        type=int,
        default=10,
        help="timed training steps (median reported), run as pretrain runs them; a step's time runs from "
        "reading its batches to its loss being ready",
    )
    p.add_argument(
        "--in-flight",
        nargs="?",
        const="on",
        choices=IN_FLIGHT_CHOICES,
        default="auto",
        help="train: keep one step in flight, as pretrain does (auto: on GPUs and TPUs, off on a CPU; "
        "a bare --in-flight is on): the next is dispatched before this one's loss is read, and a "
        "step's time is then the time between the ends of two steps",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed steps after compilation (run: the first step and this many after it are left out of the median)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="train: time --steps steps this many times (with --nanochat: nanochat, then flaxchat, each "
        "round); the JSON adds every round and the median round's ratio. A round during which the "
        "VM's host gave over 5%% of the CPU time to other guests (steal) is left out of the results "
        "(noisy_rounds) unless every round was",
    )
    p.add_argument("--batch-size", type=int, default=1, help="generation rows")
    p.add_argument("--prompt-len", type=int, default=16, help="generation prompt tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generated tokens per row")
    add_dtype_flag(p)
    add_quantize_flag(p)
    p.add_argument(
        "--checkpoint",
        default=None,
        metavar="[SOURCE:]TAG",
        help="generate: time a trained checkpoint (e.g. sft:d4) instead of a random model of the flags' shape",
    )
    add_draft_flags(p)
    p.add_argument(
        "--serve-flags",
        default="",
        metavar="FLAGS",
        help='serve: more scripts.chat_web flags, in one string (e.g. "--slots 32 --chunk 8")',
    )
    p.add_argument("-t", "--temperature", type=float, default=1.0, help="generate: sampling temperature (0 = greedy)")
    p.add_argument(
        "--show-ops", action="store_true", help="comms: list every collective (kind, shape, times, source op)"
    )
    p.add_argument(
        "--suite",
        choices=["cpu"],
        default=None,
        help="train: run every shape of a suite (CPU_SUITE), one JSON line each; other flags still apply",
    )
    p.add_argument(
        "--real-data",
        action="store_true",
        help="train: batches from the Grain loader over $FLAXCHAT_BASE_DIR's tokenizer and shards",
    )
    p.add_argument(
        "--cycle-batches",
        type=int,
        default=0,
        metavar="N",
        help="train, with --real-data: read N steps' batches from the loader once, then cycle through "
        "them (the loader's text without the loader in the step; 0 = a new batch from the loader "
        "every step)",
    )
    p.add_argument(
        "--fresh-batches",
        action="store_true",
        help="train, random tokens: new host arrays placed on the devices every step, as the loader's "
        "batches arrive (by default two batches stay on the devices and alternate)",
    )
    p.add_argument(
        "--nanochat",
        metavar="DIR",
        default=None,
        help="train: also time nanochat's step (the checkout at DIR, with PyTorch) on the same shape, "
        "first; run: run nanochat's scripts/base_train.py first, with the same flags and data",
    )
    p.add_argument(
        "--nanochat-mkl",
        choices=NANOCHAT_MKL,
        default="as-installed",
        help="with --nanochat on a CPU: the BLAS kernels nanochat's PyTorch runs. as-installed: what its "
        "wheel picks (the stock wheel's MKL takes its slower AVX2 path on AMD CPUs); "
        "avx512: MKL's AVX-512 path, as on an Intel Xeon, through a one-line C library preloaded "
        "into nanochat's processes only (built with the system's C compiler). nanochat's JSON gives "
        "the fp32 matmul rate its PyTorch reached either way",
    )
    StepProfiler.add_flag(
        p,
        "--profile-dir (train; the JSON adds where their time went: ms by kind of op and the "
        "slowest ops, and nanochat's beside them with --nanochat)",
    )
    p.add_argument(
        "--profile-dir", type=str, default=None, help="where the trace goes (default $FLAXCHAT_BASE_DIR/profile/bench)"
    )
    p.add_argument(
        "--products",
        action="store_true",
        help="train, one device: also time every matrix product of the step alone, one after another "
        '(the JSON adds "products": their time beside the step\'s, the slowest, and their time and '
        "rate by line of the program)",
    )
    add_kernel_flags(p)
    sharding.add_mesh_flags(p)
    return p


def peak_mem_gb() -> float:
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # CPU: process peak RSS (KiB -> GiB)


def make_config(args) -> GPTConfig:
    return config_from_flags(args, args.vocab_size)


# -----------------------------------------------------------------------------
# Training step (--what train, --suite, --nanochat)

# The CPU suite (`--suite cpu`): the shapes the project compares with nanochat on a CPU. The last is nanochat's
# runs/runcpu.sh model; "real" rows read batches from the Grain loader (tokenizer and shards in the base dir)
# with gradient accumulation, as scripts.pretrain does.
CPU_SUITE = {
    "d4-hd128-SSSL-T512-B8-V32768": dict(
        depth=4, head_dim=128, window_pattern="SSSL", max_seq_len=512, device_batch_size=8, vocab_size=32768
    ),
    "d4-hd64-SL-T256-B16-V4096": dict(
        depth=4, head_dim=64, window_pattern="SL", max_seq_len=256, device_batch_size=16, vocab_size=4096
    ),
    "d4-hd64-SL-T256-B16-real-accum2": dict(
        depth=4, head_dim=64, window_pattern="SL", max_seq_len=256, device_batch_size=16, grad_accum=2, real_data=True
    ),
    "d6-hd64-L-T512-B32-V32768": dict(
        depth=6, head_dim=64, window_pattern="L", max_seq_len=512, device_batch_size=32, vocab_size=32768
    ),
}


def real_batches(args, mesh, tokenizer):
    """(next_micro_batches(), loader): the Grain loader over the base dir's shards, tokenized by `tokenizer`."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    loader = make_loader(tokenizer, args.device_batch_size * dp, args.max_seq_len, "train", mesh=mesh)
    take = lambda: tuple(zip(*(next(loader) for _ in range(args.grad_accum))))
    return take, loader


def nanochat_environment(args) -> dict:
    """processes.nanochat_env for --nanochat-mkl (its library built under the base dir's bench_run/); one line and
    exit where it cannot be built."""
    try:
        return nanochat_env(args.nanochat_mkl, os.path.join(get_base_dir(), "bench_run", "mkl_avx512"))
    except RuntimeError as e:
        sys.exit(f"error: {e}")


def time_nanochat(args, config, batch_size: int) -> dict:
    """nanochat's step for the same model and batch, in a process of its own (scripts.nanochat_bench), run before
    flaxchat's so neither runs beside the other. nanochat runs as it would on its own: the compute dtype through
    NANOCHAT_DTYPE, and without the glibc huge-pages tunable flaxchat sets for itself."""
    env = nanochat_environment(args)
    env["NANOCHAT_DTYPE"] = jnp.dtype(compute_dtype(args.dtype)).name
    # run from the repository (scripts.* import from there), so the checkout's path is made absolute first
    cmd = [
        sys.executable,
        "-m",
        "scripts.nanochat_bench",
        "--dir",
        os.path.abspath(os.path.expanduser(args.nanochat)),
        "--batch-size",
        str(batch_size),
        "--config",
        json.dumps(config.to_dict()),
        "--grad-accum",
        str(args.grad_accum),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--device",
        "cuda" if jax.default_backend() == "gpu" else "cpu",
    ]
    if args.profile_steps:  # as many steps of nanochat's under torch.profiler, after its timed ones
        cmd += ["--profile", str(args.profile_steps[1] - args.profile_steps[0])]
    load = MachineLoad()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    machine = load.stop()  # over nanochat's whole process, compilation included
    if proc.returncode != 0:
        sys.exit(f"error: timing nanochat failed: {failure_line(proc.stderr)}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "machine": machine, "mkl": args.nanochat_mkl}


def bench_train(args, mesh) -> dict:
    """flaxchat's training step: the median of --steps timed steps after compilation and --warmup steps, in
    --rounds rounds. With --nanochat, each round first times nanochat's step on the same shape (time_nanochat),
    so every pair of numbers comes from the same minutes of a machine whose speed may drift."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    B, T, A = args.device_batch_size * dp, args.max_seq_len, args.grad_accum
    if args.real_data:
        tokenizer = get_tokenizer()
        args.vocab_size = tokenizer.get_vocab_size()
    theirs = [time_nanochat(args, make_config(args), B)] if args.nanochat else []  # before the loader's threads start
    loader, counter, data = None, iter(range(10**9)), "random tokens"
    if args.real_data:
        take, loader = real_batches(args, mesh, tokenizer)
        data = "grain loader"
        if args.cycle_batches:  # the loader's text, read once: no loader threads or host-to-device copies per step
            cycled = [take() for _ in range(args.cycle_batches)]
            loader.close()
            loader, take = None, lambda: cycled[next(counter) % len(cycled)]
            data = f"grain loader's first {len(cycled)} steps, cycled"
    config = make_config(args)
    model = sharding.create_sharded(
        lambda: GPT(
            config, rngs=nnx.Rngs(0), dtype=compute_dtype(args.dtype), attention=args.attention, remat=args.remat
        ),
        mesh,
    )
    with jax.set_mesh(mesh):
        optimizer = build_optimizer(model, verbose=False)
    if not args.real_data:
        rng = np.random.default_rng(0)
        put = lambda a: jax.device_put(a, sharding.batch_sharding(mesh))
        draw = lambda: tuple(put(rng.integers(0, config.vocab_size, (B, T), dtype=np.int32)) for _ in range(A))
        if args.fresh_batches:
            take = lambda: (draw(),) * 2  # random tokens as inputs and targets, new arrays every step
            data = "random tokens, new arrays every step"
        else:
            batches = [draw() for _ in range(2)]
            take = lambda: (batches[next(counter) % 2],) * 2

    profiler = StepProfiler(args.profile_steps, args.profile_dir or os.path.join(get_base_dir(), "profile", "bench"))

    optimizer_step = FlatStep(model, optimizer)  # as pretrain calls it
    steps, last, in_flight = iter(range(10**9)), {}, InFlight(in_flight_depth(args.in_flight, jax.default_backend()))

    def step():
        """Read the batches and dispatch a step (with --in-flight, while the step before it runs); returns the steps
        that finished meanwhile (InFlight's (loss, step, seconds)). A profiled step runs alone."""
        i = next(steps)
        profiled = profiler.covers(i)
        finished = [in_flight.finish()] if profiled else []
        started = time.perf_counter()
        with profiler.step(i):  # real data: reading the next batches is part of the step, as in pretrain
            xs, ys = last["batch"] = take()
            with jax.set_mesh(mesh):
                finished.append(in_flight.submit(optimizer_step(xs, ys), i, started))
            if profiled:
                finished.append(in_flight.finish())
        return [done for done in finished if done is not None]

    t0 = time.perf_counter()
    step()
    in_flight.finish()
    first_step_s = time.perf_counter() - t0  # tracing + compilation + one step
    for _ in range(args.warmup):
        step()
    in_flight.finish()
    tokens, rounds = B * T * A, []
    for r in range(args.rounds):
        if args.nanochat and r > 0:
            theirs.append(time_nanochat(args, config, B))
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
    profiler.close()
    if loader is not None:
        loader.close()
    where = profile_summary(profiler, optimizer_step, last["batch"], mesh) if args.profile_steps else None
    census = product_census(model, optimizer, last["batch"], mesh) if args.products else None
    if where is not None:
        print(format_summary(where, "flaxchat's profiled steps: "), file=sys.stderr)
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
        "peak_mem_gb": peak_mem_gb(),
        "tokens_per_step": tokens,
        "flops_per_token": model.estimate_flops(),
        "num_params": model.num_scaling_params()["total"],
        "attention": model.attention,
        "remat": model.remat,
        "data": data,
        "grad_accum": A,
        "in_flight": bool(in_flight.depth),
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
    if where is not None:
        out["profile"] = where
    if census is not None:
        out["products"] = {**census, "share_of_step": census["alone_s"] / step_s}
        print(format_census(out["products"], step_s), file=sys.stderr)
    return out


# -----------------------------------------------------------------------------
# Communication, generation, data loading (--what comms / generate / data)


def bench_comms(args, mesh) -> dict:
    """Compile the train step from abstract arrays and read its collectives and per-device FLOPs."""
    config = make_config(args)
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


def bench_generate(args, mesh) -> dict:
    if args.checkpoint:
        model = load_named_model(args.checkpoint, "sft", "--checkpoint", dtype=compute_dtype(args.dtype))
    else:
        model = GPT(make_config(args), rngs=nnx.Rngs(0), dtype=compute_dtype(args.dtype))
    model = quantize_for_generation(model, args.quantize)
    info = {"quantize": args.quantize, "weight_mb": weight_bytes(model) / 2**20, "checkpoint": args.checkpoint}
    if args.draft_model:
        source = args.checkpoint.rpartition(":")[0] or "sft"
        draft = load_named_model(args.draft_model, source, "--draft-model", dtype=compute_dtype(args.dtype))
        draft = quantize_for_generation(draft, args.quantize)
        tokenizer = get_tokenizer()  # a text prompt: how often the draft agrees depends on real text
        prompt = [tokenizer.get_bos_token_id()] + tokenizer.encode("Once upon a time, there was a little")
        out = measure_speculative(
            model, draft, prompt, args.max_new_tokens, draft_steps=args.draft_steps, temperature=args.temperature
        )
        return {
            "what": "generate",
            "speculative": True,
            "draft_model": args.draft_model,
            **out,
            **info,
            "draft_weight_mb": weight_bytes(draft) / 2**20,
            "peak_mem_gb": peak_mem_gb(),
        }
    out = measure_generation(
        model,
        batch_size=args.batch_size,
        prompt_len=args.prompt_len,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
    )
    return {"what": "generate", **out, **info, "peak_mem_gb": peak_mem_gb()}


def bench_data(args, mesh) -> dict:
    tokenizer = get_tokenizer()
    out = measure_throughput(tokenizer, batch_size=args.device_batch_size, seq_len=args.max_seq_len)
    return {"what": "data", "tok_per_s": out["tokens_per_s"], **out, "vocab_size": tokenizer.get_vocab_size()}


# -----------------------------------------------------------------------------
# --what run: real runs, flaxchat's scripts.pretrain beside nanochat's scripts/base_train.py


def run_flags(args, tokens: int) -> list[str]:
    """The flags --what run gives both trainers, which name them alike: the model, one device's batch and
    accumulation (`tokens` a step), --steps steps; val bpb, CORE and samples off, so that every step is a training
    step."""
    return [
        "--depth",
        str(args.depth),
        "--aspect-ratio",
        str(args.aspect_ratio),
        "--head-dim",
        str(args.head_dim),
        "--max-seq-len",
        str(args.max_seq_len),
        "--window-pattern",
        args.window_pattern,
        "--device-batch-size",
        str(args.device_batch_size),
        "--total-batch-size",
        str(tokens),
        "--num-iterations",
        str(args.steps),
        "--eval-every",
        "-1",
        "--core-metric-every",
        "-1",
        "--sample-every",
        "-1",
    ]


def run_base_dir(run_dir: str) -> str:
    """A base dir of flaxchat's own for the benchmark's run: the tokenizer and shards of $FLAXCHAT_BASE_DIR linked
    in, and its checkpoints, report and compiled programs kept apart from your runs' (checkpoints cleared first)."""
    base = os.path.join(run_dir, "flaxchat_base")
    os.makedirs(base, exist_ok=True)
    link(os.path.join(get_base_dir(), "tokenizer"), os.path.join(base, "tokenizer"))
    link(default_data_dir(), os.path.join(base, "base_data"))
    shutil.rmtree(os.path.join(base, "base_checkpoints"), ignore_errors=True)  # a fresh run, not a resumed one
    return base


def nanochat_base_dir(run_dir: str, tokenizer) -> tuple[str, str | None]:
    """NANOCHAT_BASE_DIR for base_train on flaxchat's data: our tokenizer in nanochat's format and our shards as
    its pretraining data; and a folder with an empty `wandb` module where wandb is not installed (base_train
    imports it even when it does not log), else None."""
    base = os.path.join(run_dir, "nanochat_base")
    save_nanochat_tokenizer(tokenizer, os.path.join(base, "tokenizer"))
    link(default_data_dir(), os.path.join(base, "base_data_climbmix"))
    if importlib.util.find_spec("wandb") is not None:
        return base, None
    stub = os.path.join(run_dir, "stub")
    os.makedirs(os.path.join(stub, "wandb"), exist_ok=True)
    with open(os.path.join(stub, "wandb", "__init__.py"), "w") as f:
        f.write('"""Empty: nanochat\'s base_train imports wandb even when it does not log (--run dummy)."""\n')
    return base, stub


def device_type_flags(args) -> list[str]:
    """base_train's --device-type where --expect-backend names the backend (else base_train detects it)."""
    named = {"gpu": "cuda", "cpu": "cpu"}.get(args.expect_backend)
    return ["--device-type", named] if named else []


def run_nanochat(args, flags, run_dir, tokenizer, first, tokens) -> dict:
    """nanochat's scripts/base_train.py, unmodified, with `flags` on flaxchat's tokenizer and shards (its own
    environment: the compute dtype through NANOCHAT_DTYPE, without flaxchat's huge-pages tunable)."""
    base, stub = nanochat_base_dir(run_dir, tokenizer)
    env = {**nanochat_environment(args), "NANOCHAT_BASE_DIR": base, "PYTHONUNBUFFERED": "1"}
    if args.dtype:
        env["NANOCHAT_DTYPE"] = args.dtype
    # nanochat's scripts/ is a namespace package (no __init__.py): a path entry holding flaxchat's `scripts` package
    # would shadow it (no scripts.base_train), so those entries are left out
    paths = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not os.path.isfile(os.path.join(p, "scripts", "__init__.py"))
    ]
    env["PYTHONPATH"] = os.pathsep.join([stub] * bool(stub) + paths)
    cmd = [sys.executable, "-m", "scripts.base_train", *flags, *device_type_flags(args)]
    out, run = run_trainer(
        "nanochat's base_train",
        cmd,
        os.path.join(run_dir, "nanochat.log"),
        cwd=os.path.expanduser(args.nanochat),
        env=env,
    )
    times = nanochat_step_times(out)
    return {**step_times(times, first, tokens), **run, "mkl": args.nanochat_mkl}


def run_flaxchat(args, flags, run_dir, base, first, tokens) -> dict:
    """scripts.pretrain with `flags` in `base`, a base dir of its own (run_base_dir); the steps' times from its
    metrics.jsonl."""
    cmd = [sys.executable, "-m", "scripts.pretrain", *flags, "--in-flight", args.in_flight]
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += ["--expect-backend", args.expect_backend] if args.expect_backend else []
    _, run = run_trainer(
        "scripts.pretrain",
        cmd,
        os.path.join(run_dir, "flaxchat.log"),
        cwd=ROOT,
        env={**os.environ, "FLAXCHAT_BASE_DIR": base, "PYTHONUNBUFFERED": "1"},
    )
    metrics = os.path.join(checkpoint_dir("base", f"d{args.depth}", base_dir=base), "metrics.jsonl")
    times = {r["step"]: r["dt"] for r in read_jsonl(metrics) if "dt" in r}
    return {**step_times(times, first, tokens), **run}


def bench_run(args) -> dict:
    """A real scripts.pretrain run of --steps steps (and nanochat's base_train first with --nanochat), each in a
    process of its own, one after the other: the median step after the first and --warmup more, tok/s, the
    timed steps' total minutes, the whole process's seconds (start-up and compilation included)."""
    tokenizer = get_tokenizer()  # FileNotFoundError where there is none, before either run starts
    if len(list_parquet_files()) < 2:
        raise FileNotFoundError(f"--what run needs at least 2 parquet shards (train + val) in {default_data_dir()}")
    run_dir = os.path.join(get_base_dir(), "bench_run")
    os.makedirs(run_dir, exist_ok=True)
    tokens = args.device_batch_size * args.max_seq_len * args.grad_accum
    flags, first = run_flags(args, tokens), args.warmup + 2
    record = {
        "what": "run",
        "flags": flags,
        "tokens_per_step": tokens,
        "timed_from_step": first,
        "dtype": args.dtype or "default",
        "in_flight": args.in_flight,
        "python": platform.python_version(),
        "jax": jax.__version__,
        "huge_pages": huge_pages_active(),
        "allocator": malloc_library(),
    }
    theirs = run_nanochat(args, flags, run_dir, tokenizer, first, tokens) if args.nanochat else None
    ours = run_flaxchat(args, flags, run_dir, run_base_dir(run_dir), first, tokens)
    record.update(ours)
    if theirs:
        record.update(nanochat=theirs, vs_nanochat=theirs["step_s"] / ours["step_s"])
    return record


# -----------------------------------------------------------------------------
# Main


def environment(args, mesh) -> dict:
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "num_devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "dtype": jnp.dtype(compute_dtype(args.dtype)).name,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "huge_pages": huge_pages_active(),
        "allocator": malloc_library(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }  # as the backend read them (sharding.native_gpu_atomics)


def run_suite(args, mesh) -> None:
    """Every shape of the suite through bench_train, one JSON line each (a missing tokenizer/data skips a row)."""
    for name, shape in CPU_SUITE.items():
        row = argparse.Namespace(**{**vars(args), "grad_accum": 1, "real_data": False, **shape})
        try:
            result = bench_train(row, mesh)
        except FileNotFoundError as e:
            result = {"what": "train", "skipped": str(e)}
        print(
            json.dumps({"shape": name, **environment(args, mesh), "config": make_config(row).to_dict(), **result}),
            flush=True,
        )


def run_main(parser, args) -> None:
    """--what run: checked, then run without starting JAX's backend here (on a GPU it would hold the memory the
    two trainers' processes need)."""
    if args.suite or args.products or args.profile_steps or args.rounds != 1 or args.real_data:
        parser.error(
            "--what run runs scripts.pretrain as it is (its own loader, one run): not with --suite, "
            "--products, --profile-steps, --rounds or --real-data"
        )
    if args.warmup < 0 or args.warmup + 2 > args.steps:
        parser.error(
            f"--what run times the steps after the first and --warmup more: --steps ({args.steps}) must be "
            f"at least --warmup + 2 ({args.warmup + 2})"
        )
    base_train = os.path.join(os.path.expanduser(args.nanochat or ""), "scripts", "base_train.py")
    if args.nanochat and not os.path.isfile(base_train):
        parser.error(f"--nanochat {args.nanochat}: not a nanochat checkout (no scripts/base_train.py in it)")
    try:
        record = bench_run(args)
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # RuntimeError: a trainer failed (its line)
        sys.exit(f"error: {e}")
    print(json.dumps(record, indent=2))


def serve_main(args) -> None:
    """--what serve: scripts.chat_web in a process of its own (this one starts no JAX backend), --checkpoint's model
    or a random one of --depth and --max-seq-len, replies of --max-new-tokens tokens (flaxchat.perf.serving)."""
    if args.checkpoint:
        source, _, tag = args.checkpoint.rpartition(":")
        flags = ["-i", source or "sft", "-g", tag]
    else:
        flags = ["--random-init", "--depth", str(args.depth), "--seq-len", str(args.max_seq_len)]
    flags += shlex.split(args.serve_flags)
    try:
        record = measure_serving(flags, "Tell me a story about a cat and a dog.", args.max_new_tokens)
    except RuntimeError as e:
        sys.exit(f"error: {e}")
    print(json.dumps({"what": "serve", "chat_web_flags": flags, **record}, indent=2))


def main(argv=None):
    quiet_library_logs()
    parser = build_parser()
    args = parse_args(parser, argv)
    StepProfiler.prepare(args.profile_steps)  # before JAX starts its backend
    sharding.native_gpu_atomics()  # likewise (mesh_from_args would, but --nanochat starts the backend before it)
    try:
        make_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.draft_model and not args.checkpoint:
        parser.error("--draft-model needs --checkpoint: a draft proposes tokens for a trained model")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.nanochat_mkl != "as-installed" and not args.nanochat:
        parser.error(f"--nanochat-mkl {args.nanochat_mkl} chooses nanochat's BLAS kernels: use it with --nanochat DIR")
    if args.cycle_batches < 0 or (args.cycle_batches and not args.real_data):
        parser.error("--cycle-batches N (N >= 1) cycles the loader's batches: use it with --real-data")
    if args.fresh_batches and args.real_data:
        parser.error("--fresh-batches draws random tokens; --real-data's batches are new every step already")
    if args.what == "run":
        return run_main(parser, args)
    if args.what == "serve":
        return serve_main(args)
    if args.nanochat:
        if args.what not in ("train", "all"):
            parser.error("--nanochat times nanochat's training step: use it with --what train")
        # On a GPU the two take turns on its memory: JAX must not take most of it before nanochat runs (set before
        # the first call that starts JAX's backend; a value you exported is kept).
        if not re.fullmatch(r"(cpu|tpu)(,(cpu|tpu))*", os.environ.get("JAX_PLATFORMS", "")):  # a GPU may be used
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        backend = jax.default_backend()
        if backend not in ("cpu", "gpu"):
            parser.error(f"--nanochat compares the two on a CPU or a CUDA GPU; JAX is running on {backend}")
        if backend == "gpu" and (jax.device_count() > 1 or args.rounds > 1):
            parser.error(
                "--nanochat on a GPU: one GPU (CUDA_VISIBLE_DEVICES=0) and --rounds 1 (JAX keeps the "
                "memory it has grown to, so nanochat cannot run again after flaxchat's first round)"
            )
        if not os.path.isfile(os.path.join(os.path.expanduser(args.nanochat), "nanochat", "gpt.py")):
            parser.error(f"--nanochat {args.nanochat}: not a nanochat checkout (no nanochat/gpt.py in it)")
    mesh = sharding.mesh_from_args(parser, args)
    if args.products and (args.what not in ("train", "all") or mesh.size > 1):
        parser.error(
            "--products times one device's products of the training step: --what train on one device "
            "(on a mesh, XLA's partitioner and Muon's shared-out stacks decide what each device multiplies)"
        )
    if args.suite:
        return run_suite(args, mesh)
    runs = {"train": bench_train, "comms": bench_comms, "generate": bench_generate, "data": bench_data}
    chosen = ["train", "generate", "data"] if args.what == "all" else [args.what]
    env = environment(args, mesh)
    results = {}
    for name in chosen:
        try:
            results[name] = runs[name](args, mesh)
        except (FileNotFoundError, ValueError) as e:  # e.g. no tokenizer/data for --what data, a bad --checkpoint
            if args.what != "all":
                sys.exit(f"error: {e}")
            results[name] = {"what": name, "skipped": str(e)}
    env["config"] = make_config(args).to_dict()  # after the runs: --real-data takes the tokenizer's vocabulary
    out = results[chosen[0]] if len(chosen) == 1 else results
    print(json.dumps({**env, **out} if len(chosen) == 1 else {**env, "results": out}, indent=2))


if __name__ == "__main__":
    main()
