"""Small shared utilities: logging on the main process, multi-host agreement, the base directory, the compute dtype,
progress bars and flag parsing."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import absl.logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm.auto
import tqdm.std
import yaml
from jax.experimental import multihost_utils

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def is_main_process() -> bool:
    return jax.process_index() == 0


def print0(*args, **kwargs) -> None:
    """print() on process 0 only, so multi-host runs log once."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def agree_max(*values):
    """Each value's maximum over all processes, as a tuple of the values' own types (bool, int, float).

    JAX runs multi-controller: every process must take the same branches and write the same numbers into
    replicated arrays, or the job hangs or diverges. Decisions one process makes from its own data (SFT's end
    of epoch, its LR progress) go through this first, as nanochat all-reduces them with MAX. The numbers
    travel as float32 (exact for bools and ints below 2**24). With one process the values come back as given.
    """
    if jax.process_count() == 1:
        return values
    gathered = multihost_utils.process_allgather(np.asarray(values, np.float32))  # (processes, len(values))
    return tuple(type(v)(m) for v, m in zip(values, gathered.max(axis=0).tolist()))


def from_main_process(obj):
    """Process 0's value of a JSON-able object, on every process (with one process, obj itself).

    For host-side results that feed back into jitted work, e.g. a tool's output forced into generation: a
    sandbox that times out on one host but not on another would otherwise make the processes diverge.
    """
    if jax.process_count() == 1:
        return obj
    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8) if is_main_process() else np.zeros(0, np.uint8)
    n = int(multihost_utils.broadcast_one_to_all(np.int32(raw.size)))
    data = multihost_utils.broadcast_one_to_all(np.pad(raw, (0, n - raw.size)))
    return json.loads(bytes(np.asarray(data, np.uint8)).decode())


def to_host(x) -> np.ndarray:
    """A jax array as numpy on every process, also when it is split over other processes' devices (an
    array sharded over 'tensor' across hosts, e.g. logits split by vocabulary, cannot be read locally)."""
    if getattr(x, "is_fully_addressable", True) or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def get_base_dir(create: bool = True) -> str:
    """Where every artifact lives: $FLAXCHAT_BASE_DIR or ~/.cache/flaxchat (created on first use unless not create)."""
    base = os.environ.get("FLAXCHAT_BASE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")
    if create:
        os.makedirs(base, exist_ok=True)
    return base


def enable_compilation_cache(path: str | None = None) -> str | None:
    """Keep compiled programs on disk across runs (JAX's persistent cache) on GPU/TPU, where a large model's
    step takes minutes to compile; a restarted or resumed run then starts at once. Off on CPU, where programs
    compile in seconds and a cache written on one CPU type may not suit another. JAX_COMPILATION_CACHE_DIR, if
    set, wins. Returns the folder in use, or None."""
    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    if path is None and jax.default_backend() == "cpu":
        return None
    path = path or os.path.join(get_base_dir(), "jax_cache")
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def compute_dtype(name: str | None = None):
    """Activation/matmul dtype. Master params stay fp32.

    bf16 on GPU/TPU; fp32 on CPU (nanochat's choice there). bf16 trains faster on CPUs with bf16 instructions
    (AVX512-BF16, AMX; see model.cpu.Forms.widened) at bf16's precision.
    `name` (or $FLAXCHAT_DTYPE) overrides: float32 | bfloat16 | float16.
    """
    name = name or os.environ.get("FLAXCHAT_DTYPE")
    if name:
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(_DTYPES)}")
        return _DTYPES[name]
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


PROGRESS_LOG_SECONDS = 30.0  # a progress line at most this often when output goes to a log ($FLAXCHAT_PROGRESS_SECONDS)


class _LogLines:
    """A file for tqdm that turns its in-place redraws ('\\r', cursor moves) into whole lines, blanks dropped."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, s: str) -> None:
        for line in s.replace("\x1b[A", "\n").replace("\r", "\n").split("\n"):
            if line.strip():
                self.stream.write(line.rstrip() + "\n")

    def flush(self) -> None:
        getattr(self.stream, "flush", lambda: None)()


class _LogTqdm(tqdm.std.tqdm):
    """tqdm whose postfix and description changes wait for the next periodic line instead of forcing one."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)

    def set_postfix_str(self, s="", refresh=True):
        super().set_postfix_str(s, refresh=False)

    def set_description(self, desc=None, refresh=True):
        super().set_description(desc, refresh=False)

    def set_description_str(self, desc=None, refresh=True):
        super().set_description_str(desc, refresh=False)


def progress_bar(iterable=None, **kwargs):
    """tqdm (its usual arguments) that suits both a terminal and a log file.

    On a terminal (or in a notebook) this is tqdm.auto's bar. When its output is not a terminal (CI, nohup, a
    redirect to a file) a redrawn bar would write hundreds of carriage-return updates into one log line, so it
    prints plain ASCII lines instead, each with the count, rate and ETA, at most one per PROGRESS_LOG_SECONDS
    (or $FLAXCHAT_PROGRESS_SECONDS), plus the first and the last: the last even with leave=False, which on a
    terminal erases a finished bar but in a log would leave a stage's only line at 0%.
    """
    stream = kwargs.get("file") or sys.stderr
    notebook = getattr(tqdm.auto, "notebook_tqdm", None) is not getattr(tqdm.auto, "std_tqdm", None)
    if notebook or getattr(stream, "isatty", lambda: False)():
        return tqdm.auto.tqdm(iterable, **kwargs)
    seconds = float(os.environ.get("FLAXCHAT_PROGRESS_SECONDS") or PROGRESS_LOG_SECONDS)
    # maxinterval too: tqdm's monitor thread would otherwise force a refresh every 10 s
    kwargs.update(file=_LogLines(stream), mininterval=seconds, maxinterval=seconds, ascii=True, dynamic_ncols=False)
    kwargs["leave"] = True  # a log's lines are never erased, so the closing one is written
    return _LogTqdm(iterable, **kwargs)


def is_out_of_memory(error: BaseException) -> bool:
    """Did an accelerator (XLA's RESOURCE_EXHAUSTED) or the host run out of memory?"""
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def parse_args(parser, argv=None):
    """argparse with an optional `--config configs/X.yaml` whose keys become the flags' defaults.

    YAML keys may be written as flags are (kebab-case) or as attributes (snake_case); explicit flags win.
    """
    if not any(a.dest == "config" for a in parser._actions):
        parser.add_argument("--config", type=str, default=None, help="YAML file of flag defaults (flags override it)")
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", type=str, default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config:
        if not os.path.exists(known.config):
            parser.error(f"--config file not found: {known.config}")
        try:
            with open(known.config, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            parser.error(f"--config {known.config} is not valid YAML: {str(e).splitlines()[0]}")
        if not isinstance(values, dict):
            parser.error(f"--config {known.config} must be a mapping of flag: value")
        dests = {a.dest for a in parser._actions}
        values = {str(k).replace("-", "_"): v for k, v in values.items()}
        unknown = sorted(set(values) - dests)
        if unknown:
            parser.error(f"--config {known.config} has unknown keys: {', '.join(unknown)}")
        parser.set_defaults(**values)
    return parser.parse_args(argv)


def quiet_library_logs() -> None:
    """Scripts call this: Orbax and JAX log every checkpoint step and backend probe at INFO through absl."""
    absl.logging.set_verbosity(absl.logging.WARNING)
    for name in ("jax._src.xla_bridge", "orbax", "absl"):
        logging.getLogger(name).setLevel(logging.WARNING)
