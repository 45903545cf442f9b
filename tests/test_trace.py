"""flaxchat.perf.trace and hlo.op_kinds: a profiler trace summed by op and kind of work, per profiled step."""

import gzip
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest

from flaxchat.perf.hlo import op_kinds, op_sources
from flaxchat.perf.trace import (
    KINDS,
    covered_share,
    format_summary,
    idle_ms,
    kind_of_name,
    main,
    side_by_side_share,
    summarize_ops,
    summarize_trace,
)


def write_trace(path, events, processes, threads):
    meta = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}} for pid, name in processes.items()]
    meta += [
        {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
        for (pid, tid), name in threads.items()
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"displayTimeUnit": "ns", "traceEvents": meta + events}, f)
    return str(path)


def op(pid, tid, ts, dur, name, hlo_op=None, module="jit_train_step"):
    args = {"hlo_op": hlo_op, "hlo_module": module} if hlo_op else {}
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def step(ts, dur, n):
    return {"ph": "X", "pid": 1, "tid": 1, "ts": ts, "dur": dur, "name": "step", "args": {"step_num": str(n)}}


def test_a_gpu_trace_counts_kernels_on_the_device_by_op_and_step(tmp_path):
    """Two steps of 10 ms: kernels on the GPU stream count (named by their HLO op, kinds from the program), the
    host's events and other modules' kernels do not."""
    events = [step(0, 10_000, 5), step(10_000, 10_000, 6)]
    for s in (0, 10_000):
        events += [
            op(2, 7, s + 100, 4000, "nvjet_tst_128x256_h_bz", "custom-call.3"),
            op(2, 7, s + 4200, 2000, "cudnn_generated_fort_native_sdpa_sm90", "custom-call.9"),
            op(2, 7, s + 6300, 1000, "loop_multiply_fusion", "multiply_fusion.2"),
            op(2, 7, s + 7400, 500, "input_reduce_fusion", "reduce_fusion"),
            op(2, 7, s + 8000, 900, "other module's kernel", "fusion.1", module="jit_generate"),
            op(1, 1, s + 50, 9000, "PjitFunction(train_step)"),
        ]  # host side: not device time
    path = write_trace(
        tmp_path / "perfetto_trace.json.gz",
        events,
        {1: "/host:CPU", 2: "/device:GPU:0"},
        {(1, 1): "python", (2, 7): "Stream #13(Compute)"},
    )
    kinds = {
        "custom-call.3": "matmul",
        "custom-call.9": "attention",
        "multiply_fusion.2": "elementwise",
        "reduce_fusion": "reduction",
    }
    s = summarize_trace(path, kinds=kinds, module="train_step")
    assert s["device"] == "accelerator" and s["steps"] == 2 and s["step_ms"] == pytest.approx(10.0)
    assert s["op_ms_per_step"] == pytest.approx(7.5)
    assert {k: v["ms"] for k, v in s["by_kind"].items()} == pytest.approx(
        {"matmul": 4.0, "attention": 2.0, "elementwise": 1.0, "reduction": 0.5}
    )
    assert [t["op"] for t in s["top"]] == ["custom-call.3", "custom-call.9", "multiply_fusion.2", "reduce_fusion"]
    assert s["top"][0]["calls"] == 1 and s["top"][0]["share"] == pytest.approx(53.3)
    # without the program, the kernel names decide
    by_name = summarize_trace(str(tmp_path), module="train_step")
    assert by_name["by_kind"]["matmul"]["ms"] == pytest.approx(4.0)
    assert by_name["by_kind"]["attention"]["ms"] == pytest.approx(2.0)
    # the GPU's idle 2.5 ms a step: 0.1 before the first kernel, three gaps of 0.1, 2.1 after the last counted one
    assert s["idle"] == pytest.approx({"before_first_op": 0.1, "between_ops": 0.3, "after_last_op": 2.1})
    text = format_summary(s, "flaxchat: ")
    assert "idle a step: 0.1 ms before the first op, 0.3 ms between ops, 2.1 ms after the last" in text
    assert s["busy"] == pytest.approx(0.75)
    assert text.startswith("flaxchat: 10.0 ms a step, 7.5 ms of ops a step over 2 step(s) (busy 75% of the step)")
    assert "custom-call.3" in text and "matmul 4.0 ms (53.3%)" in text


def test_a_cpu_trace_takes_nested_ops_self_time_on_each_thread(tmp_path):
    """XLA:CPU runs a loop's body inside the loop's own thunk: the loop keeps only its own time; each thread's ops
    add up (two busy threads make twice the step's time)."""
    events = [step(0, 1000, 1)]
    for tid in (11, 12):
        events += [
            op(1, tid, 0, 900, "while.5", "while.5"),
            op(1, tid, 100, 500, "ynn_fusion.3", "ynn_fusion.3"),
            op(1, tid, 650, 200, "copy.1", "copy.1"),
            op(1, tid, 700, 50, "bitcast.2", "bitcast.2"),
            op(1, tid, 0, 1000, "ThunkExecutor::Execute"),
        ]  # no op name: bookkeeping, not counted
    path = write_trace(
        tmp_path / "perfetto_trace.json.gz",
        events,
        {1: "/host:CPU"},
        {(1, 1): "python", (1, 11): "tf_XLAEigen/1", (1, 12): "tf_XLAEigen/2"},
    )
    s = summarize_trace(
        path, kinds={"while.5": "control", "ynn_fusion.3": "matmul", "copy.1": "layout", "bitcast.2": "layout"}
    )
    assert s["device"] == "cpu" and s["steps"] == 1
    ms = {t["op"]: t["ms"] for t in s["top"]}
    assert ms == pytest.approx({"ynn_fusion.3": 1.0, "while.5": 0.4, "copy.1": 0.3, "bitcast.2": 0.1})
    assert s["by_kind"]["layout"]["ms"] == pytest.approx(0.4) and s["op_ms_per_step"] == pytest.approx(1.8)
    assert s["busy"] == pytest.approx(0.9)  # some op ran from 0 to 900 of the 1000 µs (the executor's own event
    assert s["side_by_side"] == pytest.approx(0.9)  # names no op and does not count), on both threads
    assert "(busy 90% of the step, ops on two or more threads at once 90%)" in format_summary(s)


def test_covered_share_counts_overlapping_and_nested_events_once_within_the_windows():
    ev = lambda a, b: {"ts": a, "dur": b - a}
    events = [ev(10, 50), ev(30, 70), ev(40, 45), ev(90, 210), ev(250, 260), ev(400, 500)]
    # window 1: 10-70 and 90-100; window 2: 200-210 and 250-260; the last event falls outside both
    assert covered_share(events, [(0, 100), (200, 300)]) == pytest.approx(90 / 200)
    assert covered_share(events, []) is None


def test_side_by_side_share_counts_time_with_ops_on_two_threads_at_once():
    ev = lambda tid, a, b: {"pid": 1, "tid": tid, "ts": a, "dur": b - a}
    # thread 1: 0-60 with a nested op (one thread, however deep); thread 2: 40-80 and 100-150; thread 3: 140-160
    events = [ev(1, 0, 60), ev(1, 10, 50), ev(2, 40, 80), ev(2, 100, 150), ev(3, 140, 160), ev(1, 150, 170)]
    # two or more threads: 40-60, 140-160 (150-160 has three), 150-170's thread 1 beside thread 3 up to 160
    assert side_by_side_share(events, [(0, 200)]) == pytest.approx(40 / 200)
    assert side_by_side_share(events, [(0, 50), (145, 200)]) == pytest.approx((10 + 15) / 105)
    assert side_by_side_share([ev(1, 0, 10), ev(2, 10, 20)], [(0, 20)]) == 0  # one ends as the next starts
    assert side_by_side_share(events, []) is None


def test_idle_ms_splits_a_windows_idle_time_by_where_it_falls():
    ev = lambda a, b: {"ts": a, "dur": b - a}
    events = [ev(20, 60), ev(40, 50), ev(70, 90), ev(130, 150), ev(300, 320)]
    # window 1 (0-100): 20 before, 60-70 between, 90-100 after; window 2 (100-200): 30 before, 50 after;
    # window 3 (400-500): nothing ran, all of it counts as before the first op
    assert idle_ms(events, [(0, 100), (100, 200), (400, 500)]) == pytest.approx(
        {"before_first_op": (20 + 30 + 100) / 3e3, "between_ops": 10 / 3e3, "after_last_op": (10 + 50) / 3e3}
    )
    assert idle_ms(events, [(45, 80)]) == pytest.approx(
        {"before_first_op": 0, "between_ops": 0.01, "after_last_op": 0}
    )  # spans clipped to the window
    assert idle_ms(events, []) is None


def test_a_real_cpu_trace_of_a_jitted_step(tmp_path):
    """jax.profiler's own trace of two annotated steps, each op's kind read off the compiled program."""

    @jax.jit
    def train_step(x, w):
        h = jnp.tanh(x @ w)
        return (h.T @ h).sum(axis=0) + jnp.concatenate([h[:, :8], h[:, 8:]], axis=1).T.sum(axis=1)

    x, w = jnp.ones((256, 128)), jnp.ones((128, 64)) / 128
    train_step(x, w).block_until_ready()
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for i in range(2):
        with jax.profiler.StepTraceAnnotation("step", step_num=i):
            train_step(x, w).block_until_ready()
    jax.profiler.stop_trace()
    text = train_step.lower(x, w).compile().as_text()
    kinds, sources = op_kinds(text), op_sources(text)
    s = summarize_trace(str(tmp_path), kinds=kinds, module="train_step", sources=sources)
    assert s["device"] == "cpu" and s["steps"] == 2 and s["step_ms"] > 0 and 0 < s["busy"] <= 1
    assert s["by_kind"]["matmul"]["ms"] > 0 and set(s["by_kind"]) <= set(KINDS)
    assert all(t["op"] in kinds for t in s["top"])  # every op the trace names is an instruction of the program
    first = train_step.__wrapped__.__code__.co_firstlineno  # the decorator's line; its products are 2 and 3 below
    made = {
        f"tests/test_trace.py:{first + i} {train_step.__wrapped__.__qualname__} (jit(train_step)/dot_general)"
        for i in (2, 3)
    }
    assert {t["source"] for t in s["top"] if t["kind"] == "matmul"} & made  # the source line that made it
    assert " <- " in format_summary(s)  # each op with the JAX operation it came from
    assert {t["source"] for t in s["by_source"]} & {m.split(" (")[0] for m in made}  # and summed by line
    assert sum(t["ms"] for t in s["by_source"]) <= s["op_ms_per_step"] + 1e-9
    assert sum(v["share"] for v in s["by_kind"].values()) == pytest.approx(100, abs=0.5)


def test_a_product_made_through_the_shared_einsum_is_named_by_the_line_that_called_it():
    from flaxchat.model.cpu import einsum

    def f(x, w):
        return einsum("nc,vc->nv", x, w)

    text = jax.jit(f).lower(jnp.ones((8, 4)), jnp.ones((16, 4))).compile().as_text()
    named = {v for k, v in op_sources(text).items() if op_kinds(text).get(k) == "matmul"}
    assert named == {f"tests/test_trace.py:{f.__code__.co_firstlineno + 1} {f.__qualname__} (nc,vc->nv/dot_general)"}


def test_a_fused_product_is_named_by_its_product_not_its_epilogue():
    """A GEMM with elementwise work and a reduction fused after it (a norm's backward) is named by the product's
    source line, not by its root's."""

    def f(x, w, g):
        y = x @ w
        return y * g + jnp.sum(y * g, axis=-1, keepdims=True) * y

    line = f.__code__.co_firstlineno + 1
    text = jax.jit(f).lower(jnp.ones((256, 128)), jnp.ones((128, 128)), jnp.ones((256, 128))).compile().as_text()
    kinds, sources = op_kinds(text), op_sources(text)
    is_fusion = lambda name: re.search(rf"%{re.escape(name)} = [^\n]* fusion\(", text)
    fused = [name for name, kind in kinds.items() if kind == "matmul" and is_fusion(name)]
    assert fused  # XLA:CPU fuses the epilogue into the product's call
    for name in fused:
        root = re.search(rf"%{re.escape(name)} = [^\n]*op_name=\"([^\"]*)\"", text).group(1)
        assert not root.endswith("dot_general")  # the fusion's own metadata is its root's (the add)
        assert sources[name] == f"tests/test_trace.py:{line} {f.__qualname__} (jit(f)/dot_general)"


# The tests above that name a source line, run again from a copy of the checkout in a folder named as `git clone`
# names it: the package's own name must not be mistaken for the project's root.
SOURCE_LINE_TESTS = (
    "test_a_real_cpu_trace_of_a_jitted_step",
    "test_a_product_made_through_the_shared_einsum_is_named_by_the_line_that_called_it",
    "test_a_fused_product_is_named_by_its_product_not_its_epilogue",
)


def test_source_lines_are_named_from_a_checkout_called_flaxchat(tmp_path):
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    copy = tmp_path / "flaxchat"
    skip = shutil.ignore_patterns(
        ".git", ".*venv*", "__pycache__", ".pytest_cache", ".ruff_cache", ".pixi", "*.egg-info"
    )
    shutil.copytree(root, copy, ignore=skip)
    selected = [f"tests/test_trace.py::{name}" for name in SOURCE_LINE_TESTS]
    env = {**os.environ, "PYTHONPATH": str(copy)}
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", *selected]
    out = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and f"{len(selected)} passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


def test_op_kinds_reads_what_each_instruction_computes():
    def f(a, b, c):
        y = jax.lax.fori_loop(0, 3, lambda i, y: jnp.tanh(y @ b), a)
        return y.sum(axis=1), (c * 2 + 1).T.copy(), jnp.exp(c) * c

    text = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((32, 32)), jnp.ones((16, 48))).compile().as_text()
    kinds = op_kinds(text)
    ops = [
        m.groups()
        for line in text.splitlines()
        if (m := re.match(r"^\s*(?:ROOT\s+)?%(\S+) = .*? ([a-z][a-z0-9\-]*)\(", line))
    ]
    assert {name for name, _ in ops} == set(kinds) and set(kinds.values()) <= set(KINDS)  # each instruction, once
    of = lambda opcode: {kinds[name] for name, o in ops if o == opcode}
    assert of("while") == {"control"} and of("dot") <= {"matmul"} and of("parameter") == {"layout"}
    assert {"matmul", "reduction", "elementwise"} <= of("fusion") | of("dot") | of("reduce")
    assert {"matmul", "reduction", "elementwise", "layout", "control"} <= set(kinds.values())


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", "attention"),
        ("triton_poi_fused_add_mul_0", "elementwise"),
        ("triton_red_fused__to_copy_mean_pow_1", "reduction"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "collective"),
        ("aten::mm", "matmul"),
        ("## Call CompiledFxGraph fxtzavlxavmd4hzmcqxhg4t4362gynlswnbpyd2onen4bnm5yxn2 ##", "elementwise"),
        ("aten::cat", "layout"),
        ("transpose_copy_fusion.3", "layout"),
        ("something_else", "other"),
    ],
)
def test_kernel_names_have_a_kind(name, kind):
    assert kind_of_name(name) == kind


def test_summarize_ops_ranks_ops_and_sums_kinds_per_step():
    s = summarize_ops(
        {"aten::mm": 30.0, "triton_poi_fused_add_0": 10.0, "aten::cat": 20.0},
        steps=2,
        step_ms=40.0,
        top=2,
        counts={"aten::mm": 6, "aten::cat": 2, "triton_poi_fused_add_0": 2},
    )
    assert s["op_ms_per_step"] == 30.0 and s["step_ms"] == 40.0
    assert [(t["op"], t["ms"], t["calls"]) for t in s["top"]] == [("aten::mm", 15.0, 3), ("aten::cat", 10.0, 1)]
    assert list(s["by_kind"]) == ["matmul", "layout", "elementwise"]  # in KINDS order
    assert s["by_kind"]["matmul"] == {"ms": 15.0, "share": 50.0}


def test_ops_are_summed_by_the_line_and_pass_that_made_them():
    ops = {"fusion.1": 4.0, "custom-call.2": 10.0, "custom-call.3": 6.0, "copy.4": 2.0, "while.5": 1.0}
    sources = {
        "fusion.1": "flaxchat/model/gpt.py:165 Linear.multiply (jvp()/tanh)",
        "custom-call.2": "flaxchat/model/gpt.py:165 Linear.multiply (jvp()/dot_general)",
        "custom-call.3": "flaxchat/model/gpt.py:165 Linear.multiply (transpose(jvp())/dot_general)",
        "copy.4": "flaxchat/train/optim.py:99 step (transpose)",
    }
    kinds = {
        "fusion.1": "elementwise",
        "custom-call.2": "matmul",
        "custom-call.3": "matmul",
        "copy.4": "layout",
        "while.5": "control",
    }
    s = summarize_ops(ops, steps=2, step_ms=12.0, kinds=kinds, top=3, sources=sources)
    assert s["by_source"] == [
        {
            "source": "flaxchat/model/gpt.py:165 Linear.multiply",
            "ms": 7.0,
            "share": 60.9,
            "kinds": {"matmul": 5.0, "elementwise": 2.0},
        },
        {
            "source": "flaxchat/model/gpt.py:165 Linear.multiply, backward",
            "ms": 3.0,
            "share": 26.1,
            "kinds": {"matmul": 3.0},
        },
        {"source": "flaxchat/train/optim.py:99 step", "ms": 1.0, "share": 8.7, "kinds": {"layout": 1.0}},
    ]  # top 3 of 4
    assert "(no source)" in [t["source"] for t in summarize_ops(ops, 2, 12.0, kinds, sources=sources)["by_source"]]
    text = format_summary(s)
    assert (
        "by line of the program:" in text
        and "flaxchat/model/gpt.py:165 Linear.multiply  (matmul 5.00, elementwise 2.00)" in text
    )
    assert "by_source" not in summarize_ops(ops, 2, 12.0, kinds)  # without sources (nanochat's kernels)


def test_a_folder_without_a_trace_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no perfetto_trace.json.gz under"):
        summarize_trace(str(tmp_path))
    with pytest.raises(SystemExit, match="^error: cannot read a trace from .*no perfetto_trace.json.gz under"):
        main([str(tmp_path)])
    (tmp_path / "perfetto_trace.json.gz").write_bytes(b"not gzip")
    with pytest.raises(SystemExit, match="^error: cannot read a trace from "):
        main([str(tmp_path / "perfetto_trace.json.gz")])


def test_the_command_line_prints_a_trace_folders_summary(tmp_path, capsys):
    events = [
        step(0, 2000, 1),
        op(1, 11, 0, 1500, "ynn_fusion.3", "ynn_fusion.3"),
        op(1, 11, 1500, 500, "transpose_copy_fusion", "transpose_copy_fusion", module="jit_other"),
    ]
    (tmp_path / "plugins" / "profile" / "t").mkdir(parents=True)
    write_trace(
        tmp_path / "plugins" / "profile" / "t" / "perfetto_trace.json.gz",
        events,
        {1: "/host:CPU"},
        {(1, 11): "tf_XLAEigen/1"},
    )
    main([str(tmp_path)])
    text = capsys.readouterr().out
    assert text.startswith(
        "2.0 ms a step, 1.5 ms of ops a step over 1 step(s) (busy 75% of the step, ops on two or "
        "more threads at once 0%)\n"
    )
    assert "ynn_fusion.3" in text
    main([str(tmp_path), "--module", "", "--json"])
    every_module = json.loads(capsys.readouterr().out)
    assert every_module["by_kind"]["layout"]["ms"] == pytest.approx(0.5) and every_module["busy"] == 1.0


def test_command_buffers_count_as_other_and_the_summary_says_their_kernels_are_hidden():
    # XLA's GPU command buffers: one op each in a trace, holding kernels of every kind
    s = summarize_ops(
        {"command_buffer_371": 50.0, "custom-call.68": 30.0},
        steps=2,
        step_ms=45.0,
        kinds={"command_buffer_371": "reduction", "custom-call.68": "matmul"},
    )
    assert s["by_kind"] == {"matmul": {"ms": 15.0, "share": 37.5}, "other": {"ms": 25.0, "share": 62.5}}
    assert s["in_command_buffers_ms"] == 25.0
    assert "25.0 ms a step ran in XLA command buffers" in format_summary(s)
    assert "in_command_buffers_ms" not in summarize_ops({"custom-call.68": 30.0}, steps=2, step_ms=45.0)


@pytest.mark.parametrize("script, args", [("bench", ["--what", "train"]), ("pretrain", [])])
def test_profiling_scripts_turn_command_buffers_off_before_jax_starts(script, args, xla_flags):
    """--profile-steps adds XLA's flag to XLA_FLAGS while JAX's backend has not started (so XLA reads it)."""
    import subprocess
    import sys

    code = f"""
import os, sys
from jax._src import xla_bridge
from flaxchat.perf.profiler import StepProfiler
prepare = StepProfiler.prepare
def checked(steps):
    changed = prepare(steps)
    print(changed, xla_bridge.backends_are_initialized(), os.environ["XLA_FLAGS"])
    sys.exit(0)
StepProfiler.prepare = staticmethod(checked)
from scripts.{script} import main
main({args!r} + ["--profile-steps", "5:8"])
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "XLA_FLAGS": xla_flags(1)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().split(maxsplit=2) == ["True", "False", f"{xla_flags(1)} --xla_gpu_enable_command_buffer="]


def test_prepare_keeps_a_command_buffer_flag_already_set(monkeypatch):
    from flaxchat.perf.profiler import StepProfiler

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=FUSION")
    assert not StepProfiler.prepare((5, 8))
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer=FUSION"
    monkeypatch.delenv("XLA_FLAGS")
    assert not StepProfiler.prepare(None) and "XLA_FLAGS" not in os.environ  # nothing to profile: unchanged
    assert StepProfiler.prepare((5, 8)) and os.environ["XLA_FLAGS"] == "--xla_gpu_enable_command_buffer="
