"""A held-out check of a small chat model: identity questions in phrasings the offline SFT data never uses,
two-step arithmetic word problems with names and numbers it never draws, and story requests.

The laptop demo ends with it (scripts/run_tinystories.py): greedy replies, one score per category. A reply passes by
the rule a person applies at a glance: it names itself flaxchat; its final answer (after "####", else its last
number) is the right one; it tells a story of some length rather than answering as the assistant. Nothing here is
ever trained on: tests/test_heldout_chat.py checks the prompts against the generators in tasks/synthetic_chat.py.
"""

from __future__ import annotations

import re

IDENTITY = (
    "Hey there, who is this?",
    "What do people call you?",
    "Are you a person or a computer program?",
    "Tell me your name, please.",
    "Which team is behind you?",
    "Say a little about what you are.",
    "Who wrote the program that runs you?",
    "Before we start: what are you called?",
)

# (question, answer): two steps each, names outside the story generator's lists
ARITHMETIC = (
    (
        "Ingrid has 37 shells. She finds 18 more and then gives 12 to her brother. How many shells does she have now?",
        43,
    ),
    ("Kwame buys 6 packs of 14 stickers and loses 9 of them. How many stickers does he have left?", 75),
    ("Astrid has 250 beads. She uses 68 for a necklace and 47 for a bracelet. How many beads are left?", 135),
    ("Soren reads 23 pages on Monday and twice as many on Tuesday. How many pages does he read in the two days?", 69),
    ("Imani has 5 boxes of 12 crayons. She gives away 17 crayons. How many crayons does she keep?", 43),
    ("Dmitri saves 15 dollars a week for 8 weeks and then spends 46 dollars. How many dollars does he have?", 74),
    (
        "Lucia picks 84 apples and shares them equally among 7 baskets, then eats 3 from one basket. How many apples "
        "are left in that basket?",
        9,
    ),
    ("A train has 9 cars with 32 seats each. 118 seats are taken. How many seats are empty?", 170),
)

STORIES = (
    "Tell me a story about a fox who finds a red hat.",
    "Can you tell me a short story about two friends at the beach?",
    "Write a story about a little robot who is afraid of the dark.",
    "Tell me a bedtime story about a turtle and a kite.",
)

STORY_MIN_WORDS = 40


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


def story_ok(reply: str) -> bool:
    return len(reply.split()) >= STORY_MIN_WORDS and not identity_ok(reply)


def prompts() -> list[tuple[str, str]]:
    """(category, prompt) for every check, in a fixed order."""
    return (
        [("identity", p) for p in IDENTITY]
        + [("arithmetic", q) for q, _ in ARITHMETIC]
        + [("stories", p) for p in STORIES]
    )


def score(replies: list[str]) -> dict[str, tuple[int, int]]:
    """{category: (passed, asked)} for replies in prompts()' order."""
    checks = (
        [identity_ok] * len(IDENTITY)
        + [lambda r, a=a: final_number(r) == a for _, a in ARITHMETIC]
        + [story_ok] * len(STORIES)
    )
    if len(replies) != len(checks):
        raise ValueError(f"expected {len(checks)} replies, got {len(replies)}")
    out: dict[str, list[int]] = {}
    for (category, _), check, reply in zip(prompts(), checks, replies):
        passed, asked = out.setdefault(category, [0, 0])
        out[category] = [passed + int(check(reply)), asked + 1]
    return {k: (p, n) for k, (p, n) in out.items()}


def summary(scores: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{k} {p}/{n}" for k, (p, n) in scores.items())
