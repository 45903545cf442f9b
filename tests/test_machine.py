"""flaxchat/perf/machine.py: huge pages, the malloc in use, how busy the machine was, peak FLOP/s, CPU flags."""

import os
import sys

import jax
import pytest

from flaxchat.perf import machine


def test_malloc_library_names_a_preloaded_replacement():
    line = "7f00-7f10 r-xp 00000000 08:01 42   {}"
    maps = "\n".join(line.format(p) for p in ("/usr/lib/x86_64-linux-gnu/libc.so.6", "[heap]", "/usr/bin/python3.11"))
    assert machine.malloc_library(maps) == "system"
    preloaded = maps + "\n" + line.format("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")
    assert machine.malloc_library(preloaded) == "tcmalloc"
    conda = maps + "\n" + line.format("/opt/env/lib/libjemalloc.so.2")
    assert machine.malloc_library(conda) == "jemalloc"
    assert machine.malloc_library("") == "system"


def test_malloc_library_sees_ld_preload():
    """A real preload, read back from /proc/self/maps by a fresh interpreter."""
    import ctypes.util
    import subprocess

    found = sys.platform.startswith("linux") and ctypes.util.find_library("tcmalloc_minimal")
    if not found:
        pytest.skip("no tcmalloc to preload here (Debian/Ubuntu: apt install libtcmalloc-minimal4)")
    probe = [sys.executable, "-c", "from flaxchat.perf.machine import malloc_library; print(malloc_library())"]
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for env, expected in ((plain, "system"), ({**plain, "LD_PRELOAD": found}, "tcmalloc")):
        assert subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip() == expected


def test_huge_pages_join_other_glibc_tunables():
    env = machine.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:" + machine.HUGE_PAGES_TUNABLE, "PATH": "/bin"}
    assert machine.with_huge_pages({})["GLIBC_TUNABLES"] == machine.HUGE_PAGES_TUNABLE
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # someone turned them off: their choice stands
    assert machine.with_huge_pages(chosen) == chosen and machine.with_huge_pages(chosen) is not chosen

    assert machine.without_huge_pages(machine.with_huge_pages({"PATH": "/bin"})) == {"PATH": "/bin"}
    mixed = machine.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert machine.without_huge_pages(mixed)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


_STAT = "cpu  {} 0 {} {} 0 0 0 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 42\n"


def test_machine_load_reads_steal_and_busy_shares_from_proc_stat():
    load = machine.MachineLoad()
    load.start = machine.MachineLoad.cpu_times(_STAT.format(1000, 100, 5000, 0))
    assert load.start == [1000, 0, 100, 5000, 0, 0, 0, 0, 0, 0]
    # 300 ticks of user, 100 of system, 500 idle and 100 stolen by other guests on the host
    out = load.stop(machine.MachineLoad.cpu_times(_STAT.format(1300, 200, 5500, 100)))
    assert out["steal_pct"] == pytest.approx(10.0) and out["busy_pct"] == pytest.approx(40.0)
    assert machine.MachineLoad.noisy(out)  # over 5% stolen: timings from that stretch do not compare
    assert not machine.MachineLoad.noisy({**out, "steal_pct": 4.9}) and not machine.MachineLoad.noisy(None)
    assert machine.MachineLoad.cpu_times("no cpu line here") is None
    load.start = None  # no /proc/stat (macOS): the shares are unknown, not zero
    assert load.stop()["steal_pct"] is None and load.stop()["busy_pct"] is None
    assert not machine.MachineLoad.noisy(load.stop())  # unknown is not noisy
    if sys.platform.startswith("linux"):
        assert isinstance(machine.MachineLoad().load_avg_1m, float) and machine.MachineLoad.cpu_times() is not None


_FAULTS = """
import ctypes, threading
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def stat():
    return int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[7])
def work(out):  # a worker thread, as XLA's are: 256 MB from malloc, written and freed, twice (numpy would madvise)
    before = stat()
    for _ in range(2):
        p = libc.malloc(256 << 20); ctypes.memset(p, 1, 256 << 20); libc.free(p)
    out.append(stat() - before)
out = []
t = threading.Thread(target=work, args=(out,)); t.start(); t.join()
print(out[0])
"""


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="no transparent huge pages (not Linux)"
)
def test_huge_pages_take_large_allocations_without_a_fault_per_4kb():
    """What the tunable is for: a thread's large allocation, freed and made again, faults once per 2 MB page
    instead of once per 4 KB (the test workers run with it: conftest puts it into their environment)."""
    import subprocess
    import sys

    if "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read():
        pytest.skip("transparent huge pages are turned off on this machine")
    if tuple(map(int, os.confstr("CS_GNU_LIBC_VERSION").split()[1].split(".")[:2])) < (2, 35):
        pytest.skip("glibc older than 2.35 has no hugetlb tunable")
    faults = {}
    for name, value in (("4 KB pages", "glibc.malloc.hugetlb=0"), ("huge pages", machine.HUGE_PAGES_TUNABLE)):
        env = {**os.environ, "GLIBC_TUNABLES": value}
        faults[name] = int(
            subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, check=True).stdout
        )
    assert faults["4 KB pages"] > 2 * (256 << 20) // 4096 * 0.9, faults  # every 4 KB page, each time
    assert faults["huge pages"] < faults["4 KB pages"] / 20, faults


def test_a_cpu_peak_is_measured_for_the_compute_dtypes_products():
    """MFU of a bf16 CPU run is against the rate of its products (bf16 operands, fp32 results), not fp32's."""
    import jax.numpy as jnp

    assert machine.measured_matmul_peak(128, jnp.bfloat16, repeats=2, out_dtype=jnp.float32) > 0
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    for dtype, words in ((None, "fp32"), (jnp.float32, "fp32"), (jnp.bfloat16, "bf16 -> fp32")):
        peak, source = machine.peak_flops_per_device(dtype)
        assert peak > 0 and source.startswith(f"measured {words} matmul")


def test_cpu_bf16_instructions_reads_the_cpu_flags():
    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
    zen3 = "flags\t\t: fpu sse avx2 fma\nbugs\t\t: avx512_bf16_is_not_a_flag_here\n"
    assert machine.cpu_bf16_instructions(zen5) and machine.cpu_bf16_instructions(sapphire)
    assert not machine.cpu_bf16_instructions(zen3) and not machine.cpu_bf16_instructions("")
    assert isinstance(machine.cpu_bf16_instructions(), bool)  # this machine's /proc/cpuinfo, or False without one
