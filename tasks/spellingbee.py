"""Synthetic letter counting and spelling, generated from an English word list.

    SpellingBee(size=1000, split="train")   # "How many r are in strawberry?" answered by spelling the word
                                            # out, counting, then checking with the calculator tool
    SimpleSpelling(size=1000)               # "Spell the word: strawberry" -> "strawberry:s,t,r,a,w,b,e,r,r,y"

Tokenizers hide a word's letters inside multi-letter tokens; these tasks teach the model to spell a word
out and count over the letters, and to confirm with the tool. Example i is generated from a seed
derived from (split, i), so a task is deterministic and train and test never share a seed.

The word list comes from, in order: Debian's wamerican (/usr/share/dict/american-english), or the
offline pack's words.txt (npm an-array-of-english-words, else PyPI wordfreq; see tasks/offline.py).
"""

from __future__ import annotations

import functools
import os
import random
import string

from tasks import offline
from tasks.common import Task, completion_text
from tasks.gsm8k import extract_answer

SPLIT_SEEDS = {"train": 0, "test": 10_000_000}  # test seeds start far beyond any train index

# (template, is it a question?) -- questions sometimes end without "?", the way people type
QUESTIONS = (
    ("How many {letter} are in the word {word}", True),
    ("How many times does the letter {letter} appear in {word}", True),
    ("Count the letter {letter} in {word}.", False),
    ("How often does {letter} occur in the word {word}", True),
    ("In the word {word}, how many {letter}s are there", True),
    ("What is the number of {letter} in {word}", True),
    ("Tell me how many {letter} the word {word} has.", False),
    ("How many {letter}'s does {word} contain", True),
    ("Can you count how many times {letter} shows up in {word}", True),
    ("{word}: how many {letter}", True),
)


@functools.lru_cache(maxsize=1)
def load_words() -> tuple[list[str], str]:
    """(words, where they came from): plain lowercase words of 3+ letters, sorted."""
    if os.path.exists(offline.SYSTEM_DICT):
        with open(offline.SYSTEM_DICT, encoding="utf-8", errors="replace") as f:
            return offline.clean_words(f), f"Debian wamerican ({offline.SYSTEM_DICT})"
    path = offline.words_path()
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            words = offline.clean_words(f)
        source = offline.read_manifest().get("words", {}).get("source", "the offline pack")
        return words, f"{source} ({path})"
    raise FileNotFoundError(
        f"SpellingBee needs an English word list: install Debian's wamerican (apt-get install wamerican) or "
        f"{offline.FETCH_HINT} (it fetches npm {offline.NPM_WORDS}, else PyPI {offline.WORDFREQ})."
    )


def _quote(rng: random.Random, text: str) -> str:
    """The text bare or in quotes, as people write it."""
    quote = rng.choice(("", "'", '"'))
    return f"{quote}{text}{quote}"


class SpellingBee(Task):
    """How many times does a letter occur in a word? Generative, scored on the number after ####."""

    def __init__(self, size: int = 1000, split: str = "train", **kwargs):
        super().__init__(**kwargs)
        if split not in SPLIT_SEEDS:
            raise ValueError(f"SpellingBee split must be train or test, got {split!r}")
        if size < 1:
            raise ValueError(f"SpellingBee size must be positive, got {size}")
        self.size, self.split = size, split
        self.words, self.words_source = load_words()

    @property
    def eval_type(self) -> str:
        return "generative"

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        rng = random.Random(SPLIT_SEEDS[self.split] + index)
        word = rng.choice(self.words)
        # mostly a letter of the word; sometimes any letter, so "0" is an answer the model also sees
        letter = rng.choice(word) if rng.random() < 0.9 else rng.choice(string.ascii_lowercase)
        template, is_question = rng.choice(QUESTIONS)
        question = template.format(letter=_quote(rng, letter), word=_quote(rng, word))
        if rng.random() < 0.3:
            question = question.lower()
        if is_question and rng.random() < 0.7:
            question += "?"
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": counting_parts(word, letter)},
            ]
        }

    def evaluate(self, conversation: dict, completion) -> int:
        """1 if the number after #### in the completion is the true count, else 0."""
        ref = extract_answer(completion_text(conversation["messages"][-1]["content"]))
        pred = extract_answer(completion_text(completion))
        return int(pred is not None and pred == ref)


def counting_parts(word: str, letter: str) -> list[dict]:
    """The assistant's answer: spell the word, count hits one letter at a time, confirm with the tool."""
    count = word.count(letter)
    lines = [
        f"We need to count the letter '{letter}' in the word '{word}'. Spelling it out:",
        f"{word}:{','.join(word)}",
        "",
        f"Going through the letters and counting each '{letter}':",
    ]
    seen = 0
    for position, char in enumerate(word, 1):
        if char == letter:
            seen += 1
            lines.append(f"{position}:{char} yes, count={seen}")
        else:
            lines.append(f"{position}:{char}")
    lines += ["", f"That makes {count}. Let me check with Python:", ""]
    return [
        {"type": "text", "text": "\n".join(lines)},
        {"type": "python", "text": f"'{word}'.count('{letter}')"},
        {"type": "python_output", "text": str(count)},
        {"type": "text", "text": f"\n\nBoth ways give {count}, so the answer is:\n\n#### {count}"},
    ]


class SimpleSpelling(Task):
    """Spell a word letter by letter: the skill SpellingBee's counting builds on."""

    def __init__(self, size: int = 1000, split: str = "train", **kwargs):
        super().__init__(**kwargs)
        if split not in SPLIT_SEEDS:
            raise ValueError(f"SimpleSpelling split must be train or test, got {split!r}")
        if size < 1:
            raise ValueError(f"SimpleSpelling size must be positive, got {size}")
        self.size, self.split = size, split
        self.words, self.words_source = load_words()

    @property
    def eval_type(self) -> str:
        return "generative"

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        # a different stream of words than SpellingBee's for the same index
        word = random.Random(SPLIT_SEEDS[self.split] + 5_000_000 + index).choice(self.words)
        return {
            "messages": [
                {"role": "user", "content": f"Spell the word: {word}"},
                {"role": "assistant", "content": f"{word}:{','.join(word)}"},
            ]
        }

    def evaluate(self, conversation: dict, completion) -> bool:
        return completion_text(completion).strip() == conversation["messages"][-1]["content"]
