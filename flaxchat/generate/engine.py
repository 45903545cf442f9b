"""Inference: `generate` (one call) and nanochat's streaming `Engine`, both on the generation core.

The core, one idea a file:
- sampling: the sampler (greedy, temperature, top-k, top-p, per row, by inverse CDF);
- programs: the device state (`Slots`, a KV cache of N rows) and the jitted prefill and `lax.while_loop` decode;
- runner: N slots on the device and the narrowest program variant for each call (warmup: compiled ahead);
- batch: the slot driver: which request each slot holds; admit, decode a chunk, feed each row's `Reply`, compact;
- reply: the tool state machine, which also decodes text incrementally for streaming;
- sandbox: the tool itself (the calculator, and the opt-in Python sandbox);
- speculative: a draft model proposes and the model checks, as one more runner.

The Engine (the CLI, evaluation, RL rollouts, SFT's reply check) drives a `Batch` in the caller's thread and streams
its token columns; the server's `Scheduler` drives one on a thread of its own. The same seed gives the same tokens
however the loop is cut into calls.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

from flaxchat.common import from_main_process, is_main_process
from flaxchat.generate.batch import Batch, Request
from flaxchat.generate.programs import DecodeSettings, attention_span, controls, decode_chunk, pad_prompts, programs
from flaxchat.generate.reply import stop_tokens, until_stop
from flaxchat.generate.runner import Runner
from flaxchat.generate.sampling import check_sampling
from flaxchat.generate.sandbox import run_python, use_calculator
from flaxchat.generate.speculative import SpeculativeRunner
from flaxchat.model.gpt import with_stacked_qkv

STREAM_CHUNK = 16  # most decode steps per jitted call while streaming: smooth to watch, few calls to pay for
COMPACT_MIN_ROWS = 4  # generate_many packs its rows still going into no fewer slots: each width is a compile


def generate(
    model, prompts, max_tokens, *, temperature=1.0, top_k=None, top_p=None, seed=0, stop_tokens=(), capacity=None
) -> list[list[int]]:
    """Continue each prompt (a list of ids; lengths may differ) by up to max_tokens tokens, in one jitted loop.

    Row b samples as lane b of `seed`. A row ends after its first stop token, which is included. Returns the new
    tokens of each row.
    """
    check_sampling(temperature, top_k, top_p)
    capacity = capacity or model.config.sequence_len
    tokens, lengths = pad_prompts(prompts, capacity, max_tokens)
    n, stop_tokens = len(prompts), tuple(int(t) for t in stop_tokens)
    span = attention_span(int(lengths.max()) + max_tokens, capacity)  # a cache of only the positions it uses
    progs, params = programs(model)
    slots = progs.start(params, tokens, lengths, copies=1, rows=n, capacity=span)
    ctl = controls(
        n,
        remaining=max_tokens,
        seed=seed,
        lane=np.arange(n),
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p or 1.0,
    )
    settings = DecodeSettings(decode_chunk(max_tokens), stop_tokens, tiers=(top_k,) if top_k else ())
    _, out = progs.decode(params, slots, ctl, np.int32(max_tokens), settings=settings)
    out, steps = jax.device_get((out.tokens, out.steps))
    return [until_stop(row[: int(steps)].tolist(), stop_tokens) for row in out]


class Engine:
    """nanochat's Engine on the jitted core: `generate` streams (token column, mask column) per step."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        capacity=None,
        use_sandbox=False,
        stream_chunk=STREAM_CHUNK,
        draft_model=None,
        draft_steps=4,
        compact=False,
    ):
        self.model, self.draft_model, self.draft_steps = model, draft_model, draft_steps
        # compact=True: generate_many packs the rows still going into fewer slots as they stop. It pays on a CPU,
        # where a decode step's time grows with its rows, for long jobs (RL): each width is one more compile, which
        # a short job does not earn back
        self.compact = compact
        self.tokenizer = tokenizer
        lengths = [m.config.sequence_len for m in (model, draft_model) if m is not None]
        self.capacity = capacity or min(lengths)
        self.use_sandbox = use_sandbox  # False (default): calculator only, as nanochat; True: also run other code
        self.stream_chunk = stream_chunk
        self.python_end = tokenizer.encode_special("<|python_end|>")
        self.stop_tokens = stop_tokens(tokenizer)

    def run_tool(self, expr: str) -> str | None:
        """The calculator (arithmetic, str.count), as nanochat; with use_sandbox=True anything else runs in the
        sandbox (flaxchat.generate.sandbox, 5 s limit): opt-in, so training, evaluation and chat score the same tool.

        With several processes, process 0 runs it and every process forces its answer: a sandbox that timed out on
        one host only would otherwise send the processes' decode loops different ways (a hang).
        """
        if jax.process_count() > 1:
            return from_main_process(self._run_tool(expr) if is_main_process() else None)
        return self._run_tool(expr)

    def _run_tool(self, expr: str) -> str | None:
        result = use_calculator(expr)
        if result is None and self.use_sandbox:
            result = run_python(expr)
        return result

    def generate(self, tokens, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seed=42, top_p=None):
        """Yield (token_column, mask_column) lists, one entry per row; mask 1 = sampled, 0 = forced by the tool.

        One prefill of `tokens` is shared by num_samples rows (lanes 0.. of `seed`). Stops when every row has emitted
        <|assistant_end|> or <|bos|>, after max_tokens columns, or when the KV cache is full. Entries of a row after
        its stop token are meaningless. With a draft model, one sample is drawn by speculative sampling (the same
        distribution; several samples use the plain loop).
        """
        stream = self.generate_many([tokens], num_samples, max_tokens, temperature, top_k, [seed], top_p)
        for column, mask_column, _ in stream:
            yield column, mask_column

    def _batch(self, rows: int, top_k) -> Batch:
        """A slot driver for `rows` rows: speculative sampling for one row with a draft model, else the batched
        decode loop (compacting when self.compact)."""
        if self.draft_model is not None and rows == 1:
            runner = SpeculativeRunner(
                self.model,
                self.draft_model,
                draft_steps=self.draft_steps,
                capacity=self.capacity,
                chunk=self.stream_chunk,
                stop_tokens=self.stop_tokens,
                tool_end=self.python_end,
            )
        else:
            progs, params = programs(with_stacked_qkv(self.model))  # stacked once per call, not once per chunk
            settings = DecodeSettings(self.stream_chunk, self.stop_tokens, self.python_end, (top_k,) if top_k else ())
            runner = Runner(progs, params, self.model, slots=rows, capacity=self.capacity, settings=settings)
        return Batch(runner, self.tokenizer, self.run_tool, text=False, compact=self.compact, min_rows=COMPACT_MIN_ROWS)

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42, top_p=None):
        """`generate` for several prompts in one batch (evaluation, RL rollouts): yield (token_column, mask_column,
        live) lists, where live[i] says row i had not stopped before this column (else its entry is meaningless).
        Rows p * num_samples + j are prompt p's samples, drawn as generate(prompts[p], num_samples, seed=seeds[p])
        draws them (lane j of seeds[p]; `seeds` may be one int for every prompt). Each row stops at its stop token,
        after max_tokens tokens, or when its prompt's room in the KV cache is spent; the columns end when every row
        has stopped. A decode step reads the weights once for all its rows, so one batch of many prompts beats a
        call per prompt.
        """
        for p in prompts:
            check_prompt(p)
        check_sampling(temperature, top_k, top_p)
        seeds = [seeds] * len(prompts) if isinstance(seeds, numbers.Integral) else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        _, lengths = pad_prompts(prompts, self.capacity)  # every prompt leaves room for a token
        budgets = [
            int(self.capacity - n) if max_tokens is None else min(int(self.capacity - n), max_tokens) for n in lengths
        ]
        rows = [
            Request(
                [int(t) for t in p],
                budget,
                seed=seed,
                lane=j,
                temperature=temperature,
                top_k=top_k or 0,
                top_p=top_p or 1.0,
            )
            for p, budget, seed in zip(prompts, budgets, seeds)
            for j in range(num_samples)
        ]
        batch = self._batch(len(rows), top_k)
        batch.start(rows, copies=num_samples)
        last, chunk = [0] * len(rows), 1  # the first call makes one token: time to first token is a prefill + a step
        while batch.live:
            batch.compact()
            held = {id(r): slot for slot, r in enumerate(batch.rows) if r is not None}
            before = [len(r.tokens) for r in rows]
            out = batch.step(min(chunk, max(r.max_tokens - r.completion_tokens for r in batch.rows if r)))
            for t in range(int(out.steps)):
                live = [len(r.tokens) > b + t for r, b in zip(rows, before)]
                if not any(live):  # a speculative round may commit past every row's end
                    break
                column, sampled = list(last), [1] * len(rows)
                for i in (i for i, going in enumerate(live) if going):
                    column[i] = last[i] = rows[i].tokens[before[i] + t]
                    sampled[i] = int(not out.forced[held[id(rows[i])], t])
                yield column, sampled, live
            chunk = min(2 * chunk, self.stream_chunk)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Non-streaming: (sequences, masks), each sequence = prompt + generated tokens without the terminal token
        (nanochat's return value); decode with tokenizer.decode(seq[len(tokens):]) for the text."""
        return self.generate_batches([tokens], num_samples, seeds=kwargs.pop("seed", 42), **kwargs)[0]

    def generate_batches(
        self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42, top_p=None
    ):
        """generate_batch for several prompts in one batch (generate_many): [(sequences, masks)] per prompt."""
        stream = self.generate_many(prompts, num_samples, max_tokens, temperature, top_k, seeds, top_p)
        return collect(stream, prompts, num_samples, self.stop_tokens)


def check_prompt(tokens) -> None:
    """Refuse a prompt that is not a sequence of token ids (a string, say), with one clear sentence."""
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, numbers.Integral) for t in tokens):
        raise ValueError("tokens must be a list of token ids (ints)")


def collect(stream, prompts, num_samples: int, stop_tokens) -> list[tuple[list[list[int]], list[list[int]]]]:
    """generate_many's (column, mask column, live) triples as nanochat's generate_batch returns them, grouped by
    prompt: for each prompt (sequences, masks), a sequence being the prompt and its sample's tokens up to (without)
    its stop token."""
    rows = [p for p in prompts for _ in range(num_samples)]
    results = [[int(t) for t in p] for p in rows]
    masks = [[0] * len(p) for p in rows]
    completed = [False] * len(rows)
    for column, mask_column, live in stream:
        for i, (token, mask) in enumerate(zip(column, mask_column)):
            if completed[i] or not live[i]:
                continue
            if token in stop_tokens:
                completed[i] = True
            else:
                results[i].append(token)
                masks[i].append(mask)
        if all(completed):
            break
    return [
        (results[p * num_samples : (p + 1) * num_samples], masks[p * num_samples : (p + 1) * num_samples])
        for p in range(len(prompts))
    ]
