"""Where a step's time goes: a profiler trace summed by op and by kind of work.

`scripts.bench --profile-steps A:B` writes a jax.profiler trace (perf.profiler.StepProfiler) and adds this summary to
its
JSON; `scripts.nanochat_bench --profile N` makes the same summary of nanochat's step from torch.profiler, so the
two programs' kernels can be read side by side (runs/gpu_check.sh --profile puts both in summary.md).

Kinds: matmul (dots, GEMM libraries, fusions around a dot), attention (fused attention kernels), collective,
layout (copies, transposes, slicing and concatenation), reduction, elementwise (the other fusions), control (loop
and call bookkeeping), other. With the compiled program's HLO text (`hlo.op_kinds`) an XLA op's kind comes from
what it computes; without it, and for PyTorch's kernels, from its name. Times are self times (a loop's time
excludes the ops inside it) per profiled step: on a GPU or TPU device time; on a CPU each op's time on the thread
that ran it, summed over XLA's threads (ops XLA runs side by side both count; the helper threads an op splits its
work over record nothing of their own, so op time is not CPU time there). `busy` is the share of the step the
program was running: kernel time over step time on a device, the time at least one op ran on a CPU.

Nothing here imports JAX: nanochat's process uses it with torch only.
"""

from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import statistics

# XLA's flag that turns its GPU command buffers off, so that a trace shows their kernels
# (perf.profiler.StepProfiler.prepare)
COMMAND_BUFFERS_OFF = "--xla_gpu_enable_command_buffer="

KINDS = ("matmul", "attention", "collective", "layout", "reduction", "elementwise", "control", "other")

# Name rules, first match wins (lower-cased op or kernel name). Attention before matmul: flash kernels say gemm too.
# torch.compile's own kernels: Triton's pointwise / reduction kernels on a GPU; on a CPU the compiled region's self
# time (its fused C++ loops; the matmuls it calls are ops of their own).
_NAME_RULES = [
    ("elementwise", r"compiledfxgraph|triton_poi_"),
    ("reduction", r"triton_(red|per)_"),
    ("attention", r"fmha|sdpa|flash|attention|splash|scaled_dot_product"),
    ("collective", r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|nccl|allreduce|allgather"),
    (
        "matmul",
        r"gemm|matmul|xmma|cutlass|cublas|ynn_fusion|\bdot\b|dot_general|convolution|^dot\.|aten::mm|"
        r"aten::addmm|aten::bmm|aten::baddbmm|aten::linear|\bmm\b|extern_kernels\.mm|sgemm|wgmma|nvjet",
    ),
    (
        "layout",
        r"copy|transpose|bitcast|concatenate|\bcat\b|slice|pad|reshape|contiguous|clone|memcpy|memset|"
        r"dynamic-update|gather",
    ),
    ("reduction", r"reduce|\bsum\b|_sum|norm|softmax|logsumexp|argmax|\bmax\b|\bmean\b|red_"),
    ("control", r"^while|^conditional|^call\b|^call\.|compiledfunction|thunkexecutor"),
    (
        "elementwise",
        r"fusion|triton|loop_|elementwise|vectorized|pointwise|add|mul|exp|tanh|where|select|"
        r"convert|cpp_fused|to_copy|aten::",
    ),
]


def kind_of_name(name: str) -> str:
    """A coarse kind from an op's or kernel's name alone (see _NAME_RULES)."""
    low = name.lower()
    for kind, pattern in _NAME_RULES:
        if re.search(pattern, low):
            return kind
    return "other"


def source_line_of(source: str) -> str:
    """An op's source (hlo.op_sources) as the line of the program it belongs to, and the pass where it is a
    gradient's: "flaxchat/model/gpt.py:165 Linear.multiply (transpose(jvp())/dot_general)" -> "flaxchat/model/gpt.py:165
    Linear.multiply, backward"."""
    where, _, tail = source.partition(" (")
    return f"{where}, backward" if "transpose(" in tail else where


def summarize_ops(
    op_times: dict,
    steps: int,
    step_ms: float | None,
    kinds: dict | None = None,
    top: int = 12,
    counts: dict | None = None,
    sources: dict | None = None,
) -> dict:
    """{op: total ms over the profiled steps} -> the summary: per-step ms by kind and the `top` ops (with the JAX
    operation each came from, where `sources` names it: hlo.op_sources); with sources also `by_source`, the `top`
    lines of the program by the time of their ops (forward and backward apart; fused ops count at the line that
    names the fusion), each with its ms by kind."""
    steps = max(steps, 1)
    # an XLA command buffer (a CUDA graph of many kernels of every kind) is one op in a trace: kind "other"
    graph = lambda op: op.startswith("command_buffer")
    kind = lambda op: "other" if graph(op) else (kinds or {}).get(op) or kind_of_name(op)
    total = sum(op_times.values()) / steps
    by_kind = collections.Counter()
    for op, ms in op_times.items():
        by_kind[kind(op)] += ms / steps
    share = lambda ms: round(100 * ms / total, 1) if total else 0.0
    ranked = sorted(op_times.items(), key=lambda kv: -kv[1])[:top]
    hidden = sum(ms for op, ms in op_times.items() if graph(op)) / steps
    lines = collections.defaultdict(collections.Counter)  # line -> kind -> ms per step
    for op, ms in op_times.items() if sources else ():
        lines[source_line_of(sources[op]) if op in sources else "(no source)"][kind(op)] += ms / steps
    by_source = sorted(lines.items(), key=lambda kv: -sum(kv[1].values()))[:top]
    return {
        "steps": steps,
        "step_ms": step_ms,
        "op_ms_per_step": total,
        "by_kind": {k: {"ms": by_kind[k], "share": share(by_kind[k])} for k in KINDS if by_kind[k]},
        "top": [
            {
                "op": op,
                "kind": kind(op),
                "ms": ms / steps,
                "share": share(ms / steps),
                **({"calls": counts[op] / steps} if counts else {}),
                **({"source": sources[op]} if sources and op in sources else {}),
            }
            for op, ms in ranked
        ],
        **({"in_command_buffers_ms": hidden} if hidden else {}),
        **(
            {
                "by_source": [
                    {
                        "source": line,
                        "ms": sum(k.values()),
                        "share": share(sum(k.values())),
                        "kinds": {name: k[name] for name in KINDS if k[name]},
                    }
                    for line, k in by_source
                ]
            }
            if sources
            else {}
        ),
    }


def newest_trace(directory: str) -> str:
    """The newest perfetto_trace.json.gz under a jax.profiler log directory (plugins/profile/<time>/)."""
    found = glob.glob(os.path.join(directory, "**", "perfetto_trace.json.gz"), recursive=True)
    if not found:
        raise FileNotFoundError(
            f"no perfetto_trace.json.gz under {directory} (was the trace written with create_perfetto_trace=True?)"
        )
    return max(found, key=os.path.getmtime)


def _self_times(events: list) -> list[tuple[dict, float]]:
    """(event, self time in µs) for complete events on one thread: nested events' time is taken off their parent."""
    out, stack = [], []  # stack: [event, end, children's time]
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][1] <= e["ts"]:
            done = stack.pop()
            out.append((done[0], done[0]["dur"] - done[2]))
        if stack:
            stack[-1][2] += e["dur"]
        stack.append([e, e["ts"] + e["dur"], 0.0])
    out += [(ev, ev["dur"] - child) for ev, _, child in stack]
    return out


def summarize_trace(
    path: str, kinds: dict | None = None, module: str | None = None, top: int = 12, sources: dict | None = None
) -> dict:
    """Summary of a jax.profiler trace (a log directory or a perfetto_trace.json.gz): per profiled step (the steps
    perf.profiler.StepProfiler annotated), ms by kind and the slowest ops. kinds: hlo.op_kinds of the compiled program,
    sources: its hlo.op_sources; module: count only ops of HLO modules whose name contains it (e.g. "train_step")."""
    path = path if path.endswith(".json.gz") else newest_trace(path)
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {
        (e["pid"], e.get("tid")): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    on_device = [e for e in complete if processes.get(e["pid"], "").startswith(("/device:GPU", "/device:TPU"))]
    if any("hlo_op" in e.get("args", {}) for e in on_device):
        ops = [e for e in on_device if "hlo_op" in e.get("args", {})]
    elif on_device:  # kernels without op names: the device's stream / op lines
        ops = [e for e in on_device if re.match(r"(Stream|XLA Ops)", threads.get((e["pid"], e.get("tid")), ""))]
    else:  # a CPU: XLA's thunks on its threads
        ops = [e for e in complete if "hlo_op" in e.get("args", {})]
    if module:
        ops = [e for e in ops if module in e.get("args", {}).get("hlo_module", module)]
    by_thread = collections.defaultdict(list)
    for e in ops:
        by_thread[(e["pid"], e.get("tid"))].append(e)
    op_times, counts, named = collections.Counter(), collections.Counter(), {}
    for group in by_thread.values():
        for e, self_us in _self_times(group):
            name = e.get("args", {}).get("hlo_op") or e["name"]
            op_times[name] += self_us / 1e3
            counts[name] += 1
            if name not in named:
                named[name] = kind_of_name(e["name"])  # a kernel's name says more than "custom-call.3"
    kinds = {**{op: k for op, k in named.items() if k != "other"}, **(kinds or {})}
    steps = [e for e in complete if e["name"] == "step" and "step_num" in e.get("args", {})]  # StepTraceAnnotations
    marks = {e["args"]["step_num"]: e["dur"] / 1e3 for e in steps}  # step_num -> the host's view of the step
    out = summarize_ops(
        op_times, len(marks), statistics.median(marks.values()) if marks else None, kinds, top, counts, sources
    )
    # the share of the step the program was running (below 1: it waited on the host, on input or on transfers): on
    # a device its kernels' time over the step's; on a CPU, where XLA runs ops side by side on its threads, the
    # share of the steps' wall time during which at least one op ran
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    if on_device:
        busy = out["op_ms_per_step"] / out["step_ms"] if out["step_ms"] else None
    else:
        busy = covered_share(ops, windows)
        # XLA:CPU runs independent ops at once on its threads, so op_ms_per_step can exceed step_ms
        out["side_by_side"] = side_by_side_share(ops, windows)
    out["idle"] = idle_ms(ops, windows)
    return {"trace": path, "device": "accelerator" if on_device else "cpu", "busy": busy, **out}


def covered_share(events: list, windows: list[tuple[float, float]]) -> float | None:
    """The share of the windows' total time during which at least one of the events ran (events overlapping each
    other or nested count once); None without windows."""
    return _share_of_windows(_spans(events), windows)


def _share_of_windows(spans, windows: list[tuple[float, float]]) -> float | None:
    """The share of the windows' total time that disjoint (start, end) spans cover; None without windows."""
    total = sum(b - a for a, b in windows)
    if total <= 0:
        return None
    return sum(max(0.0, min(t, b) - max(s, a)) for a, b in windows for s, t in spans) / total


def _spans(events: list) -> list[list[float]]:
    """The events' time as disjoint [start, end] spans, in order (overlapping or nested events merged)."""
    union = []
    for s, t in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if union and s <= union[-1][1]:
            union[-1][1] = max(union[-1][1], t)
        else:
            union.append([s, t])
    return union


def idle_ms(events: list, windows: list[tuple[float, float]]) -> dict | None:
    """Where no event ran in the windows (the profiled steps), ms per window: before the first one starts (the host
    reading the batches and dispatching the step), between events (launch gaps, waits inside the step) and after
    the last one ends (the host still busy with the step, or a wait for its results); None without windows."""
    if not windows:
        return None
    spans, before, between, after = _spans(events), 0.0, 0.0, 0.0
    for a, b in windows:
        inside = [(max(s, a), min(t, b)) for s, t in spans if t > a and s < b]
        if not inside:
            before += b - a
            continue
        before += inside[0][0] - a
        between += sum(inside[i + 1][0] - inside[i][1] for i in range(len(inside) - 1))
        after += b - inside[-1][1]
    n = len(windows) * 1e3  # µs -> ms per window
    return {"before_first_op": before / n, "between_ops": between / n, "after_last_op": after / n}


def side_by_side_share(events: list, windows: list[tuple[float, float]]) -> float | None:
    """The share of the windows' total time during which events ran on two or more threads at once (an op nested in
    another on its thread counts once); None without windows."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    edges = sorted((x, d) for group in by_thread.values() for s, t in _spans(group) for x, d in ((s, 1), (t, -1)))
    shared, running, last = [], 0, None  # spans with two or more threads running
    for x, d in edges:
        if running >= 2 and x > last:
            shared.append((last, x))
        running, last = running + d, x
    return _share_of_windows(shared, windows)


def format_summary(summary: dict, title: str = "") -> str:
    """A few lines of text: the step, ms by kind, the top ops."""
    step = f"{summary['step_ms']:.1f} ms a step, " if summary.get("step_ms") else ""
    busy = summary.get("busy")
    both = summary.get("side_by_side")
    both = "" if both is None else f", ops on two or more threads at once {100 * both:.0f}%"
    busy = "" if busy is None else f" (busy {100 * busy:.0f}% of the step{both})"
    lines = [f"{title}{step}{summary['op_ms_per_step']:.1f} ms of ops a step over {summary['steps']} step(s){busy}"]
    lines.append("  " + ", ".join(f"{k} {v['ms']:.1f} ms ({v['share']}%)" for k, v in summary["by_kind"].items()))
    lines += [
        f"  {t['ms']:9.2f} ms {t['share']:5.1f}%  {t['kind']:<11} {t['op']}"
        + (f"  <- {t['source']}" if t.get("source") else "")
        for t in summary["top"]
    ]
    idle = summary.get("idle")
    if idle:
        lines.append(
            f"  idle a step: {idle['before_first_op']:.1f} ms before the first op, {idle['between_ops']:.1f} ms "
            f"between ops, {idle['after_last_op']:.1f} ms after the last"
        )
    if summary.get("by_source"):
        lines.append("  by line of the program:")
        lines += [
            f"  {t['ms']:9.2f} ms {t['share']:5.1f}%  {t['source']}  ("
            + ", ".join(f"{k} {ms:.2f}" for k, ms in t["kinds"].items())
            + ")"
            for t in summary["by_source"]
        ]
    if summary.get("in_command_buffers_ms"):
        lines.append(
            f"  {summary['in_command_buffers_ms']:.1f} ms a step ran in XLA command buffers, whose kernels a "
            f"trace hides: profile with XLA_FLAGS={COMMAND_BUFFERS_OFF} (--profile-steps sets it)"
        )
    return "\n".join(lines)


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(
        description="Where the profiled steps' time went: a jax.profiler trace (e.g. from "
        "--profile-steps) summed by op and kind of op, per step."
    )
    p.add_argument("path", help="the trace's log directory (its newest perfetto_trace.json.gz is read) or the file")
    p.add_argument(
        "--module",
        default="train_step",
        help="ops of HLO modules whose name holds this (default: train_step; '' for every module)",
    )
    p.add_argument("--top", type=int, default=12, help="how many of the slowest ops to list")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = summarize_trace(args.path, module=args.module or None, top=args.top)
    except (FileNotFoundError, OSError, ValueError, KeyError) as e:
        raise SystemExit(f"error: cannot read a trace from {args.path}: {e}") from None
    print(json.dumps(summary) if args.json else format_summary(summary))


if __name__ == "__main__":
    main()
