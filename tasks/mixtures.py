"""SFT's training mixtures (scripts.sft): nanochat's online one, flaxchat's offline one, and your own conversations
mixed into either by weight.

    online    nanochat's chat_sft: SmolTalk, MMLU auxiliary_train, GSM8K train, SpellingBee and SimpleSpelling,
              plus flaxchat's identity conversations; val on SmolTalk, MMLU and GSM8K test
    offline   flaxchat's synthetic conversations (identity, arithmetic with calculator tool calls, story requests,
              multi-turn), SpellingBee and SimpleSpelling, MMLU dev/validation and ARC validation as multiple choice
    none      only --chats

Test splits are never trained on; they only serve as validation data. The flags that size every part are added
here (add_mixture_flags), next to the code that reads them.
"""

from __future__ import annotations

from flaxchat.common import agree_max, print0
from tasks.arc import ARC
from tasks.common import TaskMixture, hub_reachable
from tasks.customjson import CustomJSON, weighted
from tasks.gsm8k import GSM8K
from tasks.mmlu import MMLU
from tasks.smoltalk import SmolTalk
from tasks.spellingbee import SimpleSpelling, SpellingBee
from tasks.synthetic_chat import ArithmeticProblems, IdentityChat, MultiTurnChat, StoryRequests

# the offline parts whose data a machine may lack: at these defaults a missing part is left out with a note; a
# size asked for by name must find its data
OPTIONAL_PARTS = {"spelling_size": 1000, "mc_epochs": 1}
SIZES = (  # flags that count examples or epochs (0 = none of that part)
    "mmlu_epochs",
    "gsm8k_epochs",
    "mc_epochs",
    "identity_size",
    "arithmetic_size",
    "story_size",
    "multi_turn_size",
    "spelling_size",
)


def add_mixture_flags(p) -> None:
    """--mixture, --chats and the size of every part of the mixtures."""
    p.add_argument(
        "--mixture",
        type=str,
        default="auto",
        choices=["auto", "online", "offline", "none"],
        help="built-in training mixture (auto: online if the HF hub is reachable; none: only --chats)",
    )
    p.add_argument(
        "--chats",
        action="append",
        default=[],
        metavar="PATH[:WEIGHT]",
        help='your conversations: a JSONL file in the OpenAI chat format (one {"messages": [...]} per line; '
        "optional system, then user/assistant alternating) or a folder of them. WEIGHT: how many times "
        "it appears per epoch of the mixture (default 1; 0.5 = half of it, 3 = three times). Repeatable",
    )
    p.add_argument(
        "--chats-val-fraction", type=float, default=0.05, help="share of each --chats source held out for val"
    )
    p.add_argument("--mmlu-epochs", type=int, default=3, help="online: epochs of MMLU auxiliary_train")
    p.add_argument("--gsm8k-epochs", type=int, default=4, help="online: epochs of GSM8K train")
    p.add_argument(
        "--mc-epochs",
        type=int,
        default=OPTIONAL_PARTS["mc_epochs"],
        help="offline: epochs of MMLU dev+validation and ARC validation (0 = none)",
    )
    p.add_argument("--identity-size", type=int, default=1000, help="identity conversations (online and offline)")
    p.add_argument(
        "--arithmetic-size", type=int, default=4000, help="offline: arithmetic word problems with tool calls"
    )
    p.add_argument("--story-size", type=int, default=1000, help="offline: story requests")
    p.add_argument(
        "--multi-turn-size",
        type=int,
        default=1000,
        help="offline: conversations that need an earlier turn (a fact the user told, the previous answer)",
    )
    p.add_argument(
        "--spelling-size",
        type=int,
        default=OPTIONAL_PARTS["spelling_size"],
        help="offline: SpellingBee and SimpleSpelling examples each (0 = none)",
    )
    p.add_argument("--val-size", type=int, default=200, help="offline: val conversations per synthetic task")


def check_mixture_args(parser, args) -> None:
    """parser.error on a size below 0 or a bad --chats; turns every --chats spec into (path, weight)."""
    for name in SIZES:
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.val_size < 1:
        parser.error(f"--val-size must be positive, got {args.val_size}")
    if not 0 <= args.chats_val_fraction < 1:
        parser.error(f"--chats-val-fraction must be in [0, 1), got {args.chats_val_fraction}")
    if args.mixture == "none" and not args.chats:
        parser.error("--mixture none trains on --chats only: give at least one --chats file")
    args.chats = [parse_chats_spec(parser, spec) for spec in args.chats]


def parse_chats_spec(parser, spec: str) -> tuple[str, float]:
    """ "path" or "path:weight" -> (path, weight)."""
    path, sep, tail = spec.rpartition(":")
    try:
        if not sep:
            raise ValueError
        weight = float(tail)
    except ValueError:
        path, weight = spec, 1.0  # no weight (or a colon inside the path)
    if weight <= 0:
        parser.error(f"--chats {spec}: the weight must be positive")
    return path, weight


def online_mixture(args):
    train = TaskMixture(
        [
            SmolTalk(split="train", source="hub"),
            *[MMLU(subset="all", split="auxiliary_train", source="hub") for _ in range(args.mmlu_epochs)],
            *[GSM8K(subset="main", split="train", source="hub") for _ in range(args.gsm8k_epochs)],
            *[IdentityChat(args.identity_size, "train", args.seed) for _ in range(2) if args.identity_size],
            SimpleSpelling(size=200_000, split="train"),
            SpellingBee(size=80_000, split="train"),
        ]
    )
    val = TaskMixture(
        [  # test splits serve as validation only, never as training data
            SmolTalk(split="test", source="hub"),
            MMLU(subset="all", split="test", source="hub", stop=5200),
            GSM8K(subset="main", split="test", source="hub", stop=420),
        ]
    )
    return train, val


def offline_mixture(args):
    synthetic = [
        (IdentityChat, args.identity_size),
        (ArithmeticProblems, args.arithmetic_size),
        (StoryRequests, args.story_size),
        (MultiTurnChat, args.multi_turn_size),
    ]
    train = [task(size, "train", args.seed) for task, size in synthetic if size]
    val = [task(args.val_size, "val", args.seed) for task, _ in synthetic]

    def spelling():
        return (
            [SpellingBee(args.spelling_size, "train"), SimpleSpelling(args.spelling_size, "train")],
            [SpellingBee(args.val_size, "test")],
        )

    def multiple_choice():
        one_epoch = [
            MMLU("all", "dev", source="offline"),
            MMLU("all", "validation", source="offline"),
            ARC("ARC-Easy", "validation", source="offline"),
            ARC("ARC-Challenge", "validation", source="offline"),
        ]
        return one_epoch * args.mc_epochs, [MMLU("all", "test", source="offline", stop=args.val_size)]

    for flag, make in (("spelling_size", spelling), ("mc_epochs", multiple_choice)):
        if not getattr(args, flag):
            continue
        try:
            more_train, more_val = make()
        except FileNotFoundError as e:
            if getattr(args, flag) != OPTIONAL_PARTS[flag]:
                raise  # asked for by name: its data must be there
            print0(f"offline mixture: leaving out --{flag.replace('_', '-')} data, not on this machine: {e}")
            continue
        train += more_train
        val += more_val
    if not train:
        raise ValueError("the offline mixture is empty: every size flag is 0")
    return TaskMixture(train), TaskMixture(val)


def custom_tasks(args) -> list:
    """(train, val, weight) of every --chats source; reading validates every line (ChatFileError, a ValueError)."""
    return [
        (
            CustomJSON(path, "train", args.chats_val_fraction, args.seed),
            CustomJSON(path, "val", args.chats_val_fraction, args.seed),
            weight,
        )
        for path, weight in args.chats
    ]


def build_mixtures(args, custom=()):
    """(train, val, which) where which is "online", "offline" or "none"; custom: custom_tasks(args), mixed in."""
    which = args.mixture
    if which == "auto":  # every process must train on the same mixture: online only if every process reaches the hub
        (unreachable,) = agree_max(not hub_reachable())
        which = "offline" if unreachable else "online"
    train, val = [], []
    if which != "none":
        builtin_train, builtin_val = online_mixture(args) if which == "online" else offline_mixture(args)
        if not custom:
            return builtin_train, builtin_val, which
        train, val = builtin_train.tasks, builtin_val.tasks
    for task_train, task_val, weight in custom:
        train += weighted(task_train, weight)
        val += [task_val] if len(task_val) else []
    if not val:
        raise ValueError("no val conversations: --chats needs --chats-val-fraction > 0 and two or more conversations")
    return TaskMixture(train), TaskMixture(val), which
