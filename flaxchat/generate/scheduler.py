"""Continuous batching: one thread owns the model and a KV cache of N slots that conversations share.

A thin user of the generation core, as the Engine is: the same prefill and decode programs
(flaxchat.generate.programs), sampler and tool state machine (flaxchat.generate.reply). A request (prompt ids +
sampling settings) waits in a queue until a slot is free, is prefilled into that slot's row of the batched cache,
and from then on advances one token per decode step alongside every other active slot. Each scheduler iteration:

1. frees the slots of requests that were cancelled (a stop button, a closed socket) since the last one;
2. admits queued requests into free slots: one jitted prefill per request, its prompt padded to a
   power-of-two bucket, written into row i of the batched cache;
3. moves live rows above the smallest power-of-two batch that holds them all into free rows below it (when
   short replies end, the long ones left in high slots do not keep the batch wide);
4. runs ONE jitted decode chunk (up to `chunk` steps) over the lowest rows of the cache that hold every active
   slot (a power of two, so a lone user does not pay for N rows), attending over only the first positions of
   the cache that hold them (also a power of two); that part of the cache is copied out once and kept while
   the rows and span stay (see _decode). Each row samples with its own temperature / top-k / top-p /
   seed, tool outputs are forced per row, and a row freezes as soon as it stops;
5. runs each slot's tool state machine and text decoder (`Reply`) on the host and streams events to its client.

A request that asks for `logprobs` makes the chunks it takes part in return each emitted token's raw
log-probability and its top alternatives (computed on the device: a few numbers per token reach the host); a
chunk none of whose rows asks runs the plain decode program. `score` gives a prompt's log-probabilities the same
way, from one forward pass.

Programs: a decode chunk needs one per (rows, span) pair, a prefill one per prompt bucket, a move one per count.
`warmup` compiles them all before serving; `warmup_in_background` compiles only the widest (every row, the whole
cache; the longest bucket), which can run any batch, and the rest in a thread of their own (programs.Precompiler),
narrowest first, while the scheduler serves: each step then uses the narrowest program compiled so far that holds
its rows, span or prompt (padding more changes no reply), and the scheduler thread alone touches the device state.

Newcomers take the lowest free slot, and step 3 keeps active rows packed at the bottom of the cache.
Randomness is per request: token n of a request uses fold_in(fold_in(key(seed), 0), n), so a seeded request
gives the same reply whichever slot it lands in and whoever else is being served (and the same as the Engine's
first sample with that seed).

Events a request receives (dicts, in the order they happen; flaxchat.serve.app forwards them unchanged): the
`Reply` events ("token", "tool"), then
    {"type": "done", "finish_reason": "stop"|"length"|"cancelled", "usage": {...}}
    {"type": "error", "reason": str, "message": str}   the request failed (the server itself goes on)
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import math
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.common import progress_bar
from flaxchat.generate import speculative
from flaxchat.generate.programs import (
    Precompiler,
    abstract,
    attention_span,
    bucket_length,
    compiler_options,
    controls,
    empty_slots,
    extent,
    in_compute_dtype,
    programs_for,
)
from flaxchat.generate.reply import Reply, stop_tokens
from flaxchat.generate.sampling import MAX_TOP_K, MAX_TOP_LOGPROBS, TOP_K_TIERS
from flaxchat.generate.sandbox import use_calculator

log = logging.getLogger(__name__)

# -----------------------------------------------------------------------------
# Requests and their host-side state


@dataclasses.dataclass
class Request:
    """One generation: prompt ids in, events out through `emit` (called from the scheduler thread)."""

    prompt: list[int]
    max_tokens: int
    emit: Callable[[dict], None]
    temperature: float = 1.0
    top_k: int = 0  # 0: sample from the whole vocabulary
    seed: int = 0
    top_p: float = 1.0  # nucleus sampling: keep the smallest set of tokens holding this much probability
    logprobs: int | None = None  # k: record each generated token's raw logprob and its k likeliest alternatives
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
        """Ask the scheduler to end this request; its slot is freed at the start of the next iteration."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def usage(self) -> dict:
        prompt = len(self.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }


def batch_rows(highest_slot: int, slots: int) -> int:
    """Rows a decode chunk runs over: the next power of two above the highest active slot, at most `slots`."""
    return min(1 << highest_slot.bit_length(), slots)


# -----------------------------------------------------------------------------
# The scheduler


def available_memory() -> int | None:
    """Bytes the KV cache may come from: the first device's free memory on an accelerator (when it reports
    memory_stats), else the machine's physical memory; None if neither is known."""
    device = jax.devices()[0]
    if device.platform != "cpu":
        try:
            stats = device.memory_stats() or {}
        except Exception:  # some backends do not implement it
            stats = {}
        if "bytes_limit" in stats:
            return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def auto_slots(
    model, capacity: int | None = None, memory: int | None = None, fraction: float = 0.25, most: int = 32
) -> tuple[int, str]:
    """Slots for a server: the largest power of two up to `most` whose KV cache stays under `fraction` of the
    available memory -> (slots, a sentence saying why). Per slot the cache holds K and V for every layer:
    2 * n_layer * capacity * n_kv_head * head_dim * dtype bytes."""
    c = model.config
    capacity = capacity or c.sequence_len
    per_slot = 2 * c.n_layer * capacity * c.n_kv_head * c.head_dim * jnp.dtype(model.dtype).itemsize
    memory = available_memory() if memory is None else memory
    if memory is None:
        return 8, f"8 slots (memory size unknown; {per_slot / 2**20:.1f} MiB of KV cache per slot)"
    slots = 1
    while slots * 2 <= most and slots * 2 * per_slot <= fraction * memory:
        slots *= 2
    return slots, (
        f"{slots} slots: {per_slot / 2**20:.1f} MiB of KV cache each, {slots * per_slot / 2**30:.2f} GiB "
        f"of {memory / 2**30:.1f} GiB available"
    )


# XLA:CPU compiles a program several times faster without LLVM's optimisations and with its older fusion code
# generator (the test suite's flags, tests/conftest.py), for slower machine code: a little slower for the widest
# decode program, several times for narrow ones (docs/LOG.md, 2026-12-02). So only the widest programs are compiled
# this way, to serve while a server's optimised programs compile.
QUICK_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


class QueueFull(Exception):
    """Raised by submit() when the waiting queue is at its limit."""


class Scheduler:
    """Owns the model and N slots; `submit` requests from any thread, events come back through request.emit.

    slots: rows of the batched KV cache (concurrent generations); chunk: most decode steps per jitted call
    (larger amortises Python overhead, smaller streams more smoothly and admits newcomers sooner).
    """

    returns_logprobs = True  # whether Request.logprobs is honoured

    def __init__(
        self,
        model,
        tokenizer,
        *,
        slots: int = 8,
        chunk: int = 8,
        capacity: int | None = None,
        max_queue: int = 256,
        run_tool: Callable[[str], str | None] = use_calculator,
    ):
        if slots < 1 or chunk < 1:
            raise ValueError(f"slots and chunk must be >= 1, got slots={slots}, chunk={chunk}")
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.chunk, self.max_queue, self.run_tool = slots, chunk, max_queue, run_tool
        self.capacity = capacity or model.config.sequence_len
        self.stop_tokens = stop_tokens(tokenizer)
        self.tool_end = tokenizer.encode_special("<|python_end|>")
        graphdef, params = nnx.split(model)
        self.params = in_compute_dtype(params, model.dtype)  # once: serving reads bf16 weights on accelerators
        self._programs = programs_for(graphdef, options=compiler_options(params))
        self._state = self._fresh_state()
        self._part = None  # the (rows, span) part of _state that decode chunks work on; see _decode
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._active: list[Request | None] = [None] * slots
        self._replies: list[Reply | None] = [None] * slots
        self._pushes: dict[int, list[int]] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self.counters = collections.Counter(
            dict.fromkeys(("admitted", "chunks", "failures", "moved", "tokens"), 0)
        )  # all in stats() from the start
        # warmup_in_background: the variants compiled ({kind: {size}}; None: any, compiled on first use), the
        # quickly compiled widest programs standing in until their optimised build is ready, the compiling thread
        self._ready: dict[str, set[tuple]] | None = None
        self._quick: dict[tuple, Callable] = {}
        self._precompiler: Precompiler | None = None
        self._shapes = None  # (parameters, state) as abstract shapes, for compiling ahead

    def _fresh_state(self):
        return empty_slots(self.model, self.slots, self.capacity)

    def _decode(self, controls, limit, rows, span, top_logprobs=None):
        """One decode chunk over the first `rows` slots -> (tokens (rows, chunk), steps, scores) on the host;
        scores: None, or with top_logprobs (logprob (rows, chunk), top values and ids (rows, chunk, top_logprobs)).

        Chunks run on a copy of the cache's first `rows` rows and `span` positions, kept from one chunk to the
        next while rows and span stay the same and written back only when they change or a prefill or a move
        needs the whole cache (_settle): copying that part out and back around every chunk costs a sizeable
        share of a chunk on a CPU."""
        static = self._decode_static(rows, span, top_logprobs)
        if (rows, span) == (self.slots, self.capacity):  # the whole cache: decoded in place, nothing copied
            self._settle()
            quick = self._quick.get(("decode", rows, span)) if top_logprobs is None else None
            run = quick or functools.partial(self._programs.decode, **static)
            self._state, out, _, steps, scores = run(self.params, self._state, controls, np.int32(limit))
            return jax.device_get((out, steps, scores))
        part = self._part
        if part is None or extent(part.cache) != (rows, span):
            self._settle()
            self._part = self._programs.extract(self._state, rows=rows, span=span)
        self._part, out, _, steps, scores = self._programs.decode(
            self.params, self._part, controls, np.int32(limit), **static
        )
        return jax.device_get((out, steps, scores))

    def _decode_static(self, rows, span, top_logprobs=None) -> dict:
        """The decode program's static arguments, passed alike by the call and by the lowering ahead of it (jit's
        cache tells apart an argument passed and one left to its default)."""
        return dict(
            rows=rows,
            span=span,
            chunk=self.chunk,
            stop_tokens=self.stop_tokens,
            tool_end=self.tool_end,
            tiers=TOP_K_TIERS,
            top_logprobs=top_logprobs,
        )

    def _settle(self) -> None:
        """Write the decoded part back into the whole cache."""
        if self._part is not None:
            self._state, self._part = self._programs.flush(self._state, self._part), None

    # --- public API (any thread) --------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue a request. Raises ValueError if it cannot fit the cache, QueueFull if too many wait."""
        if not request.prompt:
            raise ValueError("a prompt needs at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if len(request.prompt) >= self.capacity:
            raise ValueError(
                f"a {len(request.prompt)}-token prompt leaves no room in the {self.capacity}-token context"
            )
        request.max_tokens = max(0, min(request.max_tokens, self.capacity - len(request.prompt)))
        request.top_k = min(max(int(request.top_k), 0), MAX_TOP_K)
        if request.logprobs is not None and not (self.returns_logprobs and 0 <= request.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be in 0..{MAX_TOP_LOGPROBS}, and this scheduler must return them")
        if not 0.0 < request.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {request.top_p}")
        with self._lock:
            if self._closing:
                raise RuntimeError("the scheduler is shutting down")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting; try again shortly")
            self._queue.append(request)
        self._wake.set()
        return request

    def cancel(self, request: Request) -> None:
        request.cancel()
        self._wake.set()

    def score(self, ids: list[int], top: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One forward pass over ids -> (logprob of each token given those before it (T,), the first NaN; the
        `top` likeliest tokens after each of the first T-1 (T-1, top) and their logprobs). Reduced on the device
        (Programs.score): the host gets these, never the (T, vocabulary) log-probabilities. Any thread may call
        it: it reads the parameters and calls a jitted function, which JAX serialises with the scheduler's own."""
        if not 0 < len(ids) <= self.capacity:
            raise ValueError(f"a scored prompt needs 1..{self.capacity} tokens, got {len(ids)}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
        n = len(ids)
        T = min(self.capacity, 1 << (n - 1).bit_length())  # padded to a power of two: few compilations
        x = np.zeros((1, T), np.int32)
        x[0, :n] = ids
        # one static top (cut here) rather than one program per `top`: (T, 20) numbers cost nothing to bring back
        logp, values, alt = jax.device_get(self._programs.score(self.params, x, top=MAX_TOP_LOGPROBS))
        chosen = np.full(n, np.nan, np.float32)
        chosen[1:] = logp[: n - 1]
        return chosen, alt[: n - 1, :top], values[: n - 1, :top]

    def stats(self) -> dict:
        with self._lock:
            queued = len(self._queue)
        compiling = {} if self._precompiler is None else {"programs_compiling": self._precompiler.pending}
        return {
            "slots": self.slots,
            "active": sum(r is not None for r in self._active),
            "queued": queued,
            **compiling,
            **dict(self.counters),
        }

    def start(self) -> "Scheduler":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="flaxchat-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread; waiting and running requests end with an error event."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._precompiler is not None:
            self._precompiler.stop(timeout)
        self._fail_everything("shutting_down", "the server is shutting down")

    def warmup(self, buckets: bool = True, progress: bool = False) -> float:
        """Compile the decode program for every (rows, span) pair and prefill for every prompt bucket; returns seconds.

        Call it before start(): it uses the device state directly. `progress` shows a bar of the variants compiled
        so far, with an ETA: 32 slots at a 2048-token context are 43 of them (8 prompt buckets, 6 x 5 rows x span
        pairs, 5 move counts), minutes on a GPU the first time (then JAX's persistent cache has them).
        """
        t0 = time.perf_counter()
        lengths, rows, spans, moves = self._variants()
        lengths = lengths if buckets else lengths[:1]
        with progress_bar(
            total=len(lengths) + len(rows) * len(spans) + len(moves),
            desc="compiling",
            unit="program",
            disable=not progress,
        ) as bar:
            for T in lengths:
                self._state = self._programs.prefill(
                    self.params, self._state, np.int32(0), np.zeros((1, T), np.int32), np.ones(1, np.int32)
                )
                bar.update()
            for n in rows:
                for span in spans:
                    self._decode(self._controls({}, n), 1, rows=n, span=span)
                    bar.update()
            self._settle()
            for m in moves:
                dst = np.arange(m, dtype=np.int32)
                self._state = self._programs.move(self._state, self.slots - 1 - dst, dst)
                bar.update()
            jax.block_until_ready(self._state)
        return time.perf_counter() - t0

    def warmup_in_background(self, progress: bool = False) -> float:
        """Compile the widest programs now and every other variant in a thread of its own; returns seconds.

        Call it before start(). The widest decode program (every row, the whole cache) and prefill (the longest
        bucket) serve any batch and prompt, so the server takes requests once they are compiled (on a CPU, quickly:
        QUICK_CPU_COMPILE). The rest follow narrowest first (what one or two conversations use), then the widest
        ones' optimised builds; each step takes the narrowest variant ready (_fit). `progress`: a bar of them.
        """
        t0 = time.perf_counter()
        self._shapes = abstract((self.params, self._state))
        lengths, rows, spans, moves = self._variants()
        variants = [("prefill", T) for T in lengths] + [("decode", n, s) for n in rows for s in spans]
        variants += [("move", m) for m in moves]
        widest = [("prefill", lengths[-1]), ("decode", rows[-1], spans[-1])]
        quick = QUICK_CPU_COMPILE if jax.default_backend() == "cpu" else None
        self._ready = {"prefill": set(), "decode": set(), "move": set()}
        # one thread each: lowering holds the interpreter lock, XLA's compiling lets it go, so one program's compiling
        # overlaps the other's lowering
        with concurrent.futures.ThreadPoolExecutor(len(widest)) as pool:
            for key, compiled in zip(widest, pool.map(functools.partial(self._compile, options=quick), widest)):
                if quick:
                    (self._quick[key],) = compiled
                self._ready[key[0]].add(key[1:])
        # narrowest first: a variant's cost is the cache positions it computes over or copies (a move copies rows)
        cost = lambda key: math.prod(key[1:]) * (self.capacity if key[0] == "move" else 1)
        rest = sorted((k for k in variants if k not in widest), key=cost) + (widest if quick else [])
        jobs = [(key, functools.partial(self._compile, key)) for key in rest]
        self._precompiler = Precompiler(jobs, progress=progress, desc="compiling (serving meanwhile)").start()
        return time.perf_counter() - t0

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for warmup_in_background's thread to compile every variant; True once it has (or if none runs)."""
        return self._precompiler is None or self._precompiler.wait(timeout)

    def _variants(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(prompt buckets, decode rows, decode spans, move counts) a server may use."""
        rows = sorted({batch_rows(i, self.slots) for i in range(self.slots)})
        spans = sorted({attention_span(n, self.capacity) for n in range(1, self.capacity + 1)})
        # _compact's move counts: powers of two holding at most half the slots
        moves = [1 << p for p in range((self.slots // 2 - 1).bit_length() + 1)] if self.slots > 1 else []
        return self._prompt_buckets(), rows, spans, moves

    def _lowerings(self, key: tuple) -> list:
        """The programs behind a variant, lowered from the abstract shapes of the parameters and state (no buffer is
        read: any thread may do it), with the very arguments the scheduler's own calls pass, so that those calls
        find them compiled in jit's cache."""
        params, state = self._shapes
        kind, *size = key
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        if kind == "prefill":
            return [self._programs.prefill.lower(params, state, i32(), i32(1, size[0]), i32(1))]
        if kind == "move":
            return [self._programs.move.lower(state, i32(size[0]), i32(size[0]))]
        rows, span = size
        ctl, static = abstract(controls(rows)), self._decode_static(rows, span)
        if (rows, span) == (self.slots, self.capacity):
            return [self._programs.decode.lower(params, state, ctl, i32(), **static)]
        part = abstract(jax.eval_shape(functools.partial(self._programs.extract, rows=rows, span=span), state))
        return [
            self._programs.extract.lower(state, rows=rows, span=span),
            self._programs.decode.lower(params, part, ctl, i32(), **static),
            self._programs.flush.lower(state, part),
        ]

    def _compile(self, key: tuple, options: dict | None = None) -> list:
        """A variant's programs compiled: with `options` (QUICK_CPU_COMPILE), returned to be called; without, also
        left in jit's cache, where the scheduler's calls find them."""
        return [lowered.compile(options) for lowered in self._lowerings(key)]

    def _take_compiled(self) -> None:
        """Scheduler thread: variants the background thread finished become the ones to choose from."""
        if self._precompiler is not None:
            for kind, *size in self._precompiler.take():
                self._quick.pop((kind, *size), None)  # its optimised build replaces the quick one
                self._ready[kind].add(tuple(size))

    def _fit(self, kind: str, *need: int) -> tuple | None:
        """The cheapest compiled variant of `kind` at least `need` in every size (prompt bucket; rows, span; move
        count): `need` itself unless warming up in the background; None if none is ready."""
        if self._ready is None:
            return need
        fits = [v for v in self._ready[kind] if all(a >= b for a, b in zip(v, need))]
        return min(fits, key=math.prod, default=None)

    # --- the loop (scheduler thread) -----------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closing:
                    return
            self._wake.clear()
            try:
                busy = self._iteration()
            except Exception as e:  # a failed device call may have consumed the donated state: start afresh
                log.exception("scheduler iteration failed")
                self.counters["failures"] += 1
                self._fail_active("internal_error", f"generation failed: {type(e).__name__}")
                self._state, self._part = self._fresh_state(), None
                busy = False
            if not busy:
                self._wake.wait(0.5)

    def _iteration(self) -> bool:
        """One round: drop cancelled, admit, decode a chunk. False when there was nothing to run."""
        self._take_compiled()
        for i, req in enumerate(self._active):
            if req is not None and req.cancelled:
                self._finish(i, "cancelled")
        fresh = self._admit()
        live = self._compact()
        if not live:
            return False
        self._decode_chunk(max(live), limit=1 if fresh else self.chunk)  # a newcomer's first token comes fast
        return True

    def _admit(self) -> bool:
        admitted = False
        while None in self._active:
            with self._lock:
                if not self._queue:
                    break
                req = self._queue.popleft()
            if req.cancelled:
                self._end(req, "cancelled")
                continue
            slot = self._active.index(None)  # the lowest free slot keeps active rows packed
            self._prefill(slot, req)
            self._active[slot], self._replies[slot] = req, Reply(self.tokenizer, self.run_tool)
            self._pushes.pop(slot, None)
            self.counters["admitted"] += 1
            admitted = True
        return admitted

    def _compact(self) -> list[int]:
        """Move live rows that sit above the smallest batch holding them all into free rows below it; returns the
        live slots. A long reply left alone in a high slot would otherwise keep every chunk at that slot's batch
        size (16 rows computed for one conversation); moved, it decodes at the cost of its own row. Replies do
        not change: a request's randomness follows its seed, not its slot."""
        live = [i for i, r in enumerate(self._active) if r is not None]
        rows = batch_rows(len(live) - 1, self.slots) if live else 0
        high = [i for i in live if i >= rows]
        if not high:
            return live
        moves = self._fit("move", 1 << (len(high) - 1).bit_length())  # a power of two of moves: few compilations
        if moves is None:  # no move program compiled yet: wider decode chunks meanwhile
            return live
        free = [i for i in range(rows) if self._active[i] is None][: len(high)]  # enough: rows >= len(live)
        self._settle()
        pad = moves[0] - len(high)
        self._state = self._programs.move(
            self._state, np.array(high + high[:1] * pad, np.int32), np.array(free + free[:1] * pad, np.int32)
        )
        for src, dst in zip(high, free):
            self._active[dst], self._replies[dst] = self._active[src], self._replies[src]
            self._active[src] = self._replies[src] = None
            if src in self._pushes:
                self._pushes[dst] = self._pushes.pop(src)
        self.counters["moved"] += len(high)
        return [i for i, r in enumerate(self._active) if r is not None]

    def _prefill(self, slot: int, req: Request) -> None:
        self._settle()
        tokens = self._padded(req.prompt)
        run = self._quick.get(("prefill", len(tokens)), self._programs.prefill)
        self._state = run(self.params, self._state, np.int32(slot), tokens[None], np.array([len(req.prompt)], np.int32))

    def _padded(self, prompt: list[int]) -> np.ndarray:
        """The prompt padded (with its last token) to its bucket's length, or a longer compiled one's (_fit): one
        compilation per bucket."""
        (T,) = self._fit("prefill", bucket_length(len(prompt), self.capacity))
        return np.array(prompt + [prompt[-1]] * (T - len(prompt)), np.int32)

    def _prompt_buckets(self) -> list[int]:
        return sorted({bucket_length(n, self.capacity) for n in (1 << p for p in range(self.capacity.bit_length()))})

    def _controls(self, pushes: dict[int, list[int]], rows: int):
        """Controls for the first `rows` slots (pushes name slots below rows: only active slots have them)."""
        reqs = self._active[:rows]
        value = lambda f, default: [default if r is None else f(r) for r in reqs]
        return controls(
            rows,
            active=value(lambda r: True, False),
            remaining=value(lambda r: r.max_tokens - r.completion_tokens, 0),
            offset=value(lambda r: r.completion_tokens, 0),
            seed=value(lambda r: r.seed, 0),
            temperature=value(lambda r: r.temperature, 0.0),
            top_k=value(lambda r: r.top_k, 0),
            top_p=value(lambda r: r.top_p, 1.0),
            pushes=pushes,
        )

    def _decode_chunk(self, highest: int, limit: int) -> None:
        rows = batch_rows(highest, self.slots)
        ends = [len(r.prompt) + r.max_tokens for r in self._active if r is not None]
        reach = [len(r.prompt) + r.completion_tokens + limit for r in self._active if r is not None]
        span = attention_span(min(max(reach), max(ends)), self.capacity)  # where the chunk can write, at most
        pushes, self._pushes = self._pushes, {}
        # with logprobs, one static top: one more program per (rows, span), not one per k
        wants = any(r is not None and r.logprobs is not None for r in self._active[:rows])
        scoring = {"top_logprobs": MAX_TOP_LOGPROBS} if wants else {}
        if not wants:  # (with logprobs: compiled on first use, not ahead, so the exact size is as good as any)
            rows, span = self._fit("decode", rows, span)
        out, steps, scores = self._decode(self._controls(pushes, rows), limit, rows=rows, span=span, **scoring)
        self.counters["chunks"] += 1
        n = int(steps)
        for i in range(rows):
            if self._active[i] is not None:
                self._advance(i, out[i, :n].tolist(), None if scores is None else tuple(x[i, :n] for x in scores))

    def _advance(self, slot: int, tokens: list[int], scores=None) -> None:
        """Feed a slot's new tokens through its Reply; stream the events; finish the request if it ended.
        scores: (logprob (n,), top values (n, k), top ids (n, k)) of these tokens, kept when the request asks."""
        req, reply = self._active[slot], self._replies[slot]
        ended, reason = False, None
        for j, token in enumerate(tokens):
            req.completion_tokens += 1
            req.tokens.append(token)
            if req.logprobs is not None and scores is not None:
                logp, values, ids = scores
                req.token_logprobs.append(float(logp[j]))
                req.top_logprobs.append(list(zip(ids[j, : req.logprobs].tolist(), values[j, : req.logprobs].tolist())))
            self.counters["tokens"] += 1
            ended, forced = reply.feed(token)
            if ended:
                reason = "stop"
                break
            if req.completion_tokens >= req.max_tokens:
                ended, reason = True, "length"
                break
            if forced:
                self._pushes[slot] = forced
        if req.first_token_at is None and req.completion_tokens:
            req.first_token_at = time.perf_counter()
        if ended:
            self._finish(slot, reason)
        else:
            self._send(req, reply.take_events())

    def _finish(self, slot: int, reason: str) -> None:
        req, reply = self._active[slot], self._replies[slot]
        self._active[slot] = self._replies[slot] = None
        self._pushes.pop(slot, None)
        req.parts = reply.finish()
        self._send(req, reply.take_events())
        self._end(req, reason)

    def _end(self, req: Request, reason: str) -> None:
        req.finish_reason, req.finished_at = reason, time.perf_counter()
        self.counters[f"finished_{reason}"] += 1
        self._send(req, [{"type": "done", "finish_reason": reason, "usage": req.usage()}])

    def _send(self, req: Request, events: list[dict]) -> None:
        for event in events:
            try:
                req.emit(event)
            except Exception:  # the client's side is gone: stop generating for it
                log.debug("emit failed; cancelling the request", exc_info=True)
                req.cancel()
                return

    def _fail_active(self, reason: str, message: str) -> None:
        for i, req in enumerate(self._active):
            if req is not None:
                self._active[i] = self._replies[i] = None
                req.finish_reason = "error"
                self._send(req, [{"type": "error", "reason": reason, "message": message}])
        self._pushes.clear()

    def _fail_everything(self, reason: str, message: str) -> None:
        self._fail_active(reason, message)
        with self._lock:
            waiting, self._queue = list(self._queue), collections.deque()
        for req in waiting:
            req.finish_reason = "error"
            self._send(req, [{"type": "error", "reason": reason, "message": message}])


class SpeculativeScheduler(Scheduler):
    """The Scheduler with speculative sampling (flaxchat.generate.speculative): one conversation at a time, its tokens
    proposed by `draft_model` `draft_steps` at a time and checked by the model in one forward pass; the others
    wait in the queue. Replies follow the model's own distribution. It trades the batch for the lowest
    latency of one reply: a person chatting on their own machine, with a draft much cheaper than the model.

    A request's sampling settings are compiled into its programs (the first request with new settings compiles);
    everything else (streaming, tools, cancelling, scoring, /health) works as in the batched scheduler, except
    generated tokens' logprobs, which its rounds do not compute (prompt scoring works).
    """

    returns_logprobs = False

    def __init__(
        self,
        model,
        tokenizer,
        draft_model,
        *,
        draft_steps: int = 4,
        chunk: int = 8,
        capacity: int | None = None,
        max_queue: int = 256,
        run_tool: Callable[[str], str | None] = use_calculator,
    ):
        capacity = capacity or min(model.config.sequence_len, draft_model.config.sequence_len)
        super().__init__(
            model, tokenizer, slots=1, chunk=chunk, capacity=capacity, max_queue=max_queue, run_tool=run_tool
        )
        speculative.speculative_rule(1.0, None, None, draft_steps)
        self.draft_model, self.draft_steps = draft_model, draft_steps
        self._spec_programs, self._spec_params = speculative.programs(model, draft_model)
        self._spec = self._rule = None
        self._first: list[int] = []  # the prefill's token, streamed by the next decode call

    def _fresh_state(self):
        return None  # the state is the running request's Speculation

    def stats(self) -> dict:
        return {**super().stats(), "draft_steps": self.draft_steps}

    def warmup_in_background(self, progress: bool = False) -> float:
        """warmup, at once: one conversation at a time needs only a prefill per bucket and a round."""
        return self.warmup(progress=progress)

    def warmup(self, buckets: bool = True, progress: bool = False) -> float:
        """Compile prefill for every prompt bucket and a round, under greedy settings; returns seconds (`progress`:
        a bar of the variants compiled, as Scheduler.warmup)."""
        t0 = time.perf_counter()
        rule = (0.0, None, None)
        lengths = self._prompt_buckets()
        lengths = lengths if buckets else lengths[:1]
        with progress_bar(total=len(lengths) + 1, desc="compiling", unit="program", disable=not progress) as bar:
            for T in lengths:
                spec, _ = self._spec_programs.start(
                    self._spec_params,
                    np.zeros(T, np.int32),
                    np.int32(1),
                    jax.random.key(0),
                    capacity=self.capacity,
                    rule=rule,
                )
                bar.update()
            self._spec_programs.run(
                self._spec_params,
                spec,
                np.int32(1),
                k=self.draft_steps,
                rule=rule,
                stops=self.stop_tokens,
                tool_end=self.tool_end,
                chunk=self.chunk,
            )
            bar.update()
        return time.perf_counter() - t0

    def _prefill(self, slot: int, req: Request) -> None:
        self._rule = speculative.speculative_rule(req.temperature, req.top_k or None, req.top_p, self.draft_steps)
        self._spec, first = self._spec_programs.start(
            self._spec_params,
            self._padded(req.prompt),
            np.int32(len(req.prompt)),
            jax.random.key(req.seed),
            capacity=self.capacity,
            rule=self._rule,
        )
        self._first = [int(first)]

    def _decode_chunk(self, highest: int, limit: int) -> None:
        req = self._active[0]
        if self._first:
            tokens, self._first = self._first, []
        elif 0 in self._pushes:  # the tool's output goes into both caches; the reply gets it as forced tokens
            tokens = self._pushes.pop(0)
            self._spec = self._spec_programs.push(self._spec_params, self._spec, tokens)
        else:
            limit = min(limit, req.max_tokens - req.completion_tokens)
            self._spec, out, n = self._spec_programs.run(
                self._spec_params,
                self._spec,
                np.int32(limit),
                k=self.draft_steps,
                rule=self._rule,
                stops=self.stop_tokens,
                tool_end=self.tool_end,
                chunk=self.chunk,
            )
            tokens = np.asarray(out)[: int(n)].tolist()
            if not tokens:  # no room for another round in the cache
                self._finish(0, "length")
                return
        self.counters["chunks"] += 1
        self._advance(0, tokens)


def new_seed() -> int:
    """A fresh random seed for a request that did not ask for one."""
    return int(np.random.default_rng().integers(0, 2**31 - 1))
