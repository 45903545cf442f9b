"""The world of flaxchat's synthetic stories (flaxchat.data.stories writes them): the words, the plots' sentences,
word forms, the heroes, and which (hero name, opening) pairs are kept for validation stories.

The words and sentences are data files beside this module. story_words.json is the world: names,
the heroes' kinds, family, feelings, toys, places (each with the spots where a thing can hide, the activities as
base-form verb phrases, and for adventures its finds and one sentence describing it), animals (the
places they live in, the food a child may offer, how they move, in the past tense) and the word-form
exceptions. story_plots.json holds the story openings and, for each plot, its pieces (fears, lessons,
gifts, ...) and its beats: sentence templates in the order they are told, filled by `str.format`
from the story's cast (`{h.name}`, `{h.he}`, `{p.kind}`: see `Person`, `Thing` and `stories.Story.tell`).
"""

from __future__ import annotations

import json
import random
import re
import zlib
from importlib import resources
from types import SimpleNamespace

# --- the data files -----------------------------------------------------------------------------


def read_data(name: str):
    """One of this package's JSON files, through importlib.resources so that an installed wheel finds it."""
    return json.loads(resources.files("flaxchat.data").joinpath(name).read_text(encoding="utf-8"))


def records(items: list[dict], **defaults) -> list[SimpleNamespace]:
    """JSON objects as records, so templates can name their fields: `{place.name}`, `{fear.worry}`."""
    return [SimpleNamespace(**{**defaults, **item}) for item in items]


def load_words() -> SimpleNamespace:
    """story_words.json; a place without its own days and weather has the common ones."""
    words = read_data("story_words.json")
    for name in ("pet_kinds", "family", "toys", "animals", "lost_babies"):
        words[name] = records(words[name])
    words["places"] = [
        SimpleNamespace(at=f"{p.prep} {p.name}", to=f"to {p.name}", **vars(p))
        for p in records(words["places"], days=words["days"], weather=words["weather"], finds=[])
    ]
    words["feelings"] = SimpleNamespace(**words["feelings"])
    return SimpleNamespace(**words)


def load_plots() -> dict:
    """story_plots.json; in each plot's entry, the lists of objects (fears, gifts, ...) become records."""
    plots = read_data("story_plots.json")
    for name, entry in plots.items():
        if isinstance(entry, dict):
            for key, value in entry.items():
                if key != "beats" and isinstance(value, list) and value and isinstance(value[0], dict):
                    entry[key] = records(value)
            plots[name] = SimpleNamespace(**entry)
    return plots


WORDS = load_words()
PLACE = {p.key: p for p in WORDS.places}
PLOT_TEXT = load_plots()

# --- word forms ---------------------------------------------------------------------------------

_DOUBLE_FINAL = frozenset(WORDS.double_final)  # verbs that double their last letter: "swim" -> "swimming"


def past(phrase: str) -> str:
    """Past tense of a verb phrase's first word: "fly a kite" -> "flew a kite"."""
    verb, _, rest = phrase.partition(" ")
    if verb in WORDS.irregular_past:
        out = WORDS.irregular_past[verb]
    elif verb in _DOUBLE_FINAL:
        out = verb + verb[-1] + "ed"
    elif verb.endswith("e"):
        out = verb + "d"
    elif verb.endswith("y") and verb[-2] not in "aeiou":
        out = verb[:-1] + "ied"
    else:
        out = verb + "ed"
    return f"{out} {rest}".strip()


def ing(phrase: str) -> str:
    """-ing form of a verb phrase's first word: "ride the seesaw" -> "riding the seesaw"."""
    verb, _, rest = phrase.partition(" ")
    if verb in _DOUBLE_FINAL:
        out = verb + verb[-1] + "ing"
    elif verb.endswith("ie"):
        out = verb[:-2] + "ying"
    elif verb.endswith("e") and not verb.endswith(("ee", "ye", "oe")):
        out = verb[:-1] + "ing"
    else:
        out = verb + "ing"
    return f"{out} {rest}".strip()


def article(phrase: str) -> str:
    """ "a" or "an" for a phrase, by the sound of its first word."""
    first = phrase.split()[0].lower()
    vowel_sound = first[0] in "aeiou" and not first.startswith(("uni", "use", "one"))
    return "an" if vowel_sound else "a"


# --- openings and the split ---------------------------------------------------------------------
# Every story opens with one of the INTROS, naming its hero. A fixed sixth of all (hero name, opening)
# pairs is reserved for validation stories and never used by training stories, so the split of a
# story can be read off its first sentence (`split_of`) and no validation story can equal a training
# story, while every name and every opening still appears in both splits.

INTROS = PLOT_TEXT["intros"]
_INTRO_FIELDS = {
    "{h.name}": r"(?P<name>[A-Z][a-z]+)",
    "{h.kind}": "[a-z]+(?: [a-z]+)?",
    "{h.a_kind}": "an? [a-z]+(?: [a-z]+)?",
    "{h.his}": "(?:his|her)",
    "{h.He}": "(?:He|She)",
    "{trait}": "[a-z]+",
    "{a_trait}": "an? [a-z]+",
    "{town}": "[a-z]+",
    "{age}": "[a-z]+",
}


def intro_pattern(template: str) -> re.Pattern:
    """A regex matching the sentences an opening template can make; group `name` is the hero's name."""
    pattern = re.escape(template)
    for field, sub in _INTRO_FIELDS.items():
        pattern = pattern.replace(re.escape(field), sub)
    return re.compile(pattern)


INTRO_PATTERNS = tuple(intro_pattern(t) for t in INTROS)


def is_val_pair(name: str, intro: int) -> bool:
    """Whether (hero name, opening number) is reserved for validation stories."""
    # crc32, not hash(): the reservation must not change with PYTHONHASHSEED.
    return zlib.crc32(f"{name}/{intro}".encode()) % 6 == 0


HERO_SHARES = {"child": 0.45, "animal": 0.35, "role": 0.1, "thing": 0.1}
# heroes with a made-up name ("Zoodra") or of a made-up kind ("a little blimket"): words a model has never seen,
# repeated through the story, so pretraining practises copying a word it cannot know from memory
INVENTED_NAME_SHARE, INVENTED_KIND_SHARE = 0.2, 0.1
_KNOWN = frozenset(
    re.findall(
        r"[a-z]+", json.dumps(WORDS.__dict__, default=vars).lower() + json.dumps(PLOT_TEXT, default=vars).lower()
    )
)


def invented_word(rng: random.Random) -> str:
    """A made-up word ("blimket", "zoodra") of one or two syllables, never one the stories use otherwise."""
    parts = WORDS.invented
    while True:
        syllables = [rng.choice(parts["onsets"]) + rng.choice(parts["vowels"]) + rng.choice(parts["codas"])]
        syllables += [rng.choice(parts["onsets"]) + rng.choice(parts["vowels"]) for _ in range(rng.randint(0, 1))]
        word = "".join(syllables) + rng.choice(parts["endings"])
        if 4 <= len(word) <= 9 and word not in _KNOWN:
            return word


HERO_PAIRS = {
    (val, girl): tuple(
        (name, k)
        for name in (WORDS.girl_names if girl else WORDS.boy_names)
        for k in range(len(INTROS))
        if is_val_pair(name, k) == val
    )
    for val in (False, True)
    for girl in (False, True)
}

# --- characters and things ----------------------------------------------------------------------


class Person:
    """A character with the pronouns that belong to them: `{h.He} lost {h.his} ball.`"""

    def __init__(self, name: str, girl: bool, kind: str | None = None, **extra):
        self.name, self.girl, self.kind = name, girl, kind or ("girl" if girl else "boy")
        self.a_kind = f"{article(self.kind)} {self.kind}"
        self.he, self.him, self.his, self.himself = (
            ("she", "her", "her", "herself") if girl else ("he", "him", "his", "himself")
        )
        self.He, self.His = self.he.capitalize(), self.his.capitalize()
        self.__dict__.update(extra)


class Thing:
    """An object or animal, always called by the same words: `{toy.a}` = "a red ball", `{toy.the}`."""

    def __init__(self, noun: str, adj: str = "", **extra):
        self.noun = noun
        self.name = f"{adj} {noun}" if adj else noun
        self.a = f"{article(self.name)} {self.name}"
        self.the = f"the {self.name}"
        self.__dict__.update(extra)
