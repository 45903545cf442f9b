"""The demo's held-out chat check (tasks/heldout_chat.py): its prompts are never training data, and its rules pass
the replies a person would pass."""

import pytest

from tasks import heldout_chat as h
from tasks import synthetic_chat as sc


def test_the_prompts_are_not_in_the_training_generators():
    trained = {q.lower() for questions, _ in sc.IDENTITY_TOPICS.values() for q in questions}
    asked = {m["content"].lower() for c in sc.IdentityChat(3000) for m in c["messages"] if m["role"] == "user"}
    assert not {p.lower() for p in h.IDENTITY} & (trained | asked)  # nor a phrasing the generator writes
    names = {name for name, _ in sc.PEOPLE} | set(sc.WORDS.girl_names + sc.WORDS.boy_names)
    assert not {q.split()[0] for q, _ in h.ARITHMETIC} & names  # names the problems generator never draws
    assert {q.split()[0] for q, _ in h.ARITHMETIC if q[0] != "A"} <= sc.HELD_OUT_NAMES
    task = sc.ArithmeticProblems(size=2000)
    drawn = {task.get_example(i)["messages"][0]["content"] for i in range(len(task))}  # nor a question it writes
    assert not {q for q, _ in h.ARITHMETIC} & drawn


def test_rules_pass_what_a_person_would():
    assert h.identity_ok("I'm flaxchat, a small model.") and not h.identity_ok("Once upon a time there was Leo.")
    assert h.final_number("<|python_start|>37+18<|python_end|><|output_start|>55<|output_end|> ... #### 43") == 43
    assert h.final_number("She has 1,043 shells left.") == 1043 and h.final_number("no idea") is None
    story = "Once upon a time, a fox found a red hat in the woods. " * 4
    assert h.story_ok(story) and not h.story_ok("A fox.") and not h.story_ok("I'm flaxchat. " + story)


def test_score_counts_each_category():
    replies = ["flaxchat"] * 8 + [f"#### {a}" for _, a in h.ARITHMETIC[:5]] + ["#### 0"] * 3 + ["word " * 50] * 4
    scores = h.score(replies)
    assert scores == {"identity": (8, 8), "arithmetic": (5, 8), "stories": (4, 4)}
    assert h.summary(scores) == "identity 8/8, arithmetic 5/8, stories 4/4"
    with pytest.raises(ValueError, match="expected 20 replies"):
        h.score(replies[:3])
