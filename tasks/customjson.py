"""Your own conversations: JSONL files in the OpenAI chat format, one conversation per line.

    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}

    CustomJSON("my_chats.jsonl", split="train")   # a file, or a folder: every *.jsonl under it, sorted by path
    CustomJSON("my_chats/", split="val")          # the held-out share (val_fraction, default 5%)
    weighted(CustomJSON(...), 2.5)                # tasks that show it 2.5x per epoch of a TaskMixture

Roles: an optional system message first (tokenizer.render_conversation folds it into the first user message),
then user and assistant alternating, ending with the assistant. Content is a string, or a list of
{"type": "text", "text": ...} parts (joined). Every line is checked when the task is built, so a bad file
stops a run before it trains, with one sentence naming the file and the line (ChatFileError). Blank lines are
skipped; other keys (on the line or on a message) are ignored.

Train and val are a fixed shuffle of the conversations (seeded), the first round(val_fraction * n) of it val
(at least one when there are two or more conversations), so the split is the same on every run.
"""

from __future__ import annotations

import functools
import glob
import json
import os

import numpy as np

from tasks.common import Task, TaskSequence

ROLES = ("system", "user", "assistant")


class ChatFileError(ValueError):
    """A chat file that cannot be trained on; the message names the file and the line."""


def _content(value, where: str, i: int) -> str:
    if isinstance(value, str):
        return value
    is_text = lambda p: isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    if isinstance(value, list) and all(map(is_text, value)):
        return "".join(p["text"] for p in value)
    raise ChatFileError(
        f'{where}: message {i} content must be a string or a list of {{"type": "text", "text": ...}} parts'
    )


def parse_conversation(line: str, where: str) -> dict:
    """One JSONL line -> {"messages": [{"role", "content"}, ...]}, or ChatFileError saying what is wrong at `where`."""
    try:
        row = json.loads(line.strip())
    except json.JSONDecodeError as e:
        raise ChatFileError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ChatFileError(f'{where}: expected an object with a non-empty "messages" list')
    out = []
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ChatFileError(f'{where}: message {i} needs a "role" and a "content"')
        if m["role"] not in ROLES:
            raise ChatFileError(f"{where}: message {i} has role {m['role']!r}; only {', '.join(ROLES)} are supported")
        out.append({"role": m["role"], "content": _content(m["content"], where, i)})
    turns = out[1:] if out[0]["role"] == "system" else out
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            n = i + 1 + (len(out) - len(turns))
            raise ChatFileError(
                f"{where}: message {n} is from {m['role']!r} but should be from {expected!r} "
                "(an optional system message, then user and assistant alternating)"
            )
    if len(turns) < 2 or turns[-1]["role"] != "assistant":
        raise ChatFileError(f"{where}: a conversation must have a user turn and end with an assistant reply")
    return {"messages": out}


def chat_files(path: str) -> list[str]:
    """The JSONL files at `path`: the file itself, or every *.jsonl under a folder (sorted)."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "**", "*.jsonl"), recursive=True))
        if not files:
            raise ChatFileError(f"{path}: the folder holds no .jsonl files")
        return files
    if not os.path.isfile(path):
        raise ChatFileError(f"{path}: no such file or folder")
    return [path]


@functools.lru_cache(maxsize=16)
def _read(path: str, stamp: tuple) -> tuple[dict, ...]:
    del stamp  # part of the cache key only: an edited file is read again
    conversations = []
    for file in chat_files(path):
        with open(file, encoding="utf-8") as f:
            n = 0
            try:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        conversations.append(parse_conversation(line, f"{file} line {n}"))
            except UnicodeDecodeError:
                raise ChatFileError(f"{file} line {n + 1}: not UTF-8 text") from None
    if not conversations:
        raise ChatFileError(f"{path}: no conversations (an empty file)")
    return tuple(conversations)


def read_chats(path: str) -> tuple[dict, ...]:
    """Every conversation at `path`, validated (read once per process while the files stay unchanged)."""
    files = chat_files(path)
    return _read(os.path.abspath(path), tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) for f in files))


class CustomJSON(Task):
    """Conversations from a JSONL file or a folder of them; split "train", "val" or "all"."""

    def __init__(self, path: str, split: str = "train", val_fraction: float = 0.05, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        if split not in ("train", "val", "all"):
            raise ValueError(f"CustomJSON split must be train, val or all, got {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"the val fraction must be in [0, 1), got {val_fraction}")
        self.path, self.split = path, split
        self.rows = read_chats(path)
        n = len(self.rows)
        order = np.random.default_rng(seed).permutation(n)
        n_val = min(n - 1, max(1, round(val_fraction * n))) if val_fraction > 0 and n > 1 else 0
        self.indices = {"val": order[:n_val], "train": order[n_val:], "all": np.arange(n)}[split]

    def num_examples(self) -> int:
        return len(self.indices)

    def get_example(self, index: int) -> dict:
        return self.rows[int(self.indices[index])]


def weighted(task: Task, weight: float) -> list[Task]:
    """Tasks that put `task` weight times into a TaskMixture: int(weight) copies plus the first fraction of it."""
    if weight <= 0:
        raise ValueError(f"a data weight must be positive, got {weight}")
    whole, part = int(weight), weight - int(weight)
    tasks = [task] * whole
    if round(part * len(task)):
        tasks.append(TaskSequence([task], stop=round(part * len(task))))
    return tasks
