"""Built-in synthetic children's stories: the offline pretraining corpus for the laptop demo.

No package registry ships TinyStories, so flaxchat writes its own. Each story is built by one of
thirteen small plots (a lost toy found, a new friend, sharing, being brave, rescuing a kitten, a lost
baby animal, an animal friend, a small adventure, a rainy-day plan, a lesson learned, a homemade
gift, helping someone, finding and counting things) from coherent random choices: a hero with a name
and matching pronouns (a child, an animal, a storybook role such as a pirate, or a thing come alive
such as a robot; now and then with a made-up name or of a made-up kind), a grown-up, places with the
spots and activities that belong there, animals that live there, toys with one fixed color. Every beat has several phrasings, so the corpus holds many distinct
sentences, and every phrasing is written to stay true to the story's facts.

The words and sentences are data files beside this module. story_words.json is the world: names,
the heroes' kinds, family, feelings, toys, places (each with the spots where a thing can hide, the activities as
base-form verb phrases, and for adventures its finds and one sentence describing it), animals (the
places they live in, the food a child may offer, how they move, in the past tense) and the word-form
exceptions. story_plots.json holds the story openings and, for each plot, its pieces (fears, lessons,
gifts, ...) and its beats: sentence templates in the order they are told, filled by `str.format`
from the story's cast (`{h.name}`, `{h.he}`, `{p.kind}`: see `Person`, `Thing` and `Story.tell`).
This module keeps the logic: word forms, whom and what each plot casts, and the split rules.

Story `index` of seed `seed` depends on (seed, index) only, so any slice of the stream can be
regenerated on any machine. Every 100th index is a validation story, and validation stories open
with (hero name, opening sentence) pairs that training stories never use, so no validation story
can equal a training story. Editing or reordering the data files changes the stories; tests pin them.

    python -m scripts.stories --n 3 --seed 0          # print three sample stories
"""

from __future__ import annotations

import itertools
import json
import random
import re
import zlib
from collections.abc import Iterator
from importlib import resources
from types import SimpleNamespace

VAL_EVERY = 100  # index i is a validation story iff i % VAL_EVERY == VAL_EVERY - 1
MIN_WORDS, MAX_WORDS = 100, 400
SPLITS = ("train", "val")

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


def _capitalize(sentence: str) -> str:
    """Capitalize the first letter, looking past an opening quote."""
    i = 1 if sentence.startswith('"') else 0
    return sentence[:i] + sentence[i].upper() + sentence[i + 1 :]


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


# --- the story being written --------------------------------------------------------------------


class Story:
    """Collects sentences; picks a phrasing per beat and fills it from the cast (`self.cast`)."""

    def __init__(self, rng: random.Random, val: bool, hero_kind: str | None = None):
        self.rng, self.val, self.hero_kind = rng, val, hero_kind
        self.paragraphs: list[list[str]] = [[]]
        self._seen: set[str] = set()
        self._names: set[str] = set()
        trait = rng.choice(WORDS.traits)
        feel = WORDS.feelings
        self.cast: dict = {
            "trait": trait,
            "a_trait": f"{article(trait)} {trait}",
            "town": rng.choice(WORDS.towns),
            "age": rng.choice(WORDS.ages),
            "sad": rng.choice(feel.sad),
            "happy": rng.choice(feel.happy),
            "sorry": rng.choice(feel.sorry),
            "color": rng.choice(WORDS.colors),
            "about": PLOT_TEXT["about"],
        }  # one more detail about the hero; it never matters later
        self.cast["like"], self.cast["like2"] = rng.sample(WORDS.indoor_acts, 2)

    def pick(self, options):
        return self.rng.choice(options)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def set(self, **cast) -> None:
        self.cast.update(cast)

    def fill(self, template: str) -> str:
        return template.format_map(self.cast)

    def say(self, *templates: str) -> None:
        """Append one of `templates`; a sentence already told in this story is not told twice."""
        for _ in range(4):
            sentence = _capitalize(self.fill(self.rng.choice(templates)))
            if sentence not in self._seen:
                self._seen.add(sentence)
                self.paragraphs[-1].append(sentence)
                return

    def para(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def lookup(self, path: str):
        """A cast entry by dotted path: "place.weather" is `self.cast["place"].weather`."""
        first, *attrs = path.split(".")
        value = self.cast[first]
        for attr in attrs:
            value = getattr(value, attr)
        return value

    def tell(self, beats: list) -> None:
        """Tell a plot's beats (story_plots.json) in order. A beat is one of

            ["template", ...]          say one of the templates
            "para"                     start a new paragraph
            {"say": [...] | "path"}    say one of these templates, or of those at a cast path ("place.weather")
            {"each": "path"}           say each template at a cast path, in order
            {"then": [beats]}          tell these beats

        and a dict beat may be guarded: with "p", it is told with that probability; with "if": "path", when
        the cast value there is true (or equals "is", when given); "else": [beats] is told when it is not.
        """
        for beat in beats:
            if beat == "para":
                self.para()
            elif isinstance(beat, list):
                self.say(*beat)
            elif not self._holds(beat):
                self.tell(beat.get("else", []))
            elif "say" in beat:
                templates = beat["say"] if isinstance(beat["say"], list) else self.lookup(beat["say"])
                self.say(*([templates] if isinstance(templates, str) else templates))
            elif "each" in beat:
                for template in self.lookup(beat["each"]):
                    self.say(template)
            else:
                self.tell(beat["then"])

    def _holds(self, beat: dict) -> bool:
        if "p" in beat:
            return self.chance(beat["p"])
        if "if" in beat:
            value = self.lookup(beat["if"])
            return value == beat["is"] if "is" in beat else bool(value)
        return True

    def text(self) -> str:
        return "\n\n".join(" ".join(p) for p in self.paragraphs if p)

    def child(self) -> Person:
        """A child with a name not yet used in this story."""
        girl = self.chance(0.5)
        names = WORDS.girl_names if girl else WORDS.boy_names
        name = self.pick(names)
        while name in self._names:
            name = self.pick(names)
        self._names.add(name)
        return Person(name, girl)

    def hero(self) -> Person:
        """The hero: a child, an animal, a storybook role (a pirate, a queen) or a thing come alive (a robot), so a
        request for a story about any of them has stories to learn from. The name comes with the opening."""
        draw, heroes = self.rng.random(), WORDS.heroes
        if self.hero_kind:
            kind, girl = self.hero_kind, self.chance(0.5)
        elif draw < HERO_SHARES["child"]:
            kind, girl = None, self.chance(0.5)
        elif draw < HERO_SHARES["child"] + HERO_SHARES["animal"]:
            kind, girl = self.pick(heroes["animals"]), self.chance(0.5)
        elif draw < 1 - HERO_SHARES["thing"]:
            role = self.pick(heroes["roles"])
            kind, girl = role["kind"], role.get("female", self.chance(0.5))
        else:
            kind, girl = self.pick(heroes["things"]), self.chance(0.5)
        if kind not in (None, self.hero_kind) and self.chance(INVENTED_KIND_SHARE):
            kind = invented_word(self.rng)
        if self.chance(INVENTED_NAME_SHARE):
            while True:  # a made-up name with an opening that keeps the story in its split
                name, intro = invented_word(self.rng).capitalize(), self.rng.randrange(len(INTROS))
                if is_val_pair(name, intro) == self.val:
                    break
        else:
            name, intro = self.pick(HERO_PAIRS[self.val, girl])
        self.cast["intro"] = INTROS[intro]
        self._names.add(name)
        if kind is not None:  # a few more words about what the hero is, and looks that fit any kind
            self.cast["about"] = PLOT_TEXT["about"] + PLOT_TEXT["about_creature"]
        return Person(name, girl, kind)

    def grownup(self, exclude: Person | None = None) -> Person:
        member = self.pick([f for f in WORDS.family if exclude is None or f.kind != exclude.kind])
        return Person(member.kind.capitalize(), member.female, member.kind)

    def pet(self) -> Person:
        kind = self.pick(WORDS.pet_kinds)
        return Person(
            self.pick(WORDS.pet_names),
            self.chance(0.5),
            kind.kind,
            sound=kind.sound,
            sound_verb=kind.sound_verb,
            a_kind=f"{article(kind.kind)} {kind.kind}",
        )

    def activity(self, acts, key: str = "act") -> str:
        act = self.pick(acts)
        self.cast.update({key: act, key + "_ing": ing(act), key + "_past": past(act)})
        return act

    def cast_basics(self, place: SimpleNamespace | None = None) -> None:
        """The child `h`, a grown-up `p`, and (if given) the place, its day and one of its activities."""
        h = self.hero()
        looks = WORDS.looks if h.kind in ("girl", "boy") else WORDS.hero_looks
        self.set(h=h, p=self.grownup(), looks=self.pick(looks).format(h=h))
        if place is not None:
            self.set(place=place, day=self.pick(place.days))
            self.activity(place.acts)


# --- plots --------------------------------------------------------------------------------------
# Each plot casts one story into `s` (who, where, with what), then tells its beats from story_plots.json:
# beginning, problem or event, resolution, a short ending.


def lost_toy(s: Story) -> None:
    place = s.pick([p for p in WORDS.places if p.key != "hill"])
    s.cast_basics(place)
    kind = s.pick(WORDS.toys)
    spot1, spot2, spot3 = s.rng.sample(place.spots, 3)  # looked here, then here, found there
    helper = s.pick(("friend", "pet", "grownup"))  # who finds the toy
    s.set(
        toy=Thing(kind.noun, s.pick(kind.colors)),
        f=s.child(),
        pet=s.pet(),
        spot1=spot1,
        spot2=spot2,
        spot3=spot3,
        helper=helper,
    )
    s.tell(PLOT_TEXT["lost_toy"].beats)


def new_friend(s: Story) -> None:
    place = s.pick([p for p in WORDS.places if len(p.acts) >= 4 and p.key != "hill"])
    s.cast_basics(place)
    f = s.child()
    # a pronoun for the new friend is only clear when it cannot mean the hero
    s.set(
        f=f,
        lonely=s.pick(WORDS.feelings.lonely),
        softly=s.pick(WORDS.feelings.softly),
        f_pronoun_clear=f.girl != s.cast["h"].girl,
    )
    s.activity([a for a in place.acts if a != s.cast["act"]], key="act2")
    s.tell(PLOT_TEXT["new_friend"].beats)


def sharing(s: Story) -> None:
    text = PLOT_TEXT["sharing"]
    s.cast_basics()
    item = s.pick(text.items)
    sibling = s.chance(0.4)
    f = s.child()
    rel = s.pick(("little", "big")) + (" sister" if f.girl else " brother") if sibling else "friend"
    s.set(f=f, rel=rel, item=item, use_past=past(item.use), day=s.pick(WORDS.home_days))
    s.tell(text.beats)


def brave(s: Story) -> None:
    text = PLOT_TEXT["brave"]
    s.cast_basics()
    fear = s.pick(text.fears)
    s.set(
        fear=fear,
        day=s.pick(getattr(fear, "days", WORDS.days)),
        petname=s.pick(WORDS.pet_names),
        scared=s.pick(WORDS.feelings.scared),
        proud=s.pick(WORDS.feelings.proud),
    )
    s.set(want=s.fill(fear.want))  # "ride {h.his} bike": a template inside a template
    s.tell(text.beats)


def kitten_rescue(s: Story) -> None:
    text = PLOT_TEXT["kitten_rescue"]
    place = s.pick([PLACE[k] for k in text.places])
    s.cast_basics(place)
    s.set(
        kitten=Thing("kitten", s.pick(text.kitten_looks)),
        kname=s.pick(WORDS.pet_names),
        scared=s.pick(WORDS.feelings.scared),
    )
    girl = s.chance(0.5)
    s.set(owner=Person("", girl, "lady" if girl else "old man", a_kind="a lady" if girl else "an old man"))
    s.tell(text.beats)


def lost_baby(s: Story) -> None:
    baby = s.pick(WORDS.lost_babies)
    place = PLACE[s.pick(baby.homes)]
    s.cast_basics(place)
    s.set(
        baby=baby.baby,
        mother=baby.mother,
        baby_sound=baby.baby_sound,
        mother_sound=baby.mother_sound,
        worried=s.pick(WORDS.feelings.worried),
        spots=s.rng.sample(place.spots, 3),
        f=s.child(),
    )
    s.set(spot1=s.cast["spots"][0], spot2=s.cast["spots"][1], spot3=s.cast["spots"][2])
    h, f, p = s.cast["h"], s.cast["f"], s.cast["p"]
    with_friend = s.chance(0.5)
    s.set(
        helper_name=f.name if with_friend else f"{h.his} {p.kind}",
        helper_intro=f"{h.his} friend {f.name}" if with_friend else f"{h.his} {p.kind}",
    )
    s.tell(PLOT_TEXT["lost_baby"].beats)


def animal_friend(s: Story) -> None:
    animal = s.pick([a for a in WORDS.animals if a.food])
    place = PLACE[s.pick(animal.homes)]
    s.cast_basics(place)
    # "some seeds" are "them", "a nut" and "some grass" are "it".
    food_it = "them" if animal.food.startswith("some ") and animal.food.endswith("s") else "it"
    s.set(
        animal=Thing(
            animal.noun,
            s.pick(animal.looks),
            food=animal.food,
            food_it=food_it,
            move=animal.move,
            sound=animal.sound,
            sound_verb=animal.sound_verb,
        ),
        spot=s.pick(place.spots),
        snack=s.pick(WORDS.snacks),
        petname=s.pick(WORDS.pet_names),
    )
    s.tell(PLOT_TEXT["animal_friend"].beats)


def adventure(s: Story) -> None:
    place = s.pick([p for p in WORDS.places if p.finds])
    s.cast_basics(place)
    animal = s.pick([a for a in WORDS.animals if place.key in a.homes])
    with_pet = s.chance(0.4)
    s.set(
        f=s.child(),
        pet=s.pet(),
        find=s.pick(place.finds),
        spot=s.pick(place.spots),
        snack=s.pick(WORDS.snacks),
        animal=Thing(
            animal.noun, s.pick(animal.looks), sound=animal.sound, sound_verb=animal.sound_verb, move=animal.move
        ),
        worried=s.pick(WORDS.feelings.worried),
    )
    h, f, pet, find = s.cast["h"], s.cast["f"], s.cast["pet"], s.cast["find"]
    s.set(
        with_pet=with_pet,
        pal=pet.name if with_pet else f.name,
        pal_intro=pet.name if with_pet else f"{h.his} friend {f.name}",
        the_find="the " + find.split(" ", 1)[1],
    )
    s.tell(PLOT_TEXT["adventure"].beats)


def rainy_day(s: Story) -> None:
    text = PLOT_TEXT["rainy_day"]
    place = s.pick([PLACE[k] for k in text.places])
    s.cast_basics(place)
    s.set(plan=s.pick(text.plans), softly=s.pick(WORDS.feelings.softly), day=s.pick(WORDS.home_days))
    s.tell(text.beats)


def lesson(s: Story) -> None:
    text = PLOT_TEXT["lesson"]
    s.cast_basics()
    chosen = s.pick(text.lessons)
    kind = s.pick(WORDS.toys)
    s.set(lesson=chosen, day=s.pick(WORDS.home_days), f=s.child(), toy=Thing(kind.noun, s.pick(kind.colors)))
    s.tell(text.beats)


def gift(s: Story) -> None:
    text = PLOT_TEXT["gift"]
    s.cast_basics()
    r = s.grownup(exclude=s.cast["p"])  # the one whose birthday it is
    s.set(r=r, gift=s.pick(text.gifts))
    s.tell(text.beats)


def helping(s: Story) -> None:
    text = PLOT_TEXT["helping"]
    s.cast_basics()
    chosen = s.pick(text.helps)
    girl, sib = s.chance(0.5), s.child()
    neighbor = Person(("Mrs. " if girl else "Mr. ") + s.pick(WORDS.surnames), girl, "lady" if girl else "man")
    s.set(
        help=chosen,
        n=neighbor,
        f=s.child(),
        sib=Person(sib.name, sib.girl, "sister" if sib.girl else "brother"),
        petname=s.pick(WORDS.pet_names),
        day=s.pick(WORDS.home_days),
        proud=s.pick(WORDS.feelings.proud),
    )
    s.tell(text.beats)


def counting(s: Story) -> None:
    """Things found, shared and put in rows, with the sums in the story: text with numbers that add up."""
    text = PLOT_TEXT["counting"]
    place = PLACE[s.pick(sorted(text.items))]
    s.cast_basics(place)
    k, g = s.rng.randint(2, 6), s.rng.randint(2, 5)
    n5 = k * g  # what is left at the end goes into g rows of k
    n4 = s.rng.randint(1, 9)
    n3 = n5 + n4
    n1 = s.rng.randint(2, n3 - 2)
    s.set(item=s.pick(text.items[place.key]), f=s.child(), n1=n1, n2=n3 - n1, n3=n3, n4=n4, n5=n5, k=k, g=g)
    s.tell(text.beats)


PLOTS = (
    lost_toy,
    new_friend,
    sharing,
    brave,
    kitten_rescue,
    lost_baby,
    animal_friend,
    adventure,
    rainy_day,
    lesson,
    gift,
    helping,
    counting,
)

# --- public API ---------------------------------------------------------------------------------


def is_val_index(index: int) -> bool:
    """Whether story `index` belongs to the validation split (every VAL_EVERY-th story)."""
    return index % VAL_EVERY == VAL_EVERY - 1


def split_index(split: str, position: int) -> int:
    """The stream index of the `position`-th story of `split`."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if position < 0:
        raise ValueError(f"story position must be >= 0, got {position}")
    if split == "val":
        return position * VAL_EVERY + VAL_EVERY - 1
    return (position // (VAL_EVERY - 1)) * VAL_EVERY + position % (VAL_EVERY - 1)


def split_of(story: str) -> str:
    """The split a story belongs to, read from its first sentence (see INTROS)."""
    for k, pattern in enumerate(INTRO_PATTERNS):
        match = pattern.match(story)
        if match:
            return "val" if is_val_pair(match["name"], k) else "train"
    raise ValueError(f"not a flaxchat story: it does not open with one of the story openings: {story[:60]!r}")


def generate_story(index: int, seed: int = 0) -> str:
    """Story number `index` of the stream for `seed`; depends on (seed, index) alone."""
    return tell_story(index, seed)[0]


def tell_story(index: int, seed: int = 0, hero_kind: str | None = None) -> tuple[str, dict]:
    """generate_story's text and its cast (`h` the hero, `place`, `toy`, `animal`, `pet`, ...: whatever its plot
    chose), so that a request for this story can name what it is about. hero_kind, when given, is what the hero is
    ("walrus"): a story about a kind the world's lists do not have."""
    if index < 0:
        raise ValueError(f"story index must be >= 0, got {index}")
    # Seeding with a string hashes it with SHA-512: stable across processes and PYTHONHASHSEED.
    rng = random.Random(f"flaxchat-stories:{seed}:{index}")
    for _ in range(10):  # the plots are sized to fit; a rare miss just draws again from the same rng
        story = Story(rng, is_val_index(index), hero_kind)
        rng.choice(PLOTS)(story)
        text = story.text()
        if MIN_WORDS <= len(text.split()) <= MAX_WORDS:
            return text, story.cast
    raise RuntimeError(
        f"story {index} (seed {seed}) missed {MIN_WORDS}-{MAX_WORDS} words ten times; a plot is badly sized"
    )


def iter_stories(split: str = "train", seed: int = 0, start: int = 0) -> Iterator[str]:
    """Endless stream of `split` stories, beginning with the `start`-th one (for resuming)."""
    split_index(split, start)  # a bad split or start fails here, not at the first next()
    return (generate_story(split_index(split, position), seed) for position in itertools.count(start))


def generate_stories(n: int, split: str = "train", seed: int = 0, start: int = 0) -> list[str]:
    """The `n` stories of `split` starting at position `start`."""
    if n < 0:
        raise ValueError(f"number of stories must be >= 0, got {n}")
    return [generate_story(split_index(split, start + i), seed) for i in range(n)]


_SENTENCE = re.compile(r'[^.!?]*[.!?]+"?')
_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def corpus_stats(stories: list[str]) -> dict:
    """Size and variety of a list of stories."""
    words = n_bytes = 0
    vocab: set[str] = set()
    sentences: set[str] = set()
    for story in stories:
        words += len(story.split())
        n_bytes += len(story.encode())
        vocab.update(_WORD.findall(story.lower()))
        sentences.update(m.strip() for m in _SENTENCE.findall(story))
    return {
        "documents": len(stories),
        "words": words,
        "distinct_words": len(vocab),
        "distinct_sentences": len(sentences),
        "mean_words": words / max(len(stories), 1),
        "bytes": n_bytes,
    }
