"""Compiling a server's programs ahead of its requests, so that none compiles while someone waits.

A `Runner` (flaxchat.generate.runner) picks, for each call, one variant of a program: prefill per prompt bucket,
decode per (rows, span) pair, move per count of rows moved. `Precompiler.fit` answers its one question: the
narrowest compiled variant that holds these rows and this span (or this prompt, or these moves). Variants are
compiled from abstract shapes (`jitted.lower(...).compile()`: no device buffer is read, so any thread may do it) and
kept as executables the runner calls directly: nothing is left to compile on first use.

Two ways to warm up:
- `compile_all`: every variant now (chat_web --warmup-all);
- `start`: before serving, the widest decode and prefill, which can run any batch and prompt (on a CPU with XLA's
  quick options, for slower code), and the one-row decodes a first conversation runs on (optimised: a reply at
  full pace from its first token); the rest in a thread of its own while the server answers, narrowest first,
  except that a variant a request just needed goes to the front of the line. Its compiling runs at the lowest CPU
  priority, so decode steps go first (the first minute's reply keeps about half its steady pace or more, where
  the widest programs alone gave it a thirtieth: docs/LOG.md).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import os
import threading
import time
from typing import Hashable

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.common import progress_bar
from flaxchat.generate.programs import attention_span, bucket_length, controls

log = logging.getLogger(__name__)

# XLA:CPU compiles a program several times faster without LLVM's optimisations and with its older fusion code
# generator (the test suite's flags, tests/conftest.py), for slower machine code: a little slower for the widest
# decode program, several times for narrow ones (docs/LOG.md, 2026-12-02). So only the widest programs are compiled
# this way, to serve while the optimised programs compile.
QUICK_CPU_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


def abstract(tree):
    """The shapes and dtypes of a tree's arrays (JAX or NumPy) as jax.ShapeDtypeStruct: what `jitted.lower` needs."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=bool(getattr(x, "weak_type", False))), tree
    )


def batch_rows(highest_slot: int, slots: int) -> int:
    """Rows a decode chunk runs over: the next power of two above the highest active slot, at most `slots`."""
    return min(1 << highest_slot.bit_length(), slots)


def variants(slots: int, capacity: int, extend: bool = True) -> list[tuple]:
    """Every program variant a runner of `slots` rows over a `capacity`-position cache may call, as keys:
    ("prefill", bucket), ("decode", rows, span), ("move", count, span) and, with `extend` (prefix reuse), ("extend",
    bucket, span): a tail's bucket over the cache positions it reaches."""
    buckets = sorted({bucket_length(1 << p, capacity) for p in range(capacity.bit_length())})
    rows = sorted({batch_rows(i, slots) for i in range(slots)})
    spans = sorted({attention_span(n, capacity) for n in range(1, capacity + 1)})
    # the runner's move counts: powers of two (compacting moves at most half the slots, and as many kept rows back)
    moves = [1 << p for p in range((slots - 1).bit_length() + 1)] if slots > 1 else []
    keys = [("prefill", T) for T in buckets] + [("decode", n, s) for n in rows for s in spans]
    keys += [("move", m, s) for m in moves for s in spans]
    return keys + [("extend", T, s) for T in buckets for s in spans if s >= T and extend]


def lowerings(runner, key: tuple, shapes) -> dict:
    """The programs behind a variant by name, lowered from abstract shapes with the arguments the runner's calls
    pass: {"prefill"} | {"extend"} | {"move"} | {"decode"} over the whole state | {"extract", "decode", "flush"} over a
    part."""
    params, state = shapes
    progs, (kind, *size) = runner.programs, key
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    if kind == "prefill":
        return {"prefill": progs.prefill.lower(params, state, i32(), i32(1, size[0]), i32(1))}
    if kind == "move":
        count, span = size
        return {"move": progs.move.lower(state, i32(count), i32(count), span=span)}
    if kind == "extend":
        T, span = size
        return {"extend": progs.extend.lower(params, state, i32(), i32(), i32(), i32(1, T), i32(), span=span)}
    rows, span = size
    ctl = abstract(controls(rows))
    if (rows, span) == (runner.slots, runner.capacity):
        return {"decode": progs.decode.lower(params, state, ctl, i32(), settings=runner.settings)}
    part = abstract(jax.eval_shape(functools.partial(progs.extract, rows=rows, span=span), state))
    return {
        "extract": progs.extract.lower(state, rows=rows, span=span),
        "decode": progs.decode.lower(params, part, ctl, i32(), settings=runner.settings),
        "flush": progs.flush.lower(state, part),
    }


class Precompiler:
    """Compiled variants of one runner's programs, and the thread that compiles the rest.

    `fit(kind, *need)` -> the cheapest ready key of `kind` at least `need` in every size, or None; `program(key)`
    -> its executables by name (see `lowerings`), or None. Both may be called from the runner's thread while the
    compiling thread adds variants."""

    def __init__(self, runner, extend: bool = True):
        self.runner = runner
        self.shapes = abstract((runner.params, runner.state))
        self.keys = variants(runner.slots, runner.capacity, extend)
        self._ready: dict[tuple, list] = {}
        self._wanted: list[tuple] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._finished = threading.Event()
        self._thread: threading.Thread | None = None
        self.pending, self.seconds = 0, None

    def compile(self, key: tuple, options: dict | None = None, pool=None) -> dict:
        """A variant's executables by name, lowered in this thread and compiled in `pool` (an executor) if given."""
        lowered = lowerings(self.runner, key, self.shapes)
        compile_all = lambda: {name: x.compile(options) for name, x in lowered.items()}
        return compile_all() if pool is None else pool.submit(compile_all).result()

    def compile_all(self, progress: bool = False) -> float:
        """Compile every variant now, in this thread; returns seconds."""
        t0 = time.perf_counter()
        with progress_bar(total=len(self.keys), desc="compiling", unit="program", disable=not progress) as bar:
            for key in self.keys:
                self._ready[key] = self.compile(key)
                bar.update()
        self._finished.set()
        return time.perf_counter() - t0

    def start(self, progress: bool = False) -> float:
        """Compile now the widest decode and prefill (quickly on a CPU), which serve any batch and prompt, and the
        one-row decodes of the first three spans, which a conversation runs on for its first hundreds of tokens;
        the rest in a background thread. Returns the seconds until the runner can serve."""
        t0 = time.perf_counter()
        decodes = [k for k in self.keys if k[0] == "decode"]
        widest = [max(k for k in self.keys if k[0] == "prefill"), max(decodes)]
        single = [k for k in decodes if k[1] == 1 and k[2] <= 4 * decodes[0][2]]
        quick = QUICK_CPU_COMPILE if jax.default_backend() == "cpu" else None
        now = [(key, quick) for key in widest] + [(key, None) for key in single if key not in widest]
        # two threads: lowering holds the interpreter lock, XLA's compiling lets it go, so they overlap
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for (key, _), compiled in zip(now, pool.map(lambda job: self.compile(*job), now)):
                self._ready[key] = compiled
        cost = lambda key: math.prod(key[1:])
        jobs = sorted((k for k in self.keys if k not in widest + single), key=cost) + (widest if quick else [])
        self.pending = len(jobs)
        self._thread = threading.Thread(target=self._run, args=(jobs, progress), name="flaxchat-compile", daemon=True)
        self._thread.start()
        return time.perf_counter() - t0

    def _run(self, jobs: list[tuple], progress: bool) -> None:
        # Lowering (tracing in Python, holding the interpreter lock) runs here, at the usual priority; XLA's
        # compiling (which lets the lock go) in a thread at the lowest: a low-priority thread holding the lock would
        # stall the server's other threads whenever the machine is busy.
        niced = concurrent.futures.ThreadPoolExecutor(1, "flaxchat-compile-low", initializer=_lowest_priority)
        t0 = time.perf_counter()
        try:
            with progress_bar(
                total=len(jobs), desc="compiling (serving meanwhile)", unit="program", disable=not progress
            ) as bar:
                while jobs and not self._stop.is_set():
                    with self._lock:  # a variant a request wanted first
                        key = next((k for k in self._wanted if k in jobs), jobs[0])
                    jobs.remove(key)
                    try:
                        compiled = self.compile(key, pool=niced)
                    except Exception:
                        log.exception("compiling %s in the background failed; serving without it", key)
                    else:
                        with self._lock:
                            self._ready[key] = compiled
                    self.pending -= 1
                    bar.update()
        finally:
            niced.shutdown()
            self.seconds = time.perf_counter() - t0
            self._finished.set()

    def fit(self, kind: str, *need: int) -> tuple | None:
        with self._lock:
            fits = [k for k in self._ready if k[0] == kind and all(a >= b for a, b in zip(k[1:], need))]
            best = min(fits, key=lambda k: math.prod(k[1:]), default=None)
            wanted = (kind, *need)
            if (best is None or best != wanted) and wanted not in self._wanted:
                self._wanted.insert(0, wanted)
        return best

    def program(self, key: Hashable) -> dict | None:
        with self._lock:
            return self._ready.get(key)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every variant has compiled; True once they have (or if nothing compiles in the background)."""
        return self._thread is None or self._finished.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Compile nothing further; wait (at most `timeout` seconds) for the variant compiling now."""
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)


def _lowest_priority() -> None:
    """Give the calling thread (and the threads it starts) the lowest CPU priority (Linux: a thread's own nice value),
    so that it compiles only when decode steps leave a core free."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the usual priority
        log.debug("could not lower the compiling thread's priority", exc_info=True)
