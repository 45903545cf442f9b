"""Programs the benchmarks run in processes of their own: nanochat's step and trainer beside flaxchat's.

scripts/bench.py times nanochat's PyTorch step and runs nanochat's scripts/base_train.py in separate processes, so
neither program shares a process, its threads or its allocator with the other. This module holds what that needs
and is not the benchmark's own flow: nanochat's environment (without the huge-pages tunable flaxchat sets for
itself; optionally MKL's AVX-512 kernels on AMD CPUs), running a command with its output streamed to a log, the
one line that says why a process failed, and the median step of a run's logged step times.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time

from flaxchat.perf.machine import MachineLoad, without_huge_pages

# --nanochat-mkl avx512: MKL asks this function whether it runs on an Intel CPU and, where not, keeps to its AVX2
# kernels. Preloaded, this answer wins over the one inside PyTorch's MKL: its AVX-512 kernels then run on AMD CPUs
# too, as they do on an Intel Xeon, which already gets that answer.
NANOCHAT_MKL = ("as-installed", "avx512")
MKL_AVX512_SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"

NANOCHAT_STEP = re.compile(r"^step (\d+)/\d+ .*?\| dt: ([\d.]+)ms", re.M)  # base_train's line per step (0-based)


def failure_line(text: str) -> str:
    """What a failed process said: the last exception or `error: ` line of its output where there is one, else its
    last line."""
    lines = [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()] or ["it printed nothing"]
    errors = [line for line in lines if re.match(r"(error: |[\w.]+(Error|Exception)\b)", line)]
    return (errors or lines)[-1]


def mkl_avx512_library(directory: str) -> str:
    """The shared library for --nanochat-mkl avx512, built in `directory` with the C compiler ($CC, else cc or gcc)
    where it is missing or its source changed; RuntimeError with one line where there is no compiler or it fails."""
    library, source = os.path.join(directory, "mkl_avx512.so"), os.path.join(directory, "mkl_avx512.c")
    if os.path.isfile(library) and os.path.isfile(source):
        with open(source) as f:
            if f.read() == MKL_AVX512_SOURCE:
                return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("--nanochat-mkl avx512 builds a one-line C library: no C compiler found ($CC, cc or gcc)")
    os.makedirs(directory, exist_ok=True)
    with open(source, "w") as f:
        f.write(MKL_AVX512_SOURCE)
    try:  # $CC may hold a command with arguments (ccache gcc), as make reads it
        proc = subprocess.run(
            [*shlex.split(compiler), "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True
        )
    except OSError as e:
        raise RuntimeError(f"--nanochat-mkl avx512: the C compiler {compiler} did not start: {e.strerror}") from e
    if proc.returncode != 0:
        raise RuntimeError(f"--nanochat-mkl avx512: {compiler} failed: {failure_line(proc.stderr)}")
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
    """One trainer's run through stream(), timed and watched (MachineLoad); RuntimeError with its failure line if it
    fails. Returns its output and {"process_s", "machine", "log"}."""
    load, start = MachineLoad(), time.perf_counter()
    rc, out = stream(cmd, log_path, **popen)
    process_s, machine = time.perf_counter() - start, load.stop()
    if rc != 0:
        reason = failure_line(out).removeprefix("error: ")
        raise RuntimeError(f"{name} exited with {rc}: {reason} (its output: {log_path})")
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
