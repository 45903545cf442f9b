"""Synthetic conversations: determinism, disjoint splits, the tool-call format, and requests that fit their stories."""

import random
import re

import pytest

from flaxchat.data.stories import split_of, tell_story
from flaxchat.data.story_world import WORDS
from flaxchat.generate.sandbox import use_calculator
from tasks.common import TaskMixture
from tasks.gsm8k import extract_answer
from tasks.synthetic_chat import (
    GREETINGS,
    PHRASES,
    THANKS,
    ArithmeticProblems,
    IdentityChat,
    MultiTurnChat,
    StoryRequests,
    arithmetic_problem,
    followup_conversation,
    recall_conversation,
    split_of_text,
    story_facts,
    story_request,
    things_conversation,
)


def user_texts(task):
    return ["\n".join(m["content"] for m in c["messages"] if m["role"] == "user") for c in task]


@pytest.mark.parametrize(
    "make",
    [
        lambda split, seed: IdentityChat(120, split, seed),
        lambda split, seed: ArithmeticProblems(300, split, seed),
        lambda split, seed: StoryRequests(40, split, seed),
        lambda split, seed: MultiTurnChat(200, split, seed),
    ],
)
def test_deterministic_per_seed_with_disjoint_splits(make):
    train, again, other_seed, val = make("train", 0), make("train", 0), make("train", 1), make("val", 0)
    assert [train[i] for i in range(len(train))] == [again[i] for i in range(len(again))]
    assert [train[i] for i in range(10)] != [other_seed[i] for i in range(10)]
    train_users, val_users = user_texts(train), user_texts(val)
    if not isinstance(train, StoryRequests):  # stories are kept apart by the story generator's own split
        assert all(split_of_text(u) == "train" for u in train_users)
        assert all(split_of_text(u) == "val" for u in val_users)
        assert not set(train_users) & set(val_users)
    else:
        assert {split_of(c["messages"][1]["content"]) for c in train} == {"train"}
        assert {split_of(c["messages"][1]["content"]) for c in val} == {"val"}
    # conversations alternate user / assistant and end with the assistant
    for conversation in list(train)[:20] + list(val)[:20]:
        roles = [m["role"] for m in conversation["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2)


def test_identity_says_flaxchat_trained_with_jax():
    conversations = list(IdentityChat(300))
    replies = [c["messages"][-1]["content"] for c in conversations]
    assert sum("flaxchat" in r for r in replies) > 200 and sum("JAX" in r for r in replies) > 100
    # every answer about the assistant names it (a thank-you reply or a greeting's reply need not)
    for c in conversations:
        for question, answer in zip(c["messages"][::2], c["messages"][1::2]):
            if question["content"] not in THANKS and question["content"] not in GREETINGS:
                assert "flaxchat" in answer["content"], (question, answer)
    name_answers = [
        c["messages"][-1]["content"]
        for c in conversations
        if re.search(r"who are you|what is your name", c["messages"][-2]["content"], re.I)
    ]
    assert name_answers and all("flaxchat" in a and "JAX" in a for a in name_answers)
    questions = {c["messages"][-2]["content"] for c in conversations}
    assert len(questions) > 250  # phrasings with a greeting before and a polite word after


def test_arithmetic_uses_the_calculator_in_gsm8k_format():
    problems = [arithmetic_problem(i, "train") for i in range(300)]
    for p in problems:
        types = [part["type"] for part in p.parts]
        assert types == ["text", "python", "python_output", "text"]
        expr = p.parts[1]["text"]
        assert (
            p.parts[2]
            == {"type": "python_output", "text": use_calculator(expr)}
            == {
                "type": "python_output",
                "text": str(p.answer),
            }
        )
        assert p.parts[-1]["text"].endswith(f"#### {p.answer}")
        assert extract_answer(p.parts[-1]["text"]) == str(p.answer)
        assert p.answer >= 0 and p.question.endswith("?") and "~" not in p.question
        # the expression copies the question's numbers; any other is "twice" (2), "three times" (3), ... or a dozen
        asked = re.findall(r"\d+", p.question) + (["12"] if "dozen" in p.question else [])
        assert all(n in asked or n in ("2", "3", "4", "5") for n in re.findall(r"\d+", expr)), (p.question, expr)
    ops = [len(re.findall(r"//|[-+*]", p.parts[1]["text"])) for p in problems]
    assert ops.count(2) > 100 and ops.count(1) > 10 and ops.count(3) > 5  # mostly two steps
    past = sum(bool(re.search(r"\b(had|gave|bought|were)\b", p.question)) for p in problems)
    assert 50 < past < 200  # told in the present and in the past
    assert len({p.question for p in problems}) == 300


def test_arithmetic_task_scores_like_gsm8k():
    task = ArithmeticProblems(10, "val")
    conversation = task[3]
    assert conversation["answer"] == str(arithmetic_problem(3, "val").answer)
    assert task.evaluate(conversation, conversation["messages"][1]["content"]) == 1
    assert task.evaluate(conversation, "I don't know") == 0
    assert task.eval_type == "generative"


WORLD = {k if isinstance(k, str) else k["kind"] for group in WORDS.heroes.values() for k in group}
WORLD |= {t.noun for t in WORDS.toys} | {a.noun for a in WORDS.animals} | {b.baby for b in WORDS.lost_babies}


def test_story_requests_are_about_what_their_story_tells():
    """A request names the hero's kind (a fox, a pirate, a robot, a girl), maybe its name and one more thing (a
    toy, a find, an animal, a place), and the story answering it has every one of them."""
    rng, kinds, named = random.Random(0), set(), 0
    for i in range(400):
        story, cast = tell_story(i)
        facts = story_facts(story, cast)
        request = story_request(rng, facts).lower()
        assert facts["kind"] in facts["first"] and facts["name"] in facts["first"]  # the opening names the hero
        for noun in WORLD | {p.key for p in WORDS.places}:
            if re.search(rf"\b{noun}\b", request):
                assert re.search(rf"\b{noun}\b", story.lower()), (request, story[:200])
        named += facts["kind"] in request or facts["name"].lower() in request
        kinds.add(facts["kind"])
    assert named > 300  # most requests name the hero
    heroes = WORDS.heroes
    assert {"girl", "boy"} <= kinds  # children, and many animals, storybook roles and things come alive
    for group in (heroes["animals"], [r["kind"] for r in heroes["roles"]], heroes["things"]):
        assert len(kinds & set(group)) >= 5, group
    task = StoryRequests(60, max_words=220)
    for conversation in task:
        request, story = conversation["messages"][0]["content"], conversation["messages"][1]["content"]
        assert len(story.split()) <= 220
        names = set(WORDS.girl_names + WORDS.boy_names)
        assert all(name in story for name in re.findall(r"\b[A-Z][a-z]+\b", request) if name in names)


def test_multi_turn_conversations_answer_from_an_earlier_turn():
    rng, not_told = random.Random(3), 0
    for _ in range(200):
        c = recall_conversation(rng)  # the answer is something only the user said, earlier
        users = [m["content"] for m in c["messages"] if m["role"] == "user"]
        assert c["expected"] in c["messages"][-1]["content"] and c["expected"] not in users[-1]
        if c["expected"] in PHRASES["not_told"].values():  # asked for what was never told: it says so
            not_told += 1
            continue
        assert any(c["expected"] in u for u in users[:-1])
        c = things_conversation(rng)  # arithmetic on a number the user told in the first turn
        first, last = c["messages"][0]["content"], c["messages"][-1]["content"]
        expr = last[1]["text"]
        assert expr.split("+")[0].split("-")[0] in re.findall(r"\d+", first) and last[-1]["text"].endswith(
            c["expected"]
        )
        c = followup_conversation(rng)  # a follow-up computes on the previous answer
        replies = [m["content"] for m in c["messages"] if m["role"] == "assistant"]
        for before, after in zip(replies, replies[1:]):
            assert re.match(rf"{before[2]['text']}[-+*/]", after[1]["text"]), (before, after)
        assert replies[-1][2]["text"] == c["expected"] == str(use_calculator(replies[-1][1]["text"]))
    assert 10 < not_told < 60
    lengths = [len(c["messages"]) for c in MultiTurnChat(300)]
    assert sum(n >= 4 for n in lengths) > 250 and max(lengths) >= 8


def test_tasks_mix_and_bad_arguments_fail_clearly():
    mixture = TaskMixture([IdentityChat(5), ArithmeticProblems(5), StoryRequests(5), MultiTurnChat(5)])
    assert len(mixture) == 20 and all("messages" in c for c in mixture)
    with pytest.raises(ValueError, match="train or val"):
        IdentityChat(5, split="test")
    with pytest.raises(ValueError, match="positive"):
        ArithmeticProblems(0)
    with pytest.raises(ValueError, match="max_words"):
        StoryRequests(5, max_words=50)
    with pytest.raises(ValueError, match=">= 0"):
        arithmetic_problem(-1)
    with pytest.raises(ValueError, match="train or val"):
        MultiTurnChat(5, split="check")
