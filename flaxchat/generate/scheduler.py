"""Continuous batching: one thread owns the model and a batch of N slots that conversations share.

The server's user of the generation core, as the Engine is the scripts': the same slot driver
(flaxchat.generate.batch.Batch) over the same runner and programs. A request (prompt ids + sampling settings) waits
in a queue until a slot is free. Each iteration of the scheduler's thread:

1. ends requests that were cancelled (a stop button, a closed socket) and frees their slots;
2. admits queued requests into free slots (one prefill each, its prompt padded to a power-of-two bucket);
3. packs live rows low (Batch.compact), so that when short replies end a long one does not keep the batch wide;
4. runs ONE decode chunk over the lowest rows that hold every live one; each row's new tokens go through its tool
   state machine and text decoder and stream to its client as events (Batch.step).

A chunk is as long as the token latency allows (`stream_interval`): its length follows the measured time of a decode
step, so a client sees each token within about that long of its sampling, whether the model makes 10 or 1,000 tokens
a second (at most `chunk` steps: long chunks amortise the host's work per call). A newcomer's first chunk is one step.

Programs are compiled ahead (`warmup`, or `warmup_in_background`: the widest now, the rest while serving;
flaxchat.generate.warmup), so no request waits for a compile once they are done. With a draft model the batch is one
row of speculative sampling (flaxchat.generate.speculative): one conversation at a time, the others wait.

Randomness is per request: token n uses fold_in(fold_in(key(seed), 0), n), so a seeded request gives the same reply
whichever slot it lands in and whoever else is being served (and the same as the Engine's first sample with that
seed). A request that asks for `logprobs` makes the chunks it takes part in return each emitted token's raw
log-probability and top alternatives, computed on the device; `score` gives a prompt's the same way.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flaxchat.generate.batch import Batch, Request, end, send
from flaxchat.generate.programs import DecodeSettings, compiler_options, in_compute_dtype, programs_for
from flaxchat.generate.reply import stop_tokens
from flaxchat.generate.runner import Runner
from flaxchat.generate.sampling import MAX_TOP_K, MAX_TOP_LOGPROBS, TOP_K_TIERS
from flaxchat.generate.sandbox import use_calculator
from flaxchat.generate.speculative import SpeculativeRunner
from flaxchat.generate.warmup import Precompiler
from flaxchat.model.gpt import with_stacked_qkv

__all__ = ["MAX_TOP_K", "QueueFull", "Request", "Scheduler", "SpeculativeScheduler", "auto_slots", "new_seed"]

log = logging.getLogger(__name__)

STREAM_INTERVAL = 0.05  # seconds: the longest a sampled token should wait on the device before it is streamed


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


def auto_slots(model, capacity=None, memory=None, fraction: float = 0.25, most: int = 32) -> tuple[int, str]:
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


class QueueFull(Exception):
    """Raised by submit() when the waiting queue is at its limit."""


class Scheduler:
    """Owns the model and N slots; `submit` requests from any thread, events come back through request.emit.

    slots: rows of the batched KV cache (concurrent generations); chunk: most decode steps per jitted call;
    stream_interval: seconds a sampled token may wait before it is streamed (sets each chunk's length from the
    measured step time). draft_model: speculative sampling, one conversation at a time (draft_steps a round).
    prefix_reuse: keep finished rows' caches for the next turn of their conversation (batch.Batch, `keep`).
    """

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
        stream_interval: float = STREAM_INTERVAL,
        draft_model=None,
        draft_steps: int = 4,
        prefix_reuse: bool = True,
    ):
        if slots < 1 or chunk < 1:
            raise ValueError(f"slots and chunk must be >= 1, got slots={slots}, chunk={chunk}")
        if draft_model is not None:
            slots, capacity = 1, capacity or min(model.config.sequence_len, draft_model.config.sequence_len)
        self.model, self.tokenizer, self.draft_model, self.draft_steps = model, tokenizer, draft_model, draft_steps
        self.slots, self.chunk, self.max_queue, self.stream_interval = slots, chunk, max_queue, stream_interval
        self.capacity = capacity or model.config.sequence_len
        self.stop_tokens = stop_tokens(tokenizer)
        self.tool_end = tokenizer.encode_special("<|python_end|>")
        graphdef, params = nnx.split(with_stacked_qkv(model))
        self.params = in_compute_dtype(params, model.dtype)  # once: serving reads bf16 weights on accelerators
        self.programs = programs_for(graphdef, options=compiler_options(params))
        if draft_model is None:
            settings = DecodeSettings(chunk, self.stop_tokens, self.tool_end, TOP_K_TIERS)
            runner = Runner(self.programs, self.params, model, slots=slots, capacity=self.capacity, settings=settings)
        else:
            runner = SpeculativeRunner(
                model,
                draft_model,
                draft_steps=draft_steps,
                capacity=self.capacity,
                chunk=chunk,
                stop_tokens=self.stop_tokens,
                tool_end=self.tool_end,
            )
        # prefix reuse: a conversation's next turn prefills only its new tokens (not with speculative sampling, whose
        # one row has two caches to keep in step)
        self.batch = Batch(runner, tokenizer, run_tool, keep=prefix_reuse and draft_model is None)
        self.step_seconds: float | None = None  # a decode step's measured time (a moving average)
        self._queue: collections.deque[Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._failures = 0

    @property
    def returns_logprobs(self) -> bool:
        """Whether Request.logprobs is honoured (speculative rounds do not compute generated tokens' logprobs)."""
        return self.draft_model is None

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
        """One forward pass over ids -> (logprob of each token given those before it (T,), the first NaN; the `top`
        likeliest tokens after each of the first T-1 (T-1, top) and their logprobs). Reduced on the device
        (Programs.score): the host gets these, never the (T, vocabulary) log-probabilities. Any thread may call it:
        it reads the parameters and calls a jitted function, which JAX serialises with the scheduler's own."""
        if not 0 < len(ids) <= self.capacity:
            raise ValueError(f"a scored prompt needs 1..{self.capacity} tokens, got {len(ids)}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
        n = len(ids)
        x = np.zeros((1, min(self.capacity, 1 << (n - 1).bit_length())), np.int32)  # a power of two: few compiles
        x[0, :n] = ids
        # one static top (cut here) rather than one program per `top`: (T, 20) numbers cost nothing to bring back
        logp, values, alt = jax.device_get(self.programs.score(self.params, x, top=MAX_TOP_LOGPROBS))
        chosen = np.full(n, np.nan, np.float32)
        chosen[1:] = logp[: n - 1]
        return chosen, alt[: n - 1, :top], values[: n - 1, :top]

    def stats(self) -> dict:
        with self._lock:
            queued = len(self._queue)
        ahead = self.batch.runner.ahead
        extra = {"draft_steps": self.draft_steps} if self.draft_model is not None else {}
        if ahead is not None:
            extra["programs_compiling"] = ahead.pending
        if self.step_seconds is not None:
            extra["decode_step_ms"] = round(1000 * self.step_seconds, 2)
        if self.batch.keep:
            extra["kept"] = len(self.batch.kept)
        live = len(self.batch.live)
        return {
            "slots": self.slots,
            "active": live,
            "queued": queued,
            **extra,
            "failures": self._failures,
            **dict(self.batch.counters),
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
            waiting, self._queue = list(self._queue), collections.deque()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.batch.runner.ahead is not None:
            self.batch.runner.ahead.stop(timeout)
        self.batch.fail("shutting_down", "the server is shutting down")
        for request in waiting:
            request.finish_reason = "error"
            send(request, [{"type": "error", "reason": "shutting_down", "message": "the server is shutting down"}])

    # --- compiling ahead (before start) ----------------------------------------

    def warmup(self, progress: bool = False) -> float:
        """Compile every program a request may run (every prompt bucket, (rows, span) pair and move count) before
        serving; returns seconds. `progress`: a bar with an ETA (32 slots at a 2048-token context are 43 programs,
        minutes on a GPU the first time; then JAX's persistent cache has them)."""
        runner = self.batch.runner
        if self.draft_model is not None:
            return runner.warmup(progress)
        runner.ahead = Precompiler(runner, extend=self.batch.keep)
        return runner.ahead.compile_all(progress)

    def warmup_in_background(self, progress: bool = False) -> float:
        """Compile the widest programs now (they serve any batch) and the rest in a background thread while serving;
        returns the seconds until the scheduler can serve (flaxchat.generate.warmup)."""
        runner = self.batch.runner
        if self.draft_model is not None:  # one conversation at a time needs only a prefill per bucket and a round
            return runner.warmup(progress)
        runner.ahead = Precompiler(runner, extend=self.batch.keep)
        return runner.ahead.start(progress)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for warmup_in_background's thread to compile every variant; True once it has (or if none runs)."""
        return self.batch.runner.ahead is None or self.batch.runner.ahead.wait(timeout)

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
                self._failures += 1
                self.batch.fail("internal_error", f"generation failed: {type(e).__name__}")
                self.batch.runner.reset()
                busy = False
            if not busy:
                self._wake.wait(0.5)

    def _iteration(self) -> bool:
        """One round: drop cancelled, admit, decode a chunk. False when there was nothing to run."""
        for slot in self.batch.live:
            if self.batch.rows[slot].cancelled:
                self.batch.finish(slot, "cancelled")
        fresh = self._admit()
        self.batch.compact()
        if not self.batch.live:
            return False
        t0 = time.perf_counter()
        out = self.batch.step(1 if fresh else self._chunk_length())  # a newcomer's first token comes fast
        if int(out.steps):
            seconds = (time.perf_counter() - t0) / int(out.steps)
            self.step_seconds = seconds if self.step_seconds is None else 0.7 * self.step_seconds + 0.3 * seconds
        return True

    def _chunk_length(self) -> int:
        """Decode steps in the next chunk: as many as fit the stream interval at the measured step time (1..chunk)."""
        if self.step_seconds is None:
            return self.chunk
        return max(1, min(self.chunk, int(self.stream_interval / self.step_seconds)))

    def _admit(self) -> bool:
        admitted = False
        while self.batch.free:
            with self._lock:
                if not self._queue:
                    break
                request = self._queue.popleft()
            if request.cancelled:
                end(request, "cancelled")
                self.batch.counters["finished_cancelled"] += 1
                continue
            self.batch.admit(request)
            admitted = True
        return admitted


class SpeculativeScheduler(Scheduler):
    """The Scheduler with speculative sampling (flaxchat.generate.speculative): one conversation at a time, its tokens
    proposed by `draft_model` `draft_steps` at a time and checked by the model in one forward pass; the others wait
    in the queue. Replies follow the model's own distribution. It trades the batch for the lowest latency of one
    reply: a person chatting on their own machine, with a draft much cheaper than the model. Everything else
    (streaming, tools, cancelling, scoring, /health) works as in the batched scheduler, except generated tokens'
    logprobs."""

    def __init__(self, model, tokenizer, draft_model, *, draft_steps: int = 4, **kwargs):
        super().__init__(model, tokenizer, draft_model=draft_model, draft_steps=draft_steps, **kwargs)


def new_seed() -> int:
    """A fresh random seed for a request that did not ask for one."""
    return int(np.random.default_rng().integers(0, 2**31 - 1))
