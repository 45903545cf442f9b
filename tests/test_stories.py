"""The built-in synthetic story generator: determinism, pinned output, disjoint splits, length, grammar, CLI."""

import collections
import hashlib
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest

from flaxchat.data import stories as S
from flaxchat.data import story_world as W
from scripts import stories as stories_script

_SENTENCE = re.compile(r'[^.!?]*[.!?]+"?')


@pytest.fixture(scope="module")
def train_stories():
    return S.generate_stories(2000, "train", seed=0)


@pytest.fixture(scope="module")
def val_stories():
    return S.generate_stories(2000, "val", seed=0)


def test_deterministic_for_a_seed_and_independent_of_global_random_state():
    random.seed(1)
    a = S.generate_stories(50, seed=7)
    random.seed(2)
    random.random()
    b = S.generate_stories(50, seed=7)
    assert a == b
    assert [S.generate_story(i, seed=7) for i in (0, 5, 123)] == [S.generate_story(i, seed=7) for i in (0, 5, 123)]
    assert S.generate_stories(50, seed=8) != a  # another seed, another stream
    assert len(set(a)) == len(a)


# sha256 of "\x00".join(generate_stories(3000, split, seed)), recorded when the heroes grew beyond children (animals,
# roles, things, made-up names and kinds), the openings grew to twelve and the counting plot came in. A change here
# changes the pretraining corpus and every StoryRequests conversation: if it is meant, say so in the commit and
# record the new digests.
STORY_DIGESTS = {
    ("train", 0): "51d8d30651e6fe4549077d54de8a0a4181ea54a4c4243f9cd4f7e55d0dd5d678",
    ("train", 7): "ecb579083634d6852d3ea6a1a7a1102114efb27dcfcd6d003ecda6a554d1fd62",
    ("val", 0): "5dfb6ab47e9f7242a04692a46315cac751844e78aa303a55a2574f2840e5b3d2",
    ("val", 7): "4405b90ce25b833e7e480bfd9f8e8e6fc5c6d8193c554dc26ee0978b3b949c36",
}


@pytest.mark.parametrize("split,seed", sorted(STORY_DIGESTS))
def test_stories_never_drift(split, seed):
    stories = S.generate_stories(3000, split, seed)
    assert hashlib.sha256("\x00".join(stories).encode()).hexdigest() == STORY_DIGESTS[split, seed]


def test_same_stories_in_a_fresh_process_with_another_hash_seed():
    code = "from flaxchat.data.stories import generate_stories; print(repr(generate_stories(5, seed=3)))"
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=pathlib.Path(__file__).parent.parent,
    )
    assert out.stdout.strip() == repr(S.generate_stories(5, seed=3))


def test_iter_generate_and_start_agree():
    it = S.iter_stories("train", seed=1)
    first = [next(it) for _ in range(120)]
    assert first == S.generate_stories(120, "train", seed=1)
    assert S.generate_stories(10, "train", seed=1, start=95) == first[95:105]  # crosses a val index (99)
    val_it = S.iter_stories("val", seed=1, start=3)
    assert next(val_it) == S.generate_story(3 * S.VAL_EVERY + S.VAL_EVERY - 1, seed=1)


def test_split_indices_are_disjoint_and_cover_the_stream():
    n = 3 * S.VAL_EVERY
    train = [S.split_index("train", k) for k in range(n)]
    val = [S.split_index("val", k) for k in range(n // S.VAL_EVERY)]
    assert not set(train) & set(val)
    assert sorted(train + val)[:n] == list(range(n))
    assert all(S.is_val_index(i) for i in val) and not any(S.is_val_index(i) for i in train)


def test_train_and_val_share_no_story(train_stories, val_stories):
    assert not set(train_stories) & set(val_stories)
    # By construction: the (hero name, opening) pair of the first sentence decides the split.
    assert all(S.split_of(t) == "train" for t in train_stories)
    assert all(S.split_of(t) == "val" for t in val_stories)

    # ...and yet val is drawn like train: the same names and openings appear in both.
    def hero(story):
        return next(m["name"] for p in W.INTRO_PATTERNS if (m := p.match(story)))

    train_heroes, val_heroes = {hero(t) for t in train_stories}, {hero(t) for t in val_stories}
    assert len(val_heroes) > 150 and len(val_heroes & train_heroes) > 150
    with pytest.raises(ValueError, match="not a flaxchat story"):
        S.split_of("It was a dark and stormy night.")


def test_each_opening_is_recognised_unambiguously(train_stories):
    for t in train_stories[:500]:
        assert sum(bool(p.match(t)) for p in W.INTRO_PATTERNS) == 1, t[:80]


def test_names_never_collide_with_other_words(train_stories):
    names = set(W.WORDS.girl_names) | set(W.WORDS.boy_names)
    assert len(names) == len(W.WORDS.girl_names) + len(W.WORDS.boy_names) >= 300  # hundreds, no duplicates
    assert not names & set(W.WORDS.pet_names)
    assert all(re.fullmatch(r"[A-Z][a-z]+", n) for n in names)  # what split_of reads as a hero's name
    # A name that is also a word ("Rose", "rose") would blur the split guarantee and confuse a reader.
    words = set(re.findall(r"\b[a-z]+\b", " ".join(train_stories)))  # lowercase: never a name
    assert not {n.lower() for n in names | set(W.WORDS.pet_names)} & words


def test_length_between_100_and_400_words(train_stories, val_stories):
    lengths = [len(t.split()) for t in train_stories + val_stories]
    assert S.MIN_WORDS <= min(lengths) and max(lengths) <= S.MAX_WORDS


@pytest.mark.parametrize("plot", S.PLOTS, ids=lambda p: p.__name__)
def test_every_plot_fits_the_length_on_its_own(plot):
    for i in range(150):
        story = S.Story(random.Random(i), val=False)
        plot(story)
        assert S.MIN_WORDS <= len(story.text().split()) <= S.MAX_WORDS, (plot.__name__, i)


def _problems(text: str) -> list[str]:
    found = []
    if re.search(r"[{}]", text):
        found.append("unfilled template")
    if re.search(r"\b[Aa] (?!uni)[aeiouAEIOU]\w", text) or re.search(r"\b[Aa]n [b-df-hj-np-tv-z]\w", text, re.I):
        found.append("a/an")
    if re.search(r'(?:^|[.!?] |\." )[a-z]', text):
        found.append("lowercase sentence start")
    if re.search(r"  | [.,!?]|\b(\w+) \1\b", text):
        found.append("spacing or doubled word")
    sentences = [s.strip() for s in _SENTENCE.findall(text)]
    if any(n > 1 for s, n in collections.Counter(sentences).items() if len(s.split()) > 2):
        found.append("repeated sentence")
    if text.count('"') % 2:
        found.append("unbalanced quotes")
    return found


def test_stories_are_clean(train_stories):
    bad = [(t, p) for t in train_stories if (p := _problems(t))]
    assert not bad, bad[:2]


BEAT_KEYS = {"p", "if", "is", "say", "each", "then", "else"}


def beat_problems(beats, where: str) -> list[str]:
    """Beats in story_plots.json that Story.tell would misread (it does not check them itself)."""
    found = []
    for k, beat in enumerate(beats):
        at = f"{where}[{k}]"
        if beat == "para" or isinstance(beat, list) and beat and all(isinstance(t, str) for t in beat):
            continue
        if not isinstance(beat, dict) or set(beat) - BEAT_KEYS:
            found.append(f"{at}: not a beat: {beat!r}"[:200])
            continue
        if sum(key in beat for key in ("say", "each", "then")) != 1 or "p" in beat and "if" in beat:
            found.append(f"{at}: needs one of say/each/then and at most one guard")
        if "is" in beat and "if" not in beat or "else" in beat and not ("p" in beat or "if" in beat):
            found.append(f"{at}: 'is' needs 'if', 'else' needs a guard")
        for key in ("then", "else"):
            found += beat_problems(beat.get(key, []), f"{at}.{key}")
    return found


def test_every_plot_has_well_formed_beats():
    assert [plot.__name__ for plot in S.PLOTS] == [
        name for name in W.PLOT_TEXT if name not in ("intros", "about", "about_creature")
    ]
    bad = [p for plot in S.PLOTS for p in beat_problems(W.PLOT_TEXT[plot.__name__].beats, plot.__name__)]
    assert not bad, bad


def test_pronouns_follow_the_hero():
    for i in range(300):
        story = S.Story(random.Random(i), val=False)
        S.lost_toy(story)
        h, text = story.cast["h"], story.text()
        wrong = "his" if h.girl else "her"
        # The hero's own toy is always called "<pronoun> <toy>".
        assert f"{wrong} {story.cast['toy'].name}" not in text
        assert f"{h.his} {story.cast['toy'].name}" in text


def test_corpus_has_variety():
    stats = S.corpus_stats(S.generate_stories(1000, seed=0))
    assert stats["documents"] == 1000
    assert stats["distinct_sentences"] > 5000
    assert stats["distinct_words"] > 1000
    assert 130 < stats["mean_words"] < 300
    openers = collections.Counter(t.split(",")[0].split(".")[0] for t in S.generate_stories(300, seed=0))
    assert len(openers) > 50  # many ways in, not one fixed first line


def test_corpus_stats_counts():
    stats = S.corpus_stats(['Lily ran. "Hi!" said Tom.', "Lily ran. Tom sat down."])
    assert stats == {
        "documents": 2,
        "words": 10,
        "distinct_words": 7,
        "distinct_sentences": 4,
        "mean_words": 5.0,
        "bytes": 48,
    }


def test_verb_helpers():
    assert W.past("fly a kite") == "flew a kite" and W.ing("fly a kite") == "flying a kite"
    assert W.past("skip stones") == "skipped stones" and W.ing("ride the seesaw") == "riding the seesaw"
    assert W.past("chase butterflies") == "chased butterflies" and W.ing("swim") == "swimming"
    assert W.article("orange ball") == "an" and W.article("red ball") == "a"
    assert all(W.article(t) == "a" for t in W.WORDS.traits)  # "a {trait} little girl" is hard-coded


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="split"):
        S.iter_stories("test")
    with pytest.raises(ValueError, match=">= 0"):
        S.iter_stories("val", start=-1)
    with pytest.raises(ValueError, match=">= 0"):
        S.generate_story(-1)
    with pytest.raises(ValueError, match=">= 0"):
        S.generate_stories(-2)


def test_cli_prints_stories_and_stats(capsys):
    stories_script.main(["--n", "2", "--seed", "4"])
    out = capsys.readouterr().out
    assert out.count("--- train story") == 2 and S.generate_story(1, seed=4) in out
    stories_script.main(["--stats", "30"])
    stats = json.loads(capsys.readouterr().out)
    assert stats["documents"] == 30 and stats["words_per_s"] > 0 and stats["distinct_sentences"] > 100
    with pytest.raises(SystemExit):
        stories_script.main(["--n", "-1"])


def test_counting_stories_add_up():
    """The counting plot's numbers are pretraining text about arithmetic: every sum it states is true."""
    checked = 0
    for i in range(200):
        story = S.Story(random.Random(i), val=False)
        S.counting(story)
        text = story.text()
        for a, b, c in re.findall(r"(\d+) and (\d+) make (\d+)", text):
            assert int(a) + int(b) == int(c)
            checked += 1
        for a, b, c in re.findall(r"(\d+) take away (\d+) is (\d+)", text):
            assert int(a) - int(b) == int(c)
        for a, b, c in re.findall(r"(\d+) rows of (\d+) make (\d+)", text):
            assert int(a) * int(b) == int(c)
        found, more = (int(x) for x in re.findall(r"\b(\d+)\b", text)[:2])
        assert str(found + more) in re.findall(r"\b(\d+)\b", text), text  # found some, found more, now has
    assert checked > 30
