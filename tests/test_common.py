"""flaxchat/common.py: progress bars that suit logs, out-of-memory detection, the base dir (and the demo's)."""

import io
import os
import sys

import jax
import pytest

from flaxchat import common


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_in_a_log_is_whole_lines(monkeypatch):
    """Not a terminal: plain newline-terminated lines (no carriage returns), at most one per interval."""
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)  # the default file, as when stderr goes to a file or a pipe
    bar = common.progress_bar(total=20_000, desc="pretrain", dynamic_ncols=True)
    for i in range(20_000):
        bar.update(1)
        bar.set_postfix_str(f"loss {i}")  # forces a redraw on a terminal; waits for the next line in a log
        if i % 5_000 == 0:
            bar.write(f"step {i}: a message")
    bar.close()
    for _ in common.progress_bar(range(50_000), desc="val bpb", leave=False):
        pass
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    lines = [line for line in text.splitlines() if not line.startswith("step ")]
    # the first and the last line of each bar (a fast loop never waits the 30 s between lines)
    assert len(lines) <= 4, lines
    assert lines[0].startswith("pretrain:   0%") and "20000/20000" in lines[1] and "loss 19999" in lines[1]
    assert all(ord(c) < 128 for c in text)


def test_progress_interval_comes_from_the_environment(monkeypatch):
    log = io.StringIO()
    monkeypatch.setenv("FLAXCHAT_PROGRESS_SECONDS", "0")
    for _ in common.progress_bar(range(5), desc="every step", file=log, miniters=1):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [f"{i}/5" in line for i, line in enumerate(lines[:6])] == [True] * 6  # a line per step
    assert "it/s" in lines[-1] and "5/5" in lines[-1]  # then the closing line (overall rate)


def test_progress_on_a_terminal_is_tqdms_bar():
    tty = Terminal()
    for _ in common.progress_bar(range(3), desc="bar", file=tty):
        pass
    assert "\r" in tty.getvalue()  # redrawn in place, as tqdm does


def test_out_of_memory_is_recognised():
    assert common.is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while allocating"))
    assert common.is_out_of_memory(MemoryError())
    assert common.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not common.is_out_of_memory(RuntimeError("shapes do not match"))
    assert not common.is_out_of_memory(FileNotFoundError("no such pack"))


def test_base_dir_follows_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "mine"))
    assert common.get_base_dir(create=False) == str(tmp_path / "mine") and not (tmp_path / "mine").exists()
    assert common.get_base_dir() == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    monkeypatch.delenv("FLAXCHAT_BASE_DIR")
    assert common.get_base_dir(create=False) == os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")


def test_demo_writes_under_the_base_dir(tmp_path, monkeypatch, capsys):
    """The laptop demo's default folder is tinystories/ inside $FLAXCHAT_BASE_DIR (so it never replaces that
    base dir's own tokenizer or data), and its --help says so."""
    from scripts import run_tinystories

    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "mine"))
    args = run_tinystories.build_parser().parse_args([])
    assert args.base_dir == str(tmp_path / "mine" / "tinystories")
    assert run_tinystories.build_parser().parse_args(["--base-dir", "/elsewhere"]).base_dir == "/elsewhere"
    with pytest.raises(SystemExit):
        run_tinystories.build_parser().parse_args(["--help"])
    assert "$FLAXCHAT_BASE_DIR" in capsys.readouterr().out
    monkeypatch.delenv("FLAXCHAT_BASE_DIR")
    default = run_tinystories.build_parser().parse_args([]).base_dir
    assert default == os.path.join(os.path.expanduser("~"), ".cache", "flaxchat", "tinystories")
    assert not (tmp_path / "mine").exists(), "building the parser creates nothing"
    demo = run_tinystories.Demo(run_tinystories.build_parser().parse_args(["--base-dir", str(tmp_path / "d")]))
    assert demo.env["FLAXCHAT_BASE_DIR"] == str(tmp_path / "d")
    assert common.HUGE_PAGES_TUNABLE in demo.env["GLIBC_TUNABLES"].split(":")  # its stages start with huge pages


def test_malloc_library_names_a_preloaded_replacement():
    line = "7f00-7f10 r-xp 00000000 08:01 42   {}"
    maps = "\n".join(line.format(p) for p in ("/usr/lib/x86_64-linux-gnu/libc.so.6", "[heap]", "/usr/bin/python3.11"))
    assert common.malloc_library(maps) == "system"
    preloaded = maps + "\n" + line.format("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10")
    assert common.malloc_library(preloaded) == "tcmalloc"
    conda = maps + "\n" + line.format("/opt/env/lib/libjemalloc.so.2")
    assert common.malloc_library(conda) == "jemalloc"
    assert common.malloc_library("") == "system"


def test_malloc_library_sees_ld_preload():
    """A real preload, read back from /proc/self/maps by a fresh interpreter."""
    import ctypes.util
    import subprocess

    found = sys.platform.startswith("linux") and ctypes.util.find_library("tcmalloc_minimal")
    if not found:
        pytest.skip("no tcmalloc to preload here (Debian/Ubuntu: apt install libtcmalloc-minimal4)")
    probe = [sys.executable, "-c", "from flaxchat.common import malloc_library; print(malloc_library())"]
    plain = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for env, expected in ((plain, "system"), ({**plain, "LD_PRELOAD": found}, "tcmalloc")):
        assert subprocess.run(probe, env=env, capture_output=True, text=True, check=True).stdout.strip() == expected


def test_huge_pages_join_other_glibc_tunables():
    env = common.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PATH": "/bin"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:" + common.HUGE_PAGES_TUNABLE, "PATH": "/bin"}
    assert common.with_huge_pages({})["GLIBC_TUNABLES"] == common.HUGE_PAGES_TUNABLE
    chosen = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}  # someone turned them off: their choice stands
    assert common.with_huge_pages(chosen) == chosen and common.with_huge_pages(chosen) is not chosen

    assert common.without_huge_pages(common.with_huge_pages({"PATH": "/bin"})) == {"PATH": "/bin"}
    mixed = common.with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert common.without_huge_pages(mixed)["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


_STAT = "cpu  {} 0 {} {} 0 0 0 {} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 42\n"


def test_machine_load_reads_steal_and_busy_shares_from_proc_stat():
    load = common.MachineLoad()
    load.start = common.MachineLoad.cpu_times(_STAT.format(1000, 100, 5000, 0))
    assert load.start == [1000, 0, 100, 5000, 0, 0, 0, 0, 0, 0]
    # 300 ticks of user, 100 of system, 500 idle and 100 stolen by other guests on the host
    out = load.stop(common.MachineLoad.cpu_times(_STAT.format(1300, 200, 5500, 100)))
    assert out["steal_pct"] == pytest.approx(10.0) and out["busy_pct"] == pytest.approx(40.0)
    assert common.MachineLoad.noisy(out)  # over 5% stolen: timings from that stretch do not compare
    assert not common.MachineLoad.noisy({**out, "steal_pct": 4.9}) and not common.MachineLoad.noisy(None)
    assert common.MachineLoad.cpu_times("no cpu line here") is None
    load.start = None  # no /proc/stat (macOS): the shares are unknown, not zero
    assert load.stop()["steal_pct"] is None and load.stop()["busy_pct"] is None
    assert not common.MachineLoad.noisy(load.stop())  # unknown is not noisy
    if sys.platform.startswith("linux"):
        assert isinstance(common.MachineLoad().load_avg_1m, float) and common.MachineLoad.cpu_times() is not None


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


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages (not Linux)")
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
    for name, value in (("4 KB pages", "glibc.malloc.hugetlb=0"), ("huge pages", common.HUGE_PAGES_TUNABLE)):
        env = {**os.environ, "GLIBC_TUNABLES": value}
        faults[name] = int(subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True,
                                          check=True).stdout)
    assert faults["4 KB pages"] > 2 * (256 << 20) // 4096 * 0.9, faults  # every 4 KB page, each time
    assert faults["huge pages"] < faults["4 KB pages"] / 20, faults


def test_bf16_einsum_rounds_one_fp32_sum_and_its_gradients_multiply_bf16():
    """common.einsum: bf16 operands on a CPU give the fp32 sum of their products rounded once to bf16, both
    gradients the same of a bf16 cotangent, and the compiled gradient multiplies bf16 only (JAX's own transpose
    of an fp32-result product would multiply in fp32). fp32 operands are plain jnp.einsum."""
    import jax.numpy as jnp
    import numpy as np

    from flaxchat.perf.hlo import dot_types

    bf, f32 = jnp.bfloat16, jnp.float32
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((2, 48, 64)), bf)
    b = jnp.asarray(rng.standard_normal((96, 64)), bf)
    c = jnp.asarray(rng.standard_normal((2, 48, 96)), bf)  # the cotangent, exactly bf16
    exact = lambda spec, x, y: np.einsum(spec, np.asarray(x, np.float64), np.asarray(y, np.float64))
    to_bf16 = lambda x: np.asarray(jnp.asarray(x, f32).astype(bf), np.float32)

    spec = "...i,oi->...o"
    y = common.einsum(spec, a, b)
    assert y.dtype == bf
    close = lambda x, want: np.testing.assert_allclose(np.asarray(x, np.float32), to_bf16(want), rtol=2**-7, atol=1e-6)
    close(y, exact("bti,oi->bto", a, b))  # within one bf16 step of the exact sum (summation order)
    assert common.einsum(spec, a, b, f32).dtype == f32

    loss = lambda a, b: jnp.sum(common.einsum(spec, a, b).astype(f32) * c.astype(f32))
    da, db = jax.grad(loss, argnums=(0, 1))(a, b)
    assert da.dtype == db.dtype == bf
    close(da, exact("bto,oi->bti", c, b))
    close(db, exact("bti,bto->oi", a, c))
    program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(a, b).compile().as_text()
    assert {(lhs, rhs) for lhs, rhs, _ in dot_types(program)} == {("bf16", "bf16")}

    a32, b32 = a.astype(f32), b.astype(f32)
    np.testing.assert_array_equal(common.einsum(spec, a32, b32), jnp.einsum(spec, a32, b32))


def test_split_in_two_halves_an_axis():
    import jax.numpy as jnp

    x = jnp.arange(2 * 6 * 3).reshape(2, 6, 3)
    assert common.split_in_two(x, 1).shape == (2, 2, 3, 3) and common.split_in_two(x, -3).shape == (2, 1, 6, 3)
    assert (common.split_in_two(x, 1)[:, 1] == x[:, 3:]).all()


def test_activation_dtype_widens_bfloat16_on_a_cpu_only():
    import jax.numpy as jnp

    assert common.activation_dtype(jnp.bfloat16, "cpu") == jnp.float32
    assert common.activation_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert common.activation_dtype(jnp.bfloat16, "tpu") == jnp.bfloat16
    for dtype in (jnp.float32, jnp.float16):
        assert common.activation_dtype(dtype, "cpu") == dtype
    assert common.activation_dtype(jnp.bfloat16) == (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def test_a_cpu_peak_is_measured_for_the_compute_dtypes_products():
    """MFU of a bf16 CPU run is against the rate of its products (bf16 operands, fp32 results), not fp32's."""
    import jax.numpy as jnp

    assert common.measured_matmul_peak(128, jnp.bfloat16, repeats=2, out_dtype=jnp.float32) > 0
    if jax.default_backend() != "cpu":
        pytest.skip("CPU only")
    for dtype, words in ((None, "fp32"), (jnp.float32, "fp32"), (jnp.bfloat16, "bf16 -> fp32")):
        peak, source = common.peak_flops_per_device(dtype)
        assert peak > 0 and source.startswith(f"measured {words} matmul")


def test_cpu_bf16_instructions_reads_the_cpu_flags():
    zen5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    sapphire = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n"
    zen3 = "flags\t\t: fpu sse avx2 fma\nbugs\t\t: avx512_bf16_is_not_a_flag_here\n"
    assert common.cpu_bf16_instructions(zen5) and common.cpu_bf16_instructions(sapphire)
    assert not common.cpu_bf16_instructions(zen3) and not common.cpu_bf16_instructions("")
    assert isinstance(common.cpu_bf16_instructions(), bool)  # this machine's /proc/cpuinfo, or False without one
