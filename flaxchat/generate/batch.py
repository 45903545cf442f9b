"""The slot driver: which request each slot holds, and what its tokens mean. One for every user of the generation
core: the Engine runs it in the caller's thread, the Scheduler on its own thread (with a queue, cancelling and
limits on top), and speculative sampling plugs in as another runner (flaxchat.generate.speculative).

A `Batch` drives a runner (flaxchat.generate.runner.Runner, or speculative.SpeculativeRunner): it admits requests
into the lowest free slots (one prefill), runs decode chunks over the lowest rows that hold every live one, feeds
each row's tokens through its `Reply` (the tool state machine, flaxchat.generate.reply), queues a tool's output to
be forced into the row, sends each request its events, and frees a slot as soon as its request ends. With
`compact`, live rows left above the smallest power of two that holds them all move down into free rows, so that
one long reply does not keep the batch wide.

Events a request receives (dicts, in the order they happen; flaxchat.serve forwards them unchanged): the `Reply`
events ("token", "tool"), then
    {"type": "done", "finish_reason": "stop"|"length"|"cancelled", "usage": {...}}
    {"type": "error", "reason": str, "message": str}   the request failed (the server itself goes on)
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

import numpy as np

from flaxchat.generate.reply import Reply
from flaxchat.generate.warmup import batch_rows

log = logging.getLogger(__name__)

MIN_REUSE = 16  # a kept row is continued from only when the prompt holds all of it, or shares this many tokens


@dataclasses.dataclass
class Request:
    """One generation: prompt ids in; events out through `emit` (None: nobody listens, as in the Engine)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[dict], None] | None = None
    temperature: float = 1.0
    top_k: int = 0  # 0: sample from the whole vocabulary
    seed: int = 0
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens holding this much probability
    logprobs: int | None = None  # k: record each generated token's raw logprob and its k likeliest alternatives
    lane: int = 0  # which sample of its prompt and seed it is (the Engine's num_samples)
    # Filled in as the request runs (read them after its "done" event).
    parts: list = dataclasses.field(default_factory=list)  # the reply as assistant-message parts
    tokens: list = dataclasses.field(default_factory=list)  # every generated id, forced tool output included
    token_logprobs: list = dataclasses.field(default_factory=list)  # with logprobs: one float per token
    top_logprobs: list = dataclasses.field(default_factory=list)  # with logprobs: [(id, logprob)] * k per token
    completion_tokens: int = 0
    finish_reason: str | None = None
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    def cancel(self) -> None:
        """Ask for this request to end; its slot is freed before the next decode chunk."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def usage(self) -> dict:
        prompt = len(self.prompt)
        total = prompt + self.completion_tokens
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens, "total_tokens": total}


def send(request: Request, events: list[dict]) -> None:
    """Hand events to a request's listener; one that fails (the client has gone) cancels the request."""
    for event in events if request.emit is not None else ():
        try:
            request.emit(event)
        except Exception:
            log.debug("emit failed; cancelling the request", exc_info=True)
            request.cancel()
            return


def end(request: Request, reason: str) -> None:
    """Mark a request finished and send its "done" event."""
    request.finish_reason, request.finished_at = reason, time.perf_counter()
    send(request, [{"type": "done", "finish_reason": reason, "usage": request.usage()}])


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class Batch:
    """The slot table over one runner. `run_tool(expr)` is the tool (the calculator); `text`: decode the replies'
    text and send events (a server), or only follow the tool calls (the Engine). `compact`: pack live rows low and
    decode only the rows that hold them (at least `min_rows`); without it every chunk covers every slot.

    `keep` (prefix reuse; the runner must `extend`): a finished request's row keeps its cache and the tokens it holds
    until the slot is needed. A request whose prompt starts with the tokens a kept row holds (a conversation's next
    turn), or shares at least MIN_REUSE of them, is admitted into that row and only the rest of its prompt is
    prefilled (the longest match wins; at least its last token is prefilled, for the logits it samples from).
    Otherwise it takes the lowest empty slot, or else the least recently used kept row. Replies do not change: the
    row's cache holds what a whole prefill would have written."""

    def __init__(self, runner, tokenizer, run_tool, *, text=True, compact=True, min_rows=1, keep=False):
        self.runner, self.tokenizer, self.run_tool, self.text = runner, tokenizer, run_tool, text
        self.compact_rows, self.min_rows, self.keep = compact, min_rows, keep
        self.rows: list[Request | None] = [None] * runner.slots
        self.replies: list[Reply | None] = [None] * runner.slots
        self.pushes: dict[int, list[int]] = {}  # slot -> a tool's output to force in the next chunk
        self.kept: dict[int, tuple[list[int], float]] = {}  # slot -> (the tokens its cache holds, when it was freed)
        names = ("admitted", "chunks", "moved", "tokens", "prompt_tokens")
        if keep:
            names += ("prefix_hits", "prefix_misses", "prefix_tokens_saved")
        self.counters = collections.Counter(dict.fromkeys(names, 0))

    @property
    def free(self) -> int:
        return self.rows.count(None)

    @property
    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None]

    def admit(self, request: Request) -> int:
        """Prefill a request into a slot (see the class: a kept row it continues, else the lowest empty slot, else
        the least recently used kept row); returns the slot."""
        slot, reuse = self._place(request.prompt)
        if reuse and self.runner.extend(slot, request, reuse):
            self.counters["prefix_hits"] += 1
            self.counters["prefix_tokens_saved"] += reuse
        else:
            self.runner.prefill(slot, [request])
            self.counters["prefix_misses"] += self.keep
        self._seat(slot, request)
        return slot

    def _place(self, prompt: list[int]) -> tuple[int, int]:
        """(the slot for a prompt, how many of its tokens that slot's cache holds already)."""
        reuse = {}
        for slot, (held, _) in self.kept.items():
            n = common_prefix(held, prompt)
            if n == len(held) or n >= MIN_REUSE:  # less would throw away more of that row than it saves
                reuse[slot] = min(n, len(prompt) - 1)
        best = max(reuse, key=lambda slot: (reuse[slot], -slot), default=None)
        if best is not None and reuse[best] > 0:
            return best, reuse[best]
        empty = [i for i, r in enumerate(self.rows) if r is None and i not in self.kept]
        return (empty[0] if empty else min(self.kept, key=lambda slot: self.kept[slot][1])), 0

    def start(self, requests: list[Request], copies: int = 1) -> None:
        """Fill an empty batch in one prefill: requests[p * copies + j] is sample j of prompt p (they share its
        prefill)."""
        if len(requests) > self.free or self.live:
            raise ValueError(f"{len(requests)} requests for an empty batch of {len(self.rows)} slots")
        self.runner.prefill(0, requests[::copies], copies)
        for slot, request in enumerate(requests):
            self._seat(slot, request)

    def _seat(self, slot: int, request: Request) -> None:
        self.rows[slot], self.replies[slot] = request, Reply(self.tokenizer, self.run_tool, text=self.text)
        self.pushes.pop(slot, None)
        self.kept.pop(slot, None)
        self.counters["admitted"] += 1
        self.counters["prompt_tokens"] += len(request.prompt)

    def finish(self, slot: int, reason: str) -> None:
        """End the request in `slot` (stop, length, cancelled) and free the slot."""
        request, reply = self.rows[slot], self.replies[slot]
        self.rows[slot] = self.replies[slot] = None
        self.pushes.pop(slot, None)
        if self.keep:  # the row's cache holds the prompt and every token generated (each was fed back)
            self.kept[slot] = (request.prompt + request.tokens, time.monotonic())
        request.parts = reply.finish()
        send(request, reply.take_events())
        end(request, reason)
        self.counters[f"finished_{reason}"] += 1

    def fail(self, reason: str, message: str) -> None:
        """Every request in a slot ends with an error event; the slots are freed and nothing is kept."""
        self.kept.clear()
        for i, request in enumerate(self.rows):
            if request is not None:
                self.rows[i] = self.replies[i] = None
                request.finish_reason = "error"
                send(request, [{"type": "error", "reason": reason, "message": message}])
        self.pushes.clear()

    def width(self) -> int:
        """Rows the next chunk decodes: every slot, or (compacting) the power of two above the highest live one."""
        live = self.live
        if not self.compact_rows or not live:
            return len(self.rows)
        return min(max(batch_rows(live[-1], len(self.rows)), self.min_rows), len(self.rows))

    def compact(self) -> None:
        """Move live rows above the smallest batch holding them all into the lowest rows below it that hold no live
        request (a kept row there swaps places with it). Replies do not change: a request's randomness follows its
        seed and lane, not its slot."""
        live = self.live
        if not self.compact_rows or not live:
            return
        rows = min(max(batch_rows(len(live) - 1, len(self.rows)), self.min_rows), len(self.rows))
        high = [i for i in live if i >= rows]
        below = sorted((i for i in range(rows) if self.rows[i] is None), key=lambda i: (i in self.kept, i))
        free = below[: len(high)]
        swaps = [(dst, src) for src, dst in zip(high, free) if dst in self.kept]
        held = [len(self.rows[i].prompt) + self.rows[i].completion_tokens + 1 for i in high]
        held += [len(self.kept[d][0]) for d, _ in swaps]  # the cache entries each moved row holds, at most
        if not high or not self.runner.move(high + [d for d, _ in swaps], free + [s for _, s in swaps], max(held)):
            return
        for src, dst in zip(high, free):
            self.rows[dst], self.replies[dst] = self.rows[src], self.replies[src]
            self.rows[src] = self.replies[src] = None
            if src in self.pushes:
                self.pushes[dst] = self.pushes.pop(src)
        for dst, src in swaps:
            self.kept[src] = self.kept.pop(dst)
        self.counters["moved"] += len(high)

    def step(self, limit: int):
        """One decode chunk of at most `limit` steps over `width()` rows -> the runner's Emitted (host arrays, one
        row per slot decoded). Each live row's new tokens go through its Reply; a request that ends is finished."""
        rows = self.width()
        pushes, self.pushes = self.pushes, {}
        out = self.runner.decode(self.rows[:rows], pushes, limit)
        self.counters["chunks"] += 1
        for slot in range(rows):
            if self.rows[slot] is not None:
                scores = None if out.scores is None else tuple(x[slot] for x in out.scores)
                self._advance(slot, out.tokens[slot, : int(out.steps)].tolist(), scores)
        return out

    def _advance(self, slot: int, tokens: list[int], scores) -> None:
        request, reply = self.rows[slot], self.replies[slot]
        reason = None if tokens else "length"  # no token at all: the runner has no room left
        for j, token in enumerate(tokens):
            request.completion_tokens += 1
            request.tokens.append(token)
            if request.logprobs is not None and scores is not None:
                logp, values, ids = scores
                request.token_logprobs.append(float(logp[j]))
                top = list(zip(ids[j, : request.logprobs].tolist(), values[j, : request.logprobs].tolist()))
                request.top_logprobs.append(top)
            self.counters["tokens"] += 1
            ended, forced = reply.feed(token)
            if ended or request.completion_tokens >= request.max_tokens:
                reason = "stop" if ended else "length"
                break
            if forced:
                self.pushes[slot] = forced
        if request.first_token_at is None and request.completion_tokens:
            request.first_token_at = time.perf_counter()
        if reason is not None:
            self.finish(slot, reason)
        else:
            send(request, reply.take_events())
