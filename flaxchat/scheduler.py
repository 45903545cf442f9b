"""Continuous batching: one thread owns the model and a KV cache of N slots that conversations share.

A request (prompt ids + sampling settings) waits in a queue until a slot is free, is prefilled into that
slot's row of the batched cache, and from then on advances one token per decode step alongside every other
active slot. Each scheduler iteration:

1. frees the slots of requests that were cancelled (a stop button, a closed socket) since the last one;
2. admits queued requests into free slots: one jitted prefill per request, its prompt padded to a
   power-of-two bucket, written into row i of the batched cache with `dynamic_update_slice`;
3. runs ONE jitted decode chunk (a `lax.while_loop` of up to `chunk` steps) over the lowest rows of the
   cache that hold every active slot (a power of two, so a lone user does not pay for N rows), attending
   over only the first positions of the cache that hold them (also a power of two). Each row
   samples with its own temperature / top-k / seed, tool outputs are forced per row, and a row freezes as
   soon as it stops; the loop returns early when every row stopped or a row closed a tool call;
4. runs each slot's tool state machine and text decoder on the host and streams events to its client.

Free slots are always the lowest free index, so active rows stay packed at the bottom of the cache.

Sampling is vectorised across rows: greedy where temperature is 0, otherwise inverse-CDF sampling from the
(top-k filtered) softmax. Inverse-CDF needs one uniform number per row; `jax.random.categorical` would draw
a Gumbel variate per vocabulary entry, which on a CPU costs more than the model's forward pass.

Randomness is per request: token n of a request uses fold_in(fold_in(key(0), seed), n), so a seeded request
gives the same reply whichever slot it lands in and whoever else is being served.

Events a request receives (dicts, in the order they happen; flaxchat.serve forwards them unchanged):
    {"type": "token", "text": str}                     text the model wrote (consecutive tokens coalesced)
    {"type": "tool", "kind": "call"|"output", "text"}  a complete tool call, then the tool's output
    {"type": "done", "finish_reason": "stop"|"length"|"cancelled", "usage": {...}}
    {"type": "error", "reason": str, "message": str}   the request failed (the server itself goes on)
"""

from __future__ import annotations

import codecs
import collections
import dataclasses
import functools
import logging
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.engine import attention_span, bucket_length, in_compute_dtype, put_rows, take_rows
from flaxchat.execution import use_calculator
from flaxchat.gpt import KVCache

log = logging.getLogger(__name__)

MAX_TOP_K = 200  # largest top_k a request may ask for (0 = no top-k cut)
TOP_K_TIERS = (50, MAX_TOP_K)  # static top_k sizes; a chunk uses the smallest tier covering its rows
FORCED_CAPACITY = 128  # most tokens a tool output may force into a row


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
    # Filled in as the request runs (read them after its "done" event).
    parts: list = dataclasses.field(default_factory=list)  # the reply as assistant-message parts
    tokens: list = dataclasses.field(default_factory=list)  # every generated id, forced tool output included
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
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}


class Reply:
    """A slot's tool state machine and text stream (nanochat's RowState, plus incremental decoding).

    Text between special tokens is decoded with an incremental UTF-8 decoder, so a character split over
    several tokens is sent whole. `<|python_start|>expr<|python_end|>` is a tool call: the calculator
    runs and `<|output_start|>result<|output_end|>` is forced into the row.
    """

    def __init__(self, tokenizer, run_tool: Callable[[str], str | None]):
        sp = tokenizer.encode_special
        self.tokenizer, self.run_tool = tokenizer, run_tool
        self.python_start, self.python_end = sp("<|python_start|>"), sp("<|python_end|>")
        self.output_start, self.output_end = sp("<|output_start|>"), sp("<|output_end|>")
        self.stop_tokens = {sp("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.specials = {sp(name) for name in tokenizer.get_special_tokens()}
        self.mode = "text"  # text | python | python_output
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # the current text part
        self.pending = ""  # text not yet sent
        self.block: list[int] = []  # tokens of the current tool call or output
        self.parts: list[dict] = []
        self.events: list[dict] = []

    def feed(self, token: int) -> tuple[bool, list[int] | None]:
        """Take one generated token -> (reply ended, tokens to force next or None)."""
        if token in self.stop_tokens:
            return True, None
        if token == self.python_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python", []
        elif token == self.python_end and self.mode == "python":
            expr = self._close_block("call")
            result = self.run_tool(expr) if expr.strip() else None
            if result is not None:
                body = self.tokenizer.encode(result)[: FORCED_CAPACITY - 2]
                return False, [self.output_start, *body, self.output_end]
        elif token == self.output_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python_output", []
        elif token == self.output_end and self.mode == "python_output":
            self._close_block("output")
        elif self.mode != "text":
            self.block.append(token)
        elif token not in self.specials:  # a stray special token in text carries no text
            piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
            self.text += piece
            self.pending += piece
        return False, None

    def _flush_pending(self) -> None:
        if self.pending:
            self.events.append({"type": "token", "text": self.pending})
            self.pending = ""

    def _close_text(self) -> None:
        tail = self.decoder.decode(b"", final=True)
        self.text += tail
        self.pending += tail
        self._flush_pending()
        if self.text:
            self.parts.append({"type": "text", "text": self.text})
        self.text = ""
        self.decoder.reset()

    def _close_block(self, kind: str) -> str:
        text = self.tokenizer.decode(self.block)
        self.events.append({"type": "tool", "kind": kind, "text": text})
        self.parts.append({"type": self.mode, "text": text})
        self.mode, self.block = "text", []
        return text

    def take_events(self) -> list[dict]:
        """Events since the last call (pending text is sent as one token event)."""
        self._flush_pending()
        events, self.events = self.events, []
        return events

    def finish(self) -> list[dict]:
        """Close whatever part is open (an unfinished tool call is shown as it stands); returns the parts."""
        if self.mode == "text":
            self._close_text()
        else:
            self._close_block("call" if self.mode == "python" else "output")
        return self.parts


# -----------------------------------------------------------------------------
# Device programs


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    """What lives on the device between iterations, one row per slot."""

    cache: KVCache
    logits: jax.Array  # (N, V) fp32: each slot's next-token distribution
    forced: jax.Array  # (N, F) int32: per-slot queue of tokens to force (a tool's output)
    forced_len: jax.Array  # (N,) int32
    forced_pos: jax.Array  # (N,) int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Controls:
    """Per-slot settings the host sends with each decode chunk (small arrays, (N,) or (N, F))."""

    active: jax.Array  # bool: the slot holds a running request
    remaining: jax.Array  # int32: tokens the request may still generate
    offset: jax.Array  # int32: tokens it generated so far (the RNG counter)
    seed: jax.Array  # int32
    temperature: jax.Array  # float32; 0 = greedy
    top_k: jax.Array  # int32; 0 = no cut
    top_p: jax.Array  # float32; 1 = no nucleus cut
    push: jax.Array  # bool: give this slot a new forced queue before the chunk
    push_queue: jax.Array  # (N, F) int32
    push_len: jax.Array  # int32


def _argmax(x):
    """argmax over the last axis as max + first index at the max: XLA's CPU argmax is several times slower."""
    hit = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(hit, jnp.arange(x.shape[-1]), x.shape[-1]), axis=-1)


def _kth_largest(x, k: int, ks, block: int = 32):
    """Each row's ks[b]-th largest value (1 <= ks <= k) of x (B, V); V a multiple of `block`.

    The k largest values lie in the k blocks with the largest maxima, so top_k runs on k*block candidates
    instead of V. The optimisation barriers keep XLA from rewriting top_k-then-index into a full sort, which
    on a CPU is two orders of magnitude slower.
    """
    B, V = x.shape
    k = min(k, V // block)
    xb = x.reshape(B, V // block, block)
    _, best = jax.lax.optimization_barrier(jax.lax.top_k(jnp.max(xb, axis=-1), k))  # (B, k) block ids
    candidates = jnp.take_along_axis(xb, best[:, :, None], axis=1).reshape(B, k * block)
    values, _ = jax.lax.optimization_barrier(jax.lax.top_k(candidates, k))  # (B, k), largest first
    return jnp.take_along_axis(values, jnp.clip(ks - 1, 0, k - 1)[:, None], axis=1)[:, 0]


def _inverse_cdf(scaled, u, block: int = 128):
    """Index where u (B,) in [0, 1) falls in the cumulative softmax of `scaled` (B, V), V a multiple of block.

    Two levels (which block, then where in it) keep the cumulative sums short.
    """
    B, V = scaled.shape
    p = jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)).reshape(B, V // block, block)
    mass = jnp.sum(p, axis=-1)  # (B, blocks)
    cum = jnp.cumsum(mass, axis=-1)
    target = u * cum[:, -1]
    b = jnp.minimum(jnp.sum(cum <= target[:, None], axis=-1), V // block - 1)  # <=: skips zero-mass blocks
    rest = target - jnp.take_along_axis(cum - mass, b[:, None], axis=1)[:, 0]
    inner = jnp.cumsum(jnp.take_along_axis(p, b[:, None, None], axis=1)[:, 0], axis=-1)  # (B, block)
    j = jnp.minimum(jnp.sum(inner <= rest[:, None], axis=-1), block - 1)
    return b * block + j


def _nucleus_threshold(scaled, top_p):
    """Each row's smallest kept value under nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751): the
    tokens whose probability mass above them is below top_p (so the top token is always kept)."""
    s = -jnp.sort(-scaled, axis=-1)  # (B, V) largest first; a full sort, paid only when some row asks
    p = jax.nn.softmax(s, axis=-1)
    above = jnp.cumsum(p, axis=-1) - p
    return jnp.min(jnp.where(above < top_p[:, None], s, jnp.inf), axis=-1)


def sample_rows(logits, keys, temperature, top_k, top_p=None):
    """One token per row of logits (B, V), each row with its own temperature (0 = greedy), top_k (0 = all)
    and top_p (1 = all).

    Non-greedy rows draw by inverse CDF from softmax(logits / t) restricted to the row's top_k logits
    (ties at the k-th value are kept), then to its nucleus of mass top_p. top_k larger than MAX_TOP_K is
    cut to it. The nucleus needs a sort, so it runs only when a sampled row has top_p < 1.
    """
    B, V = logits.shape
    x = jnp.pad(logits, ((0, 0), (0, (-V) % 128)), constant_values=-jnp.inf)  # whole blocks; padding never drawn
    greedy = temperature <= 0
    kmax = jnp.max(jnp.where(greedy, 0, top_k))
    tiers = [min(k, V) for k in TOP_K_TIERS]
    top_k = jnp.minimum(top_k, tiers[-1])

    def threshold(k):
        return lambda: jnp.where(top_k > 0, _kth_largest(x, k, top_k), -jnp.inf)

    branch = (kmax > 0).astype(jnp.int32) + (kmax > tiers[0]).astype(jnp.int32)
    thr = jax.lax.switch(branch, [lambda: jnp.full((B,), -jnp.inf)] + [threshold(k) for k in tiers])
    t = jnp.where(greedy, 1.0, temperature)[:, None]
    scaled = jnp.where(x >= thr[:, None], x / t, -jnp.inf)
    if top_p is not None:
        cut = ~greedy & (top_p < 1.0)
        pthr = jax.lax.cond(jnp.any(cut), lambda: jnp.where(cut, _nucleus_threshold(scaled, top_p), -jnp.inf),
                            lambda: jnp.full((B,), -jnp.inf))
        scaled = jnp.where(scaled >= pthr[:, None], scaled, -jnp.inf)
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(keys)
    drawn = _inverse_cdf(scaled, u)
    # rounding at the very top of the CDF could land on a zero-probability entry: take the argmax then
    possible = jnp.take_along_axis(scaled, drawn[:, None], axis=1)[:, 0] > -jnp.inf
    best = _argmax(logits)
    return jnp.where(greedy | ~possible, best, drawn).astype(jnp.int32)


def _prefill(graphdef, params, state: SlotState, slot, tokens, length) -> SlotState:
    """Prefill one padded prompt (1, T) into row `slot` of the batched cache."""
    model = nnx.merge(graphdef, params)
    T = tokens.shape[1]
    logits, row = model.forward_cached(tokens, model.init_cache(1, T, dtype=state.cache.k[0].dtype),
                                       logits_at=jnp.reshape(length - 1, (1,)))
    cache = state.cache
    put = lambda layers, new: tuple(jax.lax.dynamic_update_slice(c, n, (slot, 0, 0, 0)) for c, n in zip(layers, new))
    cache = KVCache(
        k=put(cache.k, row.k),  # stale entries past T are never attended to
        v=put(cache.v, row.v),
        pos=cache.pos.at[slot].set(length),
        prev_embedding=cache.prev_embedding.at[slot].set(row.prev_embedding[0]),  # padding repeats the last token
    )
    return SlotState(
        cache=cache, logits=state.logits.at[slot].set(logits[0]), forced=state.forced,
        forced_len=state.forced_len.at[slot].set(0), forced_pos=state.forced_pos.at[slot].set(0),
    )


def _decode(graphdef, params, state: SlotState, ctl: Controls, limit, *, rows, span, chunk, stop_tokens, tool_end):
    """Up to `limit` (<= chunk) decode steps over the first `rows` slots -> (state, tokens (rows, chunk), steps).

    Attention reads only the first `span` cache positions, which must hold every live row to the end of the
    chunk: reading the whole cache for every row at every step would make a batch of short conversations
    cost like a batch of full contexts.

    A row is live from the start until it emits a stop token or its `remaining` budget is spent; after that
    its position is frozen (it keeps computing, harmlessly, in place). The loop ends early when no row is live
    or when a live row emitted `tool_end` (the host must run the tool before that row goes on).
    """
    model = nnx.merge(graphdef, params)
    forced = jnp.where(ctl.push[:, None], ctl.push_queue, state.forced)
    forced_len = jnp.where(ctl.push, ctl.push_len, state.forced_len)
    forced_pos = jnp.where(ctl.push, 0, state.forced_pos)
    r = slice(0, rows)
    f_queue, f_len = forced[r], forced_len[r]
    temperature, top_k, top_p, remaining = ctl.temperature[r], ctl.top_k[r], ctl.top_p[r], ctl.remaining[r]
    base = jax.random.key(0)
    seeds, offsets = ctl.seed[r], ctl.offset[r]
    stops = jnp.asarray(stop_tokens, jnp.int32)
    row_ids = jnp.arange(rows)

    def cond(c):
        _, _, _, _, step, live, paused = c
        return (step < limit) & jnp.any(live) & ~paused

    def body(c):
        cache, logits, f_pos, out, step, live, _ = c
        keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.fold_in(base, s), n))(seeds, offsets + step)
        sampled = sample_rows(logits, keys, temperature, top_k, top_p)
        is_forced = f_pos < f_len
        token = jnp.where(is_forced, f_queue[row_ids, jnp.minimum(f_pos, f_queue.shape[1] - 1)], sampled)
        new_logits, new_cache = model.forward_cached(token[:, None], cache)
        new_cache = dataclasses.replace(new_cache, pos=jnp.where(live, new_cache.pos, cache.pos))
        ended = jnp.isin(token, stops) | (step + 1 >= remaining)
        paused = jnp.any(live & ~ended & (token == tool_end))
        return (new_cache, new_logits[:, 0], f_pos + (is_forced & live), out.at[:, step].set(token), step + 1,
                live & ~ended, paused)

    live = ctl.active[r] & (remaining > 0)
    out = jnp.zeros((rows, chunk), jnp.int32)
    init = (take_rows(state.cache, rows, span), state.logits[r], forced_pos[r], out, jnp.int32(0), live, jnp.bool_(False))
    cache, logits, f_pos, out, steps, _, _ = jax.lax.while_loop(cond, body, init)
    new_state = SlotState(
        cache=put_rows(state.cache, cache, state.cache.pos[r], chunk), logits=state.logits.at[r].set(logits), forced=forced,
        forced_len=forced_len, forced_pos=forced_pos.at[r].set(f_pos),
    )
    return new_state, out, steps


_PROGRAMS: list = []  # [(graphdef, (prefill, decode))], most recent last


_SCORERS: list = []


def _score_program(graphdef):
    """The jitted log_softmax(model(x)) for a graphdef (found by equality, like _programs)."""
    for g, f in _SCORERS:
        if g == graphdef:
            return f
    f = jax.jit(lambda params, x: jax.nn.log_softmax(nnx.merge(graphdef, params)(x).astype(jnp.float32), axis=-1))
    _SCORERS.append((graphdef, f))
    return f


def _programs(graphdef):
    """Jitted (prefill, decode) for one model structure; schedulers of same-shaped models share compilations.

    A graphdef holds lists, so it is unhashable: it is found by equality in a short list.
    """
    for known, programs in _PROGRAMS:
        if known == graphdef:
            return programs
    programs = (jax.jit(functools.partial(_prefill, graphdef), donate_argnames=("state",)),
                jax.jit(functools.partial(_decode, graphdef), donate_argnames=("state",),
                        static_argnames=("rows", "span", "chunk", "stop_tokens", "tool_end")))
    _PROGRAMS[:] = _PROGRAMS[-7:] + [(graphdef, programs)]
    return programs


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


def auto_slots(model, capacity: int | None = None, memory: int | None = None, fraction: float = 0.25,
               most: int = 32) -> tuple[int, str]:
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
    return slots, (f"{slots} slots: {per_slot / 2**20:.1f} MiB of KV cache each, {slots * per_slot / 2**30:.2f} GiB "
                   f"of {memory / 2**30:.1f} GiB available")


class QueueFull(Exception):
    """Raised by submit() when the waiting queue is at its limit."""


class Scheduler:
    """Owns the model and N slots; `submit` requests from any thread, events come back through request.emit.

    slots: rows of the batched KV cache (concurrent generations); chunk: most decode steps per jitted call
    (larger amortises Python overhead, smaller streams more smoothly and admits newcomers sooner).
    """

    def __init__(self, model, tokenizer, *, slots: int = 8, chunk: int = 8, capacity: int | None = None,
                 max_queue: int = 256, run_tool: Callable[[str], str | None] = use_calculator):
        if slots < 1 or chunk < 1:
            raise ValueError(f"slots and chunk must be >= 1, got slots={slots}, chunk={chunk}")
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.chunk, self.max_queue, self.run_tool = slots, chunk, max_queue, run_tool
        self.capacity = capacity or model.config.sequence_len
        sp = tokenizer.encode_special
        self.stop_tokens = (sp("<|assistant_end|>"), tokenizer.get_bos_token_id())
        self.tool_end = sp("<|python_end|>")
        graphdef, params = nnx.split(model)
        self.params = in_compute_dtype(params, model.dtype)  # once: serving reads bf16 weights on accelerators
        self._prefill, self._decode = _programs(graphdef)
        self._score = _score_program(graphdef)
        self._state = self._fresh_state()
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._active: list[Request | None] = [None] * slots
        self._replies: list[Reply | None] = [None] * slots
        self._pushes: dict[int, list[int]] = {}
        self._thread: threading.Thread | None = None
        self._closing = False
        self.counters = collections.Counter()

    def _fresh_state(self) -> SlotState:
        cache = self.model.init_cache(self.slots, self.capacity)
        N, V = self.slots, self.model.config.vocab_size
        zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
        return SlotState(cache=cache, logits=jnp.zeros((N, V), jnp.float32), forced=zeros(N, FORCED_CAPACITY),
                         forced_len=zeros(N), forced_pos=zeros(N))

    # --- public API (any thread) --------------------------------------------

    def submit(self, request: Request) -> Request:
        """Queue a request. Raises ValueError if it cannot fit the cache, QueueFull if too many wait."""
        if not request.prompt:
            raise ValueError("a prompt needs at least one token")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if len(request.prompt) >= self.capacity:
            raise ValueError(f"a {len(request.prompt)}-token prompt leaves no room in the {self.capacity}-token context")
        request.max_tokens = max(0, min(request.max_tokens, self.capacity - len(request.prompt)))
        request.top_k = min(max(int(request.top_k), 0), MAX_TOP_K)
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
        """One forward pass over ids -> (logprob of each token given those before it, (T,), the first NaN;
        the `top` likeliest tokens at each position (T, top) and their logprobs). Any thread may call it: it
        reads the parameters and calls a jitted function, which JAX serialises with the scheduler's own calls."""
        if not 0 < len(ids) <= self.capacity:
            raise ValueError(f"a scored prompt needs 1..{self.capacity} tokens, got {len(ids)}")
        T = min(self.capacity, 1 << (len(ids) - 1).bit_length())  # padded to a power of two: few compilations
        x = np.zeros((1, T), np.int32)
        x[0, : len(ids)] = ids
        logp = np.asarray(self._score(self.params, jnp.asarray(x)))[0, : len(ids)]
        chosen = np.full(len(ids), np.nan, np.float32)
        chosen[1:] = logp[np.arange(len(ids) - 1), ids[1:]]
        alt = np.argsort(-logp[:, :], axis=-1, kind="stable")[:, :top] if top else np.zeros((len(ids), 0), int)
        return chosen, alt[:-1], np.take_along_axis(logp, alt, axis=-1)[:-1]

    def stats(self) -> dict:
        with self._lock:
            queued = len(self._queue)
        return {"slots": self.slots, "active": sum(r is not None for r in self._active), "queued": queued,
                **dict(self.counters)}

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
        self._fail_everything("shutting_down", "the server is shutting down")

    def warmup(self, buckets: bool = True) -> float:
        """Compile the decode program for every (rows, span) pair and prefill for every prompt bucket; returns seconds.

        Call it before start(): it uses the device state directly.
        """
        t0 = time.perf_counter()
        lengths = sorted({bucket_length(n, self.capacity) for n in (1 << p for p in range(self.capacity.bit_length()))})
        for T in lengths if buckets else lengths[:1]:
            self._state = self._prefill(self.params, self._state, jnp.int32(0), jnp.zeros((1, T), jnp.int32), jnp.int32(1))
        rows = sorted({batch_rows(i, self.slots) for i in range(self.slots)})
        spans = sorted({attention_span(n, self.capacity) for n in range(1, self.capacity + 1)})
        for n in rows:
            for span in spans:
                self._state, out, _ = self._decode(self.params, self._state, self._controls({}), jnp.int32(1), rows=n,
                                                   span=span, chunk=self.chunk, stop_tokens=self.stop_tokens,
                                                   tool_end=self.tool_end)
        jax.block_until_ready(self._state)
        return time.perf_counter() - t0

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
                self._state = self._fresh_state()
                busy = False
            if not busy:
                self._wake.wait(0.5)

    def _iteration(self) -> bool:
        """One round: drop cancelled, admit, decode a chunk. False when there was nothing to run."""
        for i, req in enumerate(self._active):
            if req is not None and req.cancelled:
                self._finish(i, "cancelled")
        fresh = self._admit()
        live = [i for i, r in enumerate(self._active) if r is not None]
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
            T = bucket_length(len(req.prompt), self.capacity)
            tokens = np.array([req.prompt + [req.prompt[-1]] * (T - len(req.prompt))], np.int32)
            self._state = self._prefill(self.params, self._state, jnp.int32(slot), tokens, jnp.int32(len(req.prompt)))
            self._active[slot], self._replies[slot] = req, Reply(self.tokenizer, self.run_tool)
            self._pushes.pop(slot, None)
            self.counters["admitted"] += 1
            admitted = True
        return admitted

    def _controls(self, pushes: dict[int, list[int]]) -> Controls:
        N = self.slots
        active, remaining, offset = np.zeros(N, bool), np.zeros(N, np.int32), np.zeros(N, np.int32)
        seed, temperature, top_k = np.zeros(N, np.int32), np.zeros(N, np.float32), np.zeros(N, np.int32)
        top_p = np.ones(N, np.float32)
        push, queue, qlen = np.zeros(N, bool), np.zeros((N, FORCED_CAPACITY), np.int32), np.zeros(N, np.int32)
        for i, req in enumerate(self._active):
            if req is None:
                continue
            active[i], remaining[i], offset[i] = True, req.max_tokens - req.completion_tokens, req.completion_tokens
            seed[i], temperature[i], top_k[i], top_p[i] = req.seed % 2**31, req.temperature, req.top_k, req.top_p
        for i, tokens in pushes.items():
            push[i], queue[i, : len(tokens)], qlen[i] = True, tokens, len(tokens)
        return Controls(active=active, remaining=remaining, offset=offset, seed=seed, temperature=temperature,
                        top_k=top_k, top_p=top_p, push=push, push_queue=queue, push_len=qlen)

    def _decode_chunk(self, highest: int, limit: int) -> None:
        rows = batch_rows(highest, self.slots)
        ends = [len(r.prompt) + r.max_tokens for r in self._active if r is not None]
        reach = [len(r.prompt) + r.completion_tokens + limit for r in self._active if r is not None]
        span = attention_span(min(max(reach), max(ends)), self.capacity)  # where the chunk can write, at most
        pushes, self._pushes = self._pushes, {}
        self._state, out, steps = self._decode(
            self.params, self._state, self._controls(pushes), jnp.int32(limit),
            rows=rows, span=span, chunk=self.chunk, stop_tokens=self.stop_tokens, tool_end=self.tool_end)
        out, steps = jax.device_get((out, steps))
        self.counters["chunks"] += 1
        for i in range(rows):
            if self._active[i] is not None:
                self._advance(i, out[i, : int(steps)].tolist())

    def _advance(self, slot: int, tokens: list[int]) -> None:
        """Feed a slot's new tokens through its Reply; stream the events; finish the request if it ended."""
        req, reply = self._active[slot], self._replies[slot]
        ended, reason = False, None
        for token in tokens:
            req.completion_tokens += 1
            req.tokens.append(token)
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


def new_seed() -> int:
    """A fresh random seed for a request that did not ask for one."""
    return int(np.random.default_rng().integers(0, 2**31 - 1))

