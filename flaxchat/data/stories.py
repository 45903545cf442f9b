"""Built-in synthetic children's stories: the offline pretraining corpus for the laptop demo.

No package registry ships TinyStories, so flaxchat writes its own. Each story is built by one of
thirteen small plots (a lost toy found, a new friend, sharing, being brave, rescuing a kitten, a lost
baby animal, an animal friend, a small adventure, a rainy-day plan, a lesson learned, a homemade
gift, helping someone, finding and counting things) from coherent random choices: a hero with a name
and matching pronouns (a child, an animal, a storybook role such as a pirate, or a thing come alive
such as a robot; now and then with a made-up name or of a made-up kind), a grown-up, places with the
spots and activities that belong there, animals that live there, toys with one fixed color. Every beat
has several phrasings, so the corpus holds many distinct sentences, and every phrasing is written to
stay true to the story's facts.

The world the stories are told in (the words, the plots' sentences, word forms, heroes, and which
openings are kept for validation) is flaxchat.data.story_world, read from the data files beside it.
This module is the writer: the story being written (`Story`), whom and what each plot casts, the split
of the stream, and the public API.

Story `index` of seed `seed` depends on (seed, index) only, so any slice of the stream can be
regenerated on any machine. Every 100th index is a validation story, and validation stories open
with (hero name, opening sentence) pairs that training stories never use, so no validation story
can equal a training story. Editing or reordering the data files changes the stories; tests pin them.

    python -m scripts.stories --n 3 --seed 0          # print three sample stories
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Iterator
from types import SimpleNamespace

from flaxchat.data.story_world import (
    HERO_PAIRS,
    HERO_SHARES,
    INTRO_PATTERNS,
    INTROS,
    INVENTED_KIND_SHARE,
    INVENTED_NAME_SHARE,
    PLACE,
    PLOT_TEXT,
    WORDS,
    Person,
    Thing,
    article,
    ing,
    invented_word,
    is_val_pair,
    past,
)

VAL_EVERY = 100  # index i is a validation story iff i % VAL_EVERY == VAL_EVERY - 1
MIN_WORDS, MAX_WORDS = 100, 400
SPLITS = ("train", "val")

# --- the story being written --------------------------------------------------------------------


def _capitalize(sentence: str) -> str:
    """Capitalize the first letter, looking past an opening quote."""
    i = 1 if sentence.startswith('"') else 0
    return sentence[:i] + sentence[i].upper() + sentence[i + 1 :]


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
