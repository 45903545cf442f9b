"""runs/gpu_check.sh's report: every step's output folder read into one record (report.json) and written as one
markdown page (summary.md): the machine, the tests, the training rows (beside nanochat's where it was timed), real
runs, generation and serving.

The standard library only (and perf.trace's, likewise): scripts.gpu_check runs before flaxchat's dependencies are
installed, and a report must be written even where JAX failed to start.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re
import statistics
import xml.etree.ElementTree as ET

from flaxchat.perf.trace import KINDS

SECTIONS = ("tests", "train", "real", "generate", "serve")  # what gpu_check.sh's --only may name

# -----------------------------------------------------------------------------
# Reading a step's output


def read_step(out, name, json_out: bool = True) -> dict:
    """A step's record: its command, exit status, parsed stdout (bench: one JSON; chat_web: JSON lines; a step
    without JSON out, json_out=False: the last line of its stdout)."""
    step = {"name": name, "ok": False, "command": None, "result": None}
    for key, ext in (("command", "cmd"), ("note", "note")):
        path = os.path.join(out, f"{name}.{ext}")
        if os.path.exists(path):
            step[key] = open(path, encoding="utf-8").read().strip()
    rc_path, out_path = os.path.join(out, f"{name}.rc"), os.path.join(out, f"{name}.out")
    rc = int(open(rc_path).read().strip()) if os.path.exists(rc_path) else None
    text = open(out_path, encoding="utf-8").read() if os.path.exists(out_path) else ""
    step["rc"] = rc
    try:
        if not json_out:
            step["result"] = text.strip().splitlines()[-1] if text.strip() else ""
        elif name == "serve":
            lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
            runs = [x["run"] for x in lines if "run" in x]
            final = next((x for x in reversed(lines) if "median_tok_per_s" in x), None)
            step["result"] = None if final is None else {**final, "runs": runs}
        else:
            step["result"] = json.loads(text) if text.strip() else None
    except json.JSONDecodeError as e:
        step["error"] = f"could not parse {name}.out: {e}"
    step["ok"] = rc == 0 and step["result"] is not None
    log = os.path.join(out, "logs", f"{name}.log")
    if not step["ok"] and os.path.exists(log):
        step["error"] = step.get("error") or open(log, encoding="utf-8", errors="replace").read()[-2000:]
    return step


def read_tests(out, mode) -> dict:
    tests = {
        "name": "tests",
        "ok": False,
        "passed": 0,
        "failed": 0,
        "errors": 0,
        "skipped": 0,
        "seconds": None,
        "skipped_because": [],
    }
    for key, ext in (("command", "cmd"),):
        path = os.path.join(out, f"tests.{ext}")
        if os.path.exists(path):
            tests[key] = open(path).read().strip()
    path = os.path.join(out, "tests.xml")
    if not os.path.exists(path):
        tests["error"] = "no tests.xml (pytest did not run)"
        return tests
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in ("failures", "errors", "skipped"):
            tests["failed" if key == "failures" else key] += int(suite.get(key, 0))
        tests["seconds"] = round(float(suite.get("time", 0)), 1)
        total = int(suite.get("tests", 0))
        tests["passed"] += (
            total - int(suite.get("failures", 0)) - int(suite.get("errors", 0)) - int(suite.get("skipped", 0))
        )
        for case in suite.iter("testcase"):
            skip = case.find("skipped")
            if skip is not None:
                tests["skipped_because"].append(f"{case.get('name')}: {skip.get('message', '')}"[:300])
    clean = tests["failed"] == 0 and tests["errors"] == 0
    # on a GPU every GPU test must run; on the CPU they are all skipped, each with its reason
    tests["ok"] = clean and (tests["passed"] > 0 and tests["skipped"] == 0 if mode == "gpu" else True)
    return tests


def _steps(out, prefix):
    names = sorted(
        {os.path.basename(p).rsplit(".", 1)[0] for p in glob.glob(os.path.join(out, f"{prefix}_*.cmd"))},
        key=lambda n: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", n)],
    )
    return [read_step(out, n) for n in names]


# -----------------------------------------------------------------------------
# Rows and lines of summary.md


def flops(x) -> str:
    return f"{x / 1e12:,.0f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:,.0f} GFLOP/s"


def fmt(x, spec=",.0f", none="–"):
    return none if x is None else format(x, spec)


def table(steps, columns, row) -> list[str]:
    """Markdown rows for `steps`: the step's name, then row(result)'s cells; a failed step says where to look."""
    blank = " |" * (len(columns) - 1)
    out = ["| step | " + " | ".join(columns) + " |", "| --- |" + " --- |" * len(columns)]
    for s in steps:
        out.append(
            f"| {s['name']} | " + " | ".join(row(s["result"])) + " |"
            if s["ok"]
            else f"| {s['name']} | failed: see report.json |{blank}"
        )
        if s.get("note"):
            out.append(f"| | {s['note']} |{blank}")
    return out


def train_row(r, nanochat=False) -> list[str]:
    c, n = r["config"], r["num_params"]
    data = ", " + r["data"] if r.get("data", "random tokens") != "random tokens" else ""
    if r.get("backend") == "gpu" and "nvptx-allow-ftz-atomics" not in r.get("xla_flags", "nvptx-allow-ftz-atomics"):
        data += ", fp32 atomic adds as LLVM compiles them"  # FLAXCHAT_NATIVE_GPU_ATOMICS=0
    if r.get("backend", "cpu") != "cpu" and r.get("in_flight") is False:
        data += ", each step waited for"  # --in-flight off, where the default keeps one in flight
    accum = f", {r['grad_accum']} accumulation steps" if r.get("grad_accum", 1) > 1 else ""
    row = [
        f"d{c['n_layer']} {c.get('window_pattern', '')} ({n / 1e6:,.{0 if n >= 1e8 else 1}f}M params, "
        f"{r['dtype']}{accum}{data})",
        f"{r['tokens_per_step'] // c['sequence_len']} x {c['sequence_len']}",
        fmt(r["tok_per_s"]),
        fmt(r["mfu"], ".1f"),
        fmt(r["compile_s"], ".1f"),
        fmt(r["peak_mem_gb"], ".1f"),
        r["attention"] + ("" if r["remat"] == "none" else f", remat {r['remat']}"),
        f"{flops(r['peak_flops'])} ({r['peak_flops_source']})",
    ]
    if nanochat:  # bench --nanochat: nanochat's own step on the same shape, timed first
        theirs = r.get("nanochat") or {}
        kernel = ", ".join(x for x in (theirs.get("dtype"), theirs.get("attention")) if x)
        row += [
            fmt(theirs.get("tok_per_s")) + (f" ({kernel})" if kernel else ""),
            fmt(theirs.get("compile_s"), ".1f"),
            fmt(r.get("vs_nanochat"), ".2f") + ("x" if r.get("vs_nanochat") else ""),
        ]
    return row


def run_row(r) -> list[str]:
    """bench --what run's record: both runs' median step (tok/s) over the same timed steps."""
    theirs = r.get("nanochat") or {}
    step = lambda x: f"{fmt(x.get('step_s') and 1e3 * x['step_s'], ',.1f')} ({fmt(x.get('tok_per_s'))})"
    timed = f"{r['timed_from_step']}-{r['timed_from_step'] + r['timed_steps'] - 1}"
    return [
        f"`{' '.join(r['flags'])}`",
        timed,
        step(r),
        step(theirs),
        fmt(r.get("vs_nanochat"), ".2f") + ("x" if r.get("vs_nanochat") else ""),
        f"{fmt(r['process_s'], '.0f')} / {fmt(theirs.get('process_s'), '.0f')}",
    ]


def drift_lines(steps, n=5) -> list[str]:
    """Each training row's first and last timed steps (medians of n): whether its steps slow down as it runs."""
    rows = [
        (s["name"], s["result"]["times_s"]) for s in steps if s["ok"] and len(s["result"].get("times_s", [])) >= 2 * n
    ]
    if not rows:
        return []
    med = statistics.median
    return ["", f"Step time over the run (ms, median of the first and of the last {n} timed steps):", ""] + [
        f"- {name}: {1e3 * med(t[:n]):,.1f} -> {1e3 * med(t[-n:]):,.1f}" for name, t in rows
    ]


def generate_row(r) -> list[str]:
    c = r["config"]
    return [
        f"d{c['n_layer']} ({r['dtype']}, context {c['sequence_len']})",
        str(r["batch_size"]),
        f"{r['prompt_len']} + {r['max_new_tokens']}",
        fmt(r["tok_per_s"]),
        fmt(r["ttft_s"] * 1e3, ".1f"),
        fmt(r["prefill_tok_per_s"]),
        fmt(r["compile_s"], ".1f"),
        fmt(r["peak_mem_gb"], ".1f"),
    ]


def profile_lines(steps) -> list[str]:
    """`--profile`: per training shape, each program's step time by kind of op, its slowest ops, then flaxchat's
    lines by the time of their ops."""
    lines = []
    for s in steps:
        ours = s["ok"] and s["result"].get("profile")
        if not ours:
            continue
        theirs = (s["result"].get("nanochat") or {}).get("profile")
        step_ms = lambda p: fmt(p.get("step_ms"), ".1f")
        busy = ours.get("busy")
        busy = "" if busy is None else f" (device busy {100 * busy:.0f}% of it)"
        head = f"### {s['name']}: flaxchat {step_ms(ours)} ms a step{busy}"
        lines += ["", head + (f", nanochat {step_ms(theirs)} ms" if theirs else ""), ""]
        columns = ["flaxchat ms/step", "share"] + (["nanochat ms/step", "share"] if theirs else [])
        lines += ["| kind | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 1)]
        cell = lambda p, k: (
            [fmt(p["by_kind"][k]["ms"], ".2f"), f"{p['by_kind'][k]['share']}%"] if k in p["by_kind"] else ["–", "–"]
        )
        for k in KINDS:
            if k in ours["by_kind"] or (theirs and k in theirs["by_kind"]):
                lines.append(f"| {k} | " + " | ".join(cell(ours, k) + (cell(theirs, k) if theirs else [])) + " |")
        total = lambda p: [fmt(p["op_ms_per_step"], ".2f"), "100%"]
        lines.append("| all ops | " + " | ".join(total(ours) + (total(theirs) if theirs else [])) + " |")
        for who, p in (("flaxchat", ours), ("nanochat", theirs)):
            if p:
                lines += ["", f"{who}'s slowest ops (ms a step, kind, op):", ""]
                lines += [
                    f"- {t['ms']:.2f} ms ({t['share']}%) {t['kind']}: `{t['op'][:120]}`"
                    + (f" from `{t['source']}`" if t.get("source") else "")
                    for t in p["top"][:8]
                ]
        if ours.get("scatters") is not None:  # how the compiled step adds up its embeddings' gradients
            lines += ["", f"flaxchat's scatters (element type, combiner): {', '.join(ours['scatters']) or 'none'}"]
        if ours.get("by_source"):
            lines += ["", "flaxchat's lines of the program by the time of their ops (ms a step, by kind):", ""]
            lines += [
                f"- {t['ms']:.2f} ms ({t['share']}%) `{t['source']}`: "
                + ", ".join(f"{k} {ms:.2f}" for k, ms in t["kinds"].items())
                for t in ours["by_source"]
            ]
    if lines:
        lines = [
            "",
            "## Where the time goes",
            "",
            "`--profile`: a few timed steps under the profilers (jax.profiler, "
            "and torch.profiler for nanochat), self time of every op by kind (`flaxchat.perf.trace`); on a GPU "
            "device time, on a CPU each op's time on the thread that ran it. Traces in profile/.",
        ] + lines
    return lines


# -----------------------------------------------------------------------------
# The page and the record


def environment_lines(report) -> list[str]:
    """The title, whether every check passed, and the machine: backend, JAX, accelerator packages, nvidia-smi."""
    env = report["env"]
    kind = env.get("device_kind", "?")
    lines = [
        f"# flaxchat GPU check ({report['mode']} mode): {env.get('device_count', '?')} x {kind}",
        "",
        f"{report['created']} · "
        + ("all checks passed" if report["ok"] else "SOME CHECKS FAILED: " + ", ".join(report["failed"])),
        "",
        "## Environment",
        "",
        "| what | value |",
        "| --- | --- |",
        f"| backend | {env.get('backend')} ({env.get('device_count')} x {kind}) |",
        f"| jax | {env.get('jax')} · python {env.get('python')} · {env.get('machine')} |",
        f"| accelerator packages | {', '.join(env.get('packages', [])) or '–'} |",
    ]
    smi = env.get("nvidia_smi") or {}
    if smi.get("gpus"):
        lines.append(f"| nvidia-smi | {'; '.join(smi['gpus'])} · driver CUDA {smi.get('driver_cuda_version')} |")
    if env.get("device_memory_gb"):
        lines.append(
            f"| JAX memory limit | {env['device_memory_gb']} GiB (XLA_PYTHON_CLIENT_MEM_FRACTION="
            f"{env.get('env', {}).get('XLA_PYTHON_CLIENT_MEM_FRACTION')}) |"
        )
    return lines


def tests_lines(t) -> list[str]:
    """pytest's counts and the first reasons for skipping."""
    if t.get("not_run"):
        return ["", "## Tests", "", "not run (`--only`)"]
    lines = [
        "",
        "## Tests",
        "",
        f"`{t.get('command', 'pytest -m gpu')}`: {t['passed']} passed, {t['failed']} "
        f"failed, {t['errors']} errors, {t['skipped']} skipped ({fmt(t['seconds'], '.1f')} s)",
    ]
    if t["skipped_because"]:
        lines += [""] + [f"- skipped {s}" for s in t["skipped_because"][:8]]
    return lines


def training_lines(report) -> list[str]:
    """The training table (beside nanochat's step where it was timed), step-time drift, profiles and real runs."""
    lines = [
        "",
        "## Training",
        "",
        "Random tokens unless the model says grain loader (batches of tokenized synthetic "
        "stories from the data loader, with a vocabulary trained on them; the random-token row beside it has the "
        "same shape), the real optimizer; median step after warm-up (`python -m scripts.bench --what train`). MFU "
        "is against the peak named in the last column; compile s is the first step's tracing and compilation (a "
        "warm $JAX_COMPILATION_CACHE_DIR cuts it).",
        "",
    ]
    columns = [
        "model",
        "rows x seq",
        "tok/s",
        "MFU %",
        "compile s",
        "peak mem GiB",
        "attention",
        "peak FLOP/s (source)",
    ]
    nanochat = any(s["ok"] and "nanochat" in s["result"] for s in report["train"])
    if nanochat:
        lines += [
            "nanochat: its own GPT, MuonAdamW and `torch.compile` on the same shape and batch, timed first in a "
            "process of its own (`--nanochat DIR`); vs nanochat is flaxchat's tok/s over nanochat's.",
            "",
        ]
        columns += ["nanochat tok/s", "nanochat compile s", "vs nanochat"]
    lines += table(report["train"], columns, lambda r: train_row(r, nanochat))
    lines += drift_lines(report["train"])
    lines += profile_lines(report["train"])
    if report.get("runs"):
        lines += [
            "",
            "## Real runs",
            "",
            "nanochat's own `scripts/base_train.py`, then `scripts.pretrain`, with the same "
            "flags on the same shards and tokenizer (`python -m scripts.bench --what run`); the median of the timed "
            "steps (the first, which compiles, and the warm-up after it left out); vs nanochat is nanochat's "
            "median step over flaxchat's.",
            "",
        ]
        lines += table(
            report["runs"],
            [
                "flags",
                "timed steps",
                "flaxchat ms a step (tok/s)",
                "nanochat ms a step (tok/s)",
                "vs nanochat",
                "process s (flaxchat / nanochat)",
            ],
            run_row,
        )
    return lines


def generation_lines(report) -> list[str]:
    lines = [
        "",
        "## Generation",
        "",
        "KV-cache engine, random prompts, every row makes every token (`python -m scripts.bench --what generate`).",
        "",
    ]
    if not (report["generate"] or "generate" in report.get("sections", SECTIONS)):
        return lines + ["not run (`--only`)"]
    columns = [
        "model",
        "batch",
        "prompt + new",
        "decode tok/s",
        "time to first token ms",
        "prefill tok/s",
        "compile s",
        "peak mem GiB",
    ]
    return lines + table(report["generate"], columns, generate_row)


def serving_lines(s) -> list[str]:
    """chat_web's load test: tok/s of all clients and the median time to first token, by number of clients."""
    lines = [
        "",
        "## Serving",
        "",
        "`python -m scripts.chat_web --random-init --load-test ...`: concurrent WebSocket "
        "clients against the in-process server (continuous batching), median over rounds.",
        "",
    ]
    if s.get("not_run"):
        return lines + ["not run (`--only`)"]
    if not s["ok"]:
        return lines + ["failed: see report.json"]
    r = s["result"]
    lines += [
        f"Model {r['model']}, {r['slots']} slots, {r['tokens_per_client']} tokens per client.",
        "",
        "| clients | tok/s (all clients) | vs 1 client | median time to first token s |",
        "| --- | --- | --- | --- |",
    ]
    for n, v in r["median_tok_per_s"].items():
        ttft = sorted(
            x["ttft_median_s"] for x in r["runs"] if str(x["clients"]) == n and x["ttft_median_s"] is not None
        )
        lines.append(
            f"| {n} | {fmt(v)} | {r['vs_one_client'][n]}x | {fmt(ttft[len(ttft) // 2] if ttft else None, '.3f')} |"
        )
    return lines


def summary_markdown(report) -> str:
    """The report as summary.md: environment, tests, training, generation, serving."""
    lines = environment_lines(report) + tests_lines(report["tests"]) + training_lines(report)
    lines += generation_lines(report) + serving_lines(report["serve"])
    return "\n".join(lines) + "\n"


def collect(out: str, mode: str, sections: set[str]) -> dict:
    """Every step's output in `out` as one record (report.json): the environment, the tests, the prepared data, each
    training row, real run and generation row, the serving run; `failed` names the steps that failed and `ok` says
    whether every section asked for has its rows and passed."""
    env_path = os.path.join(out, "env.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    not_run = lambda name: {"name": name, "ok": True, "not_run": True}  # left out by --only
    serve = read_step(out, "serve") if "serve" in sections else not_run("serve")
    tests = read_tests(out, mode) if "tests" in sections else not_run("tests")
    # the real pipeline's data and tokenizer: a failure there leaves its training rows out, so it fails the report
    prepared = [
        read_step(out, n, json_out=False)
        for n in ("real_data", "real_tokenizer")
        if os.path.exists(os.path.join(out, f"{n}.cmd"))
    ]
    report = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": mode,
        "out": os.path.abspath(out),
        "sections": [s for s in SECTIONS if s in sections],
        "env": env,
        "tests": tests,
        "prepared": prepared,
        "train": _steps(out, "train"),
        "runs": _steps(out, "run"),
        "generate": _steps(out, "generate"),
        "serve": serve,
    }
    steps = [tests, *prepared, *report["train"], *report["runs"], *report["generate"], serve]
    report["failed"] = [s["name"] for s in steps if not s["ok"]]
    # every section asked for has its rows (the real pipeline's are training rows too)
    report["ok"] = (
        not report["failed"]
        and (bool(report["train"]) or not sections & {"train", "real"})
        and (bool(report["generate"]) or "generate" not in sections)
    )
    return report
