"""Programs the benchmarks run in processes of their own: nanochat's step and trainer beside flaxchat's.

scripts/bench.py times nanochat's PyTorch step (`time_nanochat`) and, for --what run, runs nanochat's
scripts/base_train.py and flaxchat's scripts.pretrain (`bench_run`) in separate processes, so neither program
shares a process, its threads or its allocator with the other. Underneath: nanochat's environment (without the
huge-pages tunable flaxchat sets for itself; optionally MKL's AVX-512 kernels on AMD CPUs), running a command with
its output streamed to a log, the one line that says why a process failed, and the median step of a run's logged
step times. A failure is a ProcessError whose message is the one line to show.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from flaxchat.common import compute_dtype, get_base_dir
from flaxchat.data.dataset import default_data_dir, list_parquet_files
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.perf.machine import MachineLoad, huge_pages_active, malloc_library, without_huge_pages
from flaxchat.train.checkpoint import checkpoint_dir

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts.* run from here

# --nanochat-mkl avx512: MKL asks this function whether it runs on an Intel CPU and, where not, keeps to its AVX2
# kernels. Preloaded, this answer wins over the one inside PyTorch's MKL: its AVX-512 kernels then run on AMD CPUs
# too, as they do on an Intel Xeon, which already gets that answer.
NANOCHAT_MKL = ("as-installed", "avx512")
MKL_AVX512_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"

NANOCHAT_STEP = re.compile(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms", re.M)  # base_train's line per step (0-based)


class ProcessError(RuntimeError):
    """A process a benchmark runs, or what it needs to start, failed; the message is the one line to show."""


def failure_line(text: str) -> str:
    """What a failed process said: the last exception or `error: ` line of its output where there is one, else its
    last line."""
    lines = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()] or ["it printed nothing"]
    errors = [line for line in lines if re.match(r"(error: |[\w.]+(Error|Exception)\b)", line)]
    return (errors or lines)[-1]


def mkl_avx512_library(directory: str) -> str:
    """The shared library for --nanochat-mkl avx512, built in `directory` with the C compiler ($CC, else cc or gcc)
    where it is missing or its source changed; ProcessError with one line where there is no compiler or it fails."""
    library, source = os.path.join(directory, "mkl_avx512.so"), os.path.join(directory, "mkl_avx512.c")
    if os.path.isfile(library) and os.path.isfile(source):
        with open(source) as f:
            if f.read() == MKL_AVX512_SOURCE:
                return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise ProcessError("--nanochat-mkl avx512 builds a one-line C library: no C compiler found ($CC, cc or gcc)")
    os.makedirs(directory, exist_ok=True)
    with open(source, "w") as f:
        f.write(MKL_AVX512_SOURCE)
    try:  # $CC may hold a command with arguments (ccache gcc), as make reads it
        proc = subprocess.run(
            [*shlex.split(compiler), "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True
        )
    except OSError as e:
        raise ProcessError(f"--nanochat-mkl avx512: the C compiler {compiler} did not start: {e.strerror}") from e
    if proc.returncode != 0:
        raise ProcessError(f"--nanochat-mkl avx512: {compiler} failed: {failure_line(proc.stderr)}")
    return library


def nanochat_env(mkl: str, library_dir: str) -> dict:
    """The environment nanochat's processes start with: ours without the huge-pages tunable flaxchat sets for itself,
    and with the --nanochat-mkl choice made (avx512 preloads mkl_avx512_library, built in library_dir, before any
    library LD_PRELOAD names already)."""
    env = without_huge_pages(os.environ)
    if mkl != "avx512":
        return env
    library = mkl_avx512_library(library_dir)
    return {**env, "LD_PRELOAD": " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)}


def stream(cmd, log_path, **popen) -> tuple[int, str]:
    """Run cmd with its output (stdout and stderr) copied to our stderr as it comes (progress bars included) and
    to log_path; returns the exit status and the whole output."""
    chunks = []
    with (
        open(log_path, "wb") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen) as proc,
    ):
        while chunk := proc.stdout.read1(65536):
            chunks.append(chunk)
            log.write(chunk)
            sys.stderr.write(chunk.decode(errors="replace"))
            sys.stderr.flush()
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def run_trainer(name: str, cmd, log_path, **popen) -> tuple[str, dict]:
    """One trainer's run through stream(), timed and watched (MachineLoad); ProcessError with its failure line if it
    fails. Returns its output and {"process_s", "machine", "log"}."""
    load, start = MachineLoad(), time.perf_counter()
    rc, out = stream(cmd, log_path, **popen)
    process_s, machine = time.perf_counter() - start, load.stop()
    if rc != 0:
        reason = failure_line(out).removeprefix("error: ")
        raise ProcessError(f"{name} exited with {rc}: {reason} (its output: {log_path})")
    return out, {"process_s": process_s, "machine": machine, "log": log_path}


def nanochat_step_times(output: str) -> dict[int, float]:
    """{step (1-based): seconds} from the lines nanochat's base_train prints per step."""
    return {int(m.group(1)) + 1: float(m.group(2)) / 1e3 for m in NANOCHAT_STEP.finditer(output)}


def step_times(times: dict[int, float], first: int, tokens: int) -> dict:
    """The median step of steps first.. of a run ({step (1-based): seconds}), its tok/s, spread and total."""
    timed = [dt for step, dt in sorted(times.items()) if step >= first]
    if not timed:
        raise ValueError(f"the run logged no step from step {first} on (steps logged: {len(times)})")
    median = statistics.median(timed)
    return {
        "step_s": median,
        "tok_per_s": tokens / median,
        "step_s_min": min(timed),
        "step_s_max": max(timed),
        "timed_steps": len(timed),
        "timed_min": sum(timed) / 60,
    }


def link(target: str, name: str) -> None:
    """name -> target (a folder), replacing a link already there."""
    if os.path.lexists(name):
        os.remove(name)
    os.symlink(os.path.abspath(target), name, target_is_directory=True)


# -----------------------------------------------------------------------------
# nanochat's step (bench --what train --nanochat)


def nanochat_environment(args) -> dict:
    """nanochat_env for bench's --nanochat-mkl, its library built under the base dir's bench_run/."""
    return nanochat_env(args.nanochat_mkl, os.path.join(get_base_dir(), "bench_run", "mkl_avx512"))


def time_nanochat(args, config, batch_size: int) -> dict:
    """nanochat's step for the same model and batch (bench's flags), in a process of its own
    (scripts.nanochat_bench), run before flaxchat's so neither runs beside the other. nanochat runs as it would on its
    own: the compute dtype through NANOCHAT_DTYPE, and without the glibc huge-pages tunable flaxchat sets for
    itself."""
    env = nanochat_environment(args)
    env["NANOCHAT_DTYPE"] = jnp.dtype(compute_dtype(args.dtype)).name
    # run from the repository (scripts.* import from there), so the checkout's path is made absolute first
    cmd = [sys.executable, "-m", "scripts.nanochat_bench", "--dir", os.path.abspath(os.path.expanduser(args.nanochat))]
    cmd += ["--batch-size", str(batch_size), "--config", json.dumps(config.to_dict())]
    cmd += ["--grad-accum", str(args.grad_accum), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--device", "cuda" if jax.default_backend() == "gpu" else "cpu"]
    if args.profile_steps:  # as many steps of nanochat's under torch.profiler, after its timed ones
        cmd += ["--profile", str(args.profile_steps[1] - args.profile_steps[0])]
    load = MachineLoad()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    machine = load.stop()  # over nanochat's whole process, compilation included
    if proc.returncode != 0:
        raise ProcessError(f"timing nanochat failed: {failure_line(proc.stderr)}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "machine": machine, "mkl": args.nanochat_mkl}


# -----------------------------------------------------------------------------
# Real runs (bench --what run): flaxchat's scripts.pretrain beside nanochat's scripts/base_train.py


def run_flags(args, tokens: int) -> list[str]:
    """The flags --what run gives both trainers, which name them alike: the model, one device's batch and
    accumulation (`tokens` a step), --steps steps; val bpb, CORE and samples off, so that every step is a training
    step."""
    model = ["--depth", args.depth, "--aspect-ratio", args.aspect_ratio, "--head-dim", args.head_dim]
    model += ["--max-seq-len", args.max_seq_len, "--window-pattern", args.window_pattern]
    batch = [
        "--device-batch-size",
        args.device_batch_size,
        "--total-batch-size",
        tokens,
        "--num-iterations",
        args.steps,
    ]
    off = ["--eval-every", -1, "--core-metric-every", -1, "--sample-every", -1]
    return [str(x) for x in model + batch + off]


def run_base_dir(run_dir: str) -> str:
    """A base dir of flaxchat's own for the benchmark's run: the tokenizer and shards of $FLAXCHAT_BASE_DIR linked
    in, and its checkpoints, report and compiled programs kept apart from your runs' (checkpoints cleared first)."""
    base = os.path.join(run_dir, "flaxchat_base")
    os.makedirs(base, exist_ok=True)
    link(os.path.join(get_base_dir(), "tokenizer"), os.path.join(base, "tokenizer"))
    link(default_data_dir(), os.path.join(base, "base_data"))
    shutil.rmtree(os.path.join(base, "base_checkpoints"), ignore_errors=True)  # a fresh run, not a resumed one
    return base


def nanochat_base_dir(run_dir: str, tokenizer, save_tokenizer) -> tuple[str, str | None]:
    """NANOCHAT_BASE_DIR for base_train on flaxchat's data: our tokenizer in nanochat's format (save_tokenizer:
    export.nanochat.save_nanochat_tokenizer, which this layer does not import) and our shards as its pretraining
    data; and a folder with an empty `wandb` module where wandb is not installed (base_train imports it even when it
    does not log), else None."""
    base = os.path.join(run_dir, "nanochat_base")
    save_tokenizer(tokenizer, os.path.join(base, "tokenizer"))
    link(default_data_dir(), os.path.join(base, "base_data_climbmix"))
    if importlib.util.find_spec("wandb") is not None:
        return base, None
    stub = os.path.join(run_dir, "stub")
    os.makedirs(os.path.join(stub, "wandb"), exist_ok=True)
    with open(os.path.join(stub, "wandb", "__init__.py"), "w") as f:
        f.write('"""Empty: nanochat\'s base_train imports wandb even when it does not log (--run dummy)."""\n')
    return base, stub


def run_nanochat(args, flags, run_dir, nanochat_base, first, tokens) -> dict:
    """nanochat's scripts/base_train.py, unmodified, with `flags` on flaxchat's tokenizer and shards (nanochat_base:
    nanochat_base_dir's) in its own environment: the compute dtype through NANOCHAT_DTYPE, without flaxchat's
    huge-pages tunable."""
    base, stub = nanochat_base
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
    named = {"gpu": "cuda", "cpu": "cpu"}.get(args.expect_backend)  # else base_train detects the device itself
    cmd = [sys.executable, "-m", "scripts.base_train", *flags, *(["--device-type", named] if named else [])]
    log = os.path.join(run_dir, "nanochat.log")
    out, run = run_trainer("nanochat's base_train", cmd, log, cwd=os.path.expanduser(args.nanochat), env=env)
    return {**step_times(nanochat_step_times(out), first, tokens), **run, "mkl": args.nanochat_mkl}


def run_flaxchat(args, flags, run_dir, base, first, tokens) -> dict:
    """scripts.pretrain with `flags` in `base`, a base dir of its own (run_base_dir); the steps' times from its
    metrics.jsonl."""
    cmd = [sys.executable, "-m", "scripts.pretrain", *flags, "--in-flight", args.in_flight]
    cmd += ["--dtype", args.dtype] if args.dtype else []
    cmd += ["--expect-backend", args.expect_backend] if args.expect_backend else []
    env = {**os.environ, "FLAXCHAT_BASE_DIR": base, "PYTHONUNBUFFERED": "1"}
    _, run = run_trainer("scripts.pretrain", cmd, os.path.join(run_dir, "flaxchat.log"), cwd=ROOT, env=env)
    metrics = os.path.join(checkpoint_dir("base", f"d{args.depth}", base_dir=base), "metrics.jsonl")
    with open(metrics) if os.path.exists(metrics) else contextlib.nullcontext([]) as rows:
        times = {r["step"]: r["dt"] for r in map(json.loads, rows) if "dt" in r}
    return {**step_times(times, first, tokens), **run}


def bench_run(args, save_tokenizer) -> dict:
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
    if args.nanochat:
        nanochat_base = nanochat_base_dir(run_dir, tokenizer, save_tokenizer)
        theirs = run_nanochat(args, flags, run_dir, nanochat_base, first, tokens)
    ours = run_flaxchat(args, flags, run_dir, run_base_dir(run_dir), first, tokens)
    record.update(ours)
    if args.nanochat:
        record.update(nanochat=theirs, vs_nanochat=theirs["step_s"] / ours["step_s"])
    return record
