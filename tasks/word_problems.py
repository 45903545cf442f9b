"""Arithmetic word problems, told in phrasing families that are split into a train bank and a check bank.

    make_problem(rng)                       # a random problem in the train phrasings (all training data)
    make_problem(rng, phrasing="check")     # one in the check phrasings, with names training never draws
    arithmetic_problem(index, split, seed)  # problem `index` of the train or val split (SFT, RL)

A problem is a scene (someone has things and gains or loses some; fills boxes, a dozen or "5 in each"; shares them
equally; earns money per hour or saves it every week; spends it; pays and gets change back; seats in rows; "twice
as many"; more or fewer than a friend; two people's things put together; a distracting number beside it), told in
the present or the past, in one of several sentence orders (question last, question first, one sentence).

Every piece of wording lives in word_problems.json in two banks. The train bank writes every training example,
the check bank only the held-out check (tasks/heldout_chat.py): a check problem asks in ways no training example
was phrased, so the check measures understanding, not recall of templates (tests/test_heldout_chat.py proves that
no sentence of a check problem has the shape of a sentence in the training data). The reply is one calculator call
holding the whole expression, its numbers in the order the question gives them (`37+18-12`), then
"So the answer is 43 shells.\\n#### 43": the model learns to copy each number and pick its operation from the
words around it, and the tool does the arithmetic.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from importlib import resources

from flaxchat.data.story_world import WORDS
from flaxchat.generate.sandbox import use_calculator

DATA = json.loads(resources.files("tasks").joinpath("word_problems.json").read_text(encoding="utf-8"))
PHRASINGS = ("train", "check")
CHECK_NAMES = frozenset(name for name, _ in DATA["check_names"])
PEOPLE = {
    "train": tuple(
        (n, g)
        for n, g in [(n, "she") for n in WORDS.girl_names] + [(n, "he") for n in WORDS.boy_names] + DATA["extra_names"]
        if n not in CHECK_NAMES
    ),
    "check": tuple(map(tuple, DATA["check_names"])),
}
THINGS = DATA["things"]
PAST_SHARE = 0.35  # problems told in the past tense
ROLE_SHARE = 0.12  # people called by their job ("the farmer")


@dataclass
class Problem:
    """A word problem and its worked solution as assistant parts (text, python, python_output, ...)."""

    question: str
    parts: list[dict]
    answer: int
    unit: str = ""  # what the answer counts ("shells", "dollars")

    def conversation(self) -> dict:
        return {
            "messages": [
                {"role": "user", "content": self.question},
                {"role": "assistant", "content": [dict(p) for p in self.parts]},
            ]
        }


@dataclass
class Person:
    name: str
    he: str  # she / he

    @property
    def his(self) -> str:
        return "her" if self.he == "she" else "his"

    @property
    def him(self) -> str:
        return "her" if self.he == "she" else "him"

    @property
    def He(self) -> str:
        return self.he.capitalize()

    @property
    def His(self) -> str:
        return self.his.capitalize()


def tense(text: str, past: bool) -> str:
    """Verbs written "~gives" in the present ("gives") or the past ("gave")."""
    return re.sub(r"~(\w+)", lambda m: DATA["past"][m.group(1)] if past else m.group(1), text)


class Scene:
    """The random choices of one problem: its phrasing bank, tense, people and wording."""

    def __init__(self, rng: random.Random, phrasing: str, past: bool):
        if phrasing not in PHRASINGS:
            raise ValueError(f"phrasing must be train or check, got {phrasing!r}")
        self.rng, self.phrasing, self.past = rng, phrasing, past

    def bank(self, name: str) -> list[str]:
        """The phrasings of `name` in this scene's bank; a question written with "did" only in a past scene."""
        return [t for t in DATA["phrasings"][name][self.phrasing] if self.past or " did " not in t]

    def bank_of(self, spec: dict) -> list:
        """A template scene's templates in this scene's bank."""
        return spec[self.phrasing]

    def pick(self, name: str, **slots) -> str:
        return self.fill(self.rng.choice(self.bank(name)), **slots)

    def fill(self, template: str, **slots) -> str:
        p = slots.get("p")
        defaults = {"rel": self.rng.choice(DATA["relatives"]), "project": self.rng.choice(DATA["projects"])}
        return template.format(**{**defaults, "P": p, **slots})

    def person(self, other: Person | None = None) -> Person:
        """Someone with a name, or now and then a role ("the baker"): a problem need not be about a named child."""
        while True:
            if self.rng.random() < ROLE_SHARE:
                name, he = self.rng.choice(DATA["roles"][self.phrasing]), self.rng.choice(("he", "she"))
            else:
                name, he = self.rng.choice(PEOPLE[self.phrasing])
            if other is None or name != other.name:
                return Person(name, he)

    def thing(self) -> tuple[str, str]:
        kind = self.rng.choice(sorted(THINGS))
        return kind, self.rng.choice(THINGS[kind])

    def dollars(self, n: int) -> str:
        return f"${n}" if self.rng.random() < 0.5 else f"{n} dollars"

    def event(self, kind: str, gain: bool, n: int, p: Person, f: Person) -> str:
        """A change as a clause without its subject: "~gives 5 to Ben"."""
        table = "gain" if gain else "loss"
        options = self.bank(f"{table}_any") + (
            self.bank(f"{table}_{kind}") if f"{table}_{kind}" in DATA["phrasings"] else []
        )
        return self.fill(self.rng.choice(options), n=n, p=p, f=f)

    def first_clause(self, kind: str, gain: bool, n: int, p: Person, f: Person) -> str:
        """The first change with its subject: mostly the person ("She finds 5 more"), sometimes someone else."""
        others = self.bank("others_take_any") + (
            self.bank(f"others_take_{kind}") if kind in ("food", "outdoor") else []
        )
        if not gain and self.rng.random() < 0.2:
            clause = self.fill(self.rng.choice(others), n=n, p=p, f=f)
            return clause[0].upper() + clause[1:]
        return f"{p.He} {self.event(kind, gain, n, p, f)}"

    def start(self, kind: str, n: int, p: Person, t: str) -> str:
        extra = self.bank(f"start_{kind}") if kind in ("food", "outdoor") else []
        return self.fill(self.rng.choice(self.bank("start") + extra), n=n, p=p, t=t)

    def ask(self, p: Person, t: str, left: bool) -> str:
        return self.fill(self.rng.choice(self.bank("ask_now") + (self.bank("ask_left") if left else [])), p=p, t=t)


def ordered(template: str, x: str, y: str, op: str, values: dict) -> str:
    """x op y with its numbers in the order the template names them ("{w}" before "{a}": "w*a")."""
    first, second = (x, y) if template.index("{" + x + "}") < template.index("{" + y + "}") else (y, x)
    return f"{values[first]}{op}{values[second]}"


# --- scenes: each returns (question, expression, unit) ----------------------------------------------------------


def changes(s: Scene, steps: int):
    """Someone has things and gains or loses some, one to three times."""
    p, rng = s.person(), s.rng
    f = s.person(p)
    kind, t = s.thing()
    a, ops = rng.randint(5, 500), []
    total = a
    for _ in range(steps):
        gain = not (total > 2 and rng.random() < 0.55)
        n = rng.randint(2, 300) if gain else rng.randint(1, min(total - 1, 400))
        ops.append(("+" if gain else "-", n))
        total += n if gain else -n
    expr = str(a) + "".join(f"{op}{n}" for op, n in ops)
    events = [s.event(kind, op == "+", n, p, f) for op, n in ops]
    ask = s.ask(p, t, left=ops[-1][0] == "-")
    form = rng.random()
    if steps <= 2 and form < 0.15 and not s.past:  # the question first
        return s.pick("question_first", p=p, n=a, t=t, ev=" and then ".join(events)), expr, t
    if steps <= 2 and form < 0.35:  # one sentence: "Sam has 45 apples and gives away 17."
        return f"{s.pick('one_sentence', p=p, n=a, t=t, ev=' and then '.join(events))} {ask}", expr, t
    first = s.first_clause(kind, ops[0][0] == "+", ops[0][1], p, f)
    if steps == 1:
        body = f"{first}."
    elif steps == 2:  # "..., and later sells 7" only when the first clause's subject is the person
        links = [t for t in s.bank("link2") if first.startswith(p.He) or "{p.he} {b}" in t]
        body = s.fill(rng.choice(links), p=p, a=first, b=events[1])
    else:
        body = s.pick("link3", p=p, a=first, b=events[1], c=events[2])
    return f"{s.start(kind, a, p, t)} {body} {ask}", expr, t


def one_change(s: Scene):
    return changes(s, 1)


def two_changes(s: Scene):
    return changes(s, 2)


def three_changes(s: Scene):
    return changes(s, 3)


def groups(s: Scene):
    """Boxes of b ("5 in each", "per box", a dozen), then maybe a change; or some first and boxes bought after."""
    p, rng = s.person(), s.rng
    f = s.person(p)
    kind, t = s.thing()
    (c, cs), a, b = rng.choice(DATA["containers"]), rng.randint(2, 20), rng.randint(2, 40)
    style = rng.random()
    if style < 0.2:  # some to start with, then boxes of them
        had = rng.randint(2, 300)
        g = s.pick("groups", a=a, b=b, t=t, c=c, cs=cs)
        return f"{s.start(kind, had, p, t)} {p.He} {s.pick('then_get')} {g}. {s.ask(p, t, False)}", f"{had}+{a}*{b}", t
    if style < 0.35:
        b = 12
        opener, expr = s.pick("dozens", p=p, a=a, t=t), f"{a}*12"
    elif style < 0.55:
        template = rng.choice(s.bank("groups_two_sentences"))
        opener = s.fill(template, p=p, a=a, b=b, t=t, c=c, cs=cs)
        expr = ordered(template, "a", "b", "*", {"a": a, "b": b})
    elif kind == "food" and style < 0.75:
        opener, expr = s.pick("food_groups", p=p, a=a, b=b, t=t), f"{a}*{b}"
    else:
        opener, expr = s.pick("group_openers", p=p, g=s.pick("groups", a=a, b=b, t=t, c=c, cs=cs)), f"{a}*{b}"
    if rng.random() < 0.15:  # one step: how many in all
        return f"{opener} {s.ask(p, t, False)}", expr, t
    gain = rng.random() < 0.4
    n = rng.randint(2, 200) if gain else rng.randint(1, a * b - 1)
    change = s.first_clause(kind, gain, n, p, f)
    return f"{opener} {change}. {s.ask(p, t, left=not gain)}", f"{expr}{'+' if gain else '-'}{n}", t


def share(s: Scene):
    """Sharing equally: how many each gets, maybe after a change first, or with a change to one share after."""
    p, rng = s.person(), s.rng
    f = s.person(p)
    kind, t = s.thing()
    n, each = rng.randint(2, 12), rng.randint(2, 40)
    who = rng.choice(("friends", "children", "groups", rng.choice(DATA["containers"])[1]))
    way, style = s.pick("share_ways"), rng.random()
    if style < 0.35:  # a / n, then more for one share or some taken from it
        a, k = n * each, rng.randint(1, each - 1)
        gain = rng.random() < 0.4
        after = s.pick("share_more" if gain else "share_less", p=p, k=k)
        q = f"{s.start(kind, a, p, t)} {p.He} {way} {n} {who}. {after} {s.pick('share_after_ask', t=t)}"
        return q, f"{a}//{n}{'+' if gain else '-'}{k}", t
    if style < 0.7:  # a change first, then share what there is
        total = n * each
        gain = rng.random() < 0.5
        b = rng.randint(1, total - 1) if gain else rng.randint(1, 200)
        a = total - b if gain else total + b
        ev = s.event(kind, gain, b, p, f)
        way = way.replace("them", "them" if gain else "the rest")
        q = f"{s.start(kind, a, p, t)} {p.He} {ev}. Then {p.he} {way} {n} {who}. {s.pick('share_ask', t=t)}"
        return q, f"({a}{'+' if gain else '-'}{b})//{n}", t
    a = n * each
    return f"{s.start(kind, a, p, t)} {p.He} {way} {n} {who}. {s.pick('share_ask', t=t)}", f"{a}//{n}", t


def rate(s: Scene):
    """Money earned per hour or saved every week, then spent or added to savings; or pages read a day toward a goal."""
    p, rng = s.person(), s.rng
    a, w = rng.randint(2, 60), rng.randint(2, 12)
    per, unit = rng.choice(DATA["periods"])
    style = rng.random()
    if style < 0.3:
        verb, noun = rng.choice((("~reads", "pages"), ("~writes", "pages"), ("~runs", "laps"), ("~swims", "laps")))
        total = a * w + rng.randint(1, 300)
        goal = {"pages": ("The book ~has", "The book ~is"), "laps": ("The goal ~is", "The race ~is")}[noun]
        template = rng.choice(s.bank("goal_rate"))
        slots = dict(p=p, verb=verb, a=a, noun=noun, per=per, w=w, unit=unit, total=total, goal=goal[0], goal2=goal[1])
        return s.fill(template, **slots), f"{total}-{ordered(template, 'a', 'w', '*', slots)}", noun
    template = rng.choice(s.bank("earning"))
    slots = dict(p=p, earn=rng.choice(("~saves", "~earns", "~gets")), a=s.dollars(a), per=per, w=w, unit=unit)
    earned, product = s.fill(template, **slots), ordered(template, "a", "w", "*", {"a": a, "w": w})
    if style < 0.7:
        b = rng.randint(1, a * w - 1)
        spent = s.pick("spend_after", p=p, s=earned, spend="~spends", b=s.dollars(b), x=rng.choice(DATA["buys"]))
        return f"{spent} {s.pick('money_left', p=p)}", f"{product}-{b}", "dollars"
    had = rng.randint(2, 300)
    template = rng.choice(s.bank("already_had"))
    q = f"{s.fill(template, p=p, h=s.dollars(had), s=earned)} {s.pick('money_now', p=p)}"
    return q, (f"{had}+{product}" if template.index("{h}") < template.index("{s}") else f"{product}+{had}"), "dollars"


def spend_twice(s: Scene):
    """Money spent on two things: a - b - c."""
    p, rng = s.person(), s.rng
    a = rng.randint(20, 900)
    b = rng.randint(1, a - 2)
    c = rng.randint(1, a - b - 1)
    x, y = rng.sample(DATA["buys"], 2)
    spent = s.pick("spend_two", p=p, b=s.dollars(b), c=s.dollars(c), x=x, y=y)
    return f"{s.pick('spend_start', p=p, a=s.dollars(a))} {spent} {s.pick('spend_ask', p=p)}", f"{a}-{b}-{c}", "dollars"


def crowd(s: Scene):
    """People or animals in a place; some leave, some arrive: a - b - c or a - b + c."""
    who, where, go1, go2, come, now = s.rng.choice(DATA["crowds"])
    a = s.rng.randint(20, 500)
    b = s.rng.randint(1, a // 2)
    slots = dict(
        who=who, where=where, Where=where[0].upper() + where[1:], go1=go1, go2=go2, come=come, now=now, a=a, b=b
    )
    if s.rng.random() < 0.6:
        c = s.rng.randint(1, a - b - 1)
        return s.pick("crowd_two_leave", c=c, **slots), f"{a}-{b}-{c}", who
    c = s.rng.randint(1, 200)
    return s.pick("crowd_leave_arrive", c=c, **slots), f"{a}-{b}+{c}", who


def capacity(s: Scene):
    """Rows of seats (or plants) and some taken: a * b - c."""
    place, part, spot = s.rng.choice(DATA["places"])
    a, b = s.rng.randint(2, 40), s.rng.randint(2, 50)
    c = s.rng.randint(1, a * b - 1)
    has = s.pick("capacity_has", A="An" if place[0] in "aeiou" else "A", place=place, a=a, part=part, b=b, spot=spot)
    if spot in ("plants", "corn plants", "trees"):
        q = f"{has} {s.pick('capacity_lost', c=c, spot=spot)} {s.pick('capacity_lost_ask', spot=spot)}"
        return q, f"{a}*{b}-{c}", spot
    return f"{has} {s.pick('capacity_used', c=c, spot=spot)} {s.pick('capacity_ask', spot=spot)}", f"{a}*{b}-{c}", spot


def times_as_many(s: Scene):
    """ "Twice as many" (or three times, half) on a second day or for a second person: a + a*k, or how many more."""
    p, rng = s.person(), s.rng
    word, k = rng.choice(DATA["times"])
    a = rng.randint(2, 60) * (1 if k else 2)
    second = f"{a}*{k}" if k else f"{a}//2"
    more = k is not None and rng.random() < 0.35
    if rng.random() < 0.6:  # one person on two days
        does, do, noun = rng.choice(DATA["doings"])
        d1, d2 = rng.choice(DATA["days"])
        q = s.pick("times_days", p=p, does=does, a=a, noun=noun, d1=d1, D1=d1[0].upper() + d1[1:], d2=d2, word=word)
        if more:
            return f"{q} {s.pick('times_days_more', p=p, noun=noun, do=do, d1=d1, d2=d2)}", f"{a}*{k}-{a}", noun
        asks = rng.choice(
            ("together", "altogether", "in all", "in total") + (("in the two days",) if "day" in d1 else ())
        )
        return f"{q} {s.pick('times_days_total', p=p, noun=noun, do=do, asks=asks)}", f"{a}+{second}", noun
    f = s.person(p)
    _, t = s.thing()
    q = s.pick("times_people", p=p, f=f, a=a, t=t, word=word)
    if more:
        return f"{q} {s.pick('times_people_more', p=p, f=f, t=t)}", f"{a}*{k}-{a}", t
    total = s.pick("times_people_total", p=p, f=f, t=t, together=rng.choice(("together", "altogether", "in all")))
    return f"{q} {total}", f"{a}+{second}", t


def compare(s: Scene):
    """A friend has b more or fewer; how many together: a + (a + b)."""
    p, rng = s.person(), s.rng
    f, (_, t) = s.person(p), s.thing()
    a = rng.randint(10, 400)
    more = rng.random() < 0.5
    b = rng.randint(1, 200) if more else rng.randint(1, a - 1)
    q = s.pick("compare", p=p, f=f, a=a, b=b, t=t, rel="more" if more else "fewer")
    total = s.pick("compare_total", t=t, together=rng.choice(("together", "altogether", "in all")))
    return f"{q} {total}", f"{a}+({a}{'+' if more else '-'}{b})", t


def shopping(s: Scene):
    """Prices: what is left after buying b at c each, what two purchases cost, the change from a bill."""
    p, rng = s.person(), s.rng
    (_, many), (one, other) = rng.sample(DATA["goods"], 2)
    b, c = rng.randint(2, 12), rng.randint(2, 30)
    style = rng.random()
    if style < 0.35:
        a = rng.randint(b * c, b * c + 200)
        q = f"{s.pick('shop_left', p=p, a=s.dollars(a), b=b, many=many, c=s.dollars(c))} {s.pick('money_left', p=p)}"
        return q, f"{a}-{b}*{c}", "dollars"
    if style < 0.65:
        d, e = rng.randint(2, 12), rng.randint(2, 30)
        q = s.pick("shop_two", p=p, b=b, many=many, c=s.dollars(c), d=d, other=other, one=one, e=s.dollars(e))
        return f"{q} {s.pick('shop_spent', p=p)}", f"{b}*{c}+{d}*{e}", "dollars"
    bill = next(x for x in (10, 20, 50, 100, 200, 500, 1000) if x >= b * c)
    return s.pick("shop_change", p=p, b=b, many=many, c=s.dollars(c), bill=bill), f"{bill}-{b}*{c}", "dollars"


def distractor(s: Scene):
    """A number that does not matter (an age, other things, a street number) beside a one-step change."""
    p, rng = s.person(), s.rng
    f = s.person(p)
    kind, t = s.thing()
    other = rng.choice([x for x in THINGS["toy"] + THINGS["school"] if x != t])
    a = rng.randint(5, 400)
    gain = rng.random() < 0.5
    n = rng.randint(2, 300) if gain else rng.randint(1, a - 1)
    template = rng.choice(s.bank("side_fact"))
    side = s.fill(template, p=p, k=rng.randint(5, 12) if "years" in template else rng.randint(2, 90), other=other)
    main = f"{s.start(kind, a, p, t)} {s.first_clause(kind, gain, n, p, f)}."
    text = f"{side} {main}" if rng.random() < 0.5 else f"{main} {side}"
    return f"{text} {s.ask(p, t, left=not gain)}", f"{a}{'+' if gain else '-'}{n}", t


def combine(s: Scene):
    """Two people's things: together (maybe giving some away after), or how many more one has."""
    p, rng = s.person(), s.rng
    f, (_, t) = s.person(p), s.thing()
    a, b = rng.randint(2, 400), rng.randint(2, 400)
    q = s.pick("combine", p=p, f=f, a=a, b=b, t=t)
    if rng.random() < 0.3 and a != b:
        a, b = max(a, b), min(a, b)
        return s.pick("combine", p=p, f=f, a=a, b=b, t=t) + " " + s.pick("difference", p=p, f=f, t=t), f"{a}-{b}", t
    if rng.random() < 0.4:
        c = rng.randint(1, a + b - 1)
        return f"{q} {s.pick('combine_then', c=c)} {s.pick('combine_left', t=t)}", f"{a}+{b}-{c}", t
    return f"{q} {s.pick('combine_total', t=t)}", f"{a}+{b}", t


def template_scene(spec: dict):
    """A scene written whole in word_problems.json ("template_scenes"): its numbers (a range, or the sum or product of
    numbers drawn before it), and per bank its templates, each with the expression it asks for."""

    def scene(s: Scene):
        rng, values = s.rng, {}
        for name, rule in spec["vars"].items():
            if isinstance(rule[0], int):
                values[name] = rng.randint(*rule)
            else:
                op, x, y = rule
                values[name] = values[x] + values[y] if op == "+" else values[x] * values[y]
        template, expr, *unit = rng.choice(s.bank_of(spec))
        p = s.person()
        (c, cs), (one, many), x = rng.choice(DATA["containers"]), rng.choice(DATA["goods"]), rng.choice(DATA["buys"])
        does, do, noun = rng.choice(DATA["doings"])
        words = dict(p=p, f=s.person(p), t=s.thing()[1], box=c, boxes=cs, one=one, many=many, Many=many.capitalize())
        words |= dict(x=x, X=x[0].upper() + x[1:], does=does, do=do, noun=noun)
        unit = (unit[0] if unit else spec["unit"]).format(**words)
        return s.fill(template, **words, **values), expr.format(**values), unit

    scene.__name__ = spec["name"]
    return scene


# scene -> weight: mostly two steps, some one and three; then the scenes written whole in the data file
SCENES = (
    (one_change, 1),
    (two_changes, 4),
    (three_changes, 1),
    (groups, 4),
    (share, 2),
    (rate, 3),
    (spend_twice, 1),
    (crowd, 1),
    (capacity, 2),
    (times_as_many, 2),
    (compare, 1),
    (shopping, 2),
    (distractor, 1),
    (combine, 2),
) + tuple((template_scene(spec), 1) for spec in DATA["template_scenes"])


def solution(expr: str, unit: str, lead: str = "So the answer is") -> tuple[list[dict], int]:
    """Assistant parts: one calculator call holding the whole expression, then "#### answer".

    The tool output is what the Engine's calculator prints for the expression at run time, so SFT shows the
    model exactly the tokens it will be given when it samples. Division is written `//` so the result prints as
    an integer (use_calculator("24/6") prints "4.0").
    """
    value = use_calculator(expr)
    if value is None or not value.lstrip("-").isdigit():
        raise ValueError(f"the calculator does not give a whole number for {expr!r}: {value!r}")
    answer = int(value)
    parts = [
        {"type": "text", "text": "Let me use the calculator: "},
        {"type": "python", "text": expr},
        {"type": "python_output", "text": value},
        {"type": "text", "text": f" {lead} {answer} {unit}.\n#### {answer}"},
    ]
    return parts, answer


def make_problem(rng: random.Random, phrasing: str = "train", scene=None) -> Problem:
    """One random word problem (one to three operations, one calculator call) in the phrasings of one bank; of
    the given scene (one of SCENES' functions), else of one drawn by SCENES' weights."""
    scenes, weights = zip(*SCENES)
    told = Scene(rng, phrasing, past=rng.random() < PAST_SHARE)
    question, expr, unit = (scene or rng.choices(scenes, weights)[0])(told)
    question = re.sub(r"(^|[.?!:] )([a-z])", lambda m: m.group(1) + m.group(2).upper(), tense(question, told.past))
    parts, answer = solution(expr, unit)
    return Problem(question, parts, answer, unit)
