"""Chat-task evaluation (flaxchat/eval/chat.py): categorical by letter logits, generative via an Engine.

The categorical path runs the tiny GPT and must pick, for every question, the same letter as a forward pass
of that prompt alone restricted to its letters. The generative path runs the real tasks (GSM8K, HumanEval,
SpellingBee) on tiny offline packs with a scripted stand-in engine whose completions are chosen by the test,
and the real flaxchat Engine on the tiny GPT.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tasks.common as common
from flaxchat.eval import chat as chat_eval
from flaxchat.generate.engine import Engine
from tasks import offline
from tasks.common import Task, render_mc
from tasks.gsm8k import GSM8K, extract_answer
from tasks.humaneval import HumanEval
from tasks.spellingbee import SpellingBee, load_words


@pytest.fixture(scope="module")
def tiny_gpt(tok):
    from flaxchat.model.config import GPTConfig
    from flaxchat.model.gpt import GPT

    config = GPTConfig(sequence_len=128, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=2, n_embd=64)
    model = GPT(config, rngs=nnx.Rngs(0))
    w = model.lm_head.weight  # sharper logits than the init's, so letters are told apart
    w[...] = 0.5 * np.random.default_rng(1).standard_normal(w.shape).astype(np.float32)
    return model


@pytest.fixture(autouse=True)
def _offline(monkeypatch, tmp_path):
    monkeypatch.setattr(common, "hub_reachable", lambda: False)
    monkeypatch.setattr(offline, "SYSTEM_DICT", str(tmp_path / "no-system-dict"))
    load_words.cache_clear()
    yield
    load_words.cache_clear()


# -----------------------------------------------------------------------------
# Categorical


class Letters(Task):
    """Multiple-choice questions with 2 to 5 letters; records the letter the eval picked for each."""

    def __init__(self, items):
        super().__init__()
        self.items, self.picked = items, {}

    @property
    def eval_type(self):
        return "categorical"

    def num_examples(self):
        return len(self.items)

    def get_example(self, index):
        question, choices, answer = self.items[index]
        letters = "ABCDE"[: len(choices)]
        return {
            "messages": [
                {"role": "user", "content": render_mc(question, letters, choices)},
                {"role": "assistant", "content": answer},
            ],
            "letters": tuple(letters),
            "index": index,
        }

    def evaluate(self, conversation, completion):
        self.picked[conversation["index"]] = completion
        return completion == conversation["messages"][-1]["content"]


ITEMS = [
    ("What do cats like?", ["fish", "rocks", "rain"], "A"),
    ("Which is a color?", ["red", "dog", "run", "sky", "hat"], "A"),
    ("Where do birds live?", ["nests", "cars"], "B"),
    ("What is big?", ["an ant", "a whale", "a pea", "a bee"], "B"),
    ("Pick the animal.", ["lamp", "cow", "cup"], "B"),
]


@nnx.jit
def _logits(model, idx):
    return model(idx)


def test_categorical_batched_equals_each_prompt_alone(tiny_gpt, tok):
    task = Letters(ITEMS)
    acc = chat_eval.run_categorical_eval(task, tok, tiny_gpt, batch_size=2)
    for i in range(len(task)):
        conversation = task[i]
        prompt = tok.render_for_completion(conversation)
        assert len(prompt) <= 128
        padded = np.zeros((1, 128), np.int32)
        padded[0, : len(prompt)] = prompt
        last = np.asarray(_logits(tiny_gpt, jnp.asarray(padded)))[0, len(prompt) - 1]
        letters = conversation["letters"]
        ids = chat_eval.letter_token_ids(tok, letters)
        assert task.picked[i] == letters[int(np.argmax(last[ids]))]  # only the question's own letters compete
    assert acc == pytest.approx(np.mean([task.picked[i] == ITEMS[i][2] for i in range(len(ITEMS))]))
    assert chat_eval.run_categorical_eval(task, tok, tiny_gpt, batch_size=8, max_problems=2) in (0.0, 0.5, 1.0)
    assert set(task.picked) == set(range(len(ITEMS)))


def test_letters_must_be_single_tokens(tok):
    with pytest.raises(ValueError, match="single-token letters"):
        chat_eval.letter_token_ids(tok, ["A", "Answer"])


# -----------------------------------------------------------------------------
# Generative, with a scripted stand-in for the Engine


class ScriptedEngine:
    """generate_batches like the Engine's: per prompt, prompt + completion tokens per sample; completions from
    `reply`."""

    capacity = 10**9  # no context limit: every problem fits

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.calls = tokenizer, reply, []

    def generate_batches(self, prompts, num_samples=1, max_tokens=None, temperature=0.0, top_k=None, seeds=42):
        self.calls.append(
            {
                "prompts": len(prompts),
                "num_samples": num_samples,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_k": top_k,
                "seeds": seeds,
            }
        )
        return [self.one(tokens, num_samples) for tokens in prompts]

    def one(self, tokens, num_samples):
        texts = self.reply(self.tokenizer.decode(tokens), num_samples)
        results = [list(tokens) + self.tokenizer.encode(t) for t in texts]
        return results, [[0] * len(tokens) + [1] * (len(r) - len(tokens)) for r in results]


GSM_ROWS = [
    {"question": "Tom has 1,000 apples and buys none. How many?", "answer": "He has <<1000*1=1000>>1000.\n#### 1,000"},
    {"question": "It is 3 below zero, then 2 colder. Temperature?", "answer": "-3-2=<<-3-2=-5>>-5\n#### -5"},
    {"question": "Ann has 12 boxes of 3 pens. Pens?", "answer": "12*3=<<12*3=36>>36\n#### 36"},
    {"question": "Half of 10?", "answer": "10/2=<<10/2=5>>5\n#### 5"},
]
# completions by question: commas, negatives, a calculator tool call, and a 5.0 the official check rejects
GSM_REPLIES = {
    "Tom": "He keeps them all: #### 1000",
    "It is": "Colder means lower. #### -5",
    "Ann": "<|python_start|>12*3<|python_end|><|output_start|>36<|output_end|> so #### 36",
    "Half": "#### 5.0",
}


def reply_by_question(replies):
    def reply(prompt, n):
        for key, text in replies.items():
            if key in prompt:
                return [text] * n if isinstance(text, str) else text
        raise AssertionError(f"no reply for {prompt!r}")

    return reply


def test_gsm8k_answers_after_hashes(tok):
    offline.write_jsonl(offline.pack_path("gsm8k", "test"), GSM_ROWS)
    task = GSM8K(source="offline")
    engine = ScriptedEngine(tok, reply_by_question(GSM_REPLIES))
    acc = chat_eval.run_generative_eval(task, tok, engine, max_new_tokens=64, top_k=50, seed=7, rows=3)
    assert acc == pytest.approx(3 / 4)  # "#### 5.0" is not "#### 5"
    assert engine.calls == [
        {"prompts": 3, "num_samples": 1, "max_tokens": 64, "temperature": 0.0, "top_k": 50, "seeds": 7},
        {"prompts": 1, "num_samples": 1, "max_tokens": 64, "temperature": 0.0, "top_k": 50, "seeds": 7},
    ]  # 3 problems a batch, one seed for all
    no_answer = ScriptedEngine(tok, reply_by_question({k: "I think it is 36." for k in GSM_REPLIES}))
    assert chat_eval.run_generative_eval(task, tok, no_answer) == 0.0
    assert extract_answer("#### 1,000 and #### 2") == "1000"


def test_pass_at_k_counts_a_problem_once_any_sample_passes(tok):
    offline.write_jsonl(offline.pack_path("gsm8k", "test"), GSM_ROWS[:2])
    task = GSM8K(source="offline")
    replies = {"Tom": ["#### 7", "#### 1000", "#### 9"], "It is": ["#### 5", "#### 4", "#### 3"]}
    engine = ScriptedEngine(tok, reply_by_question(replies))
    assert chat_eval.run_generative_eval(task, tok, engine, num_samples=3, temperature=1.0) == 0.5
    assert [(call["prompts"], call["num_samples"]) for call in engine.calls] == [(2, 3)]  # 8 rows: both problems
    engine.calls.clear()
    assert chat_eval.run_generative_eval(task, tok, engine, num_samples=3, temperature=1.0, rows=2) == 0.5
    assert [(call["prompts"], call["num_samples"]) for call in engine.calls] == [(1, 3), (1, 3)]  # at least one


HUMANEVAL_ROW = {
    "task_id": "HumanEval/0",
    "entry_point": "add",
    "prompt": 'from typing import List\n\n\ndef add(a: int, b: int) -> int:\n    """Sum of a and b."""\n',
    "canonical_solution": "    return a + b\n",
    "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
}


def test_humaneval_runs_the_tests_in_the_sandbox(tok):
    offline.write_jsonl(offline.pack_path("humaneval", "test"), [HUMANEVAL_ROW])
    task = HumanEval(source="offline")
    right = "Here it is:\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```"
    wrong = "```python\ndef add(a: int, b: int) -> int:\n    return a - b\n```"
    assert chat_eval.run_generative_eval(task, tok, ScriptedEngine(tok, lambda p, n: [right] * n)) == 1.0
    assert chat_eval.run_generative_eval(task, tok, ScriptedEngine(tok, lambda p, n: [wrong] * n)) == 0.0


def test_humaneval_names_its_sandbox_and_refuses_before_sampling(tok, monkeypatch, capsys):
    from flaxchat.generate import sandbox

    offline.write_jsonl(offline.pack_path("humaneval", "test"), [HUMANEVAL_ROW])
    right = "```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```"
    engine = ScriptedEngine(tok, lambda p, n: [right] * n)
    result = chat_eval.run_chat_eval("HumanEval", None, tok, engine, task=HumanEval(source="offline"))
    assert result["accuracy"] == 1.0 and result["sandbox"] == sandbox.sandbox_kind()
    assert f"tests ran in the {result['sandbox']} sandbox" in capsys.readouterr().out
    monkeypatch.setattr(sandbox, "find_bubblewrap", lambda: (None, "no bwrap here (test)"))
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "")  # the default: bubblewrap or nothing
    engine.calls.clear()
    with pytest.raises(sandbox.SandboxUnavailable, match="no bwrap here"):
        chat_eval.run_chat_eval("HumanEval", None, tok, engine, task=HumanEval(source="offline"))
    assert engine.calls == []  # refused before a single completion was sampled


def test_spellingbee_checks_the_count(tok):
    os.makedirs(os.path.dirname(offline.words_path()), exist_ok=True)
    with open(offline.words_path(), "w", encoding="utf-8") as f:
        f.write("strawberry\nbanana\nletter\nmississippi\n")
    task = SpellingBee(size=6, split="test")
    truth = {
        tuple(tok.render_for_completion(task[i])): int(
            extract_answer("".join(p["text"] for p in task[i]["messages"][-1]["content"]))
        )
        for i in range(len(task))
    }

    class Counter(ScriptedEngine):  # answers the true count plus an offset, looked up by the prompt's ids
        def one(self, tokens, num_samples):
            texts = [f"Spelling it out... #### {truth[tuple(tokens)] + self.reply}"] * num_samples
            return [list(tokens) + self.tokenizer.encode(t) for t in texts], None

    assert chat_eval.run_generative_eval(task, tok, Counter(tok, 0)) == 1.0
    assert chat_eval.run_generative_eval(task, tok, Counter(tok, 1)) == 0.0


# -----------------------------------------------------------------------------
# The real Engine


def test_generative_eval_with_the_real_engine(tiny_gpt, tok):
    offline.write_jsonl(offline.pack_path("gsm8k", "test"), GSM_ROWS[:2])
    seen = []

    class Recording(GSM8K):
        def evaluate(self, conversation, completion):
            seen.append(completion)
            return super().evaluate(conversation, completion)

    task = Recording(source="offline")
    engine = Engine(tiny_gpt, tok, capacity=256)
    acc = chat_eval.run_generative_eval(task, tok, engine, max_new_tokens=12, temperature=0.0)
    assert acc == 0.0 and len(seen) == 2  # an untrained model writes no "#### <answer>"
    for i in range(2):  # both problems in one batch, each as a call of its own
        prompt = tok.render_for_completion(task[i])
        tokens, _ = engine.generate_batch(prompt, num_samples=1, max_tokens=12, temperature=0.0, top_k=50)
        assert seen[i] == tok.decode(tokens[0][len(prompt) :]) and len(tokens[0]) - len(prompt) <= 12
    chat_eval.run_generative_eval(task, tok, engine, max_new_tokens=12, temperature=0.0, rows=1)
    assert seen[2:] == seen[:2]  # one problem a batch: the same completions


# -----------------------------------------------------------------------------
# Task table, ChatCORE, run_chat_eval


def test_chatcore_is_the_centered_mean_over_nanochats_tasks():
    accuracies = {
        "ARC-Easy": 0.5,
        "ARC-Challenge": 0.25,
        "MMLU": 1.0,
        "GSM8K": 0.1,
        "HumanEval": 0.0,
        "SpellingBee": 1.0,
    }
    score, n = chat_eval.chatcore(accuracies)
    assert n == 5 and score == pytest.approx((1 / 3 + 0 + 1 + 0.1 + 0) / 5)  # SpellingBee is reported, not averaged
    assert chat_eval.chatcore({"MMLU": 0.625}) == (pytest.approx(0.5), 1)
    assert np.isnan(chat_eval.chatcore({"SpellingBee": 1.0})[0])
    assert chat_eval.centered(0.25, 0.25) == 0.0 and chat_eval.centered(0.3, 0.0) == pytest.approx(0.3)


def test_run_chat_eval_reports_and_checks(tiny_gpt, tok):
    result = chat_eval.run_chat_eval("MMLU", tiny_gpt, tok, task=Letters(ITEMS), batch_size=4, max_problems=3)
    assert result["examples"] == 3 and result["baseline"] == 0.25 and result["eval_type"] == "categorical"
    assert result["centered"] == pytest.approx((result["accuracy"] - 0.25) / 0.75)
    offline.write_jsonl(offline.pack_path("gsm8k", "test"), GSM_ROWS)
    with pytest.raises(ValueError, match="needs an Engine"):
        chat_eval.run_chat_eval("GSM8K", tiny_gpt, tok, source="offline")
    with pytest.raises(ValueError, match="unknown chat task"):
        chat_eval.make_task("TriviaQA")
    assert isinstance(chat_eval.make_task("GSM8K", "offline"), GSM8K)


def test_problems_longer_than_the_context_are_skipped_and_counted_wrong(tiny_gpt, tok, capsys):
    """A short-context model cannot hold every problem's prompt: those count as wrong and the line says how many,
    instead of the run failing."""
    long = ("Which word names a fruit? " * 40, ["apple", "stone"], "A")  # far beyond the 128-token context
    task = Letters([long] + ITEMS[:3])
    assert len(tok.render_for_completion(task[0])) > 128
    acc = chat_eval.run_categorical_eval(task, tok, tiny_gpt, batch_size=2)
    assert 0 not in task.picked and set(task.picked) == {1, 2, 3}
    assert acc == pytest.approx(sum(task.picked[i] == ITEMS[i - 1][2] for i in (1, 2, 3)) / 4)
    assert "skipped 1 of 4 problems" in capsys.readouterr().out
    offline.write_jsonl(
        offline.pack_path("gsm8k", "test"), [{**GSM_ROWS[0], "question": "Tom? " * 300}] + GSM_ROWS[1:2]
    )
    engine = Engine(tiny_gpt, tok, capacity=128)
    acc = chat_eval.run_generative_eval(GSM8K(source="offline"), tok, engine, max_new_tokens=8, temperature=0.0)
    assert acc == 0.0 and "skipped 1 of 2 problems" in capsys.readouterr().out
