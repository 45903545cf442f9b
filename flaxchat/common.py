"""Small shared utilities: logging on the main process, the base directory, dtype choice, progress bars, profiling."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import tqdm.auto
import tqdm.std
from jax.extend import source_info_util

# The traced helpers here (einsum, split_in_two) are not where an op comes from: a compiled program's source lines
# (hlo.op_sources, a profile's lines) and JAX's filtered tracebacks name the line that called them instead
source_info_util.register_exclusion(__file__)

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def is_main_process() -> bool:
    return jax.process_index() == 0


def print0(*args, **kwargs) -> None:
    """print() on process 0 only, so multi-host runs log once."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def agree_max(*values):
    """Each value's maximum over all processes, as a tuple of the values' own types (bool, int, float).

    JAX runs multi-controller: every process must take the same branches and write the same numbers into
    replicated arrays, or the job hangs or diverges. Decisions one process makes from its own data (SFT's end
    of epoch, its LR progress) go through this first, as nanochat all-reduces them with MAX. The numbers
    travel as float32 (exact for bools and ints below 2**24). With one process the values come back as given.
    """
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    gathered = multihost_utils.process_allgather(np.asarray(values, np.float32))  # (processes, len(values))
    return tuple(type(v)(m) for v, m in zip(values, gathered.max(axis=0).tolist()))


def from_main_process(obj):
    """Process 0's value of a JSON-able object, on every process (with one process, obj itself).

    For host-side results that feed back into jitted work, e.g. a tool's output forced into generation: a
    sandbox that times out on one host but not on another would otherwise make the processes diverge.
    """
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8) if is_main_process() else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(raw.size)))
    data = multihost_utils.broadcast_one_to_all(np.pad(raw, (0, n - raw.size)))
    return json.loads(bytes(np.asarray(data, np.uint8)).decode())


def to_host(x) -> np.ndarray:
    """A jax array as numpy on every process, also when it is split over other processes' devices (an
    array sharded over 'tensor' across hosts, e.g. logits split by vocabulary, cannot be read locally)."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def get_base_dir(create: bool = True) -> str:
    """Where every artifact lives: $FLAXCHAT_BASE_DIR or ~/.cache/flaxchat (created on first use unless not create)."""
    base = os.environ.get("FLAXCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")
    if create:
        os.makedirs(base, exist_ok=True)
    return base


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Keep compiled programs on disk across runs (JAX's persistent cache) on GPU/TPU, where a large model's
    step takes minutes to compile; a restarted or resumed run then starts at once. Off on CPU, where programs
    compile in seconds and a cache written on one CPU type may not suit another. JAX_COMPILATION_CACHE_DIR, if
    set, wins. Returns the folder in use, or None."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if path is None and jax.default_backend() == "cpu":
        return None
    path = path or os.path.join(get_base_dir(), "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def compute_dtype(name: str | None = None):
    """Activation/matmul dtype. Master params stay fp32.

    bf16 on GPU/TPU; fp32 on CPU (nanochat's choice there). bf16 trains faster on CPUs with bf16 instructions
    (AVX512-BF16, AMX; see widened_products) at bf16's precision.
    `name` (or $FLAXCHAT_DTYPE) overrides: float32 | bfloat16 | float16.
    """
    name = name or os.environ.get("FLAXCHAT_DTYPE")
    if name:
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def activation_dtype(dtype, backend: str | None = None):
    """The dtype a model of compute dtype `dtype` keeps its activations in: fp32 for bf16 on a CPU, else `dtype`.

    On a CPU bf16 is the products' dtype only, as under torch's autocast: operands rounded to bf16, fp32 results
    kept (see widened_products), norms, rotary, softmax and the residual stream in fp32. XLA:CPU rounds the result
    of every bf16 elementwise op back to bf16 and runs such a chain ~4x slower than in fp32 (a (4096, 1024)
    multiply-tanh-sigmoid chain on one Zen 5 core: 12.8 ms in bf16, 2.9 ms in fp32); with fp32 activations a bf16
    train step at nanochat's small CPU shape (d4, T=256, vocab 4096) runs ~1.35x an fp32 one instead of ~1.05x."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.bfloat16 and (backend or jax.default_backend()) == "cpu" else dtype


def widened_products(*operands) -> bool:
    """Whether a product of these operands (all bf16) asks XLA for an fp32 result: on a CPU. XLA:CPU's library
    multiplies bf16 into fp32 with the CPU's bf16 instructions (AVX512-BF16, AMX) at up to twice its fp32 rate,
    while a bf16 result takes a path slower than fp32 (upcast operands). Accelerators accumulate bf16 in fp32
    inside their kernels anyway."""
    return jax.default_backend() == "cpu" and all(x.dtype == jnp.bfloat16 for x in operands)


def split_in_two(x, axis: int):
    """x with `axis` (of even length) split into two axes (2, n/2), to contract over both.

    A bf16 product that contracts the leading (row) axis of both operands (a weight gradient) or a stacked
    product of a matrix with its own transpose is one XLA:CPU's bf16 kernels do not take: XLA converts the
    operands and multiplies at the fp32 rate. Contracting over two axes instead, XLA first lays the operand out
    for the library's bf16 kernel (a transposing copy) and the product runs at the bf16 rate. The fused loss's
    lm_head gradient takes the same route in fp32 too (gpt._local_loss_and_grads)."""
    axis = axis % x.ndim
    return x.reshape(*x.shape[:axis], 2, x.shape[axis] // 2, *x.shape[axis + 1:])


def einsum(spec: str, a, b, out_dtype=None):
    """jnp.einsum(spec, a, b) for the model's and optimizer's products; out_dtype defaults to a's dtype.

    bf16 operands on a CPU (see widened_products) multiply into fp32 and round once to out_dtype, and so do
    both gradients (the cotangent is rounded to bf16 first, as in a bf16 backward pass): JAX's own transpose
    of such a product would multiply in fp32. Every other case is plain jnp.einsum. The result equals a bf16
    product's (one rounding of an fp32 accumulation) up to summation order."""
    out_dtype = jnp.dtype(out_dtype or a.dtype)
    if widened_products(a, b):
        return _widened_einsum(spec, out_dtype, a, b)
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _widened_einsum(spec, out_dtype, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32).astype(out_dtype)


def _widened_einsum_fwd(spec, out_dtype, a, b):
    return _widened_einsum(spec, out_dtype, a, b), (a, b)


def _widened_einsum_bwd(spec, out_dtype, res, g):
    a, b = res
    inputs, out = spec.replace(" ", "").split("->")
    sa, sb = inputs.split(",")
    g = g.astype(a.dtype)
    da = jnp.einsum(f"{out},{sb}->{sa}", g, b, preferred_element_type=jnp.float32).astype(a.dtype)
    db = jnp.einsum(f"{sa},{out}->{sb}", a, g, preferred_element_type=jnp.float32).astype(b.dtype)
    return da, db


_widened_einsum.defvjp(_widened_einsum_fwd, _widened_einsum_bwd)


PROGRESS_LOG_SECONDS = 30.0  # a progress line at most this often when output goes to a log ($FLAXCHAT_PROGRESS_SECONDS)


class _LogLines:
    """A file for tqdm that turns its in-place redraws ('\\r', cursor moves) into whole lines, blanks dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        for line in s.replace("\x1b[A", "\n").replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        getattr(self.stream, "flush", lambda: None)()


class _LogTqdm(tqdm.std.tqdm):
    """tqdm whose postfix and description changes wait for the next periodic line instead of forcing one."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s="", refresh=True):
        super().set_postfix_str(s, refresh=False)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)

    def set_description_str(self, desc=None, refresh=True):
        super().set_description_str(desc, refresh=False)


def progress_bar(iterable=None, **kwargs):
    """tqdm (its usual arguments) that suits both a terminal and a log file.

    On a terminal (or in a notebook) this is tqdm.auto's bar. When its output is not a terminal (CI, nohup, a
    redirect to a file) a redrawn bar would write hundreds of carriage-return updates into one log line, so it
    prints plain ASCII lines instead, each with the count, rate and ETA, at most one per PROGRESS_LOG_SECONDS
    (or $FLAXCHAT_PROGRESS_SECONDS), plus the first and the last.
    """
    stream = kwargs.get("file") or sys.stderr
    notebook = getattr(tqdm.auto, "notebook_tqdm", None) is not getattr(tqdm.auto, "std_tqdm", None)
    if notebook or getattr(stream, "isatty", lambda: False)():
        return tqdm.auto.tqdm(iterable, **kwargs)
    seconds = float(os.environ.get("FLAXCHAT_PROGRESS_SECONDS") or PROGRESS_LOG_SECONDS)
    # maxinterval too: tqdm's monitor thread would otherwise force a refresh every 10 s
    kwargs.update(file=_LogLines(stream), mininterval=seconds, maxinterval=seconds, ascii=True, dynamic_ncols=False)
    return _LogTqdm(iterable, **kwargs)


def is_out_of_memory(error: BaseException) -> bool:
    """Did an accelerator (XLA's RESOURCE_EXHAUSTED) or the host run out of memory?"""
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


class StepProfiler:
    """A jax.profiler trace of steps [start, stop) (`--profile-steps A:B`), written under `directory`.

    Open it in XProf / TensorBoard's profile plugin (`xprof --logdir DIR`, or `tensorboard --logdir DIR` with
    tensorboard-plugin-profile) or drop the perfetto_trace.json.gz file on https://ui.perfetto.dev. Each step
    is annotated (StepTraceAnnotation) so the tools show step boundaries and per-step time.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str):
        self.start, self.stop = steps or (-1, -1)
        self.directory, self.active, self.written = directory, False, False  # written: a trace was started

    @staticmethod
    def parse(spec: str) -> tuple[int, int]:
        """'A:B' -> (A, B): the steps A, A+1, ..., B-1 (the --profile-steps flag's type)."""
        try:
            a, b = (int(x) for x in spec.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes START:STOP (e.g. 5:8), got {spec!r}") from None
        if not 0 <= a < b:
            raise argparse.ArgumentTypeError(f"{spec}: need 0 <= START < STOP")
        return a, b

    @staticmethod
    def prepare(steps) -> bool:
        """Call with --profile-steps before JAX starts its backend (XLA reads XLA_FLAGS then).

        XLA on a GPU launches a step's kernels in batches, as CUDA graphs (command buffers), and a trace shows each
        batch as one op (command_buffer_N) whose kernels are hidden. With steps to profile this turns command
        buffers off for the process (trace.COMMAND_BUFFERS_OFF; no effect on a CPU or TPU), unless XLA_FLAGS sets
        that flag already, so every kernel shows; the steps then run a little slower (d12 on one H200: 136.5
        instead of 132.1 ms a step). Returns whether XLA_FLAGS changed."""
        from flaxchat.perf.trace import COMMAND_BUFFERS_OFF

        flags = os.environ.get("XLA_FLAGS", "")
        if not steps or COMMAND_BUFFERS_OFF.rstrip("=") in flags:
            return False
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFERS_OFF}".strip()
        return True

    @staticmethod
    def add_flag(parser, where: str) -> None:
        """--profile-steps START:STOP on a script's parser; `where` says where the trace goes."""
        parser.add_argument("--profile-steps", type=StepProfiler.parse, default=None,
                            help=f"write a jax.profiler trace of steps START:STOP (e.g. 5:8; step 0 compiles) to "
                                 f"{where}. On a GPU the run turns XLA's command buffers off, so each kernel shows "
                                 "in the trace")

    def covers(self, i: int) -> bool:
        """Whether step i is one of the profiled steps."""
        return self.start <= i < self.stop

    def step(self, i: int):
        """Call before running step i; returns the context manager that annotates it."""
        if i == self.start and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = self.written = True
        elif i == self.stop and self.active:
            self.close()
        return jax.profiler.StepTraceAnnotation("step", step_num=i) if self.active else contextlib.nullcontext()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            print0(f"profile of steps {self.start}..{self.stop - 1} written to {self.directory}", file=sys.stderr)


# Dense bf16 peak FLOP/s per device (datasheets, no sparsity). MFU on CPU uses a measured matmul peak instead.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "B200": 2250e12, "A100": 312e12, "A10": 125e12,
    "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12, "RTX 3090": 71e12,
    "TPU v6": 918e12, "TPU v5p": 459e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v3": 123e12,
}


def measured_matmul_peak(n: int = 2048, dtype=jnp.float32, repeats: int = 5, out_dtype=None) -> float:
    """FLOP/s of the best of `repeats` n^3 matmuls on the default device (compile excluded); out_dtype: the
    product's result type (default dtype)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)  # random data: zeros can time differently
    f = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=out_dtype))
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def peak_flops_per_device(dtype=None) -> tuple[float, str]:
    """(peak FLOP/s, where the number came from) for this process's first device. dtype: the compute dtype; on a
    CPU the peak is measured for its products (bf16: bf16 operands, fp32 results, as the model multiplies)."""
    kind = jax.devices()[0].device_kind
    if jax.default_backend() == "cpu":
        if dtype is not None and jnp.dtype(dtype) == jnp.bfloat16:
            return measured_matmul_peak(2048, jnp.bfloat16, out_dtype=jnp.float32), \
                "measured bf16 -> fp32 matmul (2048^3) on this CPU"
        return measured_matmul_peak(), "measured fp32 matmul (2048^3) on this CPU"
    for name, flops in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return flops, f"datasheet bf16 for {kind}"
    return measured_matmul_peak(4096, jnp.bfloat16), f"measured bf16 matmul (4096^3) on {kind}"


# glibc (Linux) serves a large allocation (over 32 MB at most, and any a thread's arena cannot hold) with freshly
# mapped memory and unmaps it when it is freed, and XLA:CPU allocates each call's temporaries anew from its worker
# threads: a training step of the laptop demo's model maps ~700 MB and takes ~195k page faults to touch it, every
# step. This glibc tunable (2.35+; ignored by older ones and elsewhere) maps such memory in 2 MB pages instead.
# It is read when a process starts, so it goes into the environment of the processes we start: pixi sets it for
# every task, the laptop demo for its stages, the tests for their workers.
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def _hugetlb(env) -> str | None:
    """The glibc.malloc.hugetlb value GLIBC_TUNABLES (colon-separated name=value pairs) in `env` sets, or None."""
    for tunable in env.get("GLIBC_TUNABLES", "").split(":"):
        name, _, value = tunable.partition("=")
        if name == "glibc.malloc.hugetlb":
            return value
    return None


def with_huge_pages(env) -> dict:
    """A copy of `env` whose GLIBC_TUNABLES asks glibc for huge pages (a hugetlb value already there is kept)."""
    if _hugetlb(env) is not None:
        return dict(env)
    tunables = env.get("GLIBC_TUNABLES", "")
    return {**env, "GLIBC_TUNABLES": ":".join(t for t in (tunables, HUGE_PAGES_TUNABLE) if t)}


def without_huge_pages(env) -> dict:
    """A copy of `env` whose GLIBC_TUNABLES no longer asks for huge pages (other tunables kept): how a program
    that is not flaxchat's runs by default."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":")
                if t and t.partition("=")[0] != "glibc.malloc.hugetlb"]
    out = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    return {**out, "GLIBC_TUNABLES": ":".join(tunables)} if tunables else out


def cpu_bf16_instructions(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX flags in /proc/cpuinfo, or `cpuinfo`'s
    text): there `--dtype bfloat16` trains ~1.4x faster than fp32 (README, "bf16 on a CPU")."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return bool({"avx512_bf16", "amx_bf16"} & set(value.split()))
    return False


def huge_pages_active() -> bool:
    """Whether the environment asks glibc for huge pages (glibc reads it as a process starts: setting it later
    changes only the processes this one starts)."""
    return sys.platform.startswith("linux") and _hugetlb(os.environ) in ("1", "2")


MALLOC_LIBRARIES = ("tcmalloc", "jemalloc", "mimalloc")


def malloc_library(maps: str | None = None) -> str:
    """The malloc this process runs on: a replacement loaded into it (LD_PRELOAD of tcmalloc, jemalloc or mimalloc),
    else "system". Benchmarks record it beside huge_pages: on Linux either moves a CPU step by a few percent.
    maps: the text of /proc/self/maps (read here when None; "system" where there is none)."""
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return "system"
    libraries = {os.path.basename(line.split()[-1]) for line in maps.splitlines() if "/" in line}
    for name in MALLOC_LIBRARIES:
        if any(lib.startswith(("lib" + name, name)) for lib in libraries):
            return name
    return "system"


class MachineLoad:
    """How busy the whole machine was over a stretch of time, for benchmarks on shared machines (Linux; elsewhere
    every figure is None): the 1-minute load average at the start, and over the stretch the share of CPU time the
    hypervisor gave to other guests (steal: a VM whose host is busy runs slower whatever it runs) and the share
    this machine's CPUs spent working (user, system and interrupts). A quiet run shows a start load near 0-1
    (the tail of the previous run) and steal near 0.

        load = MachineLoad(); ...timed work...; load.stop()  # {"load_avg_1m", "steal_pct", "busy_pct"}
    """

    NOISY_STEAL_PCT = 5.0  # above this share of CPU time stolen by other guests, a stretch's timings do not compare

    def __init__(self):
        self.load_avg_1m = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
        self.start = self.cpu_times()

    @staticmethod
    def cpu_times(stat: str | None = None) -> list[int] | None:
        """The aggregate `cpu` line of /proc/stat (or of `stat`'s text): user nice system idle iowait irq softirq
        steal ... in clock ticks; None where there is none."""
        if stat is None:
            try:
                with open("/proc/stat") as f:
                    stat = f.read()
            except OSError:
                return None
        for line in stat.splitlines():
            if line.startswith("cpu "):
                return [int(x) for x in line.split()[1:]]
        return None

    @classmethod
    def noisy(cls, record: dict | None) -> bool:
        """Whether a stop() record's stretch ran while the VM's host was busy with other guests (steal above
        NOISY_STEAL_PCT): on the 2-core VMs this project measures on, such a round ran up to a third slower."""
        return bool(record) and (record.get("steal_pct") or 0.0) > cls.NOISY_STEAL_PCT

    def stop(self, end: list[int] | None = None) -> dict:
        end = self.cpu_times() if end is None else end
        out = {"load_avg_1m": self.load_avg_1m, "steal_pct": None, "busy_pct": None}
        if self.start is not None and end is not None:
            delta = [b - a for a, b in zip(self.start, end)]
            total = sum(delta[:8])  # guest time is already counted in user time
            if total > 0:
                out["steal_pct"] = 100 * delta[7] / total if len(delta) > 7 else 0.0
                out["busy_pct"] = 100 * sum(delta[i] for i in (0, 1, 2, 5, 6)) / total
        return out


def parse_args(parser, argv=None):
    """argparse with an optional `--config configs/X.yaml` whose keys become the flags' defaults.

    YAML keys may be written as flags are (kebab-case) or as attributes (snake_case); explicit flags win.
    """
    import argparse

    import yaml

    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", type=str, default=None, help="YAML file of flag defaults (flags override it)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        if not os.path.exists(known.config):
            parser.error(f"--config file not found: {known.config}")
        try:
            with open(known.config, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            parser.error(f"--config {known.config} is not valid YAML: {str(e).splitlines()[0]}")
        if not isinstance(values, dict):
            parser.error(f"--config {known.config} must be a mapping of flag: value")
        dests = {a.dest for a in parser._actions}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - dests)
        if unknown:
            parser.error(f"--config {known.config} has unknown keys: {', '.join(unknown)}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def quiet_library_logs() -> None:
    """Scripts call this: Orbax and JAX log every checkpoint step and backend probe at INFO through absl."""
    import logging

    import absl.logging

    absl.logging.set_verbosity(absl.logging.WARNING)
    for name in ("jax._src.xla_bridge", "orbax", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
