"""Tasks: datasets of conversations, with how to score a model's answer.

A conversation is a dict with "messages" (a list of {"role": "system"|"user"|"assistant", "content": ...})
and whatever a task needs to score it (e.g. "letters" for multiple choice). Assistant content is a string
or a list of parts {"type": "text" | "python" | "python_output", "text": ...}, the parts being the
assistant's tool calls and the tool's replies.

A Task is a lazy view: index it (`task[i]`, `task[a:b]`), slice it at construction (start/stop/step),
mix tasks (TaskMixture: a fixed shuffle across tasks) or chain them (TaskSequence: a curriculum).
`eval_type` says how the eval script scores it: "categorical" (compare the logits of the answer
letters) or "generative" (sample a completion and call `evaluate(conversation, completion)`).

Rows come from the Hugging Face hub when it is reachable (datasets.load_dataset with nanochat's dataset
names) and from the offline packs otherwise (tasks/offline.py); both give rows with the same fields.
"""

from __future__ import annotations

import functools
import operator
import os
import random
import socket
import urllib.parse
from collections.abc import Callable, Sequence

import numpy as np

from flaxchat.common import print0
from tasks import offline

SOURCES = ("auto", "hub", "offline")


class DataUnavailableError(FileNotFoundError):
    """A task's data is neither on a reachable hub nor in an offline pack; the message says how to get it."""


# -----------------------------------------------------------------------------
# Where rows come from


@functools.lru_cache(maxsize=None)
def hub_reachable() -> bool:
    """Can we open a connection to the Hugging Face hub? Checked once per process, in at most 3 s.

    Without this, `datasets.load_dataset` retries for ~25 s before failing when offline.
    HF_HUB_OFFLINE=1 (the hub's own switch) means no.
    """
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=3):
            return True
    except OSError:
        return False


def load_hub_dataset(repo_id: str, config: str | None, split: str):
    """One split of a hub dataset, via `datasets` (downloaded once, then read from its cache)."""
    from datasets import load_dataset  # imported lazily: it is slow to import and offline runs never need it

    return load_dataset(repo_id, config, split=split)


class Rows:
    """Random access to dataset rows (a list of dicts or a datasets.Dataset) through an optional permutation."""

    def __init__(self, data: Sequence, permutation: np.ndarray | None = None):
        self.data = data
        self.permutation = permutation

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> dict:
        physical = index if self.permutation is None else int(self.permutation[index])
        return self.data[physical]

    def shuffle(self, seed: int) -> "Rows":
        # numpy's default_rng(seed).permutation is what datasets.Dataset.shuffle(seed=seed) uses, so rows come
        # out in the same order as nanochat's (hub path and offline pack alike, when the packs keep hub order)
        return Rows(self.data, np.random.default_rng(seed).permutation(len(self.data)))


def load_rows(
    name: str,
    hub: tuple[str, str | None, str],
    pack: tuple[str, ...] | None,
    source: str = "auto",
    no_pack_reason: str | None = None,
    row_filter: Callable[[dict], bool] | None = None,
) -> Rows:
    """Rows of one task split: from the hub (repo_id, config, split) if reachable, else the offline pack.

    source: "auto" (hub first, pack as fallback), "hub" or "offline". pack: parts of offline.pack_path, or
    None when no registry ships this split (no_pack_reason then says why, for the error message).
    row_filter applies to pack rows only (e.g. one MMLU subject out of the "all" pack).
    """
    if source not in SOURCES:
        raise ValueError(f"unknown data source {source!r}; choose one of {', '.join(SOURCES)}")
    repo_id, config, split = hub
    hub_failure = None
    if source == "hub" or (source == "auto" and hub_reachable()):
        try:
            return Rows(load_hub_dataset(repo_id, config, split))
        except Exception as e:  # any hub failure (network, auth, missing split) means: try the offline pack
            if source == "hub":
                raise DataUnavailableError(
                    f"{name}: could not load {repo_id} ({split}) from the Hugging Face hub: {e}"
                ) from e
            hub_failure = f"loading {repo_id} from the hub failed ({type(e).__name__}: {e})"
            print0(f"{name}: {hub_failure}; trying the offline pack")
    hub_note = hub_failure or f"the Hugging Face hub ({repo_id}) is not reachable"
    if pack is None:
        raise DataUnavailableError(
            f"{name} is only on the Hugging Face hub ({repo_id}), and {hub_note}; "
            f"{no_pack_reason or 'no package registry ships it'}."
        )
    path = offline.pack_path(*pack)
    if not os.path.exists(path):
        raise DataUnavailableError(
            f"{name} is not available: {hub_note} and the offline pack {path} is missing; {offline.FETCH_HINT}."
        )
    rows = offline.read_jsonl(path)
    return Rows([row for row in rows if row_filter(row)] if row_filter else rows)


# -----------------------------------------------------------------------------
# Tasks


class Task:
    """A dataset of conversations viewed through start/stop/step (all examples by default)."""

    def __init__(self, start: int = 0, stop: int | None = None, step: int = 1):
        if start < 0 or step < 1 or (stop is not None and stop < start):
            raise ValueError(
                f"bad task slice start={start} stop={stop} step={step}: need 0 <= start <= stop and step >= 1"
            )
        self.start, self.stop, self.step = start, stop, step

    @property
    def eval_type(self) -> str:
        """ "categorical" or "generative"."""
        raise NotImplementedError(f"{type(self).__name__} is not an evaluation task")

    def num_examples(self) -> int:
        raise NotImplementedError

    def get_example(self, index: int) -> dict:
        raise NotImplementedError

    def __len__(self) -> int:
        stop = self.num_examples() if self.stop is None else min(self.stop, self.num_examples())
        return max(0, -(-(stop - self.start) // self.step))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index, n = operator.index(index), len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {type(self).__name__} with {n} examples")
        return self.get_example(self.start + (index % n) * self.step)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def evaluate(self, conversation: dict, completion) -> bool | int:
        """Is `completion` (the model's answer to conversation's prompt) correct?"""
        raise NotImplementedError

    def reward(self, conversation: dict, completion) -> float:
        """RL reward: 1.0 for a correct completion, else 0.0."""
        return float(self.evaluate(conversation, completion))


class TaskMixture(Task):
    """Several tasks interleaved by one fixed shuffle; pass a task twice to see it twice as often."""

    def __init__(self, tasks: list[Task], **kwargs):
        super().__init__(**kwargs)
        self.tasks = tasks
        self.lengths = [len(task) for task in tasks]
        self.index_map = [(t, i) for t, n in enumerate(self.lengths) for i in range(n)]
        # the same seed and the same shuffle as nanochat, so a mixture has the same order there and here
        random.Random(42).shuffle(self.index_map)

    def num_examples(self) -> int:
        return len(self.index_map)

    def get_example(self, index: int) -> dict:
        task_idx, local_idx = self.index_map[index]
        return self.tasks[task_idx][local_idx]


class TaskSequence(Task):
    """Several tasks one after another (a curriculum)."""

    def __init__(self, tasks: list[Task], **kwargs):
        super().__init__(**kwargs)
        self.tasks = tasks
        self.lengths = [len(task) for task in tasks]
        self.offsets = np.cumsum([0] + self.lengths)

    def num_examples(self) -> int:
        return int(self.offsets[-1])

    def get_example(self, index: int) -> dict:
        task_idx = int(np.searchsorted(self.offsets, index, side="right")) - 1
        return self.tasks[task_idx][index - int(self.offsets[task_idx])]


def render_mc(question: str, letters: Sequence[str], choices: Sequence[str]) -> str:
    """The user message of a multiple-choice question.

    Each choice is followed by "=LETTER" with no space: the answer the assistant gives is the bare letter
    token ("A", not " A"), and small models bind choice and letter better when the prompt shows that very
    token right after the choice. The layout matches nanochat's, so prompts tokenize identically.
    """
    lines = [f"Multiple Choice question: {question}"]
    lines += [f"- {choice}={letter}" for letter, choice in zip(letters, choices)]
    return "\n".join(lines) + "\n\nRespond only with the letter of the correct answer."


def completion_text(completion) -> str:
    """A completion as plain text: a string as is, or the texts of a list of message parts joined."""
    if isinstance(completion, str):
        return completion
    return "".join(part["text"] for part in completion)
