"""Helpers for runs/gpu_check.sh: the steps that need more than a line of shell.

    python -m scripts.gpu_check requirements        # flaxchat[dev]'s requirements except JAX (what to pip download)
    python -m scripts.gpu_check missing             # those of them this environment lacks (what to install offline)
    python -m scripts.gpu_check pins                # name==version of the installed JAX / CUDA / TPU packages
    python -m scripts.gpu_check env --expect-backend gpu   # backend and devices as JSON; exit 1 if not that backend
    python -m scripts.gpu_check tokenizer --vocab-size 32768 --base-dir DIR   # a tokenizer for serving, offline
    python -m scripts.gpu_check report DIR --mode gpu       # DIR's step outputs -> DIR/report.json + DIR/summary.md
    python -m scripts.gpu_check lock cuda12         # rewrite requirements/cuda12.txt (needs PyPI; maintainers)

Nothing here imports JAX, flax, torch or the flaxchat modules that need them before a subcommand does:
`requirements`, `missing` and `pins` run before flaxchat's dependencies are installed. JAX itself (and its CUDA plugin)
is never installed or replaced here.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import importlib.metadata as metadata
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
import xml.etree.ElementTree as ET

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare GPU image may lack packaging; pip always carries it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

from flaxchat.perf.trace import KINDS  # the standard library only: importable before flaxchat's dependencies

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What an accelerator install brings: installed ones are kept exactly as they are (pins), never resolved here.
ACCELERATOR = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|libtpu|libtpu-nightly|nvidia-.*)$")
PYPI = "https://pypi.org/simple"


# -----------------------------------------------------------------------------
# Requirements: pyproject.toml is the single source


def project_requirements(extras=("dev",)) -> list[Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def satisfied(req: Requirement) -> bool:
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def non_jax(reqs):
    return [r for r in reqs if not ACCELERATOR.match(canonicalize_name(r.name))]


def installed_pins() -> list[str]:
    """name==version of every installed JAX / CUDA-plugin / NVIDIA / libtpu distribution."""
    pins = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if ACCELERATOR.match(name):
            pins[name] = dist.version
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def cmd_requirements(args):
    print("\n".join(str(r) for r in non_jax(project_requirements())))


def cmd_missing(args):
    reqs = project_requirements()
    for r in reqs:
        if ACCELERATOR.match(canonicalize_name(r.name)) and not satisfied(r):
            have = metadata.version(r.name) if _installed(r.name) else "none"
            print(
                f"gpu_check: warning: flaxchat is tested with {r}, this environment has {r.name} {have}; "
                "it is kept as it is",
                file=sys.stderr,
            )
    missing = [str(r) for r in non_jax(reqs) if not satisfied(r)]
    print("\n".join(missing))


def _installed(name) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def cmd_pins(args):
    print("\n".join(installed_pins()))


# -----------------------------------------------------------------------------
# Environment: which backend, which devices


def nvidia_smi() -> dict | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return {
        "gpus": [line.strip() for line in out.stdout.strip().splitlines()],
        "driver_cuda_version": cuda.group(1) if cuda else None,
    }


def cmd_env(args):
    info = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": installed_pins(),
        "nvidia_smi": nvidia_smi(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "JAX_PLATFORMS",
                "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "JAX_COMPILATION_CACHE_DIR",
                "XLA_FLAGS",
                "CUDA_VISIBLE_DEVICES",
            )
        },
    }
    try:
        import jax

        devices = jax.devices()
        info.update(
            backend=jax.default_backend(),
            jax=jax.__version__,
            device_count=len(devices),
            device_kind=devices[0].device_kind,
            devices=[str(d) for d in devices],
        )
        stats = devices[0].memory_stats() or {}
        if "bytes_limit" in stats:
            info["device_memory_gb"] = round(stats["bytes_limit"] / 2**30, 2)
        error = None
        if args.expect_backend:
            from flaxchat.sharding import check_backend  # here: the pin checks run before JAX is installed

            try:
                check_backend(args.expect_backend)
            except ValueError as e:
                error = str(e)
    except (RuntimeError, AssertionError) as e:  # JAX_PLATFORMS names a backend that cannot start
        platforms = os.environ.get("JAX_PLATFORMS") or "default"
        reason = (str(e).strip().splitlines() or [""])[0][:500]
        if not reason:  # what JAX raises when no plugin provides the platform at all
            plugins = [p for p in info["packages"] if re.match(r"jax-cuda\d+-plugin", p)]
            reason = f"no backend provides it (installed CUDA plugins: {', '.join(plugins) or 'none'})"
        info.update(backend=None, error=reason)
        error = f"JAX could not start its {platforms} backend: {reason}"
    print(json.dumps(info, indent=2))
    if error:
        where = "a GPU" if args.expect_backend == "gpu" else f"the {args.expect_backend} backend"
        print(
            f"gpu_check: JAX is not on {where}: {error}\n"
            "gpu_check: install JAX with CUDA first (pip install -e '.[cuda12]' -c requirements/cuda12.txt, or "
            "'.[cuda13]'), check that nvidia-smi sees the GPU, or run `bash runs/gpu_check.sh --cpu` for the CPU "
            "smoke run.",
            file=sys.stderr,
        )
        sys.exit(1)


# -----------------------------------------------------------------------------
# A serving tokenizer with nanochat's vocabulary size, without a corpus


def pseudo_text(n_words, n_types, seed=0):
    """Lines of made-up words with Zipf-distributed frequencies. flaxchat's synthetic stories use ~4k distinct
    tokens' worth of merges; these give BPE enough distinct pairs for a 32k-65k vocabulary, so an offline serving
    benchmark pays for a real-sized lm_head and sampler."""
    import numpy as np

    rng = np.random.default_rng(seed)
    onsets = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "tr", "st", "br", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "y"]
    syllables = np.array([c + v for c in onsets for v in vowels] + [c + v + "n" for c in onsets for v in vowels[:5]])
    words = np.array(["".join(rng.choice(syllables, n)) for n in rng.integers(1, 5, n_types)])
    p = 1.0 / np.arange(1, n_types + 1)
    tokens = words[rng.choice(n_types, n_words, p=p / p.sum())]
    for i in range(0, n_words, 100):
        yield " ".join(tokens[i : i + 100]) + ".\n"


def cmd_tokenizer(args):
    from flaxchat.data.tokenizer import Tokenizer, get_tokenizer  # here: the pin checks run without it

    target = os.path.join(args.base_dir, "tokenizer")
    try:
        if get_tokenizer(args.base_dir).get_vocab_size() == args.vocab_size:
            print(f"tokenizer: reusing {target} (vocab {args.vocab_size:,})")
            return
    except FileNotFoundError:
        pass
    n_words = args.words or max(50_000, 60 * args.vocab_size)
    tok = Tokenizer.train_from_iterator(pseudo_text(n_words, n_types=6 * args.vocab_size), args.vocab_size)
    tok.save(target)
    print(f"tokenizer: vocab {tok.get_vocab_size():,} from {n_words:,} made-up words -> {target}")


# -----------------------------------------------------------------------------
# Report: every step's output in one JSON and one markdown table


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


def summary_markdown(report) -> str:
    env, lines = report["env"], []
    kind = env.get("device_kind", "?")
    lines += [
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
    t = report["tests"]
    if t.get("not_run"):
        lines += ["", "## Tests", "", "not run (`--only`)"]
    else:
        lines += [
            "",
            "## Tests",
            "",
            f"`{t.get('command', 'pytest -m gpu')}`: {t['passed']} passed, {t['failed']} "
            f"failed, {t['errors']} errors, {t['skipped']} skipped ({fmt(t['seconds'], '.1f')} s)",
        ]
        if t["skipped_because"]:
            lines += [""] + [f"- skipped {s}" for s in t["skipped_because"][:8]]
    lines += [
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
    lines += [
        "",
        "## Generation",
        "",
        "KV-cache engine, random prompts, every row makes every token (`python -m scripts.bench --what generate`).",
        "",
    ]
    if report["generate"] or "generate" in report.get("sections", SECTIONS):
        lines += table(
            report["generate"],
            [
                "model",
                "batch",
                "prompt + new",
                "decode tok/s",
                "time to first token ms",
                "prefill tok/s",
                "compile s",
                "peak mem GiB",
            ],
            generate_row,
        )
    else:
        lines.append("not run (`--only`)")
    s = report["serve"]
    lines += [
        "",
        "## Serving",
        "",
        "`python -m scripts.chat_web --random-init --load-test ...`: concurrent WebSocket "
        "clients against the in-process server (continuous batching), median over rounds.",
        "",
    ]
    if s.get("not_run"):
        lines.append("not run (`--only`)")
    elif s["ok"]:
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
    else:
        lines.append("failed: see report.json")
    return "\n".join(lines) + "\n"


SECTIONS = ("tests", "train", "real", "generate", "serve")


def cmd_report(args):
    out, sections = args.out, set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        sys.exit(f"error: --sections: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SECTIONS)})")
    env_path = os.path.join(out, "env.json")
    env = json.load(open(env_path)) if os.path.exists(env_path) else {}
    not_run = lambda name: {"name": name, "ok": True, "not_run": True}  # left out by --only
    serve = read_step(out, "serve") if "serve" in sections else not_run("serve")
    tests = read_tests(out, args.mode) if "tests" in sections else not_run("tests")
    # the real pipeline's data and tokenizer: a failure there leaves its training rows out, so it fails the report
    prepared = [
        read_step(out, n, json_out=False)
        for n in ("real_data", "real_tokenizer")
        if os.path.exists(os.path.join(out, f"{n}.cmd"))
    ]
    report = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "mode": args.mode,
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
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    md = summary_markdown(report)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    sys.exit(0 if report["ok"] else 1)


# -----------------------------------------------------------------------------
# Lock: the tested versions + the CUDA wheels pip resolves for them (maintainers; needs PyPI)


def dependency_closure(reqs) -> dict[str, str]:
    """name -> installed version for every distribution `reqs` pull in here (markers evaluated, extras followed)."""
    found, stack = {}, [(r, tuple(sorted(r.extras))) for r in reqs]
    seen = set()
    while stack:
        req, extras = stack.pop()
        key = (canonicalize_name(req.name), extras)
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)
        found[canonicalize_name(req.name)] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or ("",))):
                stack.append((sub, tuple(sorted(sub.extras))))
    return found


def cmd_lock(args):
    flavour = args.flavour
    tested = dependency_closure(project_requirements())
    jax_version = tested["jax"]
    with tempfile.TemporaryDirectory() as tmp:
        pins = os.path.join(tmp, "tested.txt")
        with open(pins, "w") as f:
            f.write("\n".join(f"{n}=={v}" for n, v in sorted(tested.items())) + "\n")
        pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check"]
        report = os.path.join(tmp, "report.json")
        subprocess.run(
            pip
            + [
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--index-url",
                PYPI,
                "--report",
                report,
                "-c",
                pins,
                f"jax[{flavour}]=={jax_version}",
            ],
            check=True,
        )
        resolved = {
            canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.load(open(report))["install"]
        }
        extra = {n: v for n, v in resolved.items() if n not in tested}
        path = os.path.join(ROOT, "requirements", f"{flavour}.txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cuda = flavour.removeprefix("cuda")
        header = "".join(
            f"# {line}\n"
            for line in [
                f"flaxchat with CUDA {cuda}: the versions the test suite runs against, as a pip constraints file:",
                f'  pip install -e ".[{flavour}]" -c requirements/{flavour}.txt',
                f"Produced by `python -m scripts.gpu_check lock {flavour}` on {datetime.date.today()}. "
                "The first block is",
                "the installed closure of flaxchat[dev]'s dependencies where `python -m pytest -n 2` passes",
                f"(Linux {platform.machine()}, CPython {platform.python_version()}, CPU). The second is what pip "
                f"{metadata.version('pip')} resolved against",
                f"PyPI for jax[{flavour}]=={jax_version} under those pins; a dry-run install of "
                f'-e ".[{flavour},dev]" with this file',
                "then resolved. Resolved, not run, on a GPU: `bash runs/gpu_check.sh` on a GPU machine checks it "
                "works.",
                "The pins are plain versions, so other Linux platforms and Pythons with wheels of them can use it too.",
            ]
        )
        body = (
            "\n# tested stack (flaxchat[dev] closure)\n"
            + "".join(f"{n}=={v}\n" for n, v in sorted(tested.items()))
            + f"\n# CUDA {cuda} plugin and NVIDIA libraries for jax {jax_version} (resolved against PyPI)\n"
            + "".join(f"{n}=={v}\n" for n, v in sorted(extra.items()))
        )
        with open(path, "w") as f:
            f.write(header + body)
        subprocess.run(
            pip
            + [
                "install",
                "--dry-run",
                "--ignore-installed",
                "--quiet",
                "--index-url",
                PYPI,
                "-c",
                path,
                "-e",
                f"{ROOT}[{flavour},dev]",
            ],
            check=True,
        )
    print(f"wrote {path}: {len(tested)} tested + {len(extra)} CUDA {cuda} pins; a dry-run install resolved with it")


# -----------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        description="Helpers for runs/gpu_check.sh (install, environment, tokenizer, report, lock).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements", help="flaxchat[dev] requirements except JAX and its CUDA/TPU packages, one a line")
    sub.add_parser("missing", help="the requirements above that this environment does not satisfy")
    sub.add_parser("pins", help="name==version of the installed JAX / CUDA plugin / NVIDIA / libtpu packages")
    e = sub.add_parser("env", help="JAX backend and devices as JSON; exit 1 unless on --expect-backend")
    e.add_argument("--expect-backend", choices=["cpu", "gpu", "tpu"], default=None)
    t = sub.add_parser("tokenizer", help="train a tokenizer on made-up words into BASE_DIR/tokenizer (for serving)")
    t.add_argument("--vocab-size", type=int, default=32768)
    t.add_argument("--base-dir", required=True)
    t.add_argument("--words", type=int, default=None, help="words of text (default: 60 per vocabulary entry)")
    r = sub.add_parser("report", help="collect a gpu_check output folder into report.json and summary.md")
    r.add_argument("out")
    r.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    r.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="the sections gpu_check.sh ran (its --only), comma-separated; the others are not checked",
    )
    lk = sub.add_parser("lock", help="rewrite requirements/<flavour>.txt (needs PyPI)")
    lk.add_argument("flavour", choices=["cuda12", "cuda13"])
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    {
        "requirements": cmd_requirements,
        "missing": cmd_missing,
        "pins": cmd_pins,
        "env": cmd_env,
        "tokenizer": cmd_tokenizer,
        "report": cmd_report,
        "lock": cmd_lock,
    }[args.command](args)


if __name__ == "__main__":
    main()
