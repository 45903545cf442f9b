"""Chat-task evaluation (nanochat's chat_eval): categorical tasks by logits, generative tasks by sampling.

    categorical (MMLU, ARC)   render the question for completion, read the logits at the answer position,
                              restrict them to the choice letters' tokens, take the argmax. Batched: prompts are
                              sorted by length and right-padded to length buckets (few jit shapes).
    generative (GSM8K, HumanEval, SpellingBee)
                              sample num_samples completions per problem with the Engine (which runs the
                              calculator tool); the problem passes if any completion does (pass@k), scored by
                              the task's own evaluate(): GSM8K's number after "####", HumanEval's unit tests in
                              the sandbox, SpellingBee's count.

ChatCORE is the mean centered accuracy over nanochat's five chat tasks, so 0 is chance and 1 is perfect. RL
(scripts.rl) samples its rollouts with their rewards here (sample_groups) and measures pass@k on held-out problems
(evaluate_pass_at_k). SFT (scripts.sft) sizes its evaluations to the device (sized_evaluation), runs ChatCORE over
the tasks this machine has (run_chatcore) and counts the sampled replies that end (reply_end_rate).
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import is_main_process, print0, progress_bar, to_host
from flaxchat.eval.core import plan_batches
from flaxchat.generate.engine import Engine
from flaxchat.generate.sandbox import SandboxUnavailable
from flaxchat.model.cpu import in_sub_batches
from tasks.arc import ARC
from tasks.gsm8k import GSM8K
from tasks.humaneval import HumanEval
from tasks.mmlu import MMLU
from tasks.spellingbee import SpellingBee

# Random-guess accuracy of each task: 1 of 4 letters, or ~0 for open-ended answers (nanochat's values).
BASELINES = {"ARC-Easy": 0.25, "ARC-Challenge": 0.25, "MMLU": 0.25, "GSM8K": 0.0, "HumanEval": 0.0, "SpellingBee": 0.0}
# The tasks nanochat's ChatCORE averages (scripts/chat_eval.py at 92d63d4). SpellingBee is scored and centered
# (baseline 0) like the others but kept out of ChatCORE, so the number compares with nanochat's.
CHATCORE_TASKS = ("ARC-Easy", "ARC-Challenge", "MMLU", "GSM8K", "HumanEval")
CPU_EVAL_BATCHES = 16  # a CPU's val pass: this many micro-batches (a GPU's is 40 x 524,288 tokens, nanochat's)
CPU_CHATCORE_CAT = 100  # a CPU's ChatCORE: this many problems per categorical task (MMLU alone has 14,042)
REPLY_ROOM = 64  # the reply check only uses prompts that leave at least this many tokens for the reply


def make_task(name: str, source: str = "auto"):
    """The evaluation split of a chat task by its nanochat name."""
    factories: dict[str, Callable] = {
        "ARC-Easy": lambda: ARC(subset="ARC-Easy", split="test", source=source),
        "ARC-Challenge": lambda: ARC(subset="ARC-Challenge", split="test", source=source),
        "MMLU": lambda: MMLU(subset="all", split="test", source=source),
        "GSM8K": lambda: GSM8K(subset="main", split="test", source=source),
        "HumanEval": lambda: HumanEval(source=source),
        "SpellingBee": lambda: SpellingBee(size=256, split="test"),
    }
    if name not in factories:
        raise ValueError(f"unknown chat task {name!r}; choose from {', '.join(factories)}")
    return factories[name]()


def centered(accuracy: float, baseline: float) -> float:
    return (accuracy - baseline) / (1.0 - baseline)


def chatcore(accuracies: dict[str, float]) -> tuple[float, int]:
    """(mean centered accuracy over the ChatCORE tasks that were run, how many of them were)."""
    done = [t for t in CHATCORE_TASKS if t in accuracies]
    if not done:
        return float("nan"), 0
    return float(np.mean([centered(accuracies[t], BASELINES[t]) for t in done])), len(done)


# -----------------------------------------------------------------------------
# Categorical


@nnx.jit
def logits_at_positions(model, idx, positions):
    """Logits (B, V) at one position per row of idx (B, T): the lm_head of those positions only, on a CPU in
    sub-batches of rows (cpu.in_sub_batches)."""
    return in_sub_batches(model, lambda m, x, at: m(x, logits_at=at), idx, positions)


def letter_token_ids(tokenizer, letters) -> list[int]:
    ids = []
    for letter in letters:
        encoded = tokenizer.encode(letter)
        if len(encoded) != 1:
            raise ValueError(
                f"answer letter {letter!r} is {len(encoded)} tokens in this tokenizer; "
                "categorical evaluation needs single-token letters"
            )
        ids.append(encoded[0])
    return ids


def run_categorical_eval(
    task, tokenizer, model, batch_size: int = 8, max_problems: int | None = None, desc: str = "categorical"
) -> float:
    """Accuracy of argmax over the choice letters' logits at the answer position, batched by prompt length.
    Problems whose prompt is longer than the model's context are skipped and counted as wrong (said in a line)."""
    n = len(task) if max_problems is None else min(len(task), max_problems)
    if n == 0:
        raise ValueError(f"{desc}: no problems to evaluate")
    conversations, prompts = fitting([task[i] for i in range(n)], tokenizer, model.config.sequence_len, 0, desc)
    bos = tokenizer.get_bos_token_id()  # padding: positions after the answer never affect it (causal model)
    letter_ids: dict[str, int] = {}
    passed = 0
    plan = plan_batches([len(p) for p in prompts], batch_size, model.config, True)
    for T, per_batch, members in progress_bar(plan, desc=desc, leave=False, disable=not is_main_process()):
        idx = np.full((per_batch, T), bos, np.int32)
        positions = np.zeros(per_batch, np.int32)
        for r, i in enumerate(members):
            idx[r, : len(prompts[i])], positions[r] = prompts[i], len(prompts[i]) - 1
        logits = to_host(logits_at_positions(model, jnp.asarray(idx), jnp.asarray(positions)))
        for r, i in enumerate(members):
            letters = conversations[i]["letters"]
            for letter in letters:
                if letter not in letter_ids:
                    letter_ids[letter] = letter_token_ids(tokenizer, [letter])[0]
            focus = logits[r, [letter_ids[letter] for letter in letters]]
            passed += int(task.evaluate(conversations[i], letters[int(np.argmax(focus))]))
    return passed / n


def fitting(conversations: list, tokenizer, context: int, room: int, desc: str) -> tuple[list, list]:
    """(conversations, their prompts) without those whose prompt leaves fewer than `room` positions of a
    `context`-token model: a short-context model (the laptop demo's 256) cannot hold some problems' few-shot
    prompts, and that is a wrong answer, not a failed run. Says how many it skipped."""
    prompts = [tokenizer.render_for_completion(c) for c in conversations]
    keep = [i for i, p in enumerate(prompts) if len(p) + room <= context]
    if len(keep) < len(prompts):
        print0(
            f"{desc}: skipped {len(prompts) - len(keep)} of {len(prompts)} problems whose prompts do not fit the "
            f"model's {context}-token context (counted as wrong)"
        )
    return [conversations[i] for i in keep], [prompts[i] for i in keep]


# -----------------------------------------------------------------------------
# Generative


def sample_problems(engine, tokenizer, conversations, num_samples: int, rows: int, seeds, **sampling):
    """Yield (conversation, prompt, sequences, masks) per conversation: num_samples completions of each
    (Engine.generate_batches), several conversations per batch (at most `rows` completions, at least one
    conversation). seeds: one int for every conversation, or one per conversation."""
    per_batch = max(1, rows // num_samples)
    for first in range(0, len(conversations), per_batch):
        batch = conversations[first : first + per_batch]
        prompts = [tokenizer.render_for_completion(c) for c in batch]
        some = seeds if isinstance(seeds, numbers.Integral) else list(seeds[first : first + per_batch])
        out = engine.generate_batches(prompts, num_samples=num_samples, seeds=some, **sampling)
        for conversation, prompt, (sequences, masks) in zip(batch, prompts, out):
            yield conversation, prompt, sequences, masks


def sample_groups(engine, tokenizer, task, conversations, seeds, num_samples, rows, **sampling):
    """num_samples answers to each question, several questions per Engine batch (at most `rows` rollouts, at
    least one question): per question (sequences, masks, rewards)."""
    return [
        (sequences, masks, [task.reward(conversation, tokenizer.decode(s[len(prompt) :])) for s in sequences])
        for conversation, prompt, sequences, masks in sample_problems(
            engine, tokenizer, conversations, num_samples, rows, seeds, **sampling
        )
    ]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chance that at least one of k samples drawn from n (c of them correct) is correct (Chen et al. 2021).

    Averaged over problems this is the unbiased pass@k estimate; nanochat instead checks the first k of its
    samples, which has the same expectation and more variance.
    """
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate_pass_at_k(
    engine, tokenizer, task, num_examples, k, max_new_tokens, temperature, top_k, seed=0, rows=64
) -> dict:
    """pass@1..k over the first num_examples problems of task (several problems per Engine batch, at most `rows`
    samples), and the mean reward of all samples. Problem i samples with seed + i, as one call per problem would."""
    n = min(num_examples, len(task))
    counts = []
    with progress_bar(total=n, desc="pass@k", leave=False, disable=not is_main_process()) as bar:
        for conversation, prompt, seqs, _ in sample_problems(
            engine,
            tokenizer,
            [task[i] for i in range(n)],
            k,
            rows,
            [seed + i for i in range(n)],
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
        ):
            counts.append(sum(task.evaluate(conversation, tokenizer.decode(s[len(prompt) :])) for s in seqs))
            bar.update(1)
    result = {f"pass@{j}": float(np.mean([pass_at_k(k, c, j) for c in counts])) for j in range(1, k + 1)}
    result["eval_mean_reward"] = float(np.sum(counts) / (k * n))
    return result


def run_generative_eval(
    task,
    tokenizer,
    engine,
    num_samples: int = 1,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_k: int | None = 50,
    max_problems: int | None = None,
    seed: int = 42,
    desc: str = "generative",
    rows: int = 8,
) -> float:
    """pass@num_samples: a problem counts if any of its sampled completions is correct. Problems are sampled
    several at once (at most `rows` completions a batch, at least one problem), each as a call of its own would
    sample it (nanochat: one seed for every problem)."""
    n = len(task) if max_problems is None else min(len(task), max_problems)
    if n == 0:
        raise ValueError(f"{desc}: no problems to evaluate")
    passed = 0
    conversations, _ = fitting([task[i] for i in range(n)], tokenizer, engine.capacity, 1, desc)
    with progress_bar(total=len(conversations), desc=desc, leave=False, disable=not is_main_process()) as bar:
        for conversation, prompt, results, _ in sample_problems(
            engine,
            tokenizer,
            conversations,
            num_samples,
            rows,
            seed,
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
        ):
            completions = [tokenizer.decode(tokens[len(prompt) :]) for tokens in results]
            passed += int(any(task.evaluate(conversation, c) for c in completions))
            bar.update(1)
            bar.set_postfix_str(f"{passed}/{bar.n}", refresh=False)
    return passed / n


# -----------------------------------------------------------------------------
# One task, many tasks


def run_chat_eval(
    name: str,
    model,
    tokenizer,
    engine=None,
    batch_size: int = 8,
    num_samples: int = 1,
    max_new_tokens: int = 512,
    temperature: float = 0.0,
    top_k: int | None = 50,
    max_problems: int | None = None,
    seed: int = 42,
    source: str = "auto",
    task=None,
) -> dict:
    """Evaluate one chat task (`task`, or make_task(name)): {"accuracy", "centered", "baseline", "examples",
    "seconds", "eval_type"}, and "sandbox" for a task whose answers run as code (HumanEval)."""
    t0 = time.perf_counter()
    task = task if task is not None else make_task(name, source)
    n = len(task) if max_problems is None else min(len(task), max_problems)
    sandbox = getattr(task, "sandbox", None)  # HumanEval: which sandbox runs its tests, asked before sampling
    if task.eval_type == "categorical":
        acc = run_categorical_eval(task, tokenizer, model, batch_size, max_problems, desc=name)
    elif task.eval_type == "generative":
        if engine is None:
            raise ValueError(f"{name} is generative and needs an Engine (flaxchat.generate.engine.Engine)")
        acc = run_generative_eval(
            task,
            tokenizer,
            engine,
            num_samples,
            max_new_tokens,
            temperature,
            top_k,
            max_problems,
            seed,
            desc=name,
            rows=batch_size,
        )
    else:
        raise ValueError(f"{name}: unsupported eval type {task.eval_type!r}")
    result = {
        "accuracy": acc,
        "centered": centered(acc, BASELINES[name]),
        "baseline": BASELINES[name],
        "examples": n,
        "seconds": time.perf_counter() - t0,
        "eval_type": task.eval_type,
        **({"sandbox": sandbox} if sandbox else {}),
    }
    ran_in = f" | tests ran in the {sandbox} sandbox" if sandbox else ""
    print0(
        f"{name:14s} accuracy {acc:.4f} (baseline {BASELINES[name]:.2f}) | {n} problems | {result['seconds']:.1f}s"
        + ran_in
    )
    return result


def run_chatcore(
    model, tokenizer, tasks: str, max_cat: int, max_sample: int, batch_size: int, source: str
) -> dict | None:
    """ChatCORE over `tasks` (a comma list): {"chatcore", "chatcore_tasks", per-task accuracy}. max_cat and
    max_sample: problems per categorical and per generative task (-1 = all).

    The default tasks (CHATCORE_TASKS) whose data this machine lacks, or (HumanEval) whose code no sandbox here may
    run, are left out with a note (None when that is all of them); a task named in another list must run
    (FileNotFoundError, SandboxUnavailable)."""
    engine = Engine(model, tokenizer)
    accuracies = {}
    chosen = tasks != ",".join(CHATCORE_TASKS)
    for name in [t.strip() for t in tasks.split(",") if t.strip()]:
        categorical = name in ("ARC-Easy", "ARC-Challenge", "MMLU")
        limit = max_cat if categorical else max_sample
        try:
            result = run_chat_eval(
                name,
                model,
                tokenizer,
                engine,
                batch_size=batch_size,
                max_problems=None if limit < 0 else limit,
                source=source,
            )
        except FileNotFoundError as e:
            if chosen:  # named: its data must be there
                raise
            print0(f"ChatCORE: leaving out {name}, its data is not on this machine: {e}")
            continue
        except SandboxUnavailable as e:  # HumanEval's tests run model-written code: only in a real sandbox
            if chosen:
                raise
            print0(f"ChatCORE: leaving out {name}: {e}")
            continue
        accuracies[name] = result["accuracy"]
    if not accuracies:
        return None
    score, n = chatcore(accuracies)
    return {"chatcore": score, "chatcore_tasks": n, **{f"chatcore/{k}": v for k, v in accuracies.items()}}


def sized_evaluation(args, global_batch: int, on_cpu: bool) -> str:
    """Fill in scripts.sft's evaluation sizes left at their defaults (None: --eval-tokens, --chatcore-max-cat) and
    say what they are. nanochat's are for 8 GPUs: on a CPU a val pass of 40 x 524,288 tokens, or every MMLU
    question, would outlast the run."""
    if args.eval_tokens is None:
        args.eval_tokens = CPU_EVAL_BATCHES * global_batch * args.max_seq_len if on_cpu else 40 * 524288
    if args.chatcore_max_cat is None:
        args.chatcore_max_cat = CPU_CHATCORE_CAT if on_cpu else -1
    per_task = "every" if args.chatcore_max_cat < 0 else f"{args.chatcore_max_cat:,}"
    return (
        f"evaluation: {args.eval_tokens:,} val tokens a pass, {per_task} categorical problems per ChatCORE task "
        f"({'CPU' if on_cpu else 'accelerator'} defaults unless set: --eval-tokens, --chatcore-max-cat)"
    )


# -----------------------------------------------------------------------------
# Do the replies end?


def fitting_prompts(dataset, tokenizer, n: int, max_prompt_tokens: int) -> list[dict]:
    """The first n conversations of dataset whose prompt has at most max_prompt_tokens tokens."""
    chosen = []
    for i in range(len(dataset)):
        if len(chosen) == n:
            break
        if len(tokenizer.render_for_completion(dataset[i])) <= max_prompt_tokens:
            chosen.append(dataset[i])
    return chosen


def reply_end_rate(
    model, tokenizer, conversations, max_tokens: int, seed: int = 0, show: int = 3, rows: int = 64
) -> float:
    """Fraction of sampled replies (temperature 1, top-k 50) that end with <|assistant_end|>.

    A reply ends when the model writes <|assistant_end|> or <|bos|>, or is cut at max_tokens; only the first
    counts as a reply that ended. The calculator tool runs as in chat. Conversation i samples with seed + i,
    `rows` conversations a batch.
    """
    engine = Engine(model, tokenizer)
    end = tokenizer.encode_special("<|assistant_end|>")
    ended = 0
    with progress_bar(total=len(conversations), desc="reply check", leave=False, disable=not is_main_process()) as bar:
        for first in range(0, len(conversations), rows):
            batch = conversations[first : first + rows]
            replies = [[] for _ in batch]
            for column, _, live in engine.generate_many(
                [tokenizer.render_for_completion(c) for c in batch],
                max_tokens=max_tokens,
                temperature=1.0,
                top_k=50,
                seeds=[seed + first + i for i in range(len(batch))],
            ):
                for reply, token, going in zip(replies, column, live):
                    if going:
                        reply.append(token)
            for i, (conversation, tokens) in enumerate(zip(batch, replies), start=first):
                ended += int(bool(tokens) and tokens[-1] == end)
                if i < show:
                    print0(f"--- {conversation['messages'][-2]['content'][:120]!r}\n{tokenizer.decode(tokens)}")
            bar.update(len(batch))
    return ended / max(len(conversations), 1)
