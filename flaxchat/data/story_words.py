"""Word lists, word forms and story pieces for the synthetic story generator (`flaxchat.data.stories`).

Apart from three small word-form helpers (past tense, -ing form, a/an), everything here is data.
Entries are grouped so that any random pick stays coherent with the rest of a story: a place lists
the spots, activities and animals that belong there, an animal lists the places it lives in and the
food it eats. Multi-word pieces are templates filled with `str.format` from the story's cast
(`{h.name}`, `{h.he}`, `{p.kind}`, ... see `stories.Person`).
"""

from __future__ import annotations

from typing import NamedTuple

# --- word forms -------------------------------------------------------------------------------

_IRREGULAR_PAST = {
    "build": "built", "fly": "flew", "ride": "rode", "swim": "swam", "dig": "dug", "make": "made",
    "run": "ran", "sing": "sang", "draw": "drew", "read": "read", "throw": "threw", "catch": "caught",
    "go": "went", "sit": "sat", "eat": "ate", "feed": "fed", "find": "found", "blow": "blew",
    "have": "had", "take": "took", "do": "did", "hide": "hid", "get": "got", "swing": "swung",
    "spin": "spun", "give": "gave", "hold": "held", "skip": "skipped", "slide": "slid",
}
_DOUBLE_FINAL = {"swim", "run", "dig", "hop", "skip", "sit", "pet", "pat", "jog", "clap", "hug", "stop", "get",
                 "spin", "drop", "tap"}


def past(phrase: str) -> str:
    """Past tense of a verb phrase's first word: "fly a kite" -> "flew a kite"."""
    verb, _, rest = phrase.partition(" ")
    if verb in _IRREGULAR_PAST:
        out = _IRREGULAR_PAST[verb]
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
    """"a" or "an" for a phrase, by the sound of its first word."""
    first = phrase.split()[0].lower()
    vowel_sound = first[0] in "aeiou" and not first.startswith(("uni", "use", "one"))
    return "an" if vowel_sound else "a"


# --- people -------------------------------------------------------------------------------------
# Short, common names that are not also ordinary English words (no Rose, Hope, June...), so a name
# never collides with a word used elsewhere in a story.

GIRL_NAMES = (
    "Lily", "Mia", "Emma", "Ava", "Sophia", "Olivia", "Chloe", "Zoe", "Ella", "Grace", "Anna", "Lucy",
    "Sara", "Amy", "Kate", "Molly", "Ruby", "Alice", "Emily", "Hannah", "Isla", "Julia", "Nora", "Leah",
    "Maya", "Nina", "Rosa", "Tess", "Lola", "Jenny", "Katie", "Sophie", "Abby", "Bella", "Clara", "Eva",
    "Fiona", "Gina", "Holly", "Iris", "Kelly", "Laura", "Megan", "Nadia", "Paula", "Rita", "Sally",
    "Tina", "Vera", "Wendy", "Yara", "Zara", "Amelia", "Ariana", "Bonnie", "Carly", "Diana", "Elena",
    "Erin", "Gemma", "Heidi", "Ines", "Jana", "Kira", "Lena", "Mara", "Nell", "Penny", "Rachel",
    "Sadie", "Tara", "Uma", "Violet", "Amara", "Bea", "Cora", "Dina", "Eliza", "Freya", "Gwen", "Ida",
    "Josie", "Kaya", "Lila", "Mila", "Naomi", "Pia", "Rhea", "Selma", "Thea", "Una", "Vicky", "Wren",
    "Yasmin", "Zelda", "Aisha", "Anya", "Ayla", "Beth", "Cara", "Daria", "Edie", "Elsa", "Esme",
    "Gigi", "Jill", "Kim", "Lara", "Lisa", "Luna", "Maisie", "Mina", "Nia", "Nola", "Pippa", "Polly",
    "Rina", "Sasha", "Stella", "Suki", "Tilly", "Trudy", "Wanda", "Yuki", "Zuri", "Abigail", "Adele",
    "Alma", "Anika", "Beatrice", "Carmen", "Dora", "Elise", "Evie", "Flora", "Greta", "Harriet",
    "Imogen", "Jasmine", "Kara", "Leila", "Lottie", "Marta", "Meg", "Millie", "Nancy", "Nova", "Orla",
    "Priya", "Rosie", "Sienna", "Tanya", "Winnie", "Zoey", "Ada", "Betty", "Cleo", "Ellie", "Frida",
    "Hattie", "Ivana", "Kiki", "Lulu", "Mimi", "Noor", "Olga", "Petra", "Rosalie", "Tamara",
    "Vanessa", "Ximena", "Zina", "Aria", "Bianca", "Daphne", "Eden", "Hailey", "Layla", "Mei",
)
BOY_NAMES = (
    "Tom", "Max", "Ben", "Sam", "Leo", "Jack", "Tim", "Finn", "Noah", "Liam", "Oliver", "Lucas",
    "Ethan", "Owen", "Jake", "Luke", "Adam", "Alex", "Ryan", "Dan", "Eli", "Felix", "George", "Henry",
    "Ian", "Kai", "Louis", "Milo", "Nate", "Oscar", "Peter", "Ravi", "Simon", "Theo", "Toby", "Victor",
    "Zack", "Aaron", "Arlo", "Billy", "Bobby", "Caleb", "Charlie", "Danny", "Dylan", "Eddie", "Elliot",
    "Evan", "Frank", "Gabe", "Harry", "Hugo", "Isaac", "Jasper", "Joe", "Jonah", "Kevin", "Kyle",
    "Lenny", "Levi", "Marco", "Matt", "Mike", "Nico", "Omar", "Otto", "Pablo", "Paul", "Rory",
    "Ross", "Rudy", "Seth", "Stan", "Ted", "Timmy", "Tony", "Tyler", "Vince", "Wes", "Yusuf", "Zane",
    "Abe", "Andy", "Arthur", "Axel", "Benny", "Brian", "Carl", "Cody", "Colin", "Dave", "Dean",
    "Derek", "Dev", "Eric", "Ezra", "Fred", "Gus", "Hank", "Harvey", "Ivan", "Jay", "Jonas", "Jude",
    "Karl", "Kofi", "Lars", "Leon", "Lionel", "Malik", "Marty", "Miles", "Ned", "Neil", "Nils",
    "Ollie", "Oren", "Pete", "Phil", "Raj", "Rafael", "Reid", "Rob", "Roman", "Rufus", "Ruben", "Sami",
    "Scott", "Sid", "Sven", "Tobias", "Tomas", "Umar", "Vik", "Walter", "Wyatt", "Xavier", "Yann",
    "Yosef", "Zeke", "Alfie", "Bruno", "Cyrus", "Dario", "Emil", "Enzo", "Gideon", "Hector", "Idris",
    "Joel", "Kenji", "Luca", "Marcus", "Mateo", "Nathan", "Omari", "Pedro", "Quentin", "Rami",
    "Samuel", "Tariq", "Vito", "Warren", "Yuri", "Ziggy", "Aiden", "Bilal", "Chen", "Diego", "Elias",
    "Hamid", "Jonny", "Kian", "Mason", "Rohan",
)
# Pets get their own names so a pet is never mistaken for a child.
PET_NAMES = (
    "Spot", "Buddy", "Mochi", "Coco", "Biscuit", "Pepper", "Whiskers", "Patch", "Poppy", "Fudge",
    "Ginger", "Dash", "Frosty", "Pickles", "Peanut", "Rusty", "Bingo", "Button", "Zippy", "Paws",
    "Noodle", "Pumpkin", "Waffles", "Pip", "Tiger", "Fuzzy", "Honey", "Sparky", "Oreo", "Pixie",
    "Bean", "Toffee", "Scout", "Dotty", "Smudge", "Nibbles", "Pudding", "Lucky", "Jelly", "Rocky",
)
PET_KINDS = (  # (kind, sound, sound verb)
    ("dog", "Woof! Woof!", "barked"), ("puppy", "Woof!", "barked"),
    ("cat", "Meow!", "meowed"), ("kitten", "Meow!", "meowed"),
)
FAMILY = (  # (what the child calls them, is female) - the grown-up who goes along
    ("mom", True), ("dad", False), ("grandma", True), ("grandpa", False),
)
TRAITS = (  # "a {trait} little girl" - all start with a consonant sound
    "kind", "curious", "cheerful", "friendly", "playful", "happy", "gentle", "clever", "sweet",
    "smart", "funny", "helpful", "busy", "lively", "thoughtful", "bright", "good",
)
SURNAMES = ("Baker", "Miller", "Carter", "Potter", "Parker", "Hughes", "Shaw", "Ward", "Moore", "Bennett",
            "Ellis", "Fisher", "Cole", "Price", "Turner", "Foster", "Hayes", "Lopez", "Singh", "Kim")
AGES = ("three", "four", "five", "six")
LOOKS = ("curly brown hair", "red hair", "short black hair", "yellow hair and blue eyes", "big green eyes",
         "freckles on {h.his} nose", "big brown eyes", "a gap in {h.his} front teeth", "rosy cheeks",
         "a happy laugh", "glasses with round frames", "dark curly hair")
COLORS = ("red", "blue", "green", "yellow", "pink", "purple", "orange")
TOWNS = ("small", "quiet", "little", "sleepy", "sunny", "pretty", "busy", "friendly")

# --- feelings -----------------------------------------------------------------------------------
# Each tuple holds words that read well after both "felt" and "was".
HAPPY = ("happy", "very happy", "so happy", "glad", "full of joy")
SAD = ("sad", "very sad", "upset", "so sad", "unhappy")
SCARED = ("scared", "afraid", "a little scared", "nervous", "very scared")
PROUD = ("proud", "very proud", "so proud")
EXCITED = ("excited", "so excited", "very excited")
LONELY = ("lonely", "sad", "a little lonely", "all alone", "a little sad")
WORRIED = ("worried", "a little worried", "very worried")
SORRY = ("sorry", "bad", "very sorry")
SOFTLY = ("softly", "quietly", "in a small voice", "shyly")

# --- things -------------------------------------------------------------------------------------


class Toy(NamedTuple):
    noun: str
    colors: tuple[str, ...]


_BRIGHT = ("red", "blue", "green", "yellow", "pink", "purple", "orange", "shiny red", "bright blue")
TOYS = (
    Toy("ball", _BRIGHT + ("striped", "bouncy")), Toy("teddy bear", ("brown", "white", "fluffy", "soft brown")),
    Toy("toy car", _BRIGHT), Toy("doll", ("little", "pretty", "rag", "small")), Toy("toy boat", _BRIGHT),
    Toy("hat", _BRIGHT + ("straw",)), Toy("toy train", _BRIGHT), Toy("toy truck", _BRIGHT + ("big",)),
    Toy("toy robot", ("silver", "shiny", "little", "blue")), Toy("toy dinosaur", ("green", "purple", "orange")),
    Toy("toy bunny", ("soft", "white", "pink", "gray")), Toy("yo-yo", _BRIGHT), Toy("spinning top", _BRIGHT),
    Toy("whistle", ("silver", "shiny", "little", "red")), Toy("toy plane", _BRIGHT + ("silver",)),
    Toy("bucket", _BRIGHT), Toy("picture book", ("little", "favorite", "old")), Toy("jump rope", _BRIGHT),
    Toy("bracelet", ("pink", "shiny", "beaded", "gold")), Toy("hair clip", ("pink", "sparkly", "yellow")),
    Toy("toy crown", ("gold", "shiny", "sparkly")), Toy("cape", ("red", "blue", "purple")),
    Toy("toy horse", ("brown", "white", "wooden")), Toy("rubber duck", ("yellow", "little")),
    Toy("toy tractor", ("green", "red", "yellow")), Toy("toy drum", ("red", "little", "blue")),
    Toy("toy rocket", ("silver", "red", "shiny")), Toy("stuffed puppy", ("brown", "soft", "spotted")),
    Toy("stuffed cat", ("gray", "orange", "soft")), Toy("toy fire truck", ("red", "shiny red", "big red")),
    Toy("magnifying glass", ("little", "shiny", "big")), Toy("scarf", ("red", "striped", "warm", "blue")),
)


class ShareItem(NamedTuple):
    noun: str  # always plural, so the story says "them"
    amount: str  # "a plate of"
    use: str  # "eat" -> "Can I eat some of your cookies?"
    together: str  # what the two children do once they share


SHARE_ITEMS = (
    ShareItem("cookies", "a plate of", "eat", "They ate the cookies together, and they were yummy."),
    ShareItem("grapes", "a bowl of", "eat", "They ate the sweet grapes together, one by one."),
    ShareItem("strawberries", "a bowl of", "eat", "They ate the red strawberries together. Yum!"),
    ShareItem("crackers", "a box of", "eat", "They sat side by side and ate the crackers together."),
    ShareItem("cupcakes", "a box of", "eat", "They ate the cupcakes together and got frosting on their noses."),
    ShareItem("cherries", "a bowl of", "eat", "They ate the cherries together and laughed at their red lips."),
    ShareItem("muffins", "a basket of", "eat", "They ate the warm muffins together."),
    ShareItem("crayons", "a new box of", "draw with", "They drew a big picture of a house and a sun together."),
    ShareItem("markers", "a box of", "draw with", "They drew a rainbow with every color together."),
    ShareItem("blocks", "a big box of", "build with", "They built a tall tower together, higher than ever."),
    ShareItem("stickers", "a sheet of", "play with", "They put stars and hearts on their books together."),
    ShareItem("toy cars", "a box of", "play with", "They raced the toy cars across the floor together."),
    ShareItem("marbles", "a bag of", "play with", "They rolled the marbles across the floor together."),
    ShareItem("paints", "a set of", "paint with", "They painted a big, bright picture together."),
    ShareItem("balloons", "a bunch of", "play with", "They tossed the balloons in the air together."),
    ShareItem("sea shells", "a bucket of", "play with", "They lined the shells up in a long row together."),
)
SNACKS = ("apples", "sandwiches", "crackers", "cheese", "carrots", "grapes", "cookies", "bananas")

# --- places -------------------------------------------------------------------------------------

DAYS = ("sunny morning", "bright afternoon", "warm day", "sunny day", "nice spring day",
        "Saturday morning", "lovely summer day", "beautiful morning", "sunny afternoon", "clear day")
WEATHER = ("The sun was shining, and the sky was blue.", "A soft wind was blowing.",
           "White clouds floated across the blue sky.", "The air was warm, and the sun felt nice.")
HOME_DAYS = ("day", "afternoon", "morning", "Saturday", "Sunday afternoon", "quiet afternoon")


class Place(NamedTuple):
    key: str
    name: str  # "the park"
    prep: str  # "at" -> "at the park"
    seat: str  # where a child might sit alone: "on a bench"
    spots: tuple[str, ...]  # where a thing can hide: "under the bench"
    acts: tuple[str, ...]  # verb phrases, base form: "fly a kite"
    finds: tuple[str, ...] = ()  # small treasures for an adventure
    sight: str = ""  # one sentence describing it, for an adventure
    days: tuple[str, ...] = DAYS
    weather: tuple[str, ...] = WEATHER

    @property
    def at(self) -> str:
        return f"{self.prep} {self.name}"

    @property
    def to(self) -> str:
        return f"to {self.name}"


PLACES = (
    Place("park", "the park", "at", "on a bench",
          ("under the bench", "behind the big oak tree", "in the tall grass",
           "near the flower bed", "by the water fountain"),
          ("play tag", "fly a kite", "kick a ball", "have a picnic", "play hide and seek", "blow bubbles")),
    Place("playground", "the playground", "at", "on the edge of the sandbox",
          ("under the slide", "behind the swings", "in the sandbox",
           "next to the seesaw", "under the climbing frame"),
          ("go down the slide", "play on the swings", "ride the seesaw", "dig in the sandbox",
           "play hide and seek", "climb the climbing frame")),
    Place("garden", "the garden", "in", "on the garden steps",
          ("under a bush", "behind the flower pots", "next to the carrots",
           "by the little gate", "under the big sunflowers"),
          ("water the flowers", "pick strawberries", "dig in the dirt", "look for bugs", "plant seeds"),
          ("a tiny snail shell", "a shiny blue marble", "a smooth white stone", "a yellow feather", "an old brass key"),
          "Flowers of every color grew all around, and bees buzzed from one to the next."),
    Place("backyard", "the backyard", "in", "on the back steps",
          ("under the picnic table", "behind the shed", "by the fence",
           "under the big tree", "next to the swing set"),
          ("play catch", "blow bubbles", "run through the sprinkler", "draw with chalk", "jump rope")),
    Place("beach", "the beach", "at", "on a big striped towel",
          ("behind a big rock", "under a pile of sand", "next to the beach towels",
           "near the water", "by the lifeguard chair"),
          ("build a sand castle", "look for shells", "splash in the waves", "dig a big hole", "fly a kite"),
          ("a pretty pink shell", "a smooth round stone", "a piece of green sea glass", "a tiny crab shell",
           "a long white feather"),
          "The waves went swish, swish on the sand, and the sun was warm.",
          ("hot summer day", "sunny summer morning", "warm day", "bright summer afternoon"),
          ("The sun was hot, and the sea sparkled.", "Seagulls flew high over the water.",
           "A cool wind blew in from the sea.")),
    Place("forest", "the forest", "in", "on an old log",
          ("under a pile of leaves", "behind a big log", "next to a mossy rock",
           "under a pine tree", "by the little stream"),
          ("look for pinecones", "walk on the path", "jump over logs", "listen to the birds"),
          ("a big pinecone", "a shiny acorn", "a long blue feather", "a stick shaped like a wand",
           "a red leaf as big as a hand"),
          "Tall trees were all around them, and birds sang up high in the branches."),
    Place("farm", "the farm", "on", "on a bale of hay",
          ("in the hay", "behind the barn", "near the chicken coop", "by the fence",
           "next to the tractor"),
          ("feed the chickens", "jump in the hay", "pick apples", "look for eggs"),
          ("a little bell", "an old horseshoe", "a soft white feather", "a shiny red apple"),
          "There was a big red barn, and the air smelled of hay."),
    Place("meadow", "the meadow", "in", "under a lonely tree",
          ("in the tall grass", "behind a hay bale", "near the old fence",
           "under a lonely tree", "among the flowers"),
          ("pick flowers", "chase butterflies", "roll down the hill", "fly a kite"),
          ("a four-leaf clover", "a yellow flower", "a smooth gray stone", "a bird feather"),
          "The grass was soft and green, and little flowers nodded in the wind."),
    Place("pond", "the pond", "at", "on the little dock",
          ("by the reeds", "under a big rock", "on the little dock", "behind a bush",
           "near the water"),
          ("feed the ducks", "skip stones", "look for frogs", "watch the fish"),
          ("a flat skipping stone", "a white duck feather", "a smooth green pebble", "a tiny snail shell"),
          "The water was still and green, and dragonflies zoomed over it."),
    Place("school", "the school yard", "in", "on the steps by the door",
          ("under the bench", "by the gate", "behind the big tree",
           "near the hopscotch squares", "next to the bike rack"),
          ("play hopscotch", "jump rope", "play tag", "play ball")),
    Place("hill", "the snowy hill", "on", "on a little red sled",
          ("in a pile of snow", "behind the snowman", "under a pine tree",
           "next to the sled", "near the fence"),
          ("build a snowman", "go sledding", "make snow angels", "throw snowballs"),
          ("a smooth black stone", "a pinecone with snow on it", "a red berry branch", "a pretty round stone"),
          "Everything was white and sparkly, and the snow went crunch under their feet.",
          ("snowy morning", "cold winter day", "white winter morning", "snowy afternoon"),
          ("Soft white snow covered everything.", "The air was cold, and their breath made little clouds.",
           "Snowflakes were falling, slow and soft.")),
)
PLACE = {p.key: p for p in PLACES}
ADVENTURE_PLACES = tuple(p for p in PLACES if p.finds)
INDOOR_ACTS = ("draw pictures", "read books", "play with blocks", "do a puzzle", "sing songs",
               "play dress up", "color in a coloring book", "play with dolls", "make a paper crown")

# --- animals ------------------------------------------------------------------------------------


class Animal(NamedTuple):
    noun: str
    looks: tuple[str, ...]  # adjectives: "little brown"
    sound: str  # words in quotes; "" for quiet animals
    sound_verb: str  # "chirped"
    move: str  # past tense: "hopped"
    food: str  # what a child may feed it; "" if none
    homes: tuple[str, ...]  # Place keys


ANIMALS = (
    Animal("bird", ("little brown", "small blue", "tiny yellow", "little red"), "Tweet, tweet!", "chirped",
           "hopped", "some seeds", ("park", "garden", "backyard", "forest", "meadow", "school", "hill", "playground")),
    Animal("robin", ("little", "small", "plump"), "Tweet!", "chirped", "hopped", "some seeds",
           ("park", "garden", "backyard", "meadow")),
    Animal("duck", ("white", "little brown", "fluffy"), "Quack, quack!", "quacked", "waddled", "some peas",
           ("pond", "park", "farm")),
    Animal("squirrel", ("little gray", "small red", "busy little"), "Chit, chit!", "chattered", "scampered",
           "a nut", ("park", "garden", "backyard", "forest", "school")),
    Animal("rabbit", ("little white", "small brown", "fluffy"), "", "", "hopped", "a carrot",
           ("garden", "meadow", "backyard", "farm", "forest", "hill")),
    Animal("frog", ("little green", "small", "spotted"), "Ribbit!", "croaked", "hopped", "", ("pond", "garden")),
    Animal("turtle", ("little", "small green", "old"), "", "", "crawled", "a piece of lettuce", ("pond",)),
    Animal("butterfly", ("orange", "pretty blue", "yellow"), "", "", "fluttered", "", ("garden", "meadow", "park")),
    Animal("ladybug", ("tiny red", "little"), "", "", "crawled", "", ("garden", "meadow")),
    Animal("owl", ("big brown", "little gray", "sleepy"), "Hoo, hoo!", "hooted", "flew", "", ("forest",)),
    Animal("hedgehog", ("little", "round", "prickly"), "", "", "shuffled", "", ("forest", "garden")),
    Animal("mouse", ("little gray", "tiny brown"), "Squeak!", "squeaked", "scurried", "a bit of cheese",
           ("farm", "meadow", "garden")),
    Animal("cow", ("big brown", "spotted", "black and white"), "Moo!", "mooed", "walked", "some grass",
           ("farm", "meadow")),
    Animal("pony", ("little brown", "white", "small gray"), "Neigh!", "neighed", "trotted", "an apple",
           ("farm", "meadow")),
    Animal("pig", ("pink", "little pink", "muddy"), "Oink, oink!", "oinked", "trotted", "an apple", ("farm",)),
    Animal("sheep", ("woolly", "fluffy white"), "Baa!", "baaed", "walked", "some grass", ("farm", "meadow")),
    Animal("goat", ("little white", "brown", "funny"), "Maa!", "bleated", "trotted", "a carrot", ("farm",)),
    Animal("hen", ("brown", "red", "fat little"), "Cluck, cluck!", "clucked", "strutted", "some corn",
           ("farm", "backyard")),
    Animal("crab", ("little red", "small"), "", "", "scuttled", "", ("beach",)),
    Animal("seagull", ("white", "big gray"), "Squawk!", "squawked", "flew", "a bit of bread", ("beach", "pond")),
    Animal("snail", ("little", "slow"), "", "", "crawled slowly", "", ("garden", "forest")),
    Animal("deer", ("young", "gentle brown"), "", "", "walked", "an apple", ("forest", "meadow", "hill")),
    Animal("fox", ("red", "little red"), "", "", "trotted", "", ("forest", "meadow", "hill")),
    Animal("goose", ("white", "big gray"), "Honk, honk!", "honked", "waddled", "some corn", ("pond", "farm")),
    Animal("swan", ("white", "graceful"), "", "", "swam", "", ("pond",)),
    Animal("puppy", ("little brown", "fluffy", "spotted"), "Woof!", "barked", "ran", "a dog treat",
           ("park", "backyard", "playground", "school", "beach")),
    Animal("kitten", ("little gray", "fluffy white", "orange", "tiny black"), "Meow!", "meowed", "tiptoed",
           "a little fish", ("backyard", "garden", "farm")),
)

# Baby animals that can get lost from their mothers: (baby, mother, baby sound, mother sound, places).
LOST_BABIES = (
    ("duckling", "mother duck", "Peep, peep!", "Quack, quack!", ("pond", "park")),
    ("chick", "mother hen", "Cheep, cheep!", "Cluck, cluck!", ("farm", "backyard")),
    ("lamb", "mother sheep", "Baa, baa!", "Baa!", ("farm", "meadow")),
    ("baby goat", "mother goat", "Meh, meh!", "Maa!", ("farm",)),
    ("gosling", "mother goose", "Peep!", "Honk, honk!", ("pond", "farm")),
    ("piglet", "mother pig", "Squeal!", "Oink, oink!", ("farm",)),
    ("puppy", "mother dog", "Yip, yip!", "Woof!", ("park", "backyard", "farm")),
    ("kitten", "mother cat", "Mew, mew!", "Meow!", ("backyard", "garden", "farm")),
)

# --- story pieces -------------------------------------------------------------------------------
# Plot-specific beats, written as templates. `{h}` is the child, `{p}` the grown-up with them.


class Fear(NamedTuple):
    intro: str  # sets the scene
    want: str  # "{h.name} wanted to ___, but ..."
    why: str
    worry: str  # what the child says, without quotes
    attempt: str
    success: str
    after: str
    days: tuple[str, ...] = DAYS


FEARS = (
    Fear("One {day}, {h.name} went to the playground with {h.his} {p.kind}.", "go down the big slide",
         "The slide was very tall, and the top looked so far away.", "What if I fall?",
         "{h.He} climbed the ladder, one step at a time. At the top, {h.he} sat down and held on tight.",
         "Then {h.he} let go. Whoosh! {h.He} slid all the way down to the bottom.",
         "It was so much fun that {h.he} ran right back to the ladder to go again."),
    Fear("One {day}, {h.name} went to the pool with {h.his} {p.kind}.", "jump into the water",
         "The water looked deep and blue.", "What if I sink?",
         '{h.His} {p.kind} stood in the water and held out {p.his} arms. "I will catch you," {p.he} said.',
         '{h.name} counted, "One, two, three!" Splash! {h.He} jumped in, and {h.his} {p.kind} caught {h.him}.',
         "{h.He} kicked {h.his} legs and splashed and laughed.", ("hot summer day", "warm summer morning")),
    Fear("One night, {h.his} {p.kind} tucked {h.name} into bed and turned off the light.", "fall asleep",
         "The room was very dark, and there was a big shadow in the corner.", "What if there is a monster?",
         "{h.His} {p.kind} turned the light back on, and together they looked at the big shadow.",
         "It was only {h.his} coat hanging on a chair! Then {h.his} {p.kind} gave {h.him} a little night light "
         "shaped like a star.",
         "{h.name} hugged {h.his} pillow, closed {h.his} eyes, and soon fell fast asleep."),
    Fear("One {day}, {h.name} and {h.his} {p.kind} went next door to see the neighbor's new dog, {petname}.",
         "pet {petname}", "The dog was very big, and it had a very loud bark.", "What if the dog bites me?",
         "{h.He} held out {h.his} hand very slowly.",
         "{petname} sniffed it. Then the big dog licked {h.his} fingers and wagged its tail.",
         "{h.name} giggled and patted {petname} on the head. The big dog was very friendly after all."),
    Fear("One {day}, {h.his} {p.kind} took the little training wheels off {h.name}'s bike.", "ride {h.his} bike",
         "Without the little wheels, the bike wobbled from side to side.", "What if I fall?",
         "{h.His} {p.kind} held the back of the seat, and {h.name} pushed the pedals around and around.",
         "When {h.he} looked back, {h.his} {p.kind} was not holding on anymore. {h.He} was riding all by "
         "{h.himself}!", "{h.He} rode all the way to the end of the street and back."),
    Fear("It was {h.name}'s first day at a new school, and {h.his} {p.kind} walked {h.him} to the door.",
         "go into the classroom", "There were so many children {h.he} did not know.", "What if nobody likes me?",
         "{h.name} walked in and sat down at a table where two children were building a tower with blocks.",
         '"Do you want to help?" one of them asked. {h.name} nodded and put a red block on the top.',
         "By lunch time, {h.name} had two new friends."),
    Fear("One {day}, {h.name}'s class put on a show for all the moms and dads.", "sing {h.his} song on the stage",
         "So many people were watching, and {h.his} knees felt wobbly.", "What if I forget the words?",
         "{h.He} walked onto the stage and found {h.his} {p.kind} in the crowd. {h.His} {p.kind} smiled and waved.",
         "Then {h.name} began to sing. {h.His} voice was loud and clear, and {h.he} did not forget a single word.",
         "When the song was over, everyone clapped and cheered."),
    Fear("One {day}, {h.name} went to the beach with {h.his} {p.kind}.", "go into the waves",
         "The waves were big and noisy, and they crashed on the sand.", "What if a wave knocks me over?",
         "{h.His} {p.kind} held {h.his} hand, and they walked into the water together.",
         "A little wave came and tickled {h.his} toes. Then a bigger one splashed up to {h.his} knees, "
         "and {h.he} laughed.", 'Soon {h.he} was jumping over the waves and shouting, "Again! Again!"',
         ("hot summer day", "sunny summer morning")),
    Fear("One night, a big storm came. Boom! The thunder was so loud that it woke {h.name} up.",
         "go back to sleep", "Every time the thunder boomed, {h.he} jumped under the covers.",
         "Can the thunder hurt us?",
         '{h.His} {p.kind} sat on the bed and held {h.his} hand. "Thunder is just the sound the sky makes '
         'after the lightning," {p.he} said. "Let\'s count after each flash."',
         "They counted together after every flash. Each time, the boom came later and sounded softer.",
         "Soon the storm was far away, and {h.name} fell asleep, snug and warm."),
)


class Lesson(NamedTuple):  # each field is a tuple of alternative templates
    setup: tuple[str, ...]
    warn: tuple[str, ...]
    mistake: tuple[str, ...]
    oops: tuple[str, ...]
    feel: tuple[str, ...]
    talk: tuple[str, ...]
    fix: tuple[str, ...]
    moral: tuple[str, ...]
    needs_friend: bool = False


LESSONS = (
    Lesson(("One {day}, {h.name} went to the pool with {h.his} {p.kind}.",
            "One {day}, {h.his} {p.kind} took {h.name} to the swimming pool."),
           ('"Please walk, {h.name}," said {h.his} {p.kind}. "The floor is wet and slippery."',
            '"Remember, no running by the pool," said {h.his} {p.kind}. "The floor is slippery."'),
           ("But {h.name} was so excited that {h.he} ran anyway.", "But {h.name} wanted to be first, so {h.he} ran."),
           ("Suddenly, {h.his} feet slipped, and {h.he} fell down. Ouch! {h.He} scraped {h.his} knee.",
            "Splat! {h.His} feet slid on the wet floor, and {h.he} landed on {h.his} knee."),
           ("{h.name} began to cry.", "Tears rolled down {h.name}'s face.", "{h.His} knee stung, and {h.he} cried."),
           ('{h.His} {p.kind} put a bandage on {h.his} knee. "I asked you to walk because I want you to be safe," '
            '{p.he} said gently.',
            '{h.His} {p.kind} hugged {h.him} and put on a bandage. "Rules help keep us safe," {p.he} said.'),
           ('"I am sorry," said {h.name}. "I will listen next time." For the rest of the day, {h.he} walked slowly.',
            '"I should have listened," said {h.name}. After that, {h.he} walked carefully all the way around the '
            'pool.'),
           ("{h.name} learned that it is important to listen, because grown-ups want to keep us safe.",
            "{h.name} learned to listen, because listening keeps us safe.")),
    Lesson(("{h.name} played with {h.his} blocks and cars all afternoon, and soon toys were all over the floor.",
            "One {day}, {h.name} took out all of {h.his} toys. Soon there were blocks and cars everywhere."),
           ('"Please put your toys away before bed," said {h.his} {p.kind}.',
            '"It is time to tidy up," said {h.his} {p.kind}. "Please put your toys in the box."'),
           ('"I will do it later," said {h.name}, and {h.he} went to look at a book instead.',
            '"I am too tired," said {h.name}, and {h.he} left the toys where they were.'),
           ('That night, {h.he} got up to get a drink of water. In the dark, {h.he} stepped right on a block. '
            '"Ouch!" {h.he} cried.',
            'Later, {h.he} walked across the room without looking and stepped right on a hard block. "Ouch!" '
            '{h.he} cried.'),
           ("{h.His} foot hurt, and {h.he} felt {sorry}.", "{h.name} hopped around on one foot. {h.He} felt {sorry}."),
           ('{h.His} {p.kind} came and gave {h.him} a hug. "Toys on the floor can hurt our feet," {p.he} said.',
            '"That is why we put toys away," said {h.his} {p.kind} kindly. "A tidy room is a safe room."'),
           ("The next morning, {h.name} put every block and car back in the toy box. The floor was clean and tidy.",
            "So {h.name} picked up every block and every car and put them back in the box, one by one."),
           ("From then on, {h.name} always tidied up after playing.",
            "{h.name} learned that it is good to clean up after you play.")),
    Lesson(("One {day}, {h.his} {p.kind} baked a big tray of cookies. They smelled so good!",
            "One {day}, the kitchen smelled sweet, because {h.his} {p.kind} had baked cookies."),
           ('"You can have one cookie now," said {h.his} {p.kind}. "It will be time for dinner soon."',
            '"Just one cookie before dinner," said {h.his} {p.kind}.'),
           ("But when nobody was looking, {h.name} ate one cookie, then another, and then another.",
            "But the cookies were so yummy that {h.name} ate four of them when no one was looking."),
           ("At dinner, {h.his} tummy hurt. {h.He} could not eat a single bite of {h.his} soup.",
            "Soon {h.his} tummy began to hurt, and at dinner {h.he} could not eat anything at all."),
           ("{h.He} felt {sorry} and a little sick.", "{h.He} held {h.his} tummy and felt {sorry}."),
           ('"Too many sweets can give you a tummy ache," said {h.his} {p.kind} kindly. '
            '"A little treat is nice, but not too much."',
            '{h.His} {p.kind} sat with {h.him}. "Sweets are a treat," {p.he} said. "Too many make our tummies '
            'hurt."'),
           ('"I am sorry I ate so many cookies," said {h.name}. The next day, {h.he} had just one cookie after '
            'lunch, and it tasted just right.',
            '"Next time I will have just one," said {h.name}. And the next day, that is just what {h.he} did.'),
           ("{h.name} learned that a little treat is good, but too many is not.",)),
    Lesson(("One {day}, {h.his} {p.kind} gave {h.name} a little plant in a pot.",
            "One {day}, {h.name} got a little green plant of {h.his} very own."),
           ('"This plant needs water every day," said {h.his} {p.kind}. "Can you take care of it?"',
            '"Plants get thirsty," said {h.his} {p.kind}. "You must give it water every day."'),
           ('"Yes!" said {h.name}. But {h.he} was so busy playing that {h.he} forgot to water it.',
            '"I will," said {h.name}. But {h.he} played and played, and {h.he} forgot all about the plant.'),
           ("After a few days, the little plant was droopy. Its leaves were brown and dry.",
            "A few days later, the plant was bent over, and its leaves were dry."),
           ('"Oh no!" cried {h.name}. {h.He} felt {sorry}.', "{h.name} felt {sorry} when {h.he} saw it."),
           ('"It is not too late," said {h.his} {p.kind}. "Plants need care every day, just like we do."',
            '"Let\'s give it a drink," said {h.his} {p.kind}. "Maybe it will get better."'),
           ("{h.name} gave the plant a drink of water. Every morning after that, {h.he} watered it, and soon the "
            "plant stood up tall and green.",
            "{h.name} watered the plant that day and every day after. Soon it stood up straight, and a new leaf "
            "grew."),
           ("{h.name} learned that when you take care of something every day, it grows.",
            "{h.name} learned that taking care of something means doing it every day.")),
    Lesson(("One {day}, {h.name} went to play at {h.his} friend {f.name}'s house. {f.name} had {toy.a} that "
            "{f.he} loved.", "One {day}, {h.his} friend {f.name} came over to play. {f.name} brought {toy.a}."),
           ('"This is my special {toy.noun}," said {f.name}.', '"Look at my {toy.name}," said {f.name} proudly.'),
           ("When {f.name} put it down, {h.name} grabbed the {toy.name} without asking.",
            "{h.name} wanted it so much that {h.he} took the {toy.name} without asking."),
           ('"Hey! That is mine!" cried {f.name}, and {f.he} started to cry.',
            '"Give it back!" said {f.name}, and {f.his} eyes filled with tears.'),
           ("{h.name} looked at {f.name}'s sad face and felt {sorry}.",
            "{h.name} saw how sad {f.name} was, and {h.he} felt {sorry}."),
           ('{f.name}\'s {p.kind} came over. "When we want to play with something that is not ours, we ask first," '
            '{p.he} said.', '"How would you feel if someone took your toy?" asked {f.name}\'s {p.kind}.'),
           ('{h.name} gave the {toy.name} back. "I am sorry," {h.he} said. "May I please play with your '
            '{toy.noun}?" {f.name} wiped {f.his} eyes and smiled. "Yes, we can take turns."',
            '{h.name} gave the {toy.noun} back to {f.name}. "I am sorry. Can we take turns?" {h.he} asked. '
            '{f.name} nodded, and soon they were playing together.'),
           ("{h.name} learned to always ask first.", "{h.name} learned that asking first is the kind thing to do."),
           True),
    Lesson(("One {day}, {h.name} got a new bouncy ball.", "One {day}, {h.name} was playing with {h.his} ball."),
           ('"Please do not play ball in the house," said {h.his} {p.kind}.',
            '"Balls are for outside," said {h.his} {p.kind}.'),
           ("But when {h.his} {p.kind} went to the kitchen, {h.name} bounced the ball in the living room.",
            "But it was raining, so when no one was watching, {h.name} threw the ball in the living room."),
           ("Bounce, bounce, crash! The ball hit a blue vase, and it broke into pieces.",
            "Crash! The ball knocked a vase off the table, and it broke."),
           ("{h.name} felt {sorry}. {h.He} was scared, so {h.he} pushed the pieces under the couch.",
            "{h.name} felt {sorry}. {h.He} hid the pieces behind a chair."),
           ('{h.His} {p.kind} came in. "What was that noise?" {p.he} asked. {h.name} wanted to say "Nothing," '
            'but that would not be true.',
            '"Did something break?" asked {h.his} {p.kind}. {h.name} looked at the floor. {h.His} tummy felt '
            'funny.'),
           ('"I broke the vase," {h.he} said in a small voice. "I am sorry." {h.His} {p.kind} gave {h.him} a hug. '
            '"Thank you for telling me the truth," {p.he} said, and together they cleaned up the pieces.',
            '"It was me," said {h.name}. "I broke it, and I am sorry." {h.His} {p.kind} hugged {h.him}. "I am glad '
            'you told me the truth," {p.he} said.'),
           ("{h.name} learned that telling the truth is always the right thing to do.",
            "{h.name} learned that it is always best to tell the truth.")),
    Lesson(("One {day}, {h.name} wanted to build the tallest block tower in the world.",
            "One {day}, {h.name} got out {h.his} blocks to build a great big tower."),
           ('"Go slowly," said {h.his} {p.kind}. "Put each block on carefully."',
            '"Take your time," said {h.his} {p.kind}. "Tall towers need careful hands."'),
           ("But {h.name} was in a hurry. {h.He} stacked the blocks as fast as {h.he} could.",
            "But {h.name} wanted to finish fast, so {h.he} piled the blocks on quickly."),
           ("The tower wobbled and wobbled. Then, crash! All the blocks fell down.",
            "The tower leaned to one side. Crash! It fell all over the floor."),
           ("{h.name} stamped {h.his} foot. {h.He} felt {sad}.", "{h.name} felt {sad}. {h.He} wanted to give up."),
           ('"Let\'s try again together," said {h.his} {p.kind}. "Slow and steady."',
            '"Try again, but slowly this time," said {h.his} {p.kind}.'),
           ("This time, {h.name} put each block on very carefully. The tower grew taller and taller, until it "
            "was even taller than {h.him}!",
            "So {h.name} placed the blocks one at a time, very gently. The tower grew and grew, and it did not "
            "fall."),
           ("{h.name} learned that going slowly can be better than going fast.",
            "{h.name} learned that being patient helps us do big things.")),
    Lesson(("One cold winter morning, {h.name} wanted to go outside and play in the snow.",
            "One snowy morning, {h.name} could not wait to play outside."),
           ('"Put on your coat and mittens," said {h.his} {p.kind}.',
            '"It is very cold today. Wear your coat and hat," said {h.his} {p.kind}.'),
           ('"I don\'t need them," said {h.name}, and {h.he} ran outside in {h.his} sweater.',
            '"I will be fine," said {h.name}, and {h.he} ran out without {h.his} coat.'),
           ("Soon {h.his} fingers were red and cold, and {h.his} nose was cold too. Brr!",
            "Brr! The wind was icy, and soon {h.name} could not stop shaking."),
           ("{h.He} shivered and felt {sad}.", "{h.His} teeth went chatter, chatter, chatter."),
           ('{h.His} {p.kind} was waiting at the door with {h.his} coat. "Coats keep us warm," {p.he} said with '
            'a smile.', '{h.His} {p.kind} opened the door and held out {h.his} coat. "Ready now?" {p.he} asked.'),
           ("{h.name} put on {h.his} warm coat and mittens. Then {h.he} went back out and built a big snowman.",
            "{h.name} put on {h.his} coat, hat and mittens. Now {h.he} was warm, and {h.he} played in the snow "
            "all morning."),
           ("{h.name} learned that it is good to listen when someone is trying to help.",
            "{h.name} learned that grown-ups give advice because they care.")),
    Lesson(("One {day}, {h.name} and {h.his} friend {f.name} had a race in the park.",
            "One {day}, {h.name} went to the park with {h.his} friend {f.name}. They decided to have a race."),
           ('"Ready, set, go!" shouted {h.his} {p.kind}.', '"On your marks, get set, go!" called {h.his} {p.kind}.'),
           ("They ran as fast as they could, but {f.name} was faster and won the race.",
            "They ran and ran, but {f.name} got to the big tree first."),
           ('{h.name} got cross. "That is not fair!" {h.he} shouted, and {h.he} kicked the grass.',
            '"You cheated!" shouted {h.name}, even though {f.name} had not cheated at all.'),
           ("{f.name} stopped smiling and looked {sad}.", "{f.name}'s happy face turned {sad}."),
           ('{h.His} {p.kind} knelt down. "Games are for fun," {p.he} said. "It is okay to lose sometimes."',
            '"Winning is nice, but being a good friend is nicer," said {h.his} {p.kind}.'),
           ('{h.name} took a deep breath. "Good race, {f.name}," {h.he} said. "Can we race again?" They raced '
            'again and again, and they laughed so much that they forgot who won.',
            '{h.name} walked over to {f.name}. "I am sorry. You won fair and square," {h.he} said. Then they '
            'played tag until it was time to go home.'),
           ("{h.name} learned that playing together is more fun than winning.",
            "{h.name} learned to be a good sport, whether {h.he} won or lost."),
           True),
)


class RainyPlan(NamedTuple):
    do: str  # "Let's ___!"
    steps: tuple[str, ...]  # told in order
    end: str


RAINY_PLANS = (
    RainyPlan("build a blanket fort", ("They put a big blanket over two chairs and filled the fort with soft "
              "pillows.", "Inside, they read books with a flashlight."), "It was the coziest fort ever."),
    RainyPlan("bake cookies", ("They mixed flour, sugar and butter in a big bowl.",
              "{h.name} got to stir, and {h.he} even got to lick the spoon."),
              "Soon the whole house smelled sweet and warm."),
    RainyPlan("paint pictures", ("They put paper on the table and opened the paints.",
              "{h.name} painted a big yellow sun, because the sky outside was so gray."),
              "They hung the sunny picture on the fridge."),
    RainyPlan("have a tea party", ("{h.name} set out little cups and plates for {h.his} toys.",
              "They poured pretend tea and ate real crackers."), "Everyone at the party had a lovely time."),
    RainyPlan("put on a puppet show", ("They made puppets out of old socks, with buttons for eyes.",
              "{h.name} hid behind the couch and made the puppets talk and sing."),
              "{h.His} {p.kind} laughed and clapped at the end."),
    RainyPlan("have a dance party", ("They turned on happy music and danced around the living room.",
              "{h.name} spun and jumped until {h.he} was out of breath."), "They laughed and laughed."),
    RainyPlan("make paper boats", ("They folded paper into little boats.",
              "{h.name} drew a smiley face on each boat."), "They lined the boats up by the door, ready for later."),
    RainyPlan("do a big puzzle", ("They spread the puzzle pieces on the floor. It was a picture of a farm.",
              "{h.name} found the piece with the cow on it."), "When the last piece went in, they cheered."),
    RainyPlan("play hide and seek in the house", ("{h.name} hid behind the curtains, and {h.his} {p.kind} "
              "looked everywhere.", "Then {h.name} counted to ten while {h.his} {p.kind} hid under a blanket."),
              "They played until they were both giggling."),
)


class Gift(NamedTuple):
    make: str  # "{h.name} decided to ___"
    steps: str
    problem: str
    fix: str
    use: str  # what the grown-up `{r}` does with it


GIFTS = (
    Gift("make a birthday card", "{h.He} folded a piece of paper and drew a big red heart on the front.",
         "Oh no! {h.He} knocked over {h.his} cup, and juice spilled all over the card.",
         "{h.name} did not give up. {h.He} got a new piece of paper and made the card again, even prettier "
         "than before.", "{h.His} {r.kind} put the card on the fridge for everyone to see."),
    Gift("pick some flowers", "{h.He} went into the garden and picked yellow, pink and purple flowers.",
         "But the wind blew, and some of the petals fell off.",
         "So {h.name} picked a few more and tied them all together with a pretty ribbon.",
         "{h.His} {r.kind} put the flowers in a vase on the kitchen table."),
    Gift("bake a cake", "{h.His} {p.kind} helped {h.him} mix the flour, eggs and sugar in a big bowl.",
         "When the cake came out of the oven, one side was flat and lumpy.",
         "{h.name} covered it with pink frosting and lots of sprinkles. Now it looked just right!",
         "{h.His} {r.kind} ate a big slice and said it was the best cake ever."),
    Gift("draw a picture of the whole family", "{h.He} drew {h.his} {r.kind}, {h.his} {p.kind} and {h.himself}, "
         "all holding hands under a big sun.", "Snap! {h.His} favorite crayon broke in two.",
         "{h.name} kept drawing with the two little pieces. Now {h.he} had two crayons instead of one!",
         "{h.His} {r.kind} hung the picture on the wall in the hall."),
    Gift("make a necklace", "{h.He} put colorful beads on a long string, one by one: red, blue, yellow, red, "
         "blue, yellow.", "Then the string slipped, and the beads rolled all over the floor!",
         "{h.name} picked up every bead and started again. This time {h.he} tied a big knot at the end.",
         "{h.His} {r.kind} wore the necklace all day long."),
    Gift("grow a flower in a pot", "{h.He} put soil in a little pot and planted a seed. Every day, {h.he} gave "
         "it some water.", "For a long time, nothing grew, and {h.name} began to worry.",
         "Then one morning, a tiny green sprout poked up, and soon a little red flower opened.",
         "{h.His} {r.kind} put the pot on the window sill, where the sun could shine on it."),
)


class Help(NamedTuple):
    """Someone needs a hand: `{n}` is a neighbor, `{f}` a friend, `{p}` the child's grown-up."""
    intro: str
    need: str
    offer: str
    steps: tuple[str, ...]
    hitch: str  # a small snag on the way, and how it is solved
    thanks: str


HELPS = (
    Help("One {day}, {h.name} was playing in front of {h.his} house.",
         "{n.name}, the old {n.kind} from next door, was carrying two heavy bags of groceries up the street.",
         '"Can I help you, {n.name}?" asked {h.name}.',
         ('"Oh, yes please," said {n.name}. {n.He} gave {h.name} the small bag.',),
         "Suddenly, the big bag tore, and red apples rolled all over the sidewalk! {h.name} ran after them and "
         "picked them up, one by one.",
         'At the door, {n.name} smiled. "Thank you, {h.name}. You are a very kind helper," {n.he} said, and {n.he} '
         "gave {h.name} a shiny red apple to take home."),
    Help("One {day}, {h.his} {p.kind}'s car was very dirty.", "It was covered in mud from top to bottom.",
         '"Can I help you wash it?" asked {h.name}.',
         ("{h.His} {p.kind} gave {h.him} a big yellow sponge and a bucket of soapy water.",
          "{h.name} scrubbed the doors and the wheels until they were shiny."),
         "Then {h.his} {p.kind} turned on the hose, and whoosh! The water sprayed {h.name} by mistake. {h.He} was "
         "wet from head to toe, and they both laughed.",
         '"Thank you for helping," said {h.his} {p.kind}. "The car looks like new!"'),
    Help("One windy fall day, the backyard was covered in red and yellow leaves.",
         "{h.His} {p.kind} had a lot of raking to do.", '"I can help!" said {h.name}.',
         ("{h.name} got a little rake and raked the leaves into a big pile.", "Scratch, scratch went the rake."),
         "Then a gust of wind blew the pile all over the yard again! So they raked the leaves up one more time, and "
         "when they were done, {h.name} jumped right into the pile. Crunch!",
         '"You are a great helper," said {h.his} {p.kind}, and {p.he} jumped into the leaves too.'),
    Help("One {day}, {h.name} was playing outside with {h.his} friend {f.name}.",
         "{f.name} was riding {f.his} bike when {f.he} fell off and hurt {f.his} knee.",
         '{h.name} ran over. "Are you okay?" {h.he} asked.',
         ("{f.name} was crying, so {h.name} held {f.his} hand.",
          "Then {h.name} ran to get {h.his} {p.kind}, who came with a bandage."),
         '"Does it still hurt?" asked {h.name}. "A little," said {f.name}. So {h.name} told {f.him} a funny joke '
         "about a cow, and {f.name} began to laugh.",
         '"Thank you for helping me," said {f.name}. "You are a good friend."'),
    Help("One {day}, there was a big basket of clean clothes on the bed.", "{h.His} {p.kind} looked very tired.",
         '"Can I help you fold the clothes?" asked {h.name}.',
         ("{h.name} folded the small towels into squares.",
          "Then {h.he} matched up all the socks, a blue one with a blue one and a red one with a red one."),
         "But one little sock had no partner! They looked and looked, and at last {h.name} found it hiding inside "
         "a sleeve.", '"Thank you," said {h.his} {p.kind}. "With your help, the job was quick and fun."'),
    Help("One {day}, {n.name} from next door knocked on the door.",
         '"I have to go away for two days," {n.he} said. "Could you feed my cat, {petname}, for me?"',
         '"Yes, I can do it!" said {h.name}.',
         ("Every morning and every evening, {h.name} and {h.his} {p.kind} went next door.",
          "{h.name} filled {petname}'s bowl with food and gave {petname} fresh water."),
         "On the second day, {petname} was hiding and would not come out. {h.name} sat down very quietly and "
         "called {petname}'s name, and soon the cat came and rubbed against {h.his} legs.",
         'When {n.name} came home, {n.he} gave {h.name} a big hug. "Thank you for taking such good care of '
         '{petname}," {n.he} said.'),
    Help("One {day}, {h.his} little {sib.kind}, {sib.name}, was trying to build a sand castle in the sandbox.",
         "But every time {sib.he} made a tower, it fell down, and {sib.he} started to cry.",
         '"Do you want some help?" asked {h.name}.',
         ('"Put a little water in the sand," said {h.name}. "Then it will stick together."',
          "They filled the bucket with wet sand and patted it down hard."),
         "The first tower cracked a little, but they fixed it with more wet sand. Then they made another tower, "
         "and another, until they had a whole castle.",
         '{sib.name} clapped {sib.his} hands. "Thank you, {h.name}! Our castle is the best!"'),
)
