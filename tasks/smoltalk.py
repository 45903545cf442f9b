"""SmolTalk: general multi-turn conversations (https://huggingface.co/datasets/HuggingFaceTB/smol-smoltalk).

    SmolTalk(split="train")   # ~460K conversations
    SmolTalk(split="test")    # ~24K

Hub only: no package registry ships it. Offline, SFT uses the project's synthetic conversations instead.
"""

from __future__ import annotations

from tasks.common import Task, load_rows


def check_messages(messages: list[dict]) -> None:
    """An optional system message, then user/assistant turns alternating, starting with the user; text only."""
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if len(turns) < 2:
        raise ValueError(f"a SmolTalk conversation needs at least a user and an assistant turn, got {len(turns)}")
    for i, message in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if message["role"] != expected:
            raise ValueError(f"SmolTalk message {i} has role {message['role']!r}, expected {expected!r}")
        if not isinstance(message["content"], str):
            raise ValueError(f"SmolTalk message {i} content must be a string")


class SmolTalk(Task):
    def __init__(self, split: str = "train", source: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if split not in ("train", "test"):
            raise ValueError(f"SmolTalk split must be train or test, got {split!r}")
        self.split = split
        self.ds = load_rows(
            f"SmolTalk {split}",
            ("HuggingFaceTB/smol-smoltalk", None, split),
            None,
            source,
            no_pack_reason="offline SFT uses the project's synthetic conversations instead",
        ).shuffle(seed=42)

    def num_examples(self) -> int:
        return len(self.ds)

    def get_example(self, index: int) -> dict:
        messages = self.ds[index]["messages"]
        check_messages(messages)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages]}
