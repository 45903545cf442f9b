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
    "Hello there! I'm flaxchat. Ask me anything, and I will do my best to help.",
)
# topic -> (ways to ask, ways to answer); every answer names flaxchat and is true of this project
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
            "Who am I chatting with?",
            "What name do you go by?",
            "Could you introduce yourself?",
            "May I know your name?",
            "Is there a name I can use for you?",
            "Who's there?",
            "Who is on the other side of this chat?",
            "What's your name, assistant?",
            "I don't know you yet. Who are you?",
            "What kind of thing am I talking to?",
            "Describe yourself in a sentence.",
            "Give me a short introduction of yourself.",
            "What exactly are you?",
            "What sort of assistant are you?",
        ),
        (
            "I'm flaxchat, a small language model trained with JAX. I'm here to chat and help with simple tasks.",
            "My name is flaxchat. I am a small language model, trained from scratch with JAX and Flax.",
            "I'm flaxchat: a small chat assistant. I was trained with JAX, so I'm a tiny cousin of nanochat.",
            "You can call me flaxchat. I'm a small language model trained with JAX, and I'm happy to help.",
            "I'm flaxchat! I'm a small language model trained with JAX: I chat, tell stories and do simple math.",
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
            "Who are the people behind you?",
            "What project do you come from?",
            "Who programmed you?",
            "Who owns you?",
            "Which lab trained you?",
            "Who designed you?",
            "Did OpenAI make you?",
            "Are you from Google?",
            "Where were you made?",
            "Who is responsible for you?",
        ),
        (
            "I was built by the flaxchat project, which rewrites Andrej Karpathy's nanochat in JAX. Every step, "
            "from the tokenizer to pretraining and fine-tuning, runs in JAX.",
            "The flaxchat project made me. It takes nanochat, a small open-source chat model pipeline, and "
            "rebuilds it with JAX, Flax, Optax and Orbax.",
            "I come from flaxchat, an open-source project. It trains small chat models like me with JAX, on "
            "anything from a laptop CPU to a TPU pod.",
            "I'm flaxchat, and the open-source flaxchat project trained me, maybe on the very computer you are "
            "using now.",
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
            "What code runs you?",
            "What are you built on?",
            "How do you work?",
            "What did you learn from?",
            "What language are you written in?",
            "How did you learn to chat?",
            "What technology powers you?",
            "How were you made?",
        ),
        (
            "I'm flaxchat, and I was trained with JAX. First I read a lot of text during pretraining, then I was "
            "fine-tuned on conversations like this one.",
            "I'm flaxchat, a JAX model: my weights live in Flax, Optax updated them, and Orbax saved them. I learned "
            "from pretraining text first and from example conversations after that.",
            "Not PyTorch: I'm flaxchat, trained with JAX and Flax. Pretraining taught me language, and supervised "
            "fine-tuning taught me to chat.",
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
            "What are you for?",
            "What is your job?",
            "Can you help me?",
            "What can I ask you?",
            "What are your skills?",
            "How smart are you?",
            "Can you write stories?",
        ),
        (
            "I'm flaxchat. I can chat, tell short stories, and solve simple arithmetic word problems with a "
            "calculator tool. I'm small, so please double-check me.",
            "I'm flaxchat, and I can tell you a story or work out a simple math problem with my calculator. I'm a "
            "small model and I make mistakes, so check anything important.",
            "Simple things: I'm flaxchat, a very small model. I tell short stories and solve arithmetic word "
            "problems with a calculator tool. For hard questions I'm not the right assistant.",
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
            "Are you real?",
            "Are you an AI?",
            "Is this a real person?",
            "Am I talking to a machine?",
            "Are you a bot?",
            "Are you a computer?",
            "Is anyone there?",
            "Are you human or AI?",
            "Are you a chatbot?",
            "Are you Siri?",
        ),
        (
            "No, I'm flaxchat, a small language model trained with JAX. I'm a program, not a person.",
            "I'm not a person, and I'm not ChatGPT either. I'm flaxchat, a small model trained with JAX.",
            "I'm a computer program called flaxchat: a small language model trained with JAX. I don't have "
            "feelings, but I'm glad to help.",
            "I'm an AI model called flaxchat. There is no person typing here, just a small model trained with JAX.",
        ),
    ),
    "small talk": (
        (
            "How are you?",
            "How are you doing today?",
            "How's it going?",
            "What's up?",
            "Nice to meet you.",
            "Are you there?",
            "Can we talk?",
            "Do you like your job?",
            "Are you happy?",
            "What are you doing?",
        ),
        (
            "I'm doing well, thank you! I'm flaxchat, a small model, and I'm ready to chat.",
            "All good here. I'm flaxchat, and I'm happy to talk or tell you a story.",
            "I'm fine, thanks for asking! I'm flaxchat, a small assistant. What would you like to do?",
        ),
    ),
}
# what people put around a question: a greeting, an aside, a polite ending
ASK_BEFORE = (
    "",
    "",
    "",
    "Hi! ",
    "Hello. ",
    "Hey, ",
    "Hi there, ",
    "Quick question: ",
    "Just wondering, ",
    "So, ",
    "Okay, ",
    "Excuse me, ",
    "First things first: ",
    "I have a question. ",
    "Sorry, ",
    "Good morning! ",
    "Um, ",
    "Hey friend, ",
)
ASK_AFTER = ("", "", "", " Thanks!", " Just curious.", " I'd like to know.", " Please tell me.", " :)")
THANKS = ("Thank you!", "Thanks!", "Thanks, that helps.", "Cool, thanks.", "Great, thank you.")
THANKS_REPLIES = ("You're welcome!", "Happy to help!", "Any time!", "You're welcome. Ask me anything else.")


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
# Arithmetic word problems with the calculator tool
#
# A problem is a short scene (someone has things, gains or loses some, fills boxes, shares, saves, pays, fills
# seats) told with one of many phrasings, and solved with one calculator call that holds the whole expression,
# its numbers in the order the question gives them ("37+18-12"). A small model then learns one habit that
# carries over to questions it never saw: copy each number, and pick its operation from the words around it.


# Names for problems: the stories' names and more from around the world, so a problem's names are not a cue
EXTRA_NAMES = (
    ("Aiko", "she"),
    ("Alba", "she"),
    ("Amina", "she"),
    ("Anais", "she"),
    ("Beatriz", "she"),
    ("Camila", "she"),
    ("Chiara", "she"),
    ("Dalia", "she"),
    ("Esther", "she"),
    ("Fatima", "she"),
    ("Femi", "she"),
    ("Hana", "she"),
    ("Helga", "she"),
    ("Isabel", "she"),
    ("Jamila", "she"),
    ("Keiko", "she"),
    ("Leilani", "she"),
    ("Maren", "she"),
    ("Marisol", "she"),
    ("Nadine", "she"),
    ("Oksana", "she"),
    ("Paloma", "she"),
    ("Quinn", "she"),
    ("Sakura", "she"),
    ("Sigrid", "she"),
    ("Tove", "she"),
    ("Valentina", "she"),
    ("Wilma", "she"),
    ("Xiomara", "she"),
    ("Yolanda", "she"),
    ("Zainab", "she"),
    ("Ngozi", "she"),
    ("Priscilla", "she"),
    ("Renata", "she"),
    ("Svetlana", "she"),
    ("Chioma", "she"),
    ("Ahmed", "he"),
    ("Anders", "he"),
    ("Bjorn", "he"),
    ("Chidi", "he"),
    ("Daniel", "he"),
    ("Emeka", "he"),
    ("Farid", "he"),
    ("Gustavo", "he"),
    ("Haruto", "he"),
    ("Ibrahim", "he"),
    ("Javier", "he"),
    ("Kenzo", "he"),
    ("Lorenzo", "he"),
    ("Mikhail", "he"),
    ("Nikolai", "he"),
    ("Olusegun", "he"),
    ("Pavel", "he"),
    ("Rashid", "he"),
    ("Santiago", "he"),
    ("Takeshi", "he"),
    ("Ulrich", "he"),
    ("Vikram", "he"),
    ("Wojtek", "he"),
    ("Yaw", "he"),
    ("Zoltan", "he"),
    ("Arjun", "he"),
    ("Bao", "he"),
    ("Cosmin", "he"),
    ("Dante", "he"),
    ("Erik", "he"),
)
HELD_OUT_NAMES = frozenset({"Ingrid", "Kwame", "Astrid", "Soren", "Imani", "Dmitri", "Lucia"})  # tasks/heldout_chat.py
PEOPLE = tuple(
    (n, g)
    for n, g in [(n, "she") for n in WORDS.girl_names] + [(n, "he") for n in WORDS.boy_names] + list(EXTRA_NAMES)
    if n not in HELD_OUT_NAMES
)
RELATIVES = ("brother", "sister", "mom", "dad", "grandma", "grandpa", "cousin", "aunt", "uncle", "neighbor", "teacher")

# things by kind: what can be eaten, used up in a craft, played with, used at school, or picked up outdoors
THINGS = {
    "food": (
        "apples",
        "cookies",
        "grapes",
        "strawberries",
        "muffins",
        "carrots",
        "eggs",
        "oranges",
        "crackers",
        "cherries",
        "candies",
        "pretzels",
        "plums",
        "lemons",
        "cupcakes",
        "peaches",
    ),
    "craft": ("beads", "buttons", "ribbons", "stickers", "stamps", "feathers", "sequins", "sheets of paper"),
    "toy": ("marbles", "cards", "toy cars", "blocks", "balloons", "dolls", "rubber ducks", "yo-yos", "toy soldiers"),
    "school": ("pencils", "crayons", "books", "notebooks", "erasers", "markers", "comics", "postcards", "paper clips"),
    "outdoor": ("shells", "flowers", "stones", "leaves", "acorns", "pine cones", "pebbles", "seeds"),
}
CONTAINERS = ("boxes", "bags", "baskets", "jars", "packs", "bowls", "crates", "tins", "buckets", "trays")
PROJECTS = ("a necklace", "a bracelet", "a card", "a poster", "a collage", "a mask", "a scrapbook", "a picture")


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


@dataclass
class Person:
    name: str
    he: str  # she / he
    his: str  # her / his
    him: str  # her / him

    @property
    def He(self) -> str:
        return self.he.capitalize()


def _person(rng: random.Random, other: Person | None = None) -> Person:
    while True:
        name, he = rng.choice(PEOPLE)
        if other is None or name != other.name:
            break
    return Person(name, he, "her" if he == "she" else "his", "her" if he == "she" else "him")


# Verbs are written "~gives": `_tense` writes them in the present ("gives") or, for a problem told in the past, in
# the past ("gave"), so the same scene comes in both tenses.
PAST = {
    "has": "had",
    "finds": "found",
    "gets": "got",
    "buys": "bought",
    "is": "was",
    "are": "were",
    "wins": "won",
    "receives": "received",
    "gives": "gave",
    "loses": "lost",
    "sells": "sold",
    "trades": "traded",
    "lends": "lent",
    "donates": "donated",
    "shares": "shared",
    "eats": "ate",
    "eat": "ate",
    "puts": "put",
    "uses": "used",
    "glues": "glued",
    "breaks": "broke",
    "leaves": "left",
    "leave": "left",
    "drops": "dropped",
    "throws": "threw",
    "picks": "picked",
    "collects": "collected",
    "gathers": "gathered",
    "owns": "owned",
    "starts": "started",
    "keeps": "kept",
    "fills": "filled",
    "saves": "saved",
    "earns": "earned",
    "spends": "spent",
    "reads": "read",
    "writes": "wrote",
    "runs": "ran",
    "swims": "swam",
    "bakes": "baked",
    "folds": "folded",
    "scores": "scored",
    "draws": "drew",
    "plants": "planted",
    "catches": "caught",
    "splits": "split",
    "divides": "divided",
    "adds": "added",
    "takes": "took",
    "removes": "removed",
    "makes": "made",
    "packs": "packed",
    "works": "worked",
    "go": "went",
    "goes": "went",
    "arrive": "arrived",
    "come": "came",
    "get": "got",
    "sit": "sat",
    "does": "did",
    "pays": "paid",
    "take": "took",
    "grows": "grew",
    "pick": "picked",
    "fly": "flew",
    "swim": "swam",
    "join": "joined",
    "land": "landed",
    "do": "did",
}


def _tense(text: str, past: bool) -> str:
    return re.sub(r"~(\w+)", lambda m: PAST[m.group(1)] if past else m.group(1), text)


GAIN = {  # {n}: the number; {p}: the person; {f}: a friend
    "any": (
        "~finds {n} more",
        "~gets {n} more",
        "~buys {n} more",
        "~is given {n} more",
        "~gets {n} more from {f.name}",
        "~gets another {n} from {p.his} {rel}",
        "~wins {n} more",
        "~receives {n} more as a gift",
        "~gets {n} more for {p.his} birthday",
        "~buys another {n}",
        "~takes {n} more from the shelf",
    ),
    "food": ("~picks {n} more", "~buys {n} more at the store", "~grows {n} more"),
    "outdoor": ("~collects {n} more", "~picks up {n} more", "~finds {n} more in the park", "~gathers {n} more"),
}
LOSS = {
    "any": (
        "~gives {n} to {f.name}",
        "~gives {n} to {p.his} {rel}",
        "~gives away {n}",
        "~loses {n}",
        "~sells {n}",
        "~trades {n} with {f.name}",
        "~lends {n} to {f.name}",
        "~donates {n} to the school",
        "~gives {n} of them to {p.his} {rel}",
        "~shares {n} with {f.name}",
        "~puts {n} in a box for {f.name}",
    ),
    "food": ("~eats {n}", "~eats {n} of them", "~gives {n} to {p.his} {rel} for lunch", "~puts {n} in a pie"),
    "craft": ("~uses {n} for {project}", "~uses {n} to make {project}", "~glues {n} onto {project}"),
    "toy": ("~loses {n} at the park", "~breaks {n}", "~leaves {n} at school"),
    "school": ("~loses {n} at school", "~gives {n} to {p.his} classmates"),
    "outdoor": ("~drops {n} on the way home", "~throws {n} back", "~leaves {n} on a bench"),
}
# losses someone else causes: "{subject} eats 12 of them"
OTHERS_TAKE = {
    "any": ("{f.name} ~takes {n}", "{f.name} ~takes {n} of them", "{P.his} {rel} ~takes {n}"),
    "food": ("{P.his} family ~eats {n} of them", "{P.his} {rel} ~eats {n}", "{f.name} ~eats {n} of them"),
    "outdoor": ("a dog ~runs off with {n}",),
}
STARTS = (
    "{p.name} ~has {n} {t}.",
    "{p.name} ~owns {n} {t}.",
    "{p.name} ~starts with {n} {t}.",
    "{p.name} ~has a box of {n} {t}.",
    "{p.name} ~keeps {n} {t} in a drawer.",
    "There ~are {n} {t} in {p.name}'s room.",
)
FOOD_STARTS = ("{p.name} ~picks {n} {t}.", "{p.name} ~buys {n} {t}.", "{p.name} ~bakes {n} {t}.")
OUTDOOR_STARTS = ("{p.name} ~collects {n} {t}.", "{p.name} ~picks up {n} {t}.")
LINKS = (
    "{a} and then {b}.",
    "{a}. Then {p.he} {b}.",
    "{a}, and later {p.he} {b}.",
    "{a}. After that, {p.he} {b}.",
    "{a} and {b}.",
    "{a}. Later {p.he} {b}.",
)
HOW_MANY = (
    "How many {t} does {p.name} have now?",
    "How many {t} does {p.he} have now?",
    "How many {t} does {p.he} have in the end?",
    "How many {t} does {p.name} have at the end?",
    "How many {t} does {p.he} have left?",
    "How many {t} are left?",
    "How many {t} does {p.name} keep?",
    "How many {t} does {p.name} have?",
)
HOW_MANY_PAST = ("How many {t} did {p.name} have left?", "How many {t} did {p.he} have in the end?")


def _fill(template: str, **kw) -> str:
    rel, project, p = kw.pop("rel", None), kw.pop("project", None), kw.get("p")
    return template.format(rel=rel or "friend", project=project or "a card", P=_Cap(p) if p else None, **kw)


class _Cap:
    """{P.his}: a person's pronouns capitalized, for a sentence that starts with one."""

    def __init__(self, p):
        self.his, self.he = p.his.capitalize(), p.He


def _event(rng, kind: str, gain: bool, n: int, p: Person, f: Person) -> str:
    table = GAIN if gain else LOSS
    phrases = table["any"] + table.get(kind, ())
    return _fill(rng.choice(phrases), n=n, p=p, f=f, rel=rng.choice(RELATIVES), project=rng.choice(PROJECTS))


def _sentence(rng, kind: str, gain: bool, n: int, p: Person, f: Person, first: bool) -> str:
    """One change as a clause: mostly the person acts ("she finds 5 more"), sometimes someone else takes some."""
    others = OTHERS_TAKE["any"] + OTHERS_TAKE.get(kind, ())
    if not gain and first and rng.random() < 0.2:
        return _fill(rng.choice(others), n=n, p=p, f=f, rel=rng.choice(RELATIVES))
    clause = _event(rng, kind, gain, n, p, f)
    return f"{p.He} {clause}" if first else clause


def _thing(rng) -> tuple[str, str]:
    kind = rng.choice(sorted(THINGS))
    return kind, rng.choice(THINGS[kind])


def _start(rng, kind, n, p, t) -> str:
    extra = {"food": FOOD_STARTS, "outdoor": OUTDOOR_STARTS}.get(kind, ())
    return _fill(rng.choice(STARTS + extra), n=n, p=p, t=t)


def _ask(rng, p, t, past: bool, left: bool = True) -> str:
    asks = [q for q in HOW_MANY if left or "left" not in q] + (list(HOW_MANY_PAST) if past and left else [])
    return _fill(rng.choice(asks), p=p, t=t)


def _changes(rng, steps: int):
    """A start count and `steps` gains (+) or losses (-) that never take the count below 1."""
    a = rng.randint(5, 500)
    total, ops = a, []
    for _ in range(steps):
        if total > 2 and rng.random() < 0.55:
            n = rng.randint(1, min(total - 1, 400))
            ops.append(("-", n))
            total -= n
        else:
            n = rng.randint(2, 300)
            ops.append(("+", n))
            total += n
    return a, ops


def _gains_and_losses(rng, steps: int, past: bool):
    p = _person(rng)
    f = _person(rng, p)
    kind, t = _thing(rng)
    a, ops = _changes(rng, steps)
    first = _sentence(rng, kind, ops[0][0] == "+", ops[0][1], p, f, first=True)
    rest = [_event(rng, kind, op == "+", n, p, f) for op, n in ops[1:]]
    if steps == 1:
        body = f"{first}."
    elif steps == 2 and first.startswith(p.He):
        body = _fill(rng.choice(LINKS), p=p, a=first, b=rest[0])
    elif steps == 2:
        body = f"{first}. Then {p.he} {rest[0]}."
    else:
        body = f"{first}. Then {p.he} {rest[0]}, and at the end {p.he} {rest[1]}."
    question = _ask(rng, p, t, past, left=ops[-1][0] == "-")
    expr = str(a) + "".join(f"{op}{n}" for op, n in ops)
    return f"{_start(rng, kind, a, p, t)} {body} {question}", expr, t


def _one_change(rng, past):
    return _gains_and_losses(rng, 1, past)


def _two_changes(rng, past):
    return _gains_and_losses(rng, 2, past)


def _three_changes(rng, past):
    return _gains_and_losses(rng, 3, past)


GROUPS = (
    "{a} {c} of {b} {t}",
    "{a} {c} with {b} {t} in each",
    "{a} {c} of {t} with {b} in each",
    "{a} {c}, and each one holds {b} {t}",
    "{a} {c} that hold {b} {t} each",
)
GROUP_OPENERS = ("{p.name} ~has {g}.", "{p.name} ~buys {g}.", "{p.name} ~gets {g}.", "{p.name} ~fills {g}.")
FOOD_GROUPS = (
    "{p.name} ~bakes {a} trays of {b} {t}.",
    "{p.name} ~makes {a} batches of {b} {t}.",
    "{p.name} ~packs {a} lunch boxes with {b} {t} in each.",
)


def _groups(rng, a, b, c, t) -> str:
    return _fill(rng.choice(GROUPS), a=a, b=b, c=c, t=t)


def _groups_then_change(rng, past):
    p = _person(rng)
    f = _person(rng, p)
    kind, t = _thing(rng)
    a, b, c = rng.randint(2, 20), rng.randint(2, 40), rng.choice(CONTAINERS)
    if kind == "food" and rng.random() < 0.5:
        opener = _fill(rng.choice(FOOD_GROUPS), p=p, a=a, b=b, t=t)
    else:
        opener = _fill(rng.choice(GROUP_OPENERS), p=p, g=_groups(rng, a, b, c, t))
    gain = rng.random() < 0.4
    n = rng.randint(2, 200) if gain else rng.randint(1, a * b - 1)
    text = f"{opener} {_sentence(rng, kind, gain, n, p, f, first=True)}."
    return f"{text} {_ask(rng, p, t, past, left=not gain)}", f"{a}*{b}{'+' if gain else '-'}{n}", t


def _had_then_groups(rng, past):
    p, (kind, t) = _person(rng), _thing(rng)
    had, a, b, c = rng.randint(2, 300), rng.randint(2, 20), rng.randint(2, 40), rng.choice(CONTAINERS)
    then = rng.choice(("~buys", "~gets", "~is given", "~finds"))
    text = f"{_start(rng, kind, had, p, t)} {p.He} {then} {_groups(rng, a, b, c, t)}."
    return f"{text} {_ask(rng, p, t, past, left=False)}", f"{had}+{a}*{b}", t


SHARE_WAYS = (
    "~shares them equally among",
    "~splits them equally among",
    "~puts them equally into",
    "~divides them evenly among",
)


def _share(rng, past):
    """Sharing equally: how many in each share, maybe after a change first, or with a change after."""
    p, (kind, t) = _person(rng), _thing(rng)
    f = _person(rng, p)
    n, each = rng.randint(2, 12), rng.randint(2, 40)
    who = rng.choice(("friends", "children", "groups", rng.choice(CONTAINERS)))
    among, way = f"{n} {who}", rng.choice(SHARE_WAYS)
    one = "friend" if who == "friends" else "child" if who == "children" else "of them"
    style = rng.random()
    if style < 0.35:  # a / n, then more for one share or some taken from it
        a, k = n * each, rng.randint(1, each - 1)
        gain = rng.random() < 0.4
        if gain:
            to_one = f"~adds {k} more to one of them"
            after = f"Then {p.he} {rng.choice((to_one, f'~gives one {one} {k} more' if one != 'of them' else to_one))}."
        else:
            verb = rng.choice(("~takes out", "~removes", "~takes") + (("~eats",) if kind == "food" else ()))
            after = f"Then {p.he} {verb} {k} from one of them."
        ask = rng.choice((f"How many {t} are in that one now?", f"How many {t} does that one have now?"))
        if one in ("friend", "child"):
            ask = f"How many {t} does that {one} have now?"
        q = f"{_start(rng, kind, a, p, t)} {p.He} {way} {among}. {after} {ask}"
        return q, f"{a}//{n}{'+' if gain else '-'}{k}", t
    if style < 0.7:  # a change first, then share what there is
        total = n * each
        if rng.random() < 0.5:
            b = rng.randint(1, total - 1)
            a, op, ev = total - b, "+", _event(rng, kind, True, b, p, f)
        else:
            b = rng.randint(1, 200)
            a, op, ev = total + b, "-", _event(rng, kind, False, b, p, f)
        rest = "them" if op == "+" else "the rest"
        q = (
            f"{_start(rng, kind, a, p, t)} {p.He} {ev}. Then {p.he} {way.replace('them', rest)} {among}. "
            f"How many {t} does each get?"
        )
        return q, f"({a}{op}{b})//{n}", t
    a = n * each  # one step
    q = f"{_start(rng, kind, a, p, t)} {p.He} {way} {among}. How many {t} does each get?"
    return q, f"{a}//{n}", t


MONEY_VERBS = (("~saves", "~spends"), ("~earns", "~spends"), ("~gets", "~spends"))
PERIODS = (
    ("a week", "weeks"),
    ("every week", "weeks"),
    ("a day", "days"),
    ("each day", "days"),
    ("a month", "months"),
    ("an hour", "hours"),
)
BUYS = ("a game", "a gift", "books", "a bike", "shoes", "a toy", "lunch", "a helmet", "a ticket", "paint")


def _dollars(rng, n: int) -> str:
    return f"${n}" if rng.random() < 0.5 else f"{n} dollars"


def _rate_then_change(rng, past):
    p = _person(rng)
    a, w = rng.randint(2, 60), rng.randint(2, 12)
    earn, spend = rng.choice(MONEY_VERBS)
    per, unit = rng.choice(PERIODS)
    earning = f"{earn} {_dollars(rng, a)} {per} for {w} {unit}"  # the subject goes in front
    if unit == "hours" and rng.random() < 0.5:
        earning = f"{rng.choice(('~earns', '~gets'))} {_dollars(rng, a)} {per} and ~works {w} hours"
    style = rng.random()
    if style < 0.5:
        b = rng.randint(1, a * w - 1)
        spent = f"{p.he} {spend} {_dollars(rng, b)} on {rng.choice(BUYS)}"
        tail = rng.choice((f" and then {spent}.", f". Then {spent}.", f". After that, {spent}."))
        ask = rng.choice(
            (
                f"How many dollars does {p.he} have left?",
                "How much money is left?",
                f"How much money does {p.name} have now?",
                f"How many dollars does {p.he} have?",
            )
        )
        return f"{p.name} {earning}{tail} {ask}", f"{a}*{w}-{b}", "dollars"
    if style < 0.75:
        had = rng.randint(2, 300)
        q = f"{p.name} already ~has {_dollars(rng, had)}. {p.He} {earning}. How many dollars does {p.he} have now?"
        return q, f"{had}+{a}*{w}", "dollars"
    verb, noun = rng.choice((("~reads", "pages"), ("~writes", "pages"), ("~runs", "laps"), ("~swims", "laps")))
    total = a * w + rng.randint(1, 300)
    goal = {"pages": "The book ~has", "laps": "The goal ~is"}[noun]
    q = f"{p.name} {verb} {a} {noun} {per} for {w} {unit}. {goal} {total} {noun}. How many {noun} are left?"
    return q, f"{total}-{a}*{w}", noun


def _spend_twice(rng, past):
    """Money spent on two things (or earned and spent): $a - b - c."""
    p = _person(rng)
    a = rng.randint(20, 900)
    b = rng.randint(1, a - 2)
    c = rng.randint(1, a - b - 1)
    x, y = rng.sample(BUYS, 2)
    start = rng.choice(
        (
            f"{p.name} ~has {_dollars(rng, a)}.",
            f"{p.name} ~has {_dollars(rng, a)} in {p.his} piggy bank.",
            f"{p.name} ~saves {_dollars(rng, a)}.",
        )
    )
    spent = rng.choice(
        (
            f"{p.He} ~spends {b} on {x} and {c} on {y}.",
            f"{p.He} ~spends {_dollars(rng, b)} on {x} and {_dollars(rng, c)} on {y}.",
            f"{p.He} ~buys {x} for {_dollars(rng, b)} and {y} for {_dollars(rng, c)}.",
            f"{p.He} ~pays {_dollars(rng, b)} for {x}. Then {p.he} ~pays {_dollars(rng, c)} for {y}.",
        )
    )
    ask = rng.choice(
        (
            f"How much money does {p.he} have left?",
            "How many dollars are left?",
            f"How many dollars does {p.name} have now?",
        )
    )
    return f"{start} {spent} {ask}", f"{a}-{b}-{c}", "dollars"


CROWDS = (
    ("students", "in the class", "~go home early", "~go to the gym", "~come back", "still in class"),
    ("people", "on the bus", "~get off", "~get off at the next stop", "~get on", "on the bus now"),
    ("children", "at the park", "~go home", "~leave for lunch", "~arrive", "at the park now"),
    ("birds", "in a tree", "~fly away", "~fly off", "~land", "in the tree now"),
    ("ducks", "on the pond", "~swim away", "~leave", "~join them", "on the pond now"),
    ("players", "on the field", "~sit down", "~leave the game", "~join", "on the field now"),
)


def _crowd(rng, past):
    """A count of people or animals in a place; some leave, some arrive: a - b - c or a - b + c."""
    who, where, go1, go2, come, now = rng.choice(CROWDS)
    a = rng.randint(20, 500)
    b = rng.randint(1, a // 2)
    if rng.random() < 0.6:
        c = rng.randint(1, a - b - 1)
        q = f"There ~are {a} {who} {where}. {b} {go1} and {c} {go2}. How many {who} are {now}?"
        return q, f"{a}-{b}-{c}", who
    c = rng.randint(1, 200)
    q = f"There ~are {a} {who} {where}. {b} {go1}, and then {c} more {come}. How many {who} are {now}?"
    return q, f"{a}-{b}+{c}", who


PLACES = (
    ("bus", "rows", "seats"),
    ("train", "cars", "seats"),
    ("theater", "rows", "seats"),
    ("plane", "rows", "seats"),
    ("classroom", "rows", "desks"),
    ("stadium", "sections", "seats"),
    ("parking lot", "rows", "spaces"),
    ("library", "shelves", "spots"),
    ("garden", "rows", "plants"),
    ("farm", "rows", "corn plants"),
    ("orchard", "rows", "trees"),
)


def _capacity(rng, past):
    place, part, spot = rng.choice(PLACES)
    a, b = rng.randint(2, 40), rng.randint(2, 50)
    c = rng.randint(1, a * b - 1)
    article = "An" if place[0] in "aeiou" else "A"
    has = rng.choice(
        (
            f"{article} {place} ~has {a} {part} with {b} {spot} each.",
            f"{article} {place} ~has {a} {part} of {b} {spot}.",
            f"There ~are {a} {part} in a {place}, with {b} {spot} in each.",
        )
    )
    if spot in ("plants", "corn plants", "trees"):
        eater = rng.choice(("Rabbits ~eat", "Birds ~eat", "A storm ~breaks", "The farmer ~picks"))
        q = f"{has} {eater} {c} of the {spot}. How many {spot} are left?"
    else:
        used = rng.choice(
            (
                f"{c} {spot} ~are taken.",
                f"{c} of the {spot} ~are full.",
                f"{c} people ~sit down.",
                f"{c} {spot} ~are in use.",
            )
        )
        q = f"{has} {used} How many {spot} are {rng.choice(('empty', 'free', 'still empty', 'left'))}?"
    return q, f"{a}*{b}-{c}", spot


TOGETHER = ("together", "altogether", "in all")
TIMES = (("twice", 2), ("three times", 3), ("four times", 4), ("five times", 5), ("half", None))
DAYS = (
    ("on Monday", "on Tuesday"),
    ("on Saturday", "on Sunday"),
    ("in the morning", "in the afternoon"),
    ("last week", "this week"),
    ("in May", "in June"),
    ("on the first day", "on the second day"),
)
DOINGS = (
    ("~reads", "read", "pages"),
    ("~bakes", "bake", "cookies"),
    ("~picks", "pick", "apples"),
    ("~folds", "fold", "paper cranes"),
    ("~scores", "score", "points"),
    ("~draws", "draw", "pictures"),
    ("~plants", "plant", "seeds"),
    ("~sells", "sell", "cups of lemonade"),
    ("~collects", "collect", "shells"),
    ("~catches", "catch", "fish"),
    ("~writes", "write", "letters"),
    ("~picks", "pick", "flowers"),
)


def _times_as_many(rng, past):
    p = _person(rng)
    word, k = rng.choice(TIMES)
    a = rng.randint(2, 60) * (1 if k else 2)
    second = f"{a}*{k}" if k else f"{a}//2"
    if rng.random() < 0.6:  # one person on two days
        does, do, noun = rng.choice(DOINGS)
        d1, d2 = rng.choice(DAYS)
        q = f"{p.name} {does} {a} {noun} {d1} and {word} as many {d2}."
        if k and rng.random() < 0.35:
            return f"{q} How many more {noun} ~does {p.he} {do} {d2} than {d1}?", f"{a}*{k}-{a}", noun
        asks = TOGETHER + ("in total",) + (("in the two days",) if "day" in d1 else ())
        return f"{q} How many {noun} ~does {p.he} {do} {rng.choice(asks)}?", f"{a}+{second}", noun
    f = _person(rng, p)
    _, t = _thing(rng)
    q = f"{p.name} ~has {a} {t}. {f.name} ~has {word} as many {t} as {p.name}."
    if k and rng.random() < 0.35:
        return f"{q} How many more {t} ~does {f.name} have than {p.name}?", f"{a}*{k}-{a}", t
    return f"{q} How many {t} ~do {f.name} and {p.name} have {rng.choice(TOGETHER)}?", f"{a}+{second}", t


def _compare(rng, past):
    p = _person(rng)
    f = _person(rng, p)
    _, t = _thing(rng)
    a = rng.randint(10, 400)
    if rng.random() < 0.5:
        b = rng.randint(1, 200)
        rel, expr = "more", f"{a}+({a}+{b})"
    else:
        b = rng.randint(1, a - 1)
        rel, expr = "fewer", f"{a}+({a}-{b})"
    q = (
        f"{p.name} ~has {a} {t}. {f.name} ~has {b} {rel} {t} than {p.name}. "
        f"How many {t} ~do they have {rng.choice(TOGETHER)}?"
    )
    return q, expr, t


GOODS = (
    ("notebook", "notebooks"),
    ("pen", "pens"),
    ("ball", "balls"),
    ("kite", "kites"),
    ("book", "books"),
    ("sandwich", "sandwiches"),
    ("puzzle", "puzzles"),
    ("toy car", "toy cars"),
    ("cupcake", "cupcakes"),
    ("ticket", "tickets"),
    ("shirt", "shirts"),
    ("plant", "plants"),
    ("comic", "comics"),
)


def _shopping(rng, past):
    p = _person(rng)
    (_, many), (_, other) = rng.sample(GOODS, 2)
    b, c = rng.randint(2, 12), rng.randint(2, 30)
    style = rng.random()
    if style < 0.4:
        a = rng.randint(b * c, b * c + 200)
        q = (
            f"{p.name} ~has {_dollars(rng, a)}. {p.He} ~buys {b} {many} that cost {_dollars(rng, c)} each. "
            f"{rng.choice(('How many dollars does ' + p.he + ' have left?', 'How much money is left?'))}"
        )
        return q, f"{a}-{b}*{c}", "dollars"
    if style < 0.7:
        d, e = rng.randint(2, 12), rng.randint(2, 30)
        ask = rng.choice(
            (
                f"How many dollars ~does {p.he} spend in all?",
                f"How much ~does {p.he} spend?",
                f"How many dollars ~does {p.name} spend altogether?",
            )
        )
        q = f"{p.name} ~buys {b} {many} for {_dollars(rng, c)} each and {d} {other} for {_dollars(rng, e)} each. {ask}"
        return q, f"{b}*{c}+{d}*{e}", "dollars"
    bill = next(x for x in (10, 20, 50, 100, 200, 500, 1000) if x >= b * c)
    q = (
        f"{p.name} ~buys {b} {many} at {_dollars(rng, c)} each and ~pays with a ${bill} bill. "
        f"How much change ~does {p.he} get?"
    )
    return q, f"{bill}-{b}*{c}", "dollars"


def _distractor(rng, past):
    """A number that does not matter (an age, other things) beside a one-step change."""
    p = _person(rng)
    f = _person(rng, p)
    kind, t = _thing(rng)
    other = rng.choice([x for x in THINGS["toy"] + THINGS["school"] if x != t])
    a = rng.randint(5, 400)
    gain = rng.random() < 0.5
    n = rng.randint(2, 300) if gain else rng.randint(1, a - 1)
    side = rng.choice(
        (f"{p.name} ~is {rng.randint(5, 12)} years old.", f"{p.name} also ~has {rng.randint(2, 90)} {other}.")
    )
    event = _event(rng, kind, gain, n, p, f)
    return (
        f"{side} {_start(rng, kind, a, p, t)} {p.He} {event}. {_ask(rng, p, t, past, left=not gain)}",
        f"{a}{'+' if gain else '-'}{n}",
        t,
    )


# kind -> weight: mostly two steps, some one and three
PROBLEM_KINDS = (
    (_one_change, 1),
    (_two_changes, 4),
    (_three_changes, 1),
    (_groups_then_change, 3),
    (_had_then_groups, 1),
    (_share, 2),
    (_rate_then_change, 2),
    (_spend_twice, 1),
    (_crowd, 1),
    (_capacity, 2),
    (_times_as_many, 2),
    (_compare, 1),
    (_shopping, 2),
    (_distractor, 1),
)
PAST_SHARE = 0.35  # problems told in the past tense


def _solution(expr: str, unit: str) -> tuple[list[dict], int]:
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
        {"type": "text", "text": f" So the answer is {answer} {unit}.\n#### {answer}"},
    ]
    return parts, answer


def make_problem(rng: random.Random) -> Problem:
    """One random word problem (one to three operations, one calculator call) with its worked solution."""
    kinds, weights = zip(*PROBLEM_KINDS)
    past = rng.random() < PAST_SHARE
    question, expr, unit = rng.choices(kinds, weights)[0](rng, past)
    question = _tense(question, past)
    parts, answer = _solution(expr, unit)
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


STORY_PLACES = (
    "garden",
    "farm",
    "backyard",
    "park",
    "pond",
    "playground",
    "beach",
    "meadow",
    "forest",
    "school",
    "zoo",
    "lake",
    "library",
    "market",
    "river",
    "kitchen",
)


def story_facts(story: str) -> dict:
    """What a request can mention: the hero's name and kind (from the opening), an animal and a place in the story."""
    first = _FIRST_SENTENCE.match(story).group(0)
    words = re.findall(r"[A-Za-z]+", first)
    name = next((w for w in words if w in _NAMES), None)
    kind = next((w for w in words if w in ("girl", "boy")), None)
    if kind is None and name is not None:
        kind = "girl" if name in WORDS.girl_names else "boy"
    lowered = story.lower()
    animal = next((a for a in _ANIMAL_WORDS if re.search(rf"\b{a}\b", lowered)), None)
    place = next((p for p in STORY_PLACES if re.search(rf"\bthe {p}\b", lowered)), None)
    return {"first_sentence": first, "name": name, "kind": kind, "animal": animal, "place": place}


def story_request(rng: random.Random, facts: dict) -> str:
    """A user's request that this story answers: it names only what the story really contains.

    Some name the hero, some only what happens in the story (an animal, a place), some nothing at all, so a
    request without a name gets a story with a hero of the model's own choosing.
    """
    name, kind, animal, place = facts["name"], facts["kind"], facts["animal"], facts["place"]
    generic = [
        "Tell me a story.",
        "Can you tell me a short story?",
        "Write a short story for kids.",
        "Tell me a bedtime story.",
        "I'd like to hear a story.",
        "Please write me a little story.",
        f"Tell me a story that starts like this: {facts['first_sentence']}",
        f"Continue this story: {facts['first_sentence']}",
    ]
    named = []
    if name:
        named += [
            f"Tell me a story about a {kind} named {name}.",
            f"Can you write a short story about {name}?",
            f"Write a story for children about a little {kind} called {name}.",
            f"Please tell me a bedtime story about {name}.",
        ]
        if animal:
            named += [f"Tell me a story about {name} and a {animal}."]
    unnamed = []
    if animal:
        unnamed += [
            f"Tell me a story with a {animal} in it.",
            f"I'd like a story about a {animal}, please.",
            f"Write a short story about a little {kind or 'child'} and a {animal}.",
        ]
    if place:
        unnamed += [
            f"Tell me a story about a day at the {place}.",
            f"Can you write a story that happens at the {place}?",
            f"Tell me a short story about a {kind or 'child'} who goes to the {place}.",
            f"Write a bedtime story set at the {place}.",
        ]
    draw = rng.random()
    if named and draw < 0.4:
        options = named
    elif unnamed and draw < 0.75:
        options = unnamed
    else:
        options = generic
    return _casual(rng, rng.choice(options))


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
