"""The device side of a batch of slots: a `Runner` keeps N rows of state on the device and runs the programs over
them (flaxchat.generate.programs) for the slot driver (flaxchat.generate.batch).

Decode chunks run on a copy of the slots' first `rows` rows and `span` positions (the narrowest power-of-two pair
holding every live row to the end of the chunk), kept from one chunk to the next while rows and span stay, and
written back when they change or a prefill or a move needs the whole state: copying it out and back around every
chunk would cost a sizeable share of a chunk on a CPU. With a `Precompiler` (flaxchat.generate.warmup) each call
takes the narrowest variant compiled so far; without one, each (rows, span) and prompt bucket compiles on first use.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from flaxchat.generate.programs import (
    DecodeSettings,
    attention_span,
    bucket_length,
    controls,
    empty_slots,
    pad_prompts,
)
from flaxchat.generate.sampling import MAX_TOP_LOGPROBS


class Runner:
    """N slots on the device and the programs that run over them. `rows` arguments are the driver's slot table (a
    request per slot, or None), the first so many slots; a request carries prompt, max_tokens, completion_tokens,
    seed, lane, temperature, top_k, top_p and logprobs."""

    def __init__(self, programs, params, model, *, slots: int, capacity: int, settings: DecodeSettings):
        self.programs, self.params, self.model = programs, params, model
        self.slots, self.capacity, self.settings = slots, capacity, settings
        self.ahead = None  # a Precompiler, when the owner compiles ahead
        self.reset()

    def reset(self) -> None:
        """Empty slots (after a failed call, whose donated state may be gone)."""
        self.state, self.part, self._part_key = empty_slots(self.model, self.slots, self.capacity), None, None

    def _variant(self, kind: str, *need: int) -> tuple[tuple, dict]:
        """(the sizes to run, their precompiled executables by name; {}: call the jitted programs)."""
        key = self.ahead.fit(kind, *need) if self.ahead is not None else None
        return (need, {}) if key is None else (key[1:], self.ahead.program(key))

    def prefill(self, start: int, requests: list, copies: int = 1) -> None:
        """Prefill the requests' prompts into rows start.., each into `copies` consecutive rows."""
        self._settle()
        prompts = [r.prompt for r in requests]
        (width,), ready = (bucket_length(max(map(len, prompts)), self.capacity),), {}
        if len(prompts) == 1 and copies == 1:  # the precompiled prefill variants take one prompt
            (width,), ready = self._variant("prefill", width)
        tokens, lengths = pad_prompts(prompts, self.capacity, width=width)
        run = ready.get("prefill") or functools.partial(self.programs.prefill, copies=copies)
        self.state = run(self.params, self.state, np.int32(start), tokens, lengths)

    def extend(self, slot: int, request, start: int) -> bool:
        """Prefill the request's prompt after the first `start` tokens that row `slot` already holds (they are the
        prompt's own first tokens); False (nothing done) while no program for the tail's bucket is compiled."""
        tail = request.prompt[start:]
        width = bucket_length(len(tail), self.capacity)
        (width, span), ready = self._variant("extend", width, attention_span(start + width, self.capacity))
        if (not ready and self.ahead is not None) or start + width > span:
            return False  # the padded tail would not fit behind the prefix: a whole prefill instead
        self._settle()
        tokens, length = pad_prompts([tail], self.capacity, width=width)
        last = np.int32(request.prompt[start - 1])
        run = ready.get("extend") or functools.partial(self.programs.extend, span=span)
        self.state = run(self.params, self.state, np.int32(slot), np.int32(start), last, tokens, length[0])
        return True

    def move(self, src: list[int], dst: list[int], positions: int) -> bool:
        """Copy rows src to rows dst, each holding at most `positions` cache entries; False (nothing moved) while no
        program for that many moves over that span is compiled."""
        need = (1 << (len(src) - 1).bit_length(), attention_span(positions, self.capacity))  # powers of two
        (count, span), ready = self._variant("move", *need)
        if not ready and self.ahead is not None:
            return False
        self._settle()
        pad = count - len(src)
        src, dst = np.array(src + src[:1] * pad, np.int32), np.array(dst + dst[:1] * pad, np.int32)
        self.state = (ready.get("move") or functools.partial(self.programs.move, span=span))(self.state, src, dst)
        return True

    def decode(self, rows: list, pushes: dict[int, list[int]], limit: int):
        """Up to `limit` steps over the first len(rows) slots -> Emitted on the host (numpy arrays)."""
        live = [r for r in rows if r is not None]
        reach = max(len(r.prompt) + r.completion_tokens + limit for r in live)
        ends = max(len(r.prompt) + r.max_tokens for r in live)
        n, span = len(rows), attention_span(min(reach, ends), self.capacity)  # where the chunk can write, at most
        settings, ready = self.settings, {}
        if any(r.logprobs is not None for r in live):  # one static top: one more program per (rows, span), not per k
            settings = dataclasses.replace(settings, top_logprobs=MAX_TOP_LOGPROBS)
        else:
            (n, span), ready = self._variant("decode", n, span)
        ctl = self._controls(rows + [None] * (n - len(rows)), pushes)
        run = ready.get("decode") or functools.partial(self.programs.decode, settings=settings)
        if (n, span) == (self.slots, self.capacity):  # the whole state: decoded in place, nothing copied
            self._settle()
            self.state, out = run(self.params, self.state, ctl, np.int32(limit))
        else:
            if self.part is None or self.part.extent != (n, span):
                self._settle()
                extract = ready.get("extract") or functools.partial(self.programs.extract, rows=n, span=span)
                self.part, self._part_key = extract(self.state), (n, span)
            self.part, out = run(self.params, self.part, ctl, np.int32(limit))
        return jax.device_get(out)

    def _settle(self) -> None:
        """Write the decoded part back into the whole state."""
        if self.part is not None:
            ready = (self.ahead and self.ahead.program(("decode", *self._part_key))) or {}
            self.state = ready.get("flush", self.programs.flush)(self.state, self.part)
            self.part = self._part_key = None

    def _controls(self, rows: list, pushes: dict[int, list[int]]):
        value = lambda f, default: [default if r is None else f(r) for r in rows]
        return controls(
            len(rows),
            active=value(lambda r: True, False),
            remaining=value(lambda r: r.max_tokens - r.completion_tokens, 0),
            offset=value(lambda r: r.completion_tokens, 0),
            seed=value(lambda r: r.seed, 0),
            lane=value(lambda r: r.lane, 0),
            temperature=value(lambda r: r.temperature, 0.0),
            top_k=value(lambda r: r.top_k, 0),
            top_p=value(lambda r: r.top_p, 1.0),
            pushes=pushes,
        )
