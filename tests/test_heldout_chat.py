"""The held-out chat check (tasks/heldout_chat.py): no check phrasing is ever training data (by phrasing family, not
just by value), its rules pass the replies a person would pass, and any prompt file can be scored."""

import json
import random
import re
import subprocess
import sys

import pytest

from flaxchat.data.stories import generate_stories
from flaxchat.data.story_world import WORDS
from tasks import heldout_chat as h
from tasks import synthetic_chat as sc
from tasks import word_problems as wp

# --- sentence shapes: a sentence with its values taken out ------------------------------------------------------
# Two sentences with the same shape come from the same phrasing (template), whatever names, numbers and things
# fill it, and in whichever tense. A check sentence whose shape no training sentence has is a phrasing training
# never showed.


def _vocabulary() -> dict[str, str]:
    """word or phrase -> placeholder, for every value a template slot can take."""
    d = wp.DATA
    names = [n for n, _ in wp.PEOPLE["train"] + wp.PEOPLE["check"]] + WORDS.pet_names
    values = [t for group in d["things"].values() for t in group] + d["relatives"] + d["projects"] + d["buys"]
    values += [w for pair in d["containers"] + d["goods"] for w in pair] + [w for row in d["places"] for w in row]
    values += [w for row in d["crowds"] for w in row if not w.startswith("~")] + [w for row in d["days"] for w in row]
    values += [row[2] for row in d["doings"]] + [w for row in d["periods"] for w in row] + [w for w, _ in d["times"]]
    phr = sc.PHRASES
    names += phr["cities"]["train"] + phr["cities"]["check"] + phr["pet_names"]["train"] + phr["pet_names"]["check"]
    values += phr["pet_kinds"]["train"] + phr["pet_kinds"]["check"] + list(h.CHECK_SUBJECTS) + list(h.CHECK_OBJECTS)
    values += [k if isinstance(k, str) else k["kind"] for group in WORDS.heroes.values() for k in group]
    values += ["girl", "boy"] + [t.noun for t in WORDS.toys] + [a.noun for a in WORDS.animals]
    values += [p.key for p in WORDS.places] + [f for p in WORDS.places for f in p.finds]
    vocab = {v.lower(): "T" for v in values} | {n.lower(): "N" for n in names}
    vocab |= {past: present for present, past in d["past"].items()}  # one tense
    vocab |= {w: "P" for w in ("he", "she", "him", "her", "his", "hers", "herself", "himself")}
    return vocab


VOCAB = _vocabulary()
_PHRASE = re.compile(r"\b(" + "|".join(sorted(map(re.escape, VOCAB), key=len, reverse=True)) + r")\b")


def shape(sentence: str) -> str:
    s = sentence.lower().replace("$", "")
    s = re.sub(r"\d+(th)?", "#", s)
    s = re.sub(r"# dollars", "#", s)
    s = _PHRASE.sub(lambda m: VOCAB[m.group(1)], s)
    return re.sub(r"\s+", " ", s).strip(" ?.!")


def sentences(text: str) -> list[str]:
    return [x for x in re.split(r"(?<=[.?!;:])\s+", text) if x.strip()]


def shapes(texts) -> set[str]:
    return {shape(s) for t in texts for s in sentences(t)}


def user_turns(conversations) -> list[str]:
    return [m["content"] for c in conversations for m in c["messages"] if m["role"] == "user"]


@pytest.fixture(scope="module")
def trained_user_text():
    """What the user says in the training data: word problems, story requests, multi-turn conversations, identity."""
    texts = user_turns(sc.ArithmeticProblems(4000)) + user_turns(sc.ArithmeticProblems(500, "val"))
    texts += user_turns(sc.StoryRequests(1500)) + user_turns(sc.MultiTurnChat(3000)) + user_turns(sc.IdentityChat(2000))
    return texts


def test_no_check_phrasing_is_in_the_training_data(trained_user_text):
    """Every sentence of the check (the demo's and 600 more check problems) has a shape no training sentence has:
    the check asks in phrasings, not just with names and numbers, that training never used."""
    trained = shapes(trained_user_text)
    prompts = h.demo_prompts()
    rng = random.Random(5)
    check_texts = [q for q, _ in prompts["arithmetic"]] + [wp.make_problem(rng, "check").question for _ in range(600)]
    check_texts += [r for r, _ in prompts["stories"]] + [t for turns, _ in prompts["multi_turn"] for t in turns]
    check_texts += [sc.multi_turn_conversation(rng, "check")["messages"][-2]["content"] for _ in range(300)]
    check_texts += list(h.IDENTITY)
    seen = sorted({s for t in check_texts for s in sentences(t) if shape(s) in trained})
    assert not seen, f"check sentences phrased like training data: {seen[:5]}"
    # the same shapes do find the train bank's phrasings in fresh training text (the test can fail)
    fresh = [wp.make_problem(rng, "train").question for _ in range(200)]
    assert sum(shape(s) in trained for t in fresh for s in sentences(t)) > 0.9 * sum(len(sentences(t)) for t in fresh)


def test_check_names_cities_pets_and_subjects_are_never_trained_on(trained_user_text):
    prompts = h.demo_prompts()
    joined = " ".join(trained_user_text).lower()
    stories = " ".join(generate_stories(1500)).lower()
    for name in wp.CHECK_NAMES | set(sc.PHRASES["cities"]["check"]) | set(sc.PHRASES["pet_names"]["check"]):
        assert not re.search(rf"\b{name.lower()}\b", joined), name
    assert not wp.CHECK_NAMES & {n for n, _ in wp.PEOPLE["train"]}
    for subject in h.CHECK_SUBJECTS:  # a story about it must take the word from the request
        assert not re.search(rf"\b{subject}", joined + stories), subject
    new_subjects = {w for _, words in prompts["stories"] for w in words} & set(h.CHECK_SUBJECTS)
    assert len(new_subjects) == len(prompts["stories"]) // 2  # and half are of the stories' world
    assert not set(h.IDENTITY) & {q for questions, _ in sc.IDENTITY_TOPICS.values() for q in questions}


def test_the_demo_check_covers_every_category_and_scene():
    prompts = h.demo_prompts()
    assert prompts == h.demo_prompts() and h.check_prompts(prompts) is prompts  # fixed, and a valid prompt file
    assert {k: len(v) for k, v in prompts.items()} == {"identity": 12, "arithmetic": 24, "stories": 8, "multi_turn": 12}
    assert all(len(turns) >= 2 for turns, _ in prompts["multi_turn"])
    recalled = [e for turns, e in prompts["multi_turn"] if not e.isdigit()]
    assert recalled and all(any(e in t for t in turns[:-1]) for turns, e in prompts["multi_turn"] if e in recalled)
    rng = random.Random(0)
    for scene, _ in wp.SCENES:  # every scene can be told in the check phrasings, with a whole-number answer
        for _ in range(50):
            problem = wp.make_problem(rng, "check", scene)
            assert problem.answer >= 0 and "~" not in problem.question and "{" not in problem.question


def test_rules_pass_what_a_person_would():
    assert h.identity_ok("I'm flaxchat, a small model.") and not h.identity_ok("Once upon a time there was Leo.")
    assert h.final_number("<|python_start|>37+18<|python_end|><|output_start|>55<|output_end|> ... #### 43") == 43
    assert h.final_number("She has 1,043 shells left.") == 1043 and h.final_number("no idea") is None
    story = "Once upon a time, an otter found a red hat in the woods. " * 4
    assert h.story_ok(story, ["otter"]) and h.story_ok(story.replace("an otter", "two otters"), ["otter"])
    assert not h.story_ok(story, ["walrus"]) and not h.story_ok("An otter.", ["otter"])
    assert not h.story_ok("I'm flaxchat. " + story, ["otter"]) and not h.story_ok(
        story.replace("otter", "botter"), ["otter"]
    )
    assert h.says("You told me your name is Ingrid.", "Ingrid") and not h.says("Your name is Ingridson.", "Ingrid")
    assert h.says("So the answer is 29 cards.\n#### 29", "29") and not h.says("#### 129", "29")
    assert not h.says("You have 29 cards and 3 more", "29")  # the final number is the answer


class ScriptedEngine:
    """An Engine stand-in: replies by a rule on the last user turn it sees, and keeps every prompt it was given."""

    capacity = 256

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply, self.prompts = tokenizer, reply, []

    def generate_batches(self, prompts, max_tokens=None, temperature=1.0, seeds=0, **_):
        self.prompts += prompts
        out = []
        for ids in prompts:
            last = self.tokenizer.decode(ids).split("<|user_start|>")[-1].split("<|user_end|>")[0]
            out.append(([ids + self.tokenizer.encode(self.reply(last))], [[]]))
        return out


def test_conversations_carry_the_models_own_replies(tiny_base_dir):
    from flaxchat.data.tokenizer import get_tokenizer

    tok = get_tokenizer()
    remembered = {}

    def reply(user):  # a model that remembers a name it was told and says it back when asked
        if user.startswith("My name is"):
            remembered["name"] = user.split()[-1].strip(".")
            return f"Hello {remembered['name']}"
        return f"You are {remembered.get('name', 'nobody')}" if "name" in user else "I'm flaxchat. #### 7"

    engine = ScriptedEngine(tok, reply)
    prompts = {
        "identity": ["Who are you?"],
        "arithmetic": [["What is 3 + 4?", 7], ["What is 3 + 5?", 8]],
        "stories": [["Tell me about an otter.", ["otter"]]],
        "multi_turn": [[["My name is Ingrid.", "What is my name?"], "Ingrid"], [["Hi.", "What is my name?"], "Kofi"]],
    }
    results = h.run_check(engine, tok, prompts)
    assert h.score(results) == {"identity": (1, 1), "arithmetic": (1, 2), "stories": (0, 1), "multi_turn": (1, 2)}
    assert results[-2]["replies"] == ["Hello Ingrid", "You are Ingrid"]
    second_turn = tok.decode(engine.prompts[-2])  # the first reply, then the second question
    assert "Hello Ingrid<|assistant_end|><|user_start|>What is my name?" in second_turn
    assert h.summary(h.score(results)) == "identity 1/1, arithmetic 1/2, stories 0/1, multi_turn 1/2"


@pytest.mark.parametrize(
    "bad,message",
    [
        ([1, 2], "JSON object"),
        ({"math": []}, "unknown key"),
        ({"arithmetic": [["2+2?"]]}, r'"arithmetic" item 0 must be \["question", answer\]'),
        ({"stories": [["a story", []]]}, r'"stories" item 0'),
        ({"multi_turn": [["only one string", "x"]]}, r'"multi_turn" item 0'),
        ({"identity": "who are you?"}, "must be a list"),
    ],
)
def test_bad_prompt_files_fail_with_one_sentence(bad, message):
    with pytest.raises(ValueError, match=message):
        h.check_prompts(bad)


def test_cli_writes_the_demo_check_and_refuses_a_bad_file(tmp_path):
    out = tmp_path / "check.json"
    h.main(["--write-prompts", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(h.demo_prompts()))
    bad = tmp_path / "bad.json"
    bad.write_text('{"arithmetic": [["no answer"]]}')
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.heldout_chat", "--prompts", str(bad), "--base-dir", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "must be" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(  # a base dir without a chat model: one sentence saying how to get one
        [sys.executable, "-m", "tasks.heldout_chat", "--prompts", str(out), "--base-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "no sft checkpoints" in proc.stderr and "Traceback" not in proc.stderr
