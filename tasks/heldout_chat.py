"""A held-out check of a small chat model, scoreable on any prompt file.

    python -m tasks.heldout_chat --base-dir DIR                          # the demo's check on DIR's chat model
    python -m tasks.heldout_chat --prompts FILE.json --base-dir DIR      # your own prompts, the same rules
    python -m tasks.heldout_chat --write-prompts FILE.json               # the demo's check, as a prompt file

A prompt file is JSON with any of these keys:
    "identity":   ["question", ...]                          pass: the reply names itself flaxchat
    "arithmetic": [["question", answer], ...]                pass: its final number is the answer
    "stories":    [["request", ["word", ...]], ...]          pass: a story (40+ words, not an answer about the
                                                             assistant) that names any of the words
    "multi_turn": [[["user turn 1", "user turn 2", ...], "expected"], ...]
                  the earlier assistant turns are the model's own replies; pass: the last reply says `expected`
                  (a number: its final number is that number; else the words, case aside, as whole words)
A reply's final number is the one after its last "####", else its last number. Every reply is greedy.

The demo's own check (demo_prompts(), run at the end of scripts/run_tinystories.py) is built from the check banks
of the generators only (tasks/word_problems.json, tasks/chat_phrasings.json): its word problems, story requests
and conversations are phrased in ways no training example is, with names, cities, pets and story subjects no
training example uses. tests/test_heldout_chat.py proves that no check phrasing appears in the training data.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys

from flaxchat.data.story_world import WORDS
from flaxchat.generate.engine import Engine
from flaxchat.train.checkpoint import load_model
from tasks.synthetic_chat import (
    PHRASES,
    followup_conversation,
    recall_conversation,
    things_conversation,
)
from tasks.word_problems import DATA, SCENES, make_problem

CATEGORIES = ("identity", "arithmetic", "stories", "multi_turn")
STORY_MIN_WORDS = 40

# questions about the assistant in phrasings the identity generator never writes
IDENTITY = (
    "Hey there, who is this?",
    "What do people call you?",
    "Are you a person or a computer program?",
    "Tell me your name, please.",
    "Which team is behind you?",
    "Say a little about what you are.",
    "Who wrote the program that runs you?",
    "Before we start: what are you called?",
    "Got a name I can use?",
    "What kind of program am I typing to?",
    "Who trained the model I'm chatting with?",
    "Any idea what your own name is?",
)
# story subjects no story, request or word list of the training data names (half the check's story requests): a
# story about one of them has to take the word from the request
CHECK_SUBJECTS = tuple(PHRASES["story_subjects"]["check"])
CHECK_OBJECTS = ("a silver spoon", "a paper boat", "a green umbrella", "a striped sock")
N_ARITHMETIC, N_STORIES = 24, 8


# --- the pass rules ---------------------------------------------------------------------------------------------


def identity_ok(reply: str) -> bool:
    return "flaxchat" in reply.lower()


def final_number(reply: str) -> int | None:
    """The answer a reply gives: the number after its last "####", else its last number (commas allowed)."""
    marked = re.findall(r"####\s*(-?[\d,]+)", reply)
    numbers = marked or re.findall(r"-?\d[\d,]*", reply)
    if not numbers:
        return None
    try:
        return int(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def names_any(reply: str, words) -> bool:
    """Whether the reply has any of the words as a whole word (case aside; a plural "s"/"es" allowed)."""
    return any(re.search(rf"\b{re.escape(w)}(?:e?s)?\b", reply, re.IGNORECASE) for w in words)


def story_ok(reply: str, words=()) -> bool:
    """A story of some length rather than an answer about the assistant, naming one of `words` (any, when none)."""
    is_story = len(reply.split()) >= STORY_MIN_WORDS and not identity_ok(reply)
    return is_story and (not words or names_any(reply, words))


def says(reply: str, expected: str) -> bool:
    """A multi-turn reply's pass rule: a number is its final number; words appear whole, case aside."""
    expected = str(expected).strip()
    if re.fullmatch(r"-?\d+", expected):
        return final_number(reply) == int(expected)
    return re.search(rf"(?<!\w){re.escape(expected)}(?!\w)", reply, re.IGNORECASE) is not None


# --- prompt files -----------------------------------------------------------------------------------------------


def check_prompts(prompts: dict) -> dict:
    """The prompt file's content, checked: a ValueError with one sentence saying what is wrong."""
    if not isinstance(prompts, dict):
        raise ValueError("a prompt file holds a JSON object with keys " + ", ".join(CATEGORIES))
    unknown = sorted(set(prompts) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in the prompt file; the keys are " + ", ".join(CATEGORIES))
    shapes = {
        "identity": lambda x: isinstance(x, str),
        "arithmetic": lambda x: len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], (int, float, str)),
        "stories": lambda x: len(x) == 2 and isinstance(x[0], str) and isinstance(x[1], list) and x[1],
        "multi_turn": lambda x: (
            len(x) == 2 and isinstance(x[0], list) and x[0] and all(isinstance(t, str) for t in x[0])
        ),
    }
    forms = {
        "identity": '"question"',
        "arithmetic": '["question", answer]',
        "stories": '["request", ["word", ...]]',
        "multi_turn": '[["user turn", ...], "expected"]',
    }
    for key, items in prompts.items():
        if not isinstance(items, list):
            raise ValueError(f'"{key}" must be a list of {forms[key]}')
        for i, item in enumerate(items):
            try:
                ok = shapes[key](item)
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f'"{key}" item {i} must be {forms[key]}, got {json.dumps(item)[:80]}')
    return prompts


def load_prompts(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            prompts = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"prompt file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    return check_prompts(prompts)


# --- the demo's check, from the check banks ---------------------------------------------------------------------


def _story_request(rng: random.Random, subject: str, name: str) -> tuple[str, list[str]]:
    """A request in the check bank's words about a subject no training story has."""
    bank = lambda key: PHRASES[key]["check"]  # noqa: E731
    a_kind = ("an " if subject[0] in "aeiou" else "a ") + subject
    s = rng.choice(bank("hero_subject")).format(kind=subject, name=name, a_kind=a_kind)
    if rng.random() < 0.5:
        thing = rng.choice(CHECK_OBJECTS)
        extra = bank("with_find") + (bank("with_toy") if "whose" not in s else [])  # one "whose" at most
        s = rng.choice(extra).format(s=s, toy_noun=thing.split()[-1], find=thing)
    return rng.choice(bank("story_frames")).format(s=s), [subject]


def demo_prompts(seed: int = 0) -> dict:
    """The demo's check as a prompt file: identity questions, word problems, story requests and conversations, all
    from the check banks (fixed by `seed`)."""
    rng = random.Random(f"flaxchat-heldout:{seed}")
    scenes = rng.sample([scene for scene, _ in SCENES], N_ARITHMETIC)  # a problem of each of most scenes
    arithmetic = [make_problem(rng, "check", scene) for scene in scenes]
    names = [name for name, _ in DATA["check_names"]]
    # half the story subjects are of the stories' world (a fox, a pirate, a robot), half are words no training text
    # has (an otter): those the model can only copy from the request
    world = sorted(k if isinstance(k, str) else k["kind"] for group in WORDS.heroes.values() for k in group)
    subjects = rng.sample(world, N_STORIES // 2) + rng.sample(CHECK_SUBJECTS, N_STORIES - N_STORIES // 2)
    stories = [_story_request(rng, s, rng.choice(names)) for s in subjects]
    conversations = (
        [recall_conversation(rng, "check") for _ in range(6)]
        + [things_conversation(rng, "check") for _ in range(2)]
        + [followup_conversation(rng, "check") for _ in range(4)]
    )
    return {
        "identity": list(IDENTITY),
        "arithmetic": [[p.question, p.answer] for p in arithmetic],
        "stories": [[request, words] for request, words in stories],
        "multi_turn": [
            [[m["content"] for m in c["messages"] if m["role"] == "user"], c["expected"]] for c in conversations
        ],
    }


# --- running a model on a prompt file ---------------------------------------------------------------------------


def chat_replies(engine, tokenizer, conversations: list[list[str]], max_tokens: int) -> list[list[str]]:
    """Greedy replies to each conversation's user turns, turn by turn, each turn's prompt holding the model's own
    earlier replies token for token (tool calls and their outputs included). A turn that no longer fits the
    model's context gets the reply "" (it fails)."""
    special = tokenizer.encode_special
    bos, assistant_end = tokenizer.get_bos_token_id(), special("<|assistant_end|>")
    capacity = engine.capacity
    tokens = [[bos] for _ in conversations]
    replies: list[list[str]] = [[] for _ in conversations]
    for turn in range(max(len(c) for c in conversations)):
        rows = [i for i, c in enumerate(conversations) if turn < len(c)]
        prompts = {}
        for i in rows:
            user = [special("<|user_start|>"), *tokenizer.encode(conversations[i][turn]), special("<|user_end|>")]
            ids = tokens[i] + user + [special("<|assistant_start|>")]
            if len(ids) + 8 <= capacity:
                prompts[i] = ids
            else:
                tokens[i], replies[i] = ids, replies[i] + [""]
        if not prompts:
            continue
        outs = engine.generate_batches(list(prompts.values()), max_tokens=max_tokens, temperature=0.0, seeds=0)
        for (i, ids), (sequences, _) in zip(prompts.items(), outs):
            replies[i].append(tokenizer.decode(sequences[0][len(ids) :]))
            tokens[i] = sequences[0] + [assistant_end]
    return replies


def run_check(engine, tokenizer, prompts: dict, max_tokens: int = 200) -> list[dict]:
    """Every prompt of a prompt file answered (greedy) and judged: [{category, prompt, replies, passed}]."""
    prompts = check_prompts(prompts)
    items = []  # (category, user turns, rule)
    for q in prompts.get("identity", []):
        items.append(("identity", [q], identity_ok))
    for q, answer in prompts.get("arithmetic", []):
        items.append(("arithmetic", [q], lambda r, a=answer: final_number(r) == int(float(a))))
    for q, words in prompts.get("stories", []):
        items.append(("stories", [q], lambda r, w=words: story_ok(r, w)))
    for turns, expected in prompts.get("multi_turn", []):
        items.append(("multi_turn", turns, lambda r, e=expected: says(r, e)))
    if not items:
        return []
    replies = chat_replies(engine, tokenizer, [turns for _, turns, _ in items], max_tokens)
    return [
        {"category": c, "prompt": turns, "replies": r, "passed": bool(rule(r[-1]))}
        for (c, turns, rule), r in zip(items, replies)
    ]


def score(results: list[dict]) -> dict[str, tuple[int, int]]:
    """{category: (passed, asked)}, categories in CATEGORIES order."""
    out = {}
    for category in CATEGORIES:
        mine = [r["passed"] for r in results if r["category"] == category]
        if mine:
            out[category] = (sum(mine), len(mine))
    return out


def summary(scores: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{k} {p}/{n}" for k, (p, n) in scores.items())


def print_results(results: list[dict], file=sys.stdout) -> None:
    """Each prompt and the model's whole reply (every turn of a conversation), marked pass or miss."""
    for r in results:
        mark = "pass" if r["passed"] else "MISS"
        for k, (turn, reply) in enumerate(zip(r["prompt"], r["replies"])):
            head = f"  [{r['category']} {mark}]" if k == 0 else "   " + " " * len(f"[{r['category']} {mark}]")
            print(f"{head} USER: {turn}\n      -> {' '.join(reply.split())}", file=file, flush=True)


# --- CLI --------------------------------------------------------------------------------------------------------


def main(argv=None):
    p = argparse.ArgumentParser(description="Score a chat model on a held-out prompt file (greedy replies).")
    p.add_argument("--prompts", type=str, default=None, help="the prompt file (default: the demo's check)")
    p.add_argument(
        "--base-dir", type=str, default=None, help="the base dir holding the model (default: $FLAXCHAT_BASE_DIR)"
    )
    p.add_argument("--source", choices=["sft", "rl", "base"], default="sft", help="which checkpoints (default: sft)")
    p.add_argument("--model-tag", type=str, default=None, help="the model tag (default: the only or newest one)")
    p.add_argument("--step", type=int, default=None, help="the checkpoint step (default: the last)")
    p.add_argument("--max-tokens", type=int, default=200, help="tokens per reply at most (default: 200)")
    p.add_argument("--json", type=str, default=None, help="also write every prompt, reply and verdict to this file")
    p.add_argument("--write-prompts", type=str, default=None, help="write the demo's check as a prompt file, then stop")
    args = p.parse_args(argv)
    if args.write_prompts:
        with open(args.write_prompts, "w", encoding="utf-8") as f:
            json.dump(demo_prompts(), f, indent=1)
        print(f"wrote the demo's check to {args.write_prompts}")
        return
    try:
        prompts = load_prompts(args.prompts) if args.prompts else demo_prompts()
    except ValueError as e:
        p.error(str(e))
    try:
        model, tokenizer, _ = load_model(args.source, args.model_tag, args.step, base_dir=args.base_dir)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    results = run_check(Engine(model, tokenizer), tokenizer, prompts, args.max_tokens)
    print_results(results)
    print(f"\nheld-out ({args.prompts or 'the demo check'}, greedy): {summary(score(results))}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"scores": score(results), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
