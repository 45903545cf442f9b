"""Inference: `generate` (one call) and nanochat's streaming `Engine`, built on the generation core.

The core is four files, each one idea:
- flaxchat.generate.sampling: the sampler (greedy, temperature, top-k, top-p, per row, by inverse CDF);
- flaxchat.generate.programs: the device state (`Slots`, a KV cache of N rows) and the jitted prefill and
  `lax.while_loop` decode programs over it, with each row's own settings, seed and forced tokens;
- flaxchat.generate.reply: the tool state machine (`Reply`), which also decodes text incrementally for streaming;
- flaxchat.generate.sandbox: the tool itself (the calculator, and the opt-in Python sandbox).

The Engine (the CLI, evaluation, RL rollouts, SFT's reply check) streams token columns from the decode programs
and runs each row's tool between calls; with a draft model it streams from speculative sampling
(flaxchat.generate.speculative) instead. The server's continuous batching (flaxchat.generate.scheduler) is the
other user of the same core. The same seed gives the same tokens however the loop is cut into calls.
"""

from __future__ import annotations

import numbers

import jax
import numpy as np

from flaxchat.common import from_main_process, is_main_process
from flaxchat.generate import speculative
from flaxchat.generate.programs import Slots, attention_span, controls, decode_chunk, pad_prompts, programs
from flaxchat.generate.reply import Reply, stop_tokens, until_stop
from flaxchat.generate.sampling import check_sampling
from flaxchat.generate.sandbox import run_python, use_calculator

STREAM_CHUNK = 16  # most decode steps per jitted call while streaming: smooth to watch, few calls to pay for
COMPACT_MIN_ROWS = 4  # generate_many packs its rows still going into no fewer slots: each width is a compile


def generate(
    model, prompts, max_tokens, *, temperature=1.0, top_k=None, top_p=None, seed=0, stop_tokens=(), capacity=None
) -> list[list[int]]:
    """Continue each prompt (a list of ids; lengths may differ) by up to max_tokens tokens, in one jitted loop.

    Row b samples as lane b of `seed`. A row ends after its first stop token, which is included. Returns the
    new tokens of each row.
    """
    check_sampling(temperature, top_k, top_p)
    capacity = capacity or model.config.sequence_len
    tokens, lengths = pad_prompts(prompts, capacity, max_tokens)
    n, stop_tokens = len(prompts), tuple(int(t) for t in stop_tokens)
    progs, params = programs(model)
    slots = progs.start(params, tokens, lengths, copies=1, rows=n, capacity=capacity)
    ctl = controls(
        n,
        remaining=max_tokens,
        seed=seed,
        lane=np.arange(n),
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p or 1.0,
    )
    span = attention_span(int(lengths.max()) + max_tokens, capacity)
    _, out, _, steps, _ = progs.decode(
        params,
        slots,
        ctl,
        np.int32(max_tokens),
        rows=n,
        span=span,
        chunk=decode_chunk(max_tokens),
        stop_tokens=stop_tokens,
        tool_end=-1,
        tiers=(top_k,) if top_k else (),
    )
    out, steps = jax.device_get((out, steps))
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
        # compact=True: generate_many packs the rows still going into fewer slots once half of them have stopped.
        # It pays on a CPU, where a decode step's time grows with its rows, for long jobs (RL): each width is
        # one more compile, which a short job does not earn back
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

        With several processes, process 0 runs it and every process forces its answer: a sandbox that timed
        out on one host only would otherwise send the processes' decode loops different ways (a hang).
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

        One prefill of `tokens` is shared by num_samples rows (lanes 0.. of `seed`). Stops when every row has
        emitted <|assistant_end|> or <|bos|>, after max_tokens columns, or when the KV cache is full. Entries
        of a row after its stop token are meaningless. With a draft model, one sample is drawn by speculative
        sampling (the same distribution; several samples use the plain loop).
        """
        check_prompt(tokens)
        if self.draft_model is not None and num_samples == 1:
            tokens = [int(t) for t in tokens]
            room = self.capacity - len(tokens)
            max_tokens = room if max_tokens is None else min(max_tokens, room)
            padded, lengths = pad_prompts([tokens], self.capacity, max(max_tokens, 1))
            yield from self._speculate(padded[0], lengths[0], max_tokens, temperature, top_k, top_p, seed)
            return
        for column, mask_column, _ in self.generate_many(
            [tokens], num_samples, max_tokens, temperature, top_k, [seed], top_p
        ):
            yield column, mask_column

    def generate_many(self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42, top_p=None):
        """`generate` for several prompts in one batch (evaluation, RL rollouts): yield (token_column,
        mask_column, live) lists, where live[i] says row i had not stopped before this column (else its entry is
        meaningless). Rows p * num_samples + j are prompt p's samples, drawn as generate(prompts[p],
        num_samples, seed=seeds[p]) draws them (lane j of seeds[p]; `seeds` may be one int for every prompt).
        Each row stops at its stop token, after max_tokens tokens, or when its prompt's room in the KV cache is
        spent; the columns end when every row has stopped. A decode step reads the weights once for all its
        rows, so one batch of many prompts beats a call per prompt.
        """
        for p in prompts:
            check_prompt(p)
        check_sampling(temperature, top_k, top_p)
        prompts = [[int(t) for t in p] for p in prompts]
        n = len(prompts) * num_samples
        seeds = [seeds] * len(prompts) if isinstance(seeds, numbers.Integral) else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        padded, lengths = pad_prompts(prompts, self.capacity)  # every prompt leaves room for a token
        rooms = np.repeat(self.capacity - lengths, num_samples)
        budget = rooms if max_tokens is None else np.minimum(rooms, max_tokens)
        progs, params = programs(self.model)
        slots = progs.start(params, padded, lengths, copies=num_samples, rows=n, capacity=self.capacity)
        replies = [Reply(self.tokenizer, self.run_tool, text=False) for _ in range(n)]
        row_seeds, lanes = np.repeat(seeds, num_samples), np.tile(np.arange(num_samples), len(prompts))
        held = np.arange(n)  # held[s]: the row in slot s (-1: none); decode runs over these len(held) slots
        last = np.zeros(n, np.int64)  # each row's latest token: what a row no slot holds shows in a column
        pushes: dict[int, list[int]] = {}
        # the first call makes one token: time to first token is one prefill + one step
        emitted, chunk, longest = 0, 1, int(lengths.max())
        going_at = lambda k: np.array([not r.ended and k < b for r, b in zip(replies, budget)])  # rows going at k
        while (going := going_at(emitted)).any():
            if self.compact and going.sum() <= len(held) // 2 and len(held) > COMPACT_MIN_ROWS:
                slots, held = compact(progs, slots, held, going)
            on = held >= 0
            slot_row = np.zeros(n, int)  # controls cover all n slots; those past len(held) are inactive
            slot_row[: len(held)] = np.maximum(held, 0)
            active = np.zeros(n, bool)
            active[: len(held)] = on & going[slot_row[: len(held)]]
            limit = min(emitted + chunk, int(budget.max())) - emitted
            ctl = controls(
                n,
                active=active,
                remaining=np.where(active, np.maximum(budget[slot_row] - emitted, 0), 0),
                offset=emitted,
                seed=row_seeds[slot_row],
                lane=lanes[slot_row],
                temperature=temperature,
                top_k=top_k or 0,
                top_p=top_p or 1.0,
                pushes={int(np.flatnonzero(held == r)[0]): tokens for r, tokens in pushes.items()},
            )
            span = attention_span(longest + emitted + limit, self.capacity)  # every position this call can write
            slots, out, forced, steps, _ = progs.decode(
                params,
                slots,
                ctl,
                np.int32(limit),
                rows=len(held),
                span=span,
                chunk=self.stream_chunk,
                stop_tokens=self.stop_tokens,
                tool_end=self.python_end,
                tiers=(top_k,) if top_k else (),
            )
            out, forced, steps = jax.device_get((out, forced, steps))
            pushes = {}
            for t in range(int(steps)):
                live = going_at(emitted + t)
                last[held[on]] = out[on, t]
                sampled = np.ones(n, bool)
                sampled[held[on]] = ~forced[on, t]
                column = last.tolist()
                for i in np.flatnonzero(live):
                    _, push = replies[i].feed(column[i])
                    if push:  # the loop paused right after the python_end: forced from the next call on
                        pushes[int(i)] = push
                yield column, sampled.astype(int).tolist(), live.tolist()
            emitted, chunk = emitted + int(steps), min(2 * chunk, self.stream_chunk)

    def _speculate(self, prompt, length, max_tokens, temperature, top_k, top_p, seed):
        """One sample by speculative sampling, streamed as (column, mask) pairs like `generate`."""
        rule = speculative.speculative_rule(temperature, top_k, top_p, self.draft_steps)
        progs, params = speculative.programs(self.model, self.draft_model)
        spec, first = progs.start(params, prompt, length, jax.random.key(seed), capacity=self.capacity, rule=rule)
        reply = Reply(self.tokenizer, self.run_tool, text=False)
        queue, emitted, chunk = [(int(first), 1)], 0, 1
        while queue:
            push = None
            for token, mask in queue:
                yield [token], [mask]
                emitted += 1
                ended, push = reply.feed(token)
                if ended or emitted >= max_tokens:
                    return
            if push:  # the last token was the tool's end: its output goes into both caches, then on
                spec = progs.push(params, spec, push)
                queue = [(t, 0) for t in push]
                continue
            spec, out, n = progs.run(
                params,
                spec,
                np.int32(min(chunk, max_tokens - emitted)),
                k=self.draft_steps,
                rule=rule,
                stops=self.stop_tokens,
                tool_end=self.python_end,
                chunk=self.stream_chunk,
            )
            queue = [(t, 1) for t in np.asarray(out)[: int(n)].tolist()]  # none: the cache is full
            chunk = min(2 * chunk, self.stream_chunk)

    def generate_batch(self, tokens, num_samples=1, **kwargs):
        """Non-streaming: (sequences, masks), each sequence = prompt + generated tokens without the terminal
        token (nanochat's return value); decode with tokenizer.decode(seq[len(tokens):]) for the text."""
        if self.draft_model is not None and num_samples == 1:
            stream = ((column, masks, [True]) for column, masks in self.generate(tokens, 1, **kwargs))
            return collect(stream, [tokens], 1, self.stop_tokens)[0]
        return self.generate_batches([tokens], num_samples, seeds=kwargs.pop("seed", 42), **kwargs)[0]

    def generate_batches(
        self, prompts, num_samples=1, max_tokens=None, temperature=1.0, top_k=None, seeds=42, top_p=None
    ):
        """generate_batch for several prompts in one batch (generate_many): [(sequences, masks)] per prompt."""
        stream = self.generate_many(prompts, num_samples, max_tokens, temperature, top_k, seeds, top_p)
        return collect(stream, prompts, num_samples, self.stop_tokens)


def compact(progs, slots: Slots, held: np.ndarray, going: np.ndarray) -> tuple[Slots, np.ndarray]:
    """Move the slots of the rows still going to the lowest slots; the next decode runs over the smallest power
    of two holding them, at least COMPACT_MIN_ROWS (on a CPU a decode step costs about its rows, and much of an
    RL batch's work would otherwise go to rows that have stopped). -> (slots, held)."""
    src = np.flatnonzero((held >= 0) & going[np.maximum(held, 0)])
    if len(src) == 0:
        return slots, held
    if (src != np.arange(len(src))).any():
        pad = np.full(len(held) - len(src), src[0])  # a fixed shape; a repeated (src, dst) pair is harmless
        slots = progs.move(slots, np.concatenate([src, pad]), np.concatenate([np.arange(len(src)), np.zeros_like(pad)]))
    width = max(1 << (len(src) - 1).bit_length(), COMPACT_MIN_ROWS)
    return slots, np.concatenate([held[src], np.full(width - len(src), -1)])


def check_prompt(tokens) -> None:
    """Refuse a prompt that is not a sequence of token ids (a string, say), with one clear sentence."""
    if isinstance(tokens, (str, bytes)) or not all(isinstance(t, numbers.Integral) for t in tokens):
        raise ValueError("tokens must be a list of token ids (ints)")


def collect(stream, prompts, num_samples: int, stop_tokens) -> list[tuple[list[list[int]], list[list[int]]]]:
    """generate_many's (column, mask column, live) triples as nanochat's generate_batch returns them, grouped by
    prompt: for each prompt (sequences, masks), a sequence being the prompt and its sample's tokens up to
    (without) its stop token."""
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
