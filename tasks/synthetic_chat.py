"""Synthetic conversations for offline chat training: identity, arithmetic with the calculator, story requests,
and multi-turn conversations that need what the user said earlier.

    IdentityChat(size=500, split="train")         # "Who are you?" -> "I'm flaxchat, a small language model ..."
    ArithmeticProblems(size=2000, split="train")  # word problems solved with calculator tool calls, "#### 48"
    StoryRequests(size=500, split="train")        # "Tell me a story about a fox who finds a red hat." -> that story
    MultiTurnChat(size=500, split="train")        # "My name is Ana." ... "What's my name?"; "And if she eats 3 more?"
    arithmetic_problem(index, split, seed)        # one problem as (question, answer) for RL reward checks

No package registry ships SmolTalk or GSM8K train, so offline SFT teaches the chat format with these, next
to SpellingBee / SimpleSpelling (tasks/spellingbee.py) and MMLU / ARC multiple choice. RL trains on
ArithmeticProblems(split="train") and measures pass@k on the held-out ArithmeticProblems(split="val").

Every example is a pure function of (seed, split, index). Train and val are disjoint by construction: an
example's user text hashes (crc32, stable across processes) to one split, and an example is redrawn from
its own random stream until it lands in the split asked for. Stories come from flaxchat.data.stories' own split,
whose val stories never equal a train story.

Story requests and multi-turn conversations, like the word problems (tasks/word_problems.py), are phrased from
a train bank (chat_phrasings.json): its check bank, with names, cities and pets no training example uses, writes
only tasks/heldout_chat.py's check.
"""

from __future__ import annotations

import json
import random
import re
import zlib
from collections.abc import Callable
from importlib import resources

from flaxchat.data import story_world
from flaxchat.data.stories import split_index, tell_story
from flaxchat.data.story_world import WORDS
from tasks.common import Task, completion_text
from tasks.gsm8k import extract_answer
from tasks.word_problems import CHECK_NAMES, PEOPLE, Problem, make_problem, solution

PHRASES = json.loads(resources.files("tasks").joinpath("chat_phrasings.json").read_text(encoding="utf-8"))
SPLITS = ("train", "val")
VAL_SHARE = 8  # one user text in VAL_SHARE is reserved for val


def split_of_text(text: str) -> str:
    """The split a user text belongs to (crc32, not hash(): stable whatever PYTHONHASHSEED is)."""
    return "val" if zlib.crc32(text.encode("utf-8")) % VAL_SHARE == 0 else "train"


def wrap(rng: random.Random, text: str, kind: str = "") -> str:
    """What people put around a request (a greeting, "Quick question:", "Thanks!"), in lower case now and then: so
    that no wrapping is a cue for one kind of answer. kind "math" or "story" adds wrappings of its own."""
    words = PHRASES["wrap"]
    if rng.random() < 0.3:
        before = rng.choice(words["before"] + words.get(f"{kind}_before", []))
        text = before + (text[0].lower() + text[1:] if before.endswith(", ") else text)
    if rng.random() < 0.2:
        text += rng.choice(words["after"])
    return _casual(rng, text)


_NOT_INVENTED = frozenset(PHRASES["story_subjects"]["check"]) | {n.lower() for n in CHECK_NAMES}
INVENTED_SHARE = 0.15  # of story heroes and of the names, cities and pets users tell: made-up words


def invented_word(rng: random.Random) -> str:
    """A made-up word (flaxchat.data.story_world.invented_word) that is no value of the check: the model can only copy
    it from the request ("a story about a blimket", "Call me Zoodra"), so it learns to take words from what it is
    told, not from memory."""
    while True:
        word = story_world.invented_word(rng)
        if word not in _NOT_INVENTED:
            return word


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


IDENTITY_WORDS = PHRASES["identity"]
GREETINGS, GREETING_REPLIES = tuple(IDENTITY_WORDS["greetings"]), tuple(IDENTITY_WORDS["greeting_replies"])
# topic -> (ways to ask, ways to answer); every answer names flaxchat and is true of this project
IDENTITY_TOPICS = {topic: (tuple(t["ask"]), tuple(t["answer"])) for topic, t in IDENTITY_WORDS["topics"].items()}
# what people put around a question: a greeting, an aside, a polite ending
ASK_BEFORE, ASK_AFTER = tuple(IDENTITY_WORDS["ask_before"]), tuple(IDENTITY_WORDS["ask_after"])
THANKS, THANKS_REPLIES = tuple(IDENTITY_WORDS["thanks"]), tuple(IDENTITY_WORDS["thanks_replies"])


def _wrap_question(rng: random.Random, question: str) -> str:
    before, after = rng.choice(ASK_BEFORE), rng.choice(ASK_AFTER)
    if before and before[-2] in ",:":  # "Hey, who are you?": the question goes on in lower case
        question = question[0].lower() + question[1:] if not question.startswith("I ") else question
    return _casual(rng, f"{before}{question}{after}")


def _identity_conversation(rng: random.Random) -> dict:
    """One to three turns: maybe a greeting first, a question about the assistant, maybe a thank-you."""
    topic = rng.choice(sorted(IDENTITY_TOPICS))
    questions, answers = IDENTITY_TOPICS[topic]
    messages = []
    if rng.random() < 0.15:  # greeting as its own turn
        messages += [
            {"role": "user", "content": rng.choice(GREETINGS)},
            {"role": "assistant", "content": rng.choice(GREETING_REPLIES)},
        ]
    messages += [
        {"role": "user", "content": _wrap_question(rng, rng.choice(questions))},
        {"role": "assistant", "content": rng.choice(answers)},
    ]
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
# Arithmetic word problems with the calculator tool (tasks/word_problems.py writes them)


def arithmetic_conversation(index: int, split: str = "train", seed: int = 0) -> tuple[Problem, dict]:
    """Problem number `index` of `split` and its conversation, the question as a user types it (now and then with a
    greeting or a thank-you around it); a pure function of (index, split, seed). The split goes by that text."""
    if index < 0:
        raise ValueError(f"problem index must be >= 0, got {index}")
    _check_split("arithmetic_problem", split, 1)
    holder = {}

    def make(rng):
        problem = make_problem(rng)
        conversation = problem.conversation()
        conversation["messages"][0]["content"] = wrap(rng, problem.question, "math")
        holder["problem"] = problem
        return conversation

    conversation = _draw_in_split(f"flaxchat-arithmetic:{seed}:{split}:{index}", split, make)
    return holder["problem"], conversation


def arithmetic_problem(index: int, split: str = "train", seed: int = 0) -> Problem:
    """Problem number `index` of `split` (the question without what arithmetic_conversation puts around it)."""
    return arithmetic_conversation(index, split, seed)[0]


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
        problem, conversation = arithmetic_conversation(index, self.split, self.seed)
        return {**conversation, "answer": str(problem.answer)}

    def evaluate(self, conversation: dict, completion) -> int:
        """1 if the number after "####" in the completion equals the answer, else 0 (as GSM8K)."""
        reference = conversation.get("answer") or extract_answer(
            completion_text(conversation["messages"][-1]["content"])
        )
        predicted = extract_answer(completion_text(completion))
        return int(predicted is not None and predicted == reference)


# -----------------------------------------------------------------------------
# Story requests answered with the synthetic stories

_FIRST_SENTENCE = re.compile(r"^.*?[.!?](?=\s|$)")
_WORLD_KINDS = {k if isinstance(k, str) else k["kind"] for group in WORDS.heroes.values() for k in group} | {
    "girl",
    "boy",
}


def story_facts(story: str, cast: dict) -> dict:
    """What a request for this story can name: its hero (name and kind: a girl, a fox, a pirate, a robot), and
    whichever toy, found thing, animal and place the story really tells of."""
    h = cast["h"]
    facts = {"first": _FIRST_SENTENCE.match(story).group(0), "name": h.name, "kind": h.kind, "a_kind": h.a_kind}
    place, toy, animal = cast.get("place"), cast.get("toy"), cast.get("animal")
    if place is not None and place.name in story:
        facts["place"], facts["at_place"] = place.name, place.at
    if toy is not None and toy.name in story:
        facts["toy"], facts["toy_noun"] = toy.a, toy.noun
    if cast.get("find") and cast["find"] in story:
        facts["find"] = cast["find"]
    for name in ("baby", "kitten"):
        if cast.get(name) is not None:
            animal = cast[name]
    noun = getattr(animal, "noun", animal)
    if noun and re.search(rf"\b{noun}\b", story):
        facts["animal"] = noun
    return facts


def story_request(rng: random.Random, facts: dict, phrasing: str = "train") -> str:
    """A user's request that this story answers: most name its hero (a kind, maybe a name), often with one more
    thing the story tells of (a toy, a find, an animal, a place); a few name nothing."""
    bank = lambda name: PHRASES[name][phrasing]  # noqa: E731
    if rng.random() < 0.12 and facts["kind"] in _WORLD_KINDS:
        return rng.choice(bank("story_generic")).format(first=facts["first"])
    subjects = bank("hero_subject")
    if facts["kind"] not in _WORLD_KINDS:  # a made-up hero: the request names what it is
        subjects = [t for t in subjects if "{kind}" in t or "{a_kind}" in t]
    subject = rng.choice(subjects).format(**facts)
    extras = [key for key in ("toy", "find", "animal", "place") if key in facts]
    if extras and rng.random() < 0.5:
        key = rng.choice(extras)
        subject = rng.choice(bank(f"with_{key}")).format(s=subject, **facts)
    request = rng.choice(bank("story_frames")).format(s=subject)
    return wrap(rng, request, "story") if phrasing == "train" else request


class StoryRequests(Task):
    """A request for a story, answered with a story from flaxchat.data.stories about what it names.

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
        kind = invented_word(rng) if rng.random() < INVENTED_SHARE else None  # then the request must name it
        while True:  # about half of all stories fit 250 words; each try is a fresh story
            story, cast = tell_story(split_index(story_split, rng.randrange(10**7)), self.seed, hero_kind=kind)
            if len(story.split()) <= self.max_words:
                break
        request = story_request(rng, story_facts(story, cast))
        return {"messages": [{"role": "user", "content": request}, {"role": "assistant", "content": story}]}


# -----------------------------------------------------------------------------
# Multi-turn conversations: later questions need an earlier user turn, or build on the previous answer


def _turns(*pairs) -> list[dict]:
    return [{"role": role, "content": text} for pair in pairs for role, text in zip(("user", "assistant"), pair)]


def _fact(rng: random.Random, kind: str, phrasing: str) -> dict:
    """One thing a user can tell about themselves: its value and the words that tell, acknowledge, ask, answer."""
    invented = phrasing == "train" and rng.random() < INVENTED_SHARE
    if kind in ("name", "city", "pet") and invented:
        value = invented_word(rng).capitalize()
    elif kind == "name":
        value = rng.choice(PEOPLE[phrasing])[0]
    elif kind == "city":
        value = rng.choice(PHRASES["cities"][phrasing])
    elif kind == "pet":
        value = rng.choice(PHRASES["pet_names"][phrasing])
    else:
        value = str(rng.randint(2, 99) if kind == "number" else rng.randint(5, 12))
    slots = {"v": value, "kind": rng.choice(PHRASES["pet_kinds"][phrasing])}
    words = PHRASES["facts"][kind]
    say = lambda options: rng.choice(options).format(**slots)  # noqa: E731
    return {
        "value": value,
        "tell": say(words["tell"][phrasing]),
        "ack": say(words["ack"]),
        "ask": say(words["ask"][phrasing]),
        "answer": say(words["answer"]),
    }


def _between(rng: random.Random, phrasing: str) -> list[dict]:
    """Something else talked about before the user asks back: a question about the assistant or a word problem."""
    if rng.random() < 0.5:
        return _turns(rng.choice(PHRASES["between"][phrasing]))
    problem = make_problem(rng, phrasing)
    return problem.conversation()["messages"]


def recall_conversation(rng: random.Random, phrasing: str = "train") -> dict:
    """The user tells one or two things (a name, a city, a pet, a number, an age), maybe talks of something else,
    then asks for one back; "expected" is what the last reply must say. Now and then (train only) the user asks for
    something never told, and the answer says so: an answer comes from the conversation, not from habit."""
    kinds = rng.sample(sorted(PHRASES["facts"]), 2 if rng.random() < 0.4 else 1)
    facts = [_fact(rng, kind, phrasing) for kind in kinds]
    if phrasing == "train" and rng.random() < 0.15:
        missing = rng.choice([k for k in sorted(PHRASES["facts"]) if k not in kinds])
        answer = PHRASES["not_told"][missing]
        asked = _fact(rng, missing, phrasing)["ask"]
        told = _turns(*[(f["tell"], f["ack"]) for f in facts]) if rng.random() < 0.5 else []
        return {"messages": told + _turns((asked, answer)), "expected": answer}
    messages = _turns(*[(f["tell"], f["ack"]) for f in facts])
    if rng.random() < 0.6:
        messages += _between(rng, phrasing)
    asked = rng.choice(facts)
    messages += _turns((asked["ask"], asked["answer"]))
    return {"messages": messages, "expected": asked["value"]}


def things_conversation(rng: random.Random, phrasing: str = "train") -> dict:
    """ "I have 12 marbles." ... "I give away 5. How many do I have left?": arithmetic on a number told earlier."""
    words = PHRASES["have_things"]
    t = rng.choice(["marbles", "stickers", "books", "apples", "coins", "cards", "shells", "pencils", "cookies"])
    n = rng.randint(3, 200)
    gain = rng.random() < 0.5
    k = rng.randint(2, 100) if gain else rng.randint(1, n - 1)
    messages = _turns((rng.choice(words["tell"][phrasing]).format(n=n, t=t), rng.choice(words["ack"]).format(n=n, t=t)))
    if rng.random() < 0.3:
        messages += _turns(rng.choice(PHRASES["between"][phrasing]))
    question = rng.choice(words["gain" if gain else "loss"][phrasing]).format(k=k, t=t)
    parts, answer = solution(f"{n}{'+' if gain else '-'}{k}", t, lead="So you have")
    messages += [{"role": "user", "content": question}, {"role": "assistant", "content": parts}]
    return {"messages": messages, "expected": str(answer)}


_PRONOUNS = dict(PEOPLE["train"] + PEOPLE["check"])


def followup_conversation(rng: random.Random, phrasing: str = "train") -> dict:
    """A word problem, then one or two follow-ups on its answer: "And if she gives away 3 more?" -> answer - 3."""
    while True:  # a follow-up says "she" or "he": a problem about a named person
        problem = make_problem(rng, phrasing)
        names = [w for w in re.findall(r"[A-Z][a-z]+", problem.question) if w in _PRONOUNS]
        if names:
            break
    he, value = _PRONOUNS[names[0]], problem.answer
    messages = problem.conversation()["messages"]
    for _ in range(2 if rng.random() < 0.2 else 1):
        divisors = [k for k in range(2, 11) if value % k == 0 and value // k > 0]
        kinds = ["gain", "times"] + (["loss"] if value > 1 else []) + (["share"] if divisors else [])
        kind = rng.choice(kinds)
        k = (
            {"gain": rng.randint(2, 60), "loss": rng.randint(1, max(value - 1, 1)), "times": 2}[kind]
            if kind != "share"
            else rng.choice(divisors)
        )
        expr = {"gain": f"{value}+{k}", "loss": f"{value}-{k}", "times": f"{value}*2", "share": f"{value}//{k}"}[kind]
        question = rng.choice(PHRASES["followups"][kind][phrasing]).format(he=he, k=k)
        parts, value = solution(expr, problem.unit)
        messages += [
            {"role": "user", "content": question[0].upper() + question[1:]},
            {"role": "assistant", "content": parts},
        ]
    return {"messages": messages, "expected": str(value)}


MULTI_TURN_KINDS = ((recall_conversation, 5), (things_conversation, 2), (followup_conversation, 3))


def multi_turn_conversation(rng: random.Random, phrasing: str = "train") -> dict:
    makers, weights = zip(*MULTI_TURN_KINDS)
    conversation = rng.choices(makers, weights)[0](rng, phrasing)
    if phrasing == "train":
        for message in conversation["messages"][::2]:
            message["content"] = wrap(rng, message["content"])
    return conversation


class MultiTurnChat(Task):
    """Conversations whose last answer needs an earlier turn: a fact the user told (recall), a number the user
    has (arithmetic on it), or the previous answer (a follow-up)."""

    def __init__(self, size: int = 500, split: str = "train", seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        _check_split("MultiTurnChat", split, size)
        self.size, self.split, self.seed = size, split, seed

    def num_examples(self) -> int:
        return self.size

    def get_example(self, index: int) -> dict:
        stream = f"flaxchat-multi-turn:{self.seed}:{self.split}:{index}"
        return {"messages": _draw_in_split(stream, self.split, multi_turn_conversation)["messages"]}
