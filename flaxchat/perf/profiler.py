"""Profiling training steps: a jax.profiler trace of chosen steps, and where their time went."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import jax

from flaxchat.common import print0
from flaxchat.perf.hlo import op_kinds, op_sources, scatter_combiners
from flaxchat.perf.trace import COMMAND_BUFFERS_OFF, format_summary, summarize_trace


class StepProfiler:
    """A jax.profiler trace of steps [start, stop) (`--profile-steps A:B`), written under `directory`.

    Open it in XProf / TensorBoard's profile plugin (`xprof --logdir DIR`, or `tensorboard --logdir DIR` with
    tensorboard-plugin-profile) or drop the perfetto_trace.json.gz file on https://ui.perfetto.dev. Each step
    is annotated (StepTraceAnnotation) so the tools show step boundaries and per-step time.
    """

    def __init__(self, steps: tuple[int, int] | None, directory: str):
        self.start, self.stop = steps or (-1, -1)
        self.directory, self.active, self.written = directory, False, False  # written: a trace was started

    @staticmethod
    def parse(spec: str) -> tuple[int, int]:
        """'A:B' -> (A, B): the steps A, A+1, ..., B-1 (the --profile-steps flag's type)."""
        try:
            a, b = (int(x) for x in spec.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes START:STOP (e.g. 5:8), got {spec!r}") from None
        if not 0 <= a < b:
            raise argparse.ArgumentTypeError(f"{spec}: need 0 <= START < STOP")
        return a, b

    @staticmethod
    def prepare(steps) -> bool:
        """Call with --profile-steps before JAX starts its backend (XLA reads XLA_FLAGS then).

        XLA on a GPU launches a step's kernels in batches, as CUDA graphs (command buffers), and a trace shows each
        batch as one op (command_buffer_N) whose kernels are hidden. With steps to profile this turns command
        buffers off for the process (trace.COMMAND_BUFFERS_OFF; no effect on a CPU or TPU), unless XLA_FLAGS sets
        that flag already, so every kernel shows; the steps then run a little slower (d12 on one H200: 136.5
        instead of 132.1 ms a step). Returns whether XLA_FLAGS changed."""
        flags = os.environ.get("XLA_FLAGS", "")
        if not steps or COMMAND_BUFFERS_OFF.rstrip("=") in flags:
            return False
        os.environ["XLA_FLAGS"] = f"{flags} {COMMAND_BUFFERS_OFF}".strip()
        return True

    @staticmethod
    def add_flag(parser, where: str) -> None:
        """--profile-steps START:STOP on a script's parser; `where` says where the trace goes."""
        parser.add_argument(
            "--profile-steps",
            type=StepProfiler.parse,
            default=None,
            help=f"write a jax.profiler trace of steps START:STOP (e.g. 5:8; step 0 compiles) to "
            f"{where}. On a GPU the run turns XLA's command buffers off, so each kernel shows "
            "in the trace",
        )

    def covers(self, i: int) -> bool:
        """Whether step i is one of the profiled steps."""
        return self.start <= i < self.stop

    def step(self, i: int):
        """Call before running step i; returns the context manager that annotates it."""
        if i == self.start and not self.active:
            os.makedirs(self.directory, exist_ok=True)
            jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
            self.active = self.written = True
        elif i == self.stop and self.active:
            self.close()
        return jax.profiler.StepTraceAnnotation("step", step_num=i) if self.active else contextlib.nullcontext()

    def dispatch(self, i: int, in_flight, run) -> list:
        """Step i through `in_flight` (train.step.InFlight), as the training loops run their steps: run() reads the
        step's batches and dispatches it, returning (outputs, info); the step's clock starts before the read. A
        profiled step runs alone (the step in flight is finished first, and this one waited for). Returns the steps
        that finished meanwhile, InFlight's (outputs, info, seconds) each, the oldest first."""
        profiled = self.covers(i)
        finished = [in_flight.finish()] if profiled else []
        started = time.perf_counter()
        with self.step(i):
            outputs, info = run()
            finished.append(in_flight.submit(outputs, info, started))
            if profiled:
                finished.append(in_flight.finish())
        return [done for done in finished if done is not None]

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
            print0(f"profile of steps {self.start}..{self.stop - 1} written to {self.directory}", file=sys.stderr)


def profile_summary(profiler, step, batch, mesh) -> dict | None:
    """Where a StepProfiler's steps of a FlatStep spent their time (flaxchat.perf.trace's summary), each op's kind and
    source line read off the compiled step: the same program, compiled again from the same arguments (at once where
    the persistent compilation cache is on, as on accelerators). batch: (xs, ys) as the step takes them. None if no
    trace was written."""
    if not profiler.written:
        return None
    with jax.set_mesh(mesh):
        hlo = step.lower(*batch).compile().as_text()
    summary = summarize_trace(profiler.directory, kinds=op_kinds(hlo), module="train_step", sources=op_sources(hlo))
    # the embeddings' gradients: "f32 add" where the device adds atomically (hlo.scatter_combiners)
    summary["scatters"] = [f"{dtype} {' '.join(ops)}" for dtype, ops in scatter_combiners(hlo)]
    return summary


def save_profile_summary(profiler, step, batch, mesh) -> dict | None:
    """profile_summary of a training run's profiled steps, saved as summary.json beside the trace and printed to
    stderr; None if no trace was written."""
    summary = profile_summary(profiler, step, batch, mesh)
    if summary is not None:
        with open(os.path.join(profiler.directory, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print0(format_summary(summary, "the profiled steps: "), file=sys.stderr)
    return summary
