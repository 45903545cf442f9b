"""Synthetic conversations for offline chat training: identity, arithmetic with the calculator, story requests.

    IdentityChat(size=500, split="train")         # "Who are you?" -> "I'm flaxchat, a small language model ..."
    ArithmeticProblems(size=2000, split="train")  # word problems solved with calculator tool calls, "#### 48"
    StoryRequests(size=500, split="train")        # "Tell me a story about a girl named Lily." -> a story
    arithmetic_problem(index, split, seed)        # one problem as (question, answer) for RL reward checks

No package registry ships SmolTalk or GSM8K train, so offline SFT teaches the chat format with these, next
to SpellingBee / SimpleSpelling (tasks/spellingbee.py) and MMLU / ARC multiple choice. RL trains on
ArithmeticProblems(split="train") and measures pass@k on the held-out ArithmeticProblems(split="val").

Every example is a pure function of (seed, split, index). Train and val are disjoint by construction: an
example's user text hashes (crc32, stable across processes) to one split, and an example is redrawn from
its own random stream until it lands in the split asked for. Stories come from flaxchat.data.stories' own split,
whose val stories never equal a train story.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from flaxchat.data.stories import WORDS, generate_story, split_index
from flaxchat.generate.sandbox import use_calculator
from tasks.common import Task, completion_text
from tasks.gsm8k import extract_answer

SPLITS = ("train", "val")
VAL_SHARE = 8  # one user text in VAL_SHARE is reserved for val


def split_of_text(text: str) -> str:
    """The split a user text belongs to (crc32, not hash(): stable whatever PYTHONHASHSEED is)."""
    return "val" if zlib.crc32(text.encode("utf-8")) % VAL_SHARE == 0 else "train"


def _check_split(name: str, split: str, size: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"{name} split must be train or val, got {split!r}")
    if size < 1:
        raise ValueError(f"{name} size must be positive, got {size}")


def _draw_in_split(stream: str, split: str, make: Callable[[random.Random], dict]) -> dict:
    """Draw make(rng) from the random stream `stream` until its user text belongs to `split`.

    About 1 in VAL_SHARE draws is val, so a val example takes ~VAL_SHARE draws; 200 without a hit would
    mean the generator has too few distinct questions, which is a bug worth hearing about.
    """
    rng = random.Random(stream)  # a str seed is hashed with SHA-512: stable across processes
    for _ in range(200):
        example = make(rng)
        user_text = "\n".join(m["content"] for m in example["messages"] if m["role"] == "user")
        if split_of_text(user_text) == split:
            return example
    raise RuntimeError(f"no {split} example in 200 draws of {stream!r}; the generator is too narrow")


def _casual(rng: random.Random, text: str) -> str:
    """People type questions in lower case and drop the question mark now and then."""
    if rng.random() < 0.25:
        text = text.lower()
    if text.endswith("?") and rng.random() < 0.2:
        text = text[:-1]
    return text


# -----------------------------------------------------------------------------
# Identity


GREETINGS = ("Hi!", "Hello!", "Hey there.", "Hi there!", "Good morning!", "Hello, friend.", "Hey!", "Greetings.")
GREETING_REPLIES = (
    "Hello! I'm flaxchat. How can I help you today?",
    "Hi! I'm flaxchat, a small assistant. What would you like to talk about?",
    "Hey! Nice to meet you. I'm flaxchat. What can I do for you?",
    "Hello there! Ask me anything, and I will do my best to help.",
)
# topic -> (ways to ask, ways to answer); every answer is true of this project
IDENTITY_TOPICS = {
    "name": (
        (
            "Who are you?",
            "What is your name?",
            "What's your name?",
            "What should I call you?",
            "Do you have a name?",
            "Tell me about yourself.",
            "Introduce yourself, please.",
            "What are you?",
            "Who am I talking to?",
            "Can you tell me who you are?",
        ),
        (
            "I'm flaxchat, a small language model trained with JAX. I'm here to chat and help with simple tasks.",
            "My name is flaxchat. I am a small language model, trained from scratch with JAX and Flax.",
            "I'm flaxchat: a small chat assistant. I was trained with JAX, so I'm a tiny cousin of nanochat.",
            "You can call me flaxchat. I'm a small language model trained with JAX, and I'm happy to help.",
        ),
    ),
    "maker": (
        (
            "Who made you?",
            "Who created you?",
            "Who built you?",
            "Where do you come from?",
            "Which company made you?",
            "Who trained you?",
            "Who is your creator?",
            "Who developed you?",
        ),
        (
            "I was built by the flaxchat project, which rewrites Andrej Karpathy's nanochat in JAX. Every step, "
            "from the tokenizer to pretraining and fine-tuning, runs in JAX.",
            "The flaxchat project made me. It takes nanochat, a small open-source chat model pipeline, and "
            "rebuilds it with JAX, Flax, Optax and Orbax.",
            "I come from flaxchat, an open-source project. It trains small chat models like me with JAX, on "
            "anything from a laptop CPU to a TPU pod.",
        ),
    ),
    "training": (
        (
            "How were you trained?",
            "What framework were you trained with?",
            "Are you built with PyTorch?",
            "What software runs you?",
            "How did you learn to talk?",
            "Were you trained with JAX?",
        ),
        (
            "I was trained with JAX. First I read a lot of text during pretraining, then I was fine-tuned on "
            "conversations like this one, and finally I practised math problems with reinforcement learning.",
            "I'm a JAX model: my weights live in Flax, Optax updated them, and Orbax saved them. I learned from "
            "pretraining text first and from example conversations after that.",
            "Not PyTorch: I was trained with JAX and Flax. Pretraining taught me language, supervised fine-tuning "
            "taught me to chat, and reinforcement learning helped with arithmetic.",
        ),
    ),
    "skills": (
        (
            "What can you do?",
            "How can you help me?",
            "What are you good at?",
            "What are your abilities?",
            "Can you do math?",
            "What kind of questions can you answer?",
            "What do you know how to do?",
        ),
        (
            "I can chat, tell short stories, spell words and count letters, answer multiple-choice questions, and "
            "solve simple arithmetic word problems with a calculator tool. I'm small, so please double-check me.",
            "I can tell you a story, count the letters in a word, or work out a simple math problem with my "
            "calculator. I'm a small model and I make mistakes, so check anything important.",
            "Simple things: short stories, spelling, letter counting and arithmetic word problems, where I use a "
            "calculator tool. For hard questions I'm not the right assistant: I'm a very small model.",
        ),
    ),
    "nature": (
        (
            "Are you a human?",
            "Are you ChatGPT?",
            "Are you alive?",
            "Are you a robot?",
            "Are you a person?",
            "Are you smart?",
            "Are you a big model?",
            "Do you have feelings?",
        ),
        (
            "No, I'm flaxchat, a small language model trained with JAX. I'm a program, not a person.",
            "I'm not a person, and I'm not ChatGPT either. I'm flaxchat, a small model trained with JAX.",
            "I'm a computer program called flaxchat: a small language model trained with JAX. I don't have "
            "feelings, but I'm glad to help.",
        ),
    ),
}
THANKS = ("Thank you!", "Thanks!", "Thanks, that helps.", "Cool, thanks.", "Great, thank you.")
THANKS_REPLIES = ("You're welcome!", "Happy to help!", "Any time!", "You're welcome. Ask me anything else.")


def _identity_conversation(rng: random.Random) -> dict:
    """One to three turns: maybe a greeting first, a question about the assistant, maybe a thank-you."""
    topic = rng.choice(sorted(IDENTITY_TOPICS))
    questions, answers = IDENTITY_TOPICS[topic]
    question = _casual(rng, rng.choice(questions))
    messages = []
    style = rng.random()
    if style < 0.2:  # greeting as its own turn
        messages += [
            {"role": "user", "content": rng.choice(GREETINGS)},
            {"role": "assistant", "content": rng.choice(GREETING_REPLIES)},
        ]
    elif style < 0.45:  # greeting in the same message
        question = f"{rng.choice(GREETINGS)} {question}"
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": rng.choice(answers)}]
    if rng.random() < 0.15:
        messages += [
            {"role": "user", "content": rng.choice(THANKS)},
            {"role": "assistant", "content": rng.choice(THANKS_REPLIES)},
        ]
    return {"messages": messages}


class IdentityChat(Task):
    """Who the assistant is: flaxchat, a small model trained with JAX (nanochat's identity conversations)."""

    def __init__(self, size: int = 500, split: str = "train", seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        _check_split("IdentityChat", split, size)
        self.size, self.split, self.seed = size, split, seed

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        return _draw_in_split(f"flaxchat-identity:{self.seed}:{self.split}:{index}", self.split, _identity_conversation)


# -----------------------------------------------------------------------------
# Arithmetic word problems with the calculator tool


ITEMS = (
    "apples",
    "cookies",
    "marbles",
    "stickers",
    "pencils",
    "crayons",
    "books",
    "cards",
    "shells",
    "balloons",
    "stamps",
    "eggs",
    "flowers",
    "beads",
    "buttons",
    "carrots",
    "grapes",
    "toy cars",
    "blocks",
    "ribbons",
)
MADE = ("cookies", "cupcakes", "bracelets", "paper stars", "sandwiches", "paper boats", "muffins", "kites")
CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "bowls")
PRICED = (
    ("notebook", "notebooks"),
    ("toy car", "toy cars"),
    ("ball", "balls"),
    ("kite", "kites"),
    ("book", "books"),
    ("cupcake", "cupcakes"),
    ("sandwich", "sandwiches"),
    ("puzzle", "puzzles"),
    ("box of crayons", "boxes of crayons"),
)


@dataclass
class Problem:
    """A word problem and its worked solution as assistant parts (text, python, python_output, ...)."""

    question: str
    parts: list[dict]
    answer: int

    def conversation(self) -> dict:
        return {
            "messages": [
                {"role": "user", "content": self.question},
                {"role": "assistant", "content": [dict(p) for p in self.parts]},
            ]
        }


def _solution(*pieces) -> tuple[list[dict], int]:
    """Assistant parts from text pieces and ("calc", expr) tool calls, ending in "#### answer".

    Each tool output is what the Engine's calculator prints for the expression at run time, so SFT shows
    the model exactly the tokens it will be given when it samples. Division is written `//` so the result
    prints as an integer (use_calculator("24/6") prints "4.0", which would then need rewriting as "#### 4").
    """
    parts, value = [], None
    for piece in pieces:
        if isinstance(piece, tuple):
            value = use_calculator(piece[1])
            if value is None:
                raise ValueError(f"the calculator cannot evaluate {piece[1]!r}")
            parts += [{"type": "python", "text": piece[1]}, {"type": "python_output", "text": value}]
        else:
            parts.append({"type": "text", "text": piece})
    answer = int(value)
    parts[-1]["text"] += f"\n#### {answer}"  # the last piece is always text
    return parts, answer


def _people(rng: random.Random) -> tuple[str, str, str, str]:
    """(name, he/she, He/She, another child's name)."""
    girl = rng.random() < 0.5
    name = rng.choice(WORDS.girl_names if girl else WORDS.boy_names)
    friend = rng.choice([n for n in WORDS.girl_names[:30] + WORDS.boy_names[:30] if n != name])
    he = "she" if girl else "he"
    return name, he, he.capitalize(), friend


# One function per kind of problem: (question, (parts, answer)). The tool does the arithmetic; the model has to
# copy the right numbers (up to three digits) into the right expressions.


def _add(rng):
    name, he, He, _ = _people(rng)
    a, b, item = rng.randint(2, 400), rng.randint(2, 300), rng.choice(ITEMS)
    q = f"{name} has {a} {item}. {He} gets {b} more. How many {item} does {name} have now?"
    return q, _solution(
        f"{name} starts with {a} {item} and gets {b} more, so {he} has {a} + {b} = ",
        ("calc", f"{a}+{b}"),
        f" {a + b} {item}.",
    )


def _subtract(rng):
    name, he, He, friend = _people(rng)
    a = rng.randint(10, 900)
    b, item = rng.randint(1, a - 1), rng.choice(ITEMS)
    q = f"{name} had {a} {item}. {He} gave {b} of them to {friend}. How many {item} does {name} have left?"
    return q, _solution(
        f"{name} had {a} {item} and gave away {b}, so {he} has {a} - {b} = ",
        ("calc", f"{a}-{b}"),
        f" {a - b} {item} left.",
    )


def _multiply(rng):
    a, b = rng.randint(2, 40), rng.randint(2, 60)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    q = f"There are {a} {box} with {b} {item} in each. How many {item} are there in all?"
    return q, _solution(f"{a} {box} with {b} {item} each make {a} * {b} = ", ("calc", f"{a}*{b}"), f" {a * b} {item}.")


def _divide(rng):
    name, he, He, _ = _people(rng)
    b, k = rng.randint(2, 19), rng.randint(2, 60)
    a, item = b * k, rng.choice(ITEMS)
    q = f"{name} has {a} {item} and shares them equally among {b} friends. How many {item} does each friend get?"
    return q, _solution(
        f"{a} {item} shared equally among {b} friends gives each friend {a} / {b} = ",
        ("calc", f"{a}//{b}"),
        f" {k} {item}.",
    )


def _price(rng):
    name, he, He, _ = _people(rng)
    a, b, (thing, _) = rng.randint(2, 99), rng.randint(2, 19), rng.choice(PRICED)
    q = f"A {thing} costs ${a}. {name} buys {b} of them. How many dollars does {name} spend?"
    return q, _solution(f"{b} of them at ${a} each cost {b} * {a} = $", ("calc", f"{b}*{a}"), f"{a * b}.")


def _rate(rng):
    name, he, He, _ = _people(rng)
    a, b = rng.randint(2, 90), rng.randint(2, 30)
    q = f"{name} reads {a} pages every day. How many pages does {he} read in {b} days?"
    return q, _solution(f"{a} pages a day for {b} days is {a} * {b} = ", ("calc", f"{a}*{b}"), f" {a * b} pages.")


def _older(rng):
    name, he, He, friend = _people(rng)
    a, b = rng.randint(3, 60), rng.randint(1, 40)
    q = f"{name} is {a} years old. {friend} is {b} years older than {name}. How old is {friend}?"
    return q, _solution(f"{friend} is {a} + {b} = ", ("calc", f"{a}+{b}"), f" {a + b} years old.")


def _packs_plus(rng):
    name, he, He, _ = _people(rng)
    a, b, c, item = rng.randint(2, 20), rng.randint(2, 30), rng.randint(1, 200), rng.choice(ITEMS)
    q = (
        f"{name} buys {a} packs of {item} with {b} {item} in each pack. {He} already had {c} {item}. "
        f"How many {item} does {he} have now?"
    )
    return q, _solution(
        f"The packs hold {a} * {b} = ",
        ("calc", f"{a}*{b}"),
        f" {a * b} {item}. Adding the {c} {he} had gives {a * b} + {c} = ",
        ("calc", f"{a * b}+{c}"),
        f" {a * b + c} {item}.",
    )


def _buy_then_give(rng):
    name, he, He, friend = _people(rng)
    a, b, item = rng.randint(5, 400), rng.randint(2, 300), rng.choice(ITEMS)
    c = rng.randint(1, a + b - 1)
    q = (
        f"{name} has {a} {item}. {He} buys {b} more and then gives {c} to {friend}. "
        f"How many {item} does {name} have now?"
    )
    return q, _solution(
        f"After buying, {name} has {a} + {b} = ",
        ("calc", f"{a}+{b}"),
        f" {a + b} {item}. After giving {c} away, {he} has {a + b} - {c} = ",
        ("calc", f"{a + b}-{c}"),
        f" {a + b - c} {item}.",
    )


def _change(rng):
    name, he, He, _ = _people(rng)
    b, c, (_, things) = rng.randint(2, 12), rng.randint(2, 30), rng.choice(PRICED)
    a = rng.randint(b * c, b * c + 200)
    q = f"{name} has ${a}. {He} buys {b} {things} that cost ${c} each. How many dollars does {he} have left?"
    return q, _solution(
        f"The {things} cost {b} * {c} = $",
        ("calc", f"{b}*{c}"),
        f"{b * c}. {name} has ${a} - ${b * c} = $",
        ("calc", f"{a}-{b * c}"),
        f"{a - b * c} left.",
    )


# Harder kinds: three steps, an unstated intermediate quantity, or a number that does not matter. The tool still
# does the arithmetic; the model has to pick the right numbers and operations, which a small model gets wrong
# often enough for RL to have something to improve.


def _three_steps(rng):
    name, he, He, friend = _people(rng)
    a, b, c, item, box = (
        rng.randint(2, 200),
        rng.randint(2, 20),
        rng.randint(2, 40),
        rng.choice(ITEMS),
        rng.choice(CONTAINERS),
    )
    d = rng.randint(1, a + b * c - 1)
    q = (
        f"{name} has {a} {item}. {He} buys {b} {box} with {c} {item} in each, and then gives {d} {item} to "
        f"{friend}. How many {item} does {name} have now?"
    )
    x, y = b * c, a + b * c
    return q, _solution(
        f"The {box} hold {b} * {c} = ",
        ("calc", f"{b}*{c}"),
        f" {x} {item}. With the {a} {he} had, {he} has {a} + {x} = ",
        ("calc", f"{a}+{x}"),
        f" {y} {item}. After giving {d} to {friend}, {he} has {y} - {d} = ",
        ("calc", f"{y}-{d}"),
        f" {y - d} {item}.",
    )


def _fewer_together(rng):
    name, he, He, friend = _people(rng)
    a, item = rng.randint(10, 600), rng.choice(ITEMS)
    b = rng.randint(1, a - 1)
    q = f"{name} has {a} {item}. {friend} has {b} fewer {item} than {name}. How many {item} do they have together?"
    return q, _solution(
        f"{friend} has {a} - {b} = ",
        ("calc", f"{a}-{b}"),
        f" {a - b} {item}. Together they have {a} + {a - b} = ",
        ("calc", f"{a}+{a - b}"),
        f" {2 * a - b} {item}.",
    )


def _times_more(rng):
    name, he, He, friend = _people(rng)
    a, b, item = rng.randint(2, 90), rng.randint(2, 12), rng.choice(ITEMS)
    q = (
        f"{name} has {a} {item}. {friend} has {b} times as many {item} as {name}. "
        f"How many more {item} does {friend} have than {name}?"
    )
    return q, _solution(
        f"{friend} has {a} * {b} = ",
        ("calc", f"{a}*{b}"),
        f" {a * b} {item}. That is {a * b} - {a} = ",
        ("calc", f"{a * b}-{a}"),
        f" {a * b - a} more than {name}.",
    )


def _hours(rng):
    name, he, He, _ = _people(rng)
    a, start, item = rng.randint(3, 60), rng.randint(6, 11), rng.choice(MADE)
    end = rng.randint(start + 1, 18)
    q = (
        f"{name} makes {a} {item} every hour. {He} works from {start} o'clock until {end} o'clock. "
        f"How many {item} does {he} make?"
    )
    return q, _solution(
        f"{He} works {end} - {start} = ",
        ("calc", f"{end}-{start}"),
        f" {end - start} hours, so {he} makes {a} * {end - start} = ",
        ("calc", f"{a}*{end - start}"),
        f" {a * (end - start)} {item}.",
    )


def _split_cost(rng):
    n = rng.randint(2, 9)
    total = n * rng.randint(3, 60)
    a = rng.randint(1, total - 1)
    b = total - a
    q = (
        f"{n} friends buy a pizza for ${a} and drinks for ${b}. They split the cost equally. "
        f"How many dollars does each friend pay?"
    )
    return q, _solution(
        f"Everything costs {a} + {b} = $",
        ("calc", f"{a}+{b}"),
        f"{total}. Split {n} ways, each friend pays {total} / {n} = $",
        ("calc", f"{total}//{n}"),
        f"{total // n}.",
    )


def _distractor(rng):
    name, he, He, _ = _people(rng)
    age, a, b, c = rng.randint(5, 12), rng.randint(5, 500), rng.randint(2, 300), rng.randint(2, 400)
    item, other = rng.sample(ITEMS, 2)
    if rng.random() < 0.5:
        q = f"{name} is {age} years old. {He} has {a} {item} and finds {b} more. How many {item} does {name} have?"
        return q, _solution(
            f"{name}'s age does not matter here. {He} has {a} + {b} = ", ("calc", f"{a}+{b}"), f" {a + b} {item}."
        )
    a = max(a, b + 1)
    q = f"{name} has {a} {item} and {c} {other}. {He} gives away {b} {item}. How many {item} are left?"
    return q, _solution(f"Only the {item} matter: {a} - {b} = ", ("calc", f"{a}-{b}"), f" {a - b} {item} are left.")


def _savings(rng):
    name, he, He, _ = _people(rng)
    a, w = rng.randint(2, 60), rng.randint(2, 20)
    b = rng.randint(1, a * w - 1)
    q = f"{name} saves ${a} every week for {w} weeks. Then {he} spends ${b}. How many dollars does {he} have left?"
    return q, _solution(
        f"{He} saves {a} * {w} = $",
        ("calc", f"{a}*{w}"),
        f"{a * w}. After spending ${b}, {he} has {a * w} - {b} = $",
        ("calc", f"{a * w}-{b}"),
        f"{a * w - b} left.",
    )


def _trip(rng):
    n, a, b = rng.randint(3, 30), rng.randint(2, 20), rng.randint(2, 12)
    c = n * (a + b) + rng.randint(0, 200)
    q = (
        f"{n} children go on a trip. Each ticket costs ${a} and each lunch costs ${b}. The teacher pays for all "
        f"of it with ${c}. How many dollars of change does the teacher get?"
    )
    x, y = a + b, n * (a + b)
    return q, _solution(
        f"One child costs {a} + {b} = $",
        ("calc", f"{a}+{b}"),
        f"{x}. All {n} children cost {n} * {x} = $",
        ("calc", f"{n}*{x}"),
        f"{y}. The change is {c} - {y} = $",
        ("calc", f"{c}-{y}"),
        f"{c - y}.",
    )


PROBLEM_KINDS = (
    _add,
    _subtract,
    _multiply,
    _divide,
    _price,
    _rate,
    _older,
    _packs_plus,
    _buy_then_give,
    _change,
    _three_steps,
    _fewer_together,
    _times_more,
    _hours,
    _split_cost,
    _distractor,
    _savings,
    _trip,
)


def make_problem(rng: random.Random) -> Problem:
    """One random word problem (one to three calculator steps) with its worked solution."""
    question, (parts, answer) = rng.choice(PROBLEM_KINDS)(rng)
    return Problem(question, parts, answer)


def arithmetic_problem(index: int, split: str = "train", seed: int = 0) -> Problem:
    """Problem number `index` of `split`; a pure function of (index, split, seed)."""
    if index < 0:
        raise ValueError(f"problem index must be >= 0, got {index}")
    _check_split("arithmetic_problem", split, 1)
    holder = {}

    def make(rng):
        problem = make_problem(rng)
        holder["problem"] = problem
        return problem.conversation()

    _draw_in_split(f"flaxchat-arithmetic:{seed}:{split}:{index}", split, make)
    return holder["problem"]


class ArithmeticProblems(Task):
    """Generated word problems answered with calculator tool calls in GSM8K's format ("#### 48" at the end).

    Generative and scored exactly as GSM8K: the number after "####" must equal the reference answer.
    """

    def __init__(self, size: int = 2000, split: str = "train", seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        _check_split("ArithmeticProblems", split, size)
        self.size, self.split, self.seed = size, split, seed

    @property
    def eval_type(self) -> str:
        return "generative"

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        problem = arithmetic_problem(index, self.split, self.seed)
        return {**problem.conversation(), "answer": str(problem.answer)}

    def evaluate(self, conversation: dict, completion) -> int:
        """1 if the number after "####" in the completion equals the answer, else 0 (as GSM8K)."""
        reference = conversation.get("answer") or extract_answer(
            completion_text(conversation["messages"][-1]["content"])
        )
        predicted = extract_answer(completion_text(completion))
        return int(predicted is not None and predicted == reference)


# -----------------------------------------------------------------------------
# Story requests answered with the synthetic stories


_NAMES = frozenset(WORDS.girl_names) | frozenset(WORDS.boy_names)
_ANIMAL_WORDS = tuple(
    dict.fromkeys(
        [a.noun for a in WORDS.animals] + [k.kind for k in WORDS.pet_kinds] + [b.baby for b in WORDS.lost_babies]
    )
)
_FIRST_SENTENCE = re.compile(r"^.*?[.!?](?=\s|$)")


def story_facts(story: str) -> dict:
    """What a request can mention: the hero's name and kind (from the opening) and an animal in the story."""
    first = _FIRST_SENTENCE.match(story).group(0)
    words = re.findall(r"[A-Za-z]+", first)
    name = next((w for w in words if w in _NAMES), None)
    kind = next((w for w in words if w in ("girl", "boy")), None)
    if kind is None and name is not None:
        kind = "girl" if name in WORDS.girl_names else "boy"
    lowered = story.lower()
    animal = next((a for a in _ANIMAL_WORDS if re.search(rf"\b{a}\b", lowered)), None)
    return {"first_sentence": first, "name": name, "kind": kind, "animal": animal}


def story_request(rng: random.Random, facts: dict) -> str:
    """A user's request that this story answers: it names only what the story really contains."""
    name, kind, animal = facts["name"], facts["kind"], facts["animal"]
    generic = [
        "Tell me a story.",
        "Can you tell me a short story?",
        "Write a short story for kids.",
        f"Tell me a story that starts like this: {facts['first_sentence']}",
        f"Continue this story: {facts['first_sentence']}",
    ]
    options = []
    if name:
        options += [
            f"Tell me a story about a {kind} named {name}.",
            f"Can you write a short story about {name}?",
            f"Write a story for children about a little {kind} called {name}.",
            f"Please tell me a bedtime story about {name}.",
        ]
    if animal:
        options += [f"Tell me a story with a {animal} in it.", f"I'd like a story about a {animal}, please."]
        if name:
            options += [f"Tell me a story about {name} and a {animal}."]
    # mostly a request the story answers specifically; sometimes a plain "tell me a story"
    return _casual(rng, rng.choice(options if options and rng.random() < 0.75 else generic))


class StoryRequests(Task):
    """A request for a story, answered with a story from flaxchat.data.stories that fits it.

    Train examples use train stories and val examples val stories (flaxchat.data.stories keeps those apart);
    stories longer than max_words are skipped so the reply fits a small model's context whole.
    """

    def __init__(self, size: int = 500, split: str = "train", seed: int = 0, max_words: int = 250, **kwargs):
        super().__init__(**kwargs)
        _check_split("StoryRequests", split, size)
        if max_words < 100:
            raise ValueError(f"max_words must be at least 100 (the shortest stories), got {max_words}")
        self.size, self.split, self.seed, self.max_words = size, split, seed, max_words

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        rng = random.Random(f"flaxchat-story-requests:{self.seed}:{self.split}:{index}")
        story_split = "val" if self.split == "val" else "train"
        while True:  # about half of all stories fit 250 words; each try is a fresh story
            story = generate_story(split_index(story_split, rng.randrange(10**7)), seed=self.seed)
            if len(story.split()) <= self.max_words:
                break
        request = story_request(rng, story_facts(story))
        return {"messages": [{"role": "user", "content": request}, {"role": "assistant", "content": story}]}
