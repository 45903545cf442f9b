"""Facts about the machine a measurement runs on: peak FLOP/s, huge pages, the malloc in use, how busy it was."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time

import jax
import jax.numpy as jnp

from flaxchat.common import compute_dtype

# Dense bf16 peak FLOP/s per device (datasheets, no sparsity). MFU on CPU uses a measured matmul peak instead.
PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A10": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "TPU v6": 918e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v4": 275e12,
    "TPU v3": 123e12,
}


def peak_memory_gb() -> float:
    """The most memory this process's first device held so far (GiB); on a CPU, the process's peak resident set."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"] / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


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
            return measured_matmul_peak(
                2048, jnp.bfloat16, out_dtype=jnp.float32
            ), "measured bf16 -> fp32 matmul (2048^3) on this CPU"
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
    tunables = [
        t for t in env.get("GLIBC_TUNABLES", "").split(":") if t and t.partition("=")[0] != "glibc.malloc.hugetlb"
    ]
    out = {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"}
    return {**out, "GLIBC_TUNABLES": ":".join(tunables)} if tunables else out


def cpu_bf16_instructions(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX flags in /proc/cpuinfo, or `cpuinfo`'s
    text): there `--dtype bfloat16` trains faster than fp32 (docs/cpu-speed.md, "bf16 on a CPU")."""
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


def speed_tips(dtype) -> list[str]:
    """What would make training faster on this CPU and is not on (a training script prints them): glibc's huge
    pages where they are off, bf16 where the CPU multiplies it in hardware and the run computes in fp32."""
    tips = []
    if jax.default_backend() == "cpu" and sys.platform.startswith("linux") and not huge_pages_active():
        tips.append(
            f"tip: GLIBC_TUNABLES={HUGE_PAGES_TUNABLE} in the environment makes CPU steps faster (pixi tasks and "
            "the laptop demo set it; docs/cpu-speed.md)"
        )
    if jax.default_backend() == "cpu" and jnp.dtype(dtype) == jnp.float32 and cpu_bf16_instructions():
        tips.append(
            "tip: this CPU multiplies bf16 in hardware: --dtype bfloat16 (or FLAXCHAT_DTYPE=bfloat16) trains "
            "faster than fp32 here (bf16 products, fp32 activations; docs/cpu-speed.md, 'bf16 on a CPU')"
        )
    return tips


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


def environment(dtype, mesh) -> dict:
    """What a benchmark's record says about where it ran: devices, mesh, the compute dtype (--dtype, or
    common.compute_dtype's choice), versions, huge pages, the malloc in use and XLA_FLAGS as the backend read them
    (sharding.native_gpu_atomics)."""
    return {
        "device": jax.devices()[0].device_kind,
        "backend": jax.default_backend(),
        "num_devices": jax.device_count(),
        "mesh": dict(mesh.shape),
        "dtype": jnp.dtype(compute_dtype(dtype)).name,
        "jax": jax.__version__,
        "python": platform.python_version(),
        "huge_pages": huge_pages_active(),
        "allocator": malloc_library(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
    }


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
