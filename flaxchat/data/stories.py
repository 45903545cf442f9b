"""Built-in synthetic children's stories: the offline pretraining corpus for the laptop demo.

No package registry ships TinyStories, so flaxchat writes its own. Each story is built by one of
twelve small plot functions (a lost toy found, a new friend, sharing, being brave, rescuing a
kitten, a lost baby animal, an animal friend, a small adventure, a rainy-day plan, a lesson
learned, a homemade gift, helping someone) from coherent random choices: a child with a name and
matching pronouns, a grown-up, places with the spots and activities that belong there, animals
that live there, toys with one fixed color. Every beat has several phrasings, so the corpus holds
many distinct sentences, and every phrasing is written to stay true to the story's facts.

Story `index` of seed `seed` depends on (seed, index) only, so any slice of the stream can be
regenerated on any machine. Every 100th index is a validation story, and validation stories open
with (hero name, opening sentence) pairs that training stories never use, so no validation story
can equal a training story.

    python -m flaxchat.data.stories --n 3 --seed 0          # print three sample stories
    python -m flaxchat.data.stories --stats 10000           # corpus statistics (and generation speed)
    python -m flaxchat.data.stories --n 5 --split val       # validation stories
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import time
import zlib
from collections.abc import Iterator

from flaxchat.data import story_words as W

VAL_EVERY = 100  # index i is a validation story iff i % VAL_EVERY == VAL_EVERY - 1
MIN_WORDS, MAX_WORDS = 100, 400
SPLITS = ("train", "val")


# Every story opens with one of these sentences, naming its hero. A fixed sixth of all (hero name,
# opening) pairs is reserved for validation stories and never used by training stories, so the split
# of a story can be read off its first sentence (`split_of`) and no validation story can equal a
# training story, while every name and every opening still appears in both splits.
INTROS = (
    "Once upon a time, there was a {trait} little {h.kind} named {h.name}.",
    "There once was a little {h.kind} named {h.name}.",
    "{h.name} was a {trait} little {h.kind}.",
    "Once upon a time, in a {town} town, there lived a little {h.kind} named {h.name}.",
    "Once upon a time, there was a {h.kind} named {h.name}. {h.He} was {age} years old.",
    "Once upon a time, there lived {a_trait} {h.kind} named {h.name}.",
)
_INTRO_FIELDS = {"{h.name}": r"(?P<name>[A-Z][a-z]+)", "{h.kind}": "(?:girl|boy)", "{h.He}": "(?:He|She)",
                 "{trait}": "[a-z]+", "{a_trait}": "an? [a-z]+", "{town}": "[a-z]+", "{age}": "[a-z]+"}


def _intro_pattern(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for field, sub in _INTRO_FIELDS.items():
        pattern = pattern.replace(re.escape(field), sub)
    return re.compile(pattern)


_INTRO_PATTERNS = tuple(_intro_pattern(t) for t in INTROS)


def _is_val_pair(name: str, intro: int) -> bool:
    # crc32, not hash(): the reservation must not change with PYTHONHASHSEED.
    return zlib.crc32(f"{name}/{intro}".encode()) % 6 == 0


HERO_PAIRS = {(val, girl): tuple((name, k) for name in (W.GIRL_NAMES if girl else W.BOY_NAMES)
                                 for k in range(len(INTROS)) if _is_val_pair(name, k) == val)
              for val in (False, True) for girl in (False, True)}

# --- characters and things ----------------------------------------------------------------------


def _capitalize(sentence: str) -> str:
    """Capitalize the first letter, looking past an opening quote."""
    i = 1 if sentence.startswith('"') else 0
    return sentence[:i] + sentence[i].upper() + sentence[i + 1:]


class Person:
    """A character with the pronouns that belong to them: `{h.He} lost {h.his} ball.`"""

    def __init__(self, name: str, girl: bool, kind: str | None = None, **extra):
        self.name, self.girl, self.kind = name, girl, kind or ("girl" if girl else "boy")
        self.he, self.him, self.his, self.himself = (
            ("she", "her", "her", "herself") if girl else ("he", "him", "his", "himself"))
        self.He, self.His = self.he.capitalize(), self.his.capitalize()
        self.__dict__.update(extra)


class Thing:
    """An object or animal, always called by the same words: `{toy.a}` = "a red ball", `{toy.the}`."""

    def __init__(self, noun: str, adj: str = "", **extra):
        self.noun = noun
        self.name = f"{adj} {noun}" if adj else noun
        self.a = f"{W.article(self.name)} {self.name}"
        self.the = f"the {self.name}"
        self.__dict__.update(extra)


# --- the story being written --------------------------------------------------------------------


class _Story:
    """Collects sentences; picks a phrasing per beat and fills it from the cast (`self.cast`)."""

    def __init__(self, rng: random.Random, val: bool):
        self.rng, self.val = rng, val
        self.paragraphs: list[list[str]] = [[]]
        self._seen: set[str] = set()
        self._names: set[str] = set()
        trait = rng.choice(W.TRAITS)
        self.cast: dict = {"trait": trait, "a_trait": f"{W.article(trait)} {trait}", "town": rng.choice(W.TOWNS),
                           "age": rng.choice(W.AGES), "sad": rng.choice(W.SAD), "happy": rng.choice(W.HAPPY),
                           "sorry": rng.choice(W.SORRY), "color": rng.choice(W.COLORS)}
        self.cast["like"], self.cast["like2"] = rng.sample(W.INDOOR_ACTS, 2)

    def pick(self, options):
        return self.rng.choice(options)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def set(self, **cast) -> None:
        self.cast.update(cast)

    def say(self, *templates: str) -> None:
        """Append one of `templates`; a sentence already told in this story is not told twice."""
        for _ in range(4):
            sentence = _capitalize(self.rng.choice(templates).format_map(self.cast))
            if sentence not in self._seen:
                self._seen.add(sentence)
                self.paragraphs[-1].append(sentence)
                return

    def maybe(self, p: float, *templates: str) -> None:
        if self.chance(p):
            self.say(*templates)

    def para(self) -> None:
        if self.paragraphs[-1]:
            self.paragraphs.append([])

    def text(self) -> str:
        return "\n\n".join(" ".join(p) for p in self.paragraphs if p)

    def child(self, hero: bool = False) -> Person:
        """A child with a name not yet used in this story; the hero's name comes with its opening."""
        girl = self.chance(0.5)
        if hero:
            name, self.cast["intro"] = self.pick(HERO_PAIRS[self.val, girl])
        else:
            name = self.pick(W.GIRL_NAMES if girl else W.BOY_NAMES)
            while name in self._names:
                name = self.pick(W.GIRL_NAMES if girl else W.BOY_NAMES)
        self._names.add(name)
        return Person(name, girl)

    def grownup(self, exclude: Person | None = None) -> Person:
        kind, girl = self.pick([f for f in W.FAMILY if exclude is None or f[0] != exclude.kind])
        return Person(kind.capitalize(), girl, kind)

    def pet(self) -> Person:
        kind, sound, verb = self.pick(W.PET_KINDS)
        return Person(self.pick(W.PET_NAMES), self.chance(0.5), kind, sound=sound, sound_verb=verb,
                      a_kind=f"{W.article(kind)} {kind}")

    def activity(self, acts, key: str = "act") -> str:
        act = self.pick(acts)
        self.cast.update({key: act, key + "_ing": W.ing(act), key + "_past": W.past(act)})
        return act

    def cast_basics(self, place: W.Place | None = None) -> None:
        """The child `h`, a grown-up `p`, and (if given) the place, its day and one of its activities."""
        h = self.child(hero=True)
        self.set(h=h, p=self.grownup(), looks=self.pick(W.LOOKS).format(h=h))
        if place is not None:
            self.set(place=place, day=self.pick(place.days))
            self.activity(place.acts)


def _intro(s: _Story) -> None:
    """Who the story is about: the opening drawn together with the hero's name (see INTROS)."""
    s.say(INTROS[s.cast["intro"]])


def _about(s: _Story, p: float = 0.5) -> None:
    """Sometimes, one more detail about the child; it never matters later, so it never contradicts."""
    if s.chance(p):
        s.say("{h.He} had {looks}.", "{h.His} favorite color was {color}.", "{h.He} loved to {like} and to "
              "{like2}.", "{h.He} liked to {like} with {h.his} {p.kind}.", "Everyone said {h.he} had a big smile.")


def _weather(s: _Story, place: W.Place, p: float = 0.5) -> None:
    if s.chance(p):
        s.say(*place.weather)


def _outro_friends(s: _Story) -> None:
    s.say("From that day on, {h.name} and {f.name} were best friends.",
          "After that day, {h.name} and {f.name} played together all the time.",
          "{h.name} and {f.name} became the best of friends.")


# --- plots --------------------------------------------------------------------------------------
# Each plot writes one story into `s`: beginning, problem or event, resolution, a short ending.


def _lost_toy(s: _Story) -> None:
    place = s.pick([p for p in W.PLACES if p.key != "hill"])
    s.cast_basics(place)
    kind = s.pick(W.TOYS)
    spot1, spot2, spot3 = s.rng.sample(place.spots, 3)  # looked here, then here, found there
    helper = s.pick(("friend", "pet", "grownup"))
    s.set(toy=Thing(kind.noun, s.pick(kind.colors)), f=s.child(), pet=s.pet(), spot1=spot1, spot2=spot2, spot3=spot3)
    _intro(s)
    _about(s, 0.3)
    s.say("{h.He} had {toy.a} that {h.he} loved very much.", "{h.His} favorite toy was {toy.a}.",
          "{h.He} loved {h.his} {toy.name} more than anything.")
    s.maybe(0.5, "{h.He} took it everywhere {h.he} went.", "{h.He} played with it every day.")
    s.say("One {day}, {h.name} went {place.to} with {h.his} {p.kind}.",
          "One {day}, {h.name} and {h.his} {p.kind} went {place.to}.")
    if helper == "pet":
        s.say("{h.His} {pet.kind}, {pet.name}, came too.", "{pet.name}, {h.his} {pet.kind}, came along.")
    s.say("{h.name} brought {h.his} {toy.name} with {h.him}.", "Of course, {h.he} took {h.his} {toy.name} along.")
    s.say("{h.He} wanted to {act}.", "{h.He} ran off to {act}.")
    _weather(s, place)
    s.say("{h.He} had so much fun {act_ing} that {h.he} forgot all about {h.his} {toy.noun}.",
          "{h.He} {act_past} until the sun was low in the sky.")
    s.para()
    s.say("When it was time to go home, {h.name} looked for {h.his} {toy.name}. It was gone!",
          "After a while, {h.name} wanted {h.his} {toy.name}, but {h.he} could not find it anywhere.")
    s.say('"Oh no! Where is my {toy.noun}?" cried {h.name}.', '"My {toy.noun} is lost!" {h.name} cried.',
          '"Where did my {toy.noun} go?" {h.name} asked.')
    s.say("{h.He} felt {sad}.", "{h.His} eyes filled with tears.", "{h.He} was so upset that {h.he} wanted to cry.")
    s.say("{h.He} looked {spot1}, but it was not there.", "First, {h.he} looked {spot1}. It was not there.")
    s.say("Then {h.he} looked {spot2}. It was not there either.", "{h.He} looked {spot2} too, but there was "
          "no {toy.noun}.")
    s.para()
    _toy_found(s, helper)
    s.para()
    s.say("From that day on, {h.name} always kept {h.his} {toy.name} close.",
          "After that, {h.name} never left {h.his} {toy.noun} behind again.",
          "{h.name} learned to always take care of {h.his} things.")
    s.maybe(0.4, "It was a very good day after all.", "{h.He} went home {happy}.")


def _toy_found(s: _Story, helper: str) -> None:
    """Who finds the lost toy {spot3}: a friend who comes by, the pet, or the grown-up's good question."""
    if helper == "friend":
        s.say("Just then, {h.his} friend {f.name} came by.", "Just then, {h.his} friend {f.name} came running over.")
        s.say('"Why are you sad, {h.name}?" asked {f.name}.', '"What is wrong?" {f.name} asked.')
        s.say('"I lost my {toy.name}," said {h.name}.', '"I can\'t find my {toy.noun}," {h.name} said sadly.')
        s.say('"Don\'t worry. I will help you look," said {f.name}.', '"Let\'s look together!" said {f.name}.')
        s.say('{f.name} looked {spot3}. "I found it!" {f.he} shouted.', "The two friends looked {spot3}, and "
              "there it was!")
        s.say("{h.name} hugged {h.his} {toy.name} tight.", "{h.name} picked up {h.his} {toy.name} and smiled.")
        s.say('"Thank you, {f.name}! You are a good friend," said {h.name}.', '"Thank you!" said {h.name}. '
              '"You are the best!"')
    elif helper == "pet":
        s.say("{pet.name} sniffed the ground.", "{pet.name} put {pet.his} nose to the ground and sniffed.")
        s.say("Then {pet.name} ran off and stopped {spot3}.", "Then {pet.name} trotted away and stopped {spot3}.")
        s.say('"{pet.sound}" {pet.sound_verb} {pet.name}.', "{pet.name} {pet.sound_verb} and {pet.sound_verb}.")
        s.say("{h.name} ran over. There was {h.his} {toy.name}!", "{h.name} ran to see. It was {h.his} {toy.name}!")
        s.say('{h.name} gave {pet.name} a big hug. "You found it! You are the best {pet.kind} ever!"',
              '"Good {pet.kind}, {pet.name}!" said {h.name}, and {h.he} gave {pet.him} a big hug.')
    else:
        s.say("{h.His} {p.kind} came over and held {h.his} hand.", "{h.His} {p.kind} knelt down next to {h.him}.")
        s.say('"Let\'s think," said {h.his} {p.kind}. "Where did you play last?"',
              '"Where did you have it last?" asked {h.his} {p.kind}.')
        s.say('{h.name} thought hard. "I was playing {spot3}!"', '"I think I was {spot3}," said {h.name}.')
        s.say("They went {spot3} together, and there it was!", "They looked {spot3}, and there was the {toy.noun}!")
        s.say('"Thank you, {p.name}!" said {h.name}, and {h.he} hugged {h.his} {toy.name}.')


def _new_friend(s: _Story) -> None:
    place = s.pick([p for p in W.PLACES if len(p.acts) >= 4 and p.key != "hill"])
    s.cast_basics(place)
    f = s.child()
    s.set(f=f, lonely=s.pick(W.LONELY), softly=s.pick(W.SOFTLY))
    s.activity([a for a in place.acts if a != s.cast["act"]], key="act2")
    _intro(s)
    _about(s, 0.3)
    s.maybe(0.6, "{h.He} loved to {act}.", "{h.His} favorite thing to do was {act_ing}.")
    s.say("One {day}, {h.name} went {place.to} with {h.his} {p.kind}.",
          "One {day}, {h.his} {p.kind} took {h.him} {place.to}.")
    _weather(s, place)
    s.say("There, {h.he} saw a {f.kind} sitting all alone {place.seat}.", "{h.He} saw a {f.kind} {h.he} did not "
          "know. The {f.kind} was sitting by {f.himself} {place.seat}.")
    if f.girl != s.cast["h"].girl:  # a pronoun is only clear when it cannot mean the hero
        s.say("{f.He} looked {lonely}.", "{f.He} seemed {lonely}.")
    else:
        s.say("The {f.kind} looked {lonely}.", "The {f.kind} seemed {lonely}.")
    s.para()
    s.say("{h.name} walked over and smiled.", "{h.name} felt a little shy, but {h.he} took a deep breath and "
          "walked over.")
    s.say('"Hi! My name is {h.name}. What is your name?"', '"Hello! I am {h.name}," {h.he} said. "What is your '
          'name?"')
    s.say('"I am {f.name}," said the {f.kind} {softly}.', '"My name is {f.name}," the {f.kind} said {softly}.')
    s.maybe(0.6, '"We just moved here," said {f.name}. "I don\'t have any friends yet."',
            '"I am new here," said {f.name}. "I don\'t know anyone."')
    s.say('"Do you want to {act} with me?" asked {h.name}.', '"Would you like to play with me? We can {act}!" '
          'said {h.name}.')
    s.say('{f.name} smiled a big smile. "Yes, please!" {f.he} said.', '{f.name}\'s face lit up. "I would love to!"')
    s.para()
    s.say("So {h.name} and {f.name} {act_past} together.", "The two children {act_past} together.")
    s.say("They laughed and had so much fun.", "They had the best time.", "They giggled and giggled.")
    s.maybe(0.7, "Then they {act2_past}.", "After that, they {act2_past}.")
    s.maybe(0.5, '"This is fun!" said {f.name}.', '"You are a good friend, {h.name}," said {f.name}.')
    s.para()
    s.say("When the sun began to set, it was time to go home.", "Soon it was time to go home.")
    s.say('"Can we play again tomorrow?" asked {f.name}.', '"Will you play with me again?" asked {f.name}.')
    s.say('"Yes! See you tomorrow!" said {h.name}.', '"Of course!" said {h.name} with a smile.')
    _outro_friends(s)
    s.maybe(0.6, "{h.name} was glad {h.he} had said hello.", "A little hello had made a big new friendship.",
            "{h.name} learned that being kind to someone new can make a friend.")


def _sharing(s: _Story) -> None:
    s.cast_basics()
    item = s.pick(W.SHARE_ITEMS)
    sibling = s.chance(0.4)
    f = s.child()
    rel = s.pick(("little", "big")) + (" sister" if f.girl else " brother") if sibling else "friend"
    s.set(f=f, rel=rel, item=item, use_past=W.past(item.use), day=s.pick(W.HOME_DAYS))
    _intro(s)
    _about(s, 0.5)
    s.say("One {day}, {h.his} {p.kind} gave {h.him} {item.amount} {item.noun}.",
          "One {day}, {h.name} got {item.amount} {item.noun} from {h.his} {p.kind}.")
    s.say("{h.name} was {happy}.", '"Thank you!" said {h.name}. {h.He} loved {item.noun}.')
    s.say("Then {h.his} {rel} {f.name} came and sat down next to {h.him}.",
          "Just then, {h.his} {rel} {f.name} came into the room.")
    s.say('"Can I {item.use} some of your {item.noun}?" asked {f.name}.',
          '"Those look nice! Can I have some {item.noun} too?" asked {f.name}.')
    s.para()
    s.say('"No! They are mine!" said {h.name}.', '"No," said {h.name}. "They are all for me."')
    s.say("{h.He} held the {item.noun} close to {h.him}.", "{h.He} did not want to share.")
    s.say("{f.name} looked {sad}. {f.He} walked away and sat in the corner.",
          "{f.name}'s smile went away. {f.He} sat down by {f.himself} and looked at the floor.")
    s.say("{h.name} started to {item.use} the {item.noun} all alone, but it was not much fun.",
          "{h.name} looked at {h.his} {item.noun}. Then {h.he} looked at {f.name}.")
    s.say("{h.He} had a funny feeling in {h.his} tummy.", "Something did not feel right.")
    s.maybe(0.7, '{h.His} {p.kind} came over. "How do you think {f.name} feels?" {p.he} asked.')
    s.maybe(0.7, '"When we share, two people are happy instead of one," said {h.his} {p.kind}.',
            '"Sharing makes everyone feel good," said {h.his} {p.kind} softly.')
    s.para()
    s.say('{h.name} walked over to {f.name}. "I am sorry," {h.he} said. "Let\'s share!"',
          '{h.name} took the {item.noun} to {f.name}. "Here, you can have half," {h.he} said.')
    s.say('{f.name} smiled. "Thank you, {h.name}!"', '{f.name}\'s face lit up. "Really? Thank you!"')
    s.say("{item.together}")
    s.maybe(0.5, '"Sharing is fun!" said {f.name}.', "{h.His} {p.kind} smiled when {p.he} saw them.")
    s.say("{h.name} felt warm and happy inside.", "Sharing made {h.name} feel much better than keeping them.")
    s.say("{h.name} learned that sharing makes everyone happy.", "{h.name} learned that it is more fun to share.",
          "Now {h.name} knew that sharing is caring.")


def _brave(s: _Story) -> None:
    s.cast_basics()
    fear = s.pick(W.FEARS)
    s.set(fear=fear, day=s.pick(fear.days), petname=s.pick(W.PET_NAMES), scared=s.pick(W.SCARED),
          proud=s.pick(W.PROUD))
    _intro(s)
    _about(s, 0.4)
    s.maybe(0.5, "{h.He} was good at many things, but some things still made {h.him} feel {scared}.")
    s.say(fear.intro)
    s.say("{h.name} wanted to " + fear.want + ", but {h.he} was {scared}.",
          "{h.name} wanted to " + fear.want + ". But {h.he} felt {scared}.")
    s.say(fear.why)
    s.say('"' + fear.worry + '" {h.he} asked.', '"' + fear.worry + '" {h.he} said in a small voice.')
    s.para()
    s.say('"It is okay to be scared," said {h.his} {p.kind}. "Being brave means trying even when you are scared."',
          '"You can do it," said {h.his} {p.kind}. "I believe in you."',
          '{h.His} {p.kind} gave {h.him} a hug. "You are braver than you think," {p.he} said.')
    s.say("{h.name} took a deep breath.", "{h.name} took a big, deep breath and nodded.")
    s.say(fear.attempt)
    s.say(fear.success)
    s.para()
    s.say('"I did it!" {h.name} shouted.', '"I did it! I really did it!" said {h.name}.')
    s.say("{h.He} felt {proud} of {h.himself}.", "{h.His} {p.kind} smiled. \"I am {proud} of you,\" {p.he} said.")
    s.say(fear.after)
    s.say("{h.name} learned that being brave does not mean you are never scared. It means you try anyway.",
          "{h.name} learned that {h.he} could do hard things, even when {h.he} felt {scared}.",
          "Now {h.name} knew that {h.he} was brave.")


def _kitten_rescue(s: _Story) -> None:
    place = s.pick([W.PLACE[k] for k in ("park", "backyard", "garden", "school", "farm")])
    s.cast_basics(place)
    s.set(kitten=Thing("kitten", s.pick(("little gray", "fluffy white", "orange", "tiny black", "striped"))),
          kname=s.pick(W.PET_NAMES), scared=s.pick(W.SCARED))
    girl = s.chance(0.5)
    s.set(owner=Person("", girl, "lady" if girl else "old man", a_kind="a lady" if girl else "an old man"))
    _intro(s)
    _about(s, 0.4)
    s.say("One {day}, {h.name} was {act_ing} {place.at} with {h.his} {p.kind}.",
          "One {day}, {h.name} and {h.his} {p.kind} went {place.to} to {act}.")
    _weather(s, place)
    s.say('Suddenly, {h.he} heard a tiny sound. "Meow! Meow!"', 'Then {h.he} heard a small voice: "Meow!"')
    s.say("{h.He} looked up. There was {kitten.a}, stuck high up in a tree!",
          "{h.He} looked all around. High up in a tree sat {kitten.a}.")
    s.say("The kitten was {scared}. It could not get down.", "The poor kitten was stuck, and it was {scared}.")
    s.para()
    s.say('"{p.name}! A kitten is stuck in the tree!" cried {h.name}.',
          '{h.name} ran to {h.his} {p.kind}. "Come quick! There is a kitten in the tree!"')
    s.say("{h.His} {p.kind} got a tall ladder and climbed up slowly.",
          "{h.His} {p.kind} found a ladder and leaned it against the tree. Then {p.he} climbed up, step by step.")
    s.say('{p.He} held out {p.his} hand. "Come here, little one," {p.he} said softly.',
          '"It is okay, little kitten," {p.he} said in a gentle voice.')
    s.say("The kitten stepped into {p.his} arms, and {p.he} carried it down.",
          "The kitten climbed onto {p.his} shoulder, and they came down together.")
    s.say("{h.name} petted the kitten gently. It purred and purred.",
          "The kitten rubbed its soft head against {h.name}'s hand and purred.")
    s.para()
    if s.chance(0.5):
        s.say("Just then, {owner.a_kind} came hurrying over.", "Just then, {owner.a_kind} came running down the path.")
        s.say('"{kname}! There you are!" {owner.he} called. "I have been looking everywhere for you."')
        s.say('"Thank you for saving my kitten," the {owner.kind} said to {h.name}.',
              "The {owner.kind} thanked {h.name} and {h.his} {p.kind} again and again.")
    else:
        s.say("Nobody came to look for the kitten, so {h.his} {p.kind} said {h.name} could keep it.",
              "The kitten had no home, so {h.name} got to keep it.")
        s.say("{h.name} named the kitten {kname}.", "{h.name} gave the kitten a name: {kname}.")
    s.say("{h.name} was so glad that {h.he} had helped.", "{h.name} smiled all the way home.")
    s.say("Helping others, even very small ones, makes the world a little kinder.",
          "{h.name} learned that it is good to help anyone who needs it.")


def _lost_baby(s: _Story) -> None:
    baby, mother, baby_sound, mother_sound, homes = s.pick(W.LOST_BABIES)
    place = W.PLACE[s.pick(homes)]
    s.cast_basics(place)
    s.set(baby=baby, mother=mother, baby_sound=baby_sound, mother_sound=mother_sound, worried=s.pick(W.WORRIED),
          spots=s.rng.sample(place.spots, 3), f=s.child())
    s.set(spot1=s.cast["spots"][0], spot2=s.cast["spots"][1], spot3=s.cast["spots"][2])
    h, f, p = s.cast["h"], s.cast["f"], s.cast["p"]
    with_friend = s.chance(0.5)
    s.set(helper_name=f.name if with_friend else f"{h.his} {p.kind}",
          helper_intro=f"{h.his} friend {f.name}" if with_friend else f"{h.his} {p.kind}")
    _intro(s)
    _about(s, 0.4)
    s.say("One {day}, {h.name} went {place.to} with {helper_intro}.",
          "One {day}, {h.name} and {helper_intro} went {place.to} to {act}.")
    _weather(s, place)
    s.say('Then {h.he} heard a tiny sound. "{baby_sound}"', 'Suddenly, {h.name} heard something: "{baby_sound}"')
    s.say("{spot1}, there was a little {baby}, all alone.", "{h.He} looked {spot1} and saw a little {baby}.")
    s.say("It was crying for its mother.", "The little {baby} was lost, and it could not find its mother.")
    s.para()
    s.say('"Poor little {baby}," said {h.name}. "We will help you find your mom."',
          '"Don\'t be sad, little {baby}," said {h.name}. "We will find your mother."')
    s.say("{h.name} and {helper_name} looked {spot2}, but the {mother} was not there.",
          "First they looked {spot2}. There was no {mother} there.")
    s.say("The little {baby} followed them everywhere.",
          "The little {baby} stayed close to {h.name}'s feet.")
    s.say("{h.name} felt {worried}.", "Where could the {mother} be?")
    s.say('Then they heard a loud sound {spot3}. "{mother_sound}"',
          '"{mother_sound}" Something was calling {spot3}.')
    s.para()
    s.say("It was the {mother}!", "There was the {mother}, looking for her baby!")
    s.say("The little {baby} ran to its mother as fast as it could.", "The little {baby} hurried to its mother.")
    s.say("The {mother} nuzzled her baby, and the {baby} snuggled close.")
    s.say('"Hooray!" shouted {h.name}, and {h.he} clapped {h.his} hands.', '"You found your mom!" said {h.name}.')
    s.say("{h.He} felt warm inside.", "{h.He} felt {happy}, because {h.he} had helped a little friend.")
    s.say("Being kind and helpful is a wonderful thing.", "{h.name} learned that even small helpers can do big things.")


def _animal_friend(s: _Story) -> None:
    animal = s.pick([a for a in W.ANIMALS if a.food])
    place = W.PLACE[s.pick(animal.homes)]
    s.cast_basics(place)
    # "some seeds" are "them", "a nut" and "some grass" are "it".
    food_it = "them" if animal.food.startswith("some ") and animal.food.endswith("s") else "it"
    s.set(animal=Thing(animal.noun, s.pick(animal.looks), food=animal.food, food_it=food_it, move=animal.move,
                       sound=animal.sound, sound_verb=animal.sound_verb),
          spot=s.pick(place.spots), snack=s.pick(W.SNACKS), petname=s.pick(W.PET_NAMES))
    _intro(s)
    _about(s, 0.5)
    s.say("One {day}, {h.name} went {place.to} with {h.his} {p.kind}.",
          "One {day}, {h.name} and {h.his} {p.kind} went {place.to} to {act}.")
    _weather(s, place, 0.7)
    s.say("They sat down {spot} and ate some {snack}.", "After a while, they sat down {spot} to rest.")
    s.say("Then {animal.a} {animal.move} up to {h.name}.", "Just then, {animal.a} {animal.move} over to them.")
    if animal.sound:
        s.say('"{animal.sound}" {animal.sound_verb} the {animal.noun}.')
    s.say("It looked at {h.name} with big eyes. It looked hungry.", "The {animal.noun} looked very hungry.")
    s.para()
    s.say('"Are you hungry, little {animal.noun}?" asked {h.name}.',
          '"Hello, {animal.noun}," whispered {h.name}. "Are you hungry?"')
    s.say('"I think the {animal.noun} would like {animal.food}," said {h.his} {p.kind}.',
          '{h.His} {p.kind} handed {h.him} {animal.food}. "Let\'s see if it likes this," {p.he} said.')
    s.maybe(0.6, "At first, the {animal.noun} was shy, and it stepped back.",
            "At first, the {animal.noun} did not come any closer.")
    s.maybe(0.6, "{h.name} stayed very still and quiet.", "{h.name} knelt down slowly, so {h.he} would not scare it.")
    s.say("{h.name} held out {animal.food} very gently.", "{h.name} held {animal.food} out on {h.his} open hand.")
    s.say("The {animal.noun} came closer and closer. Then, gulp! It ate {animal.food_it} all up!",
          "The {animal.noun} ate {animal.food_it} right up.")
    s.say("{h.name} giggled.", "{h.name} laughed with joy.")
    s.para()
    s.say("The next day, {h.name} came back, and so did the {animal.noun}.",
          "After that, the {animal.noun} came to see {h.name} every day.")
    s.say('{h.name} named {animal.the} {petname}. "You are my friend, {petname}," {h.he} said.',
          "{h.name} gave the {animal.noun} a name. {h.He} called it {petname}.")
    s.maybe(0.6, "Every day, {h.name} brought a little snack for {petname}.",
            "Every morning, {h.name} looked out for {petname}.")
    s.say("{h.name} and {petname} were friends.", "Now {h.name} had a special animal friend.")
    s.maybe(0.6, "{h.name} learned that being gentle and kind can make a friend of anyone.",
            "Kindness is the best way to make a friend.")


def _adventure(s: _Story) -> None:
    place = s.pick(W.ADVENTURE_PLACES)
    s.cast_basics(place)
    animal = s.pick([a for a in W.ANIMALS if place.key in a.homes])
    with_pet = s.chance(0.4)
    s.set(f=s.child(), pet=s.pet(), find=s.pick(place.finds), spot=s.pick(place.spots), snack=s.pick(W.SNACKS),
          animal=Thing(animal.noun, s.pick(animal.looks), sound=animal.sound, sound_verb=animal.sound_verb,
                       move=animal.move), worried=s.pick(W.WORRIED))
    find = s.cast["find"]
    s.set(pal=s.cast["pet"].name if with_pet else s.cast["f"].name,
          pal_intro=s.cast["pet"].name if with_pet else f"{s.cast['h'].his} friend {s.cast['f'].name}",
          the_find="the " + find.split(" ", 1)[1])
    _intro(s)
    s.say("{h.He} loved adventures.", "{h.He} loved to explore new places.", "{h.He} was always curious.")
    if with_pet:
        s.say("{h.He} had {pet.a_kind} named {pet.name}.",
              "{h.His} best friend was {h.his} {pet.kind}, {pet.name}.")
    s.say("One {day}, {h.name} and {pal_intro} went on an adventure {place.at}.",
          "One {day}, {h.name} and {pal_intro} set off to explore {place.name}.")
    s.maybe(0.6, "{h.name} packed a little bag with {snack} and water.", '"Let\'s explore!" said {h.name}.')
    s.para()
    s.say(place.sight)
    s.say("They walked and walked.", "They walked along, looking at everything.")
    s.say("Soon they saw {animal.a}.", "After a while, they met {animal.a}.")
    if animal.sound:
        s.say('"{animal.sound}" {animal.sound_verb} the {animal.noun}.')
    s.say("Soon the {animal.noun} {animal.move} away.", "They watched the {animal.noun} for a long time, until "
          "it {animal.move} away.")
    s.say("{spot}, {h.name} found {find}.", "A little later, {h.name} saw something {spot}. It was {find}!")
    s.say('"Look!" {h.he} said. "A treasure!"', '"Wow!" said {h.name}. "Look what I found!"')
    s.say("{h.He} put it in {h.his} pocket to take home.", "{h.He} held it carefully in {h.his} hand.")
    if s.chance(0.6):
        s.say("Then {h.name} tripped over a little rock and fell down.", "Oops! {h.name} slipped and fell down.")
        if with_pet:
            s.say("{pet.name} ran over and licked {h.his} face until {h.he} laughed.")
        else:
            s.say('{f.name} helped {h.him} up. "Are you okay?" {f.he} asked.')
        s.say('"I am okay!" said {h.name}, and {h.he} brushed off {h.his} knees.')
    s.para()
    s.say("When the sun began to go down, they walked back home.", "Soon it was getting late, so they headed home.")
    s.say("{h.name} showed {the_find} to {h.his} {p.kind}.", "At home, {h.name} told {h.his} {p.kind} all about "
          "the {animal.noun} and showed {p.him} {the_find}.")
    s.say('"What a wonderful adventure!" said {h.his} {p.kind}.', '"You found a real treasure," said {h.his} '
          '{p.kind} with a smile.')
    s.say("{h.name} put the treasure on the shelf by {h.his} bed, so {h.he} would always remember the day.")
    s.say("It was the best adventure ever.", "{h.name} could not wait for the next adventure.")


def _rainy_day(s: _Story) -> None:
    place = s.pick([W.PLACE[k] for k in ("park", "playground", "beach", "backyard", "garden", "pond", "meadow")])
    s.cast_basics(place)
    plan = s.pick(W.RAINY_PLANS)
    s.set(plan=plan, softly=s.pick(W.SOFTLY), day=s.pick(W.HOME_DAYS))
    _intro(s)
    _about(s, 0.5)
    s.say("One {day}, {h.name} wanted to go {place.to} and {act}.",
          "{h.name} had a plan. {h.He} wanted to {act} {place.at}.")
    s.say("But when {h.he} looked out the window, it was raining.", "But then dark clouds came, and it began "
          "to rain.", "But outside, rain was falling from the gray sky.")
    s.maybe(0.6, "Drip, drop, drip. The rain fell and fell.", "The rain went pitter-patter on the roof.")
    s.say("{h.He} felt {sad}.", "{h.name} pressed {h.his} nose against the window. {h.He} felt {sad}.")
    s.say('"Now I can\'t go outside," {h.he} said.', '"Rain, rain, go away," {h.he} sang {softly}.')
    s.maybe(0.6, '"Will the rain stop soon?" {h.he} asked {h.his} {p.kind}. "Not for a while," said {h.his} '
            '{p.kind}.', '"It is not fair," {h.he} said with a sigh.')
    s.para()
    s.say('"I have an idea," said {h.his} {p.kind}. "Let\'s {plan.do}!"',
          '{h.His} {p.kind} smiled. "How about we {plan.do}?" {p.he} asked.')
    s.say('{h.name} jumped up. "Yes!"', '"Okay!" said {h.name}.')
    for step in plan.steps:
        s.say(step)
    s.say(plan.end)
    s.maybe(0.5, "Then they drank warm cocoa by the window.", "After that, they had a snack of warm toast and "
            "apple slices.")
    s.para()
    s.say("{h.name} forgot all about the rain.", "{h.name} was having so much fun that {h.he} did not even "
          "notice the rain.")
    if s.chance(0.6):
        s.say("Later, the rain stopped, and a big rainbow came out.", "After a while, the sun peeked out, and "
              "a rainbow stretched across the sky.")
        if plan.do == "make paper boats":
            s.say("{h.name} and {h.his} {p.kind} put on their boots and sailed the paper boats in the puddles.")
        else:
            s.say("{h.name} and {h.his} {p.kind} put on their boots and jumped in the puddles. Splash!")
    s.say('{h.name} gave {h.his} {p.kind} a big hug. "Thank you for the best idea!" {h.he} said.',
          '"That was so much fun," said {h.name}, and {h.he} gave {h.his} {p.kind} a hug.')
    s.say("{h.name} learned that a rainy day can be a fun day too.", "Even a gray day can be full of fun.",
          "It was a wonderful rainy day.")


def _lesson(s: _Story) -> None:
    s.cast_basics()
    lesson = s.pick(W.LESSONS)
    kind = s.pick(W.TOYS)
    s.set(day=s.pick(W.HOME_DAYS), f=s.child(), toy=Thing(kind.noun, s.pick(kind.colors)))
    _intro(s)
    _about(s, 0.5)
    s.maybe(0.5, "{h.He} was a good {h.kind}, but sometimes {h.he} forgot to listen.",
            "{h.He} loved to play, and {h.he} was always in a hurry.")
    s.say(*lesson.setup)
    s.say(*lesson.warn)
    s.para()
    s.say(*lesson.mistake)
    s.say(*lesson.oops)
    s.say(*lesson.feel)
    s.maybe(0.6, "{h.name} sat very still and thought about what had happened.",
            "{h.He} wished {h.he} could go back and try again.")
    s.para()
    s.say(*lesson.talk)
    s.say(*lesson.fix)
    s.maybe(0.6, "{h.He} felt much better.", "Now everything felt right again.")
    s.para()
    s.say(*lesson.moral)
    s.maybe(0.5, "It was a lesson {h.he} would always remember.", "And {h.he} never forgot it.")


def _gift(s: _Story) -> None:
    s.cast_basics()
    r = s.grownup(exclude=s.cast["p"])
    s.set(r=r, gift=s.pick(W.GIFTS))
    gift = s.cast["gift"]
    _intro(s)
    _about(s, 0.4)
    s.say("It was almost {h.his} {r.kind}'s birthday.", "Soon it would be {h.his} {r.kind}'s birthday.")
    s.say("{h.name} wanted to give {r.him} something special.", '"What can I give {r.name}?" {h.he} asked '
          '{h.his} {p.kind}.')
    s.say('"The best gifts are the ones you make yourself," said {h.his} {p.kind}.',
          '"Why don\'t you make something?" said {h.his} {p.kind}.')
    s.say("So {h.name} decided to " + gift.make + ".")
    s.para()
    s.say(gift.steps)
    s.say(gift.problem)
    s.say('"Oh no!" cried {h.name}. {h.He} felt {sad}.', "{h.name} felt {sad}. {h.He} wanted to cry.")
    s.maybe(0.6, '"It is okay," said {h.his} {p.kind}. "Let\'s try again."',
            '"Everybody makes mistakes," said {h.his} {p.kind}. "You can fix it."')
    s.say(gift.fix)
    s.para()
    s.say("On {h.his} {r.kind}'s birthday, {h.name} gave {r.him} the gift.", "When the big day came, "
          "{h.name} gave {h.his} {r.kind} the surprise.")
    s.say('"Happy birthday, {r.name}!" {h.he} said.', '"Happy birthday!" said {h.name}. "I made it for you!"')
    s.say('"Did you make this all by yourself?" asked {h.his} {r.kind}. "Yes!" said {h.name} proudly.',
          "{h.His} {r.kind}'s eyes lit up.")
    s.say('"I love it," said {h.his} {r.kind}, and {r.he} gave {h.name} a big hug.')
    s.say(gift.use)
    s.say("{h.name} learned that the best gifts come from the heart.", "A gift made with love is the best gift "
          "of all.")


def _helping(s: _Story) -> None:
    s.cast_basics()
    helps = s.pick(W.HELPS)
    girl, sib = s.chance(0.5), s.child()
    s.set(n=Person(("Mrs. " if girl else "Mr. ") + s.pick(W.SURNAMES), girl, "lady" if girl else "man"),
          f=s.child(), sib=Person(sib.name, sib.girl, "sister" if sib.girl else "brother"),
          petname=s.pick(W.PET_NAMES), day=s.pick(W.HOME_DAYS), proud=s.pick(W.PROUD))
    _intro(s)
    _about(s, 0.4)
    s.maybe(0.6, "{h.He} liked to help.", "{h.He} always wanted to be a good helper.",
            "{h.He} had a big, kind heart.")
    s.say(helps.intro)
    s.say(helps.need)
    s.maybe(0.6, "{h.name} wanted to help.", "{h.name} could see that someone needed a helper.")
    s.say(helps.offer)
    s.para()
    for step in helps.steps:
        s.say(step)
    s.say(helps.hitch)
    s.para()
    s.say(helps.thanks)
    s.say("{h.name} felt {proud}.", "{h.name} smiled from ear to ear.", "{h.name} felt warm and {happy} inside.")
    s.say("{h.name} learned that helping others makes everyone happy.", "Helping others is a wonderful feeling.",
          "Even a small helper can make a big difference.")
    s.maybe(0.5, "{h.He} could not wait to help again.", "It was a very good day.")


PLOTS = (_lost_toy, _new_friend, _sharing, _brave, _kitten_rescue, _lost_baby, _animal_friend, _adventure,
         _rainy_day, _lesson, _gift, _helping)

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
    for k, pattern in enumerate(_INTRO_PATTERNS):
        match = pattern.match(story)
        if match:
            return "val" if _is_val_pair(match["name"], k) else "train"
    raise ValueError(f"not a flaxchat story: it does not open with one of the story openings: {story[:60]!r}")


def generate_story(index: int, seed: int = 0) -> str:
    """Story number `index` of the stream for `seed`; depends on (seed, index) alone."""
    if index < 0:
        raise ValueError(f"story index must be >= 0, got {index}")
    # Seeding with a string hashes it with SHA-512: stable across processes and PYTHONHASHSEED.
    rng = random.Random(f"flaxchat-stories:{seed}:{index}")
    for _ in range(10):  # the plots are sized to fit; a rare miss just draws again from the same rng
        story = _Story(rng, is_val_index(index))
        rng.choice(PLOTS)(story)
        text = story.text()
        if MIN_WORDS <= len(text.split()) <= MAX_WORDS:
            return text
    raise RuntimeError(f"story {index} (seed {seed}) missed {MIN_WORDS}-{MAX_WORDS} words ten times; a plot is "
                       "badly sized")


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
    return {"documents": len(stories), "words": words, "distinct_words": len(vocab),
            "distinct_sentences": len(sentences), "mean_words": words / max(len(stories), 1), "bytes": n_bytes}


# --- command line -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print synthetic children's stories or corpus statistics.")
    parser.add_argument("--n", type=int, default=3, help="number of stories to print")
    parser.add_argument("--seed", type=int, default=0, help="stream seed")
    parser.add_argument("--split", default="train", choices=SPLITS, help="which split to draw from")
    parser.add_argument("--start", type=int, default=0, help="position of the first story in the split")
    parser.add_argument("--stats", type=int, default=0, metavar="N",
                        help="instead of printing stories, generate N and print corpus statistics as JSON")
    args = parser.parse_args(argv)
    if args.n < 0 or args.stats < 0 or args.start < 0:
        parser.error("--n, --stats and --start must be >= 0")
    if args.stats:
        from flaxchat.common import progress_bar  # imported here: it brings jax, which generating stories never needs

        t0 = time.perf_counter()
        stream = itertools.islice(iter_stories(args.split, args.seed, args.start), args.stats)
        stories = list(progress_bar(stream, total=args.stats, desc="stories", unit="story", disable=args.stats < 50_000))
        seconds = time.perf_counter() - t0
        stats = corpus_stats(stories)
        stats.update(seconds=round(seconds, 2), words_per_s=round(stats["words"] / seconds),
                     mb_per_s=round(stats["bytes"] / seconds / 1e6, 3), mean_words=round(stats["mean_words"], 1))
        print(json.dumps(stats, indent=2))
        return
    for i, story in enumerate(generate_stories(args.n, args.split, args.seed, args.start)):
        print(f"--- {args.split} story {args.start + i} (seed {args.seed}) ---\n{story}\n")


if __name__ == "__main__":
    main()
