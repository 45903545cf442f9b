"""Pretraining batches: parquet documents -> tokens -> BOS-aligned best-fit rows -> (B, T) int32 on devices.

The pipeline is a Grain pipeline:

    ReaderStream (this reader's documents, forever)             flaxchat.data.dataset.ParquetDocuments underneath
      chunks of 128 documents per parquet row group             nanochat's tokenizer batches
      .map(tokenize)  .to_iter_dataset(threads)                 BOS-prepended token ids, tokenized ahead in threads
      BestFitPackIterDataset                                    nanochat's BOS-aligned best-fit packing
      .map(rows -> inputs, targets)  ThreadPrefetchIterDataset  batches ready before the step asks
    DataLoader.__next__                                         jax.make_array_from_process_local_data

Packing is nanochat's algorithm (flaxchat.data.packing): rows of T+1 tokens filled best-fit from a buffer of
documents, cropped to fill, no padding, every row starting with BOS. This module is the Grain plumbing around it.

Multi-host: processes that hold different rows of the batch read disjoint shards of the documents and
build only their local rows; processes holding the same rows (replicas) read the same shard.

Resume: `get_state()` is a JSON-able dict naming the reader's position and the documents in its packing
buffer. Restored on the same reader layout it is exact (the batches that would have followed, follow);
restored from every process's states onto another layout (more or fewer hosts, a different mesh) the
position is carried over: the documents the interrupted epoch still owes are split over the new readers
first, so none is trained on twice or skipped.

Readers take parquet row groups round-robin within each file and tokenizer batches are cut per row group,
both as nanochat does, so a single reader's batches equal nanochat's on any shards. The one deliberate
difference: resume restores the packing buffer exactly where nanochat skips ahead to the next row group.
There is no separate device-prefetch stage: JAX's device_put is asynchronous, so placing a ready host
batch returns at once and the copy overlaps the running step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.data.dataset import ParquetDocuments, list_parquet_files, split_files
from flaxchat.data.packing import BUFFER_SIZE, TOKENIZER_BATCH_SIZE, BestFitPacker
from flaxchat.sharding import batch_sharding

STATE_FORMAT = 2


# -----------------------------------------------------------------------------
# The packer as a Grain transformation


class BestFitPackIterDataset(grain.IterDataset):
    """Grain IterDataset: (first_doc_id, [token arrays]) chunks -> (B, T+1) best-fit row batches.

    Written by hand because Grain's packers (grain.experimental.BestFitPackIterDataset and friends)
    solve a different problem: they bin-pack whole sequences into a fixed set of padded bins with
    segment ids, and checkpoint by replaying the parent from the start of the current pack. nanochat's
    packer never pads, crops to fill, and keeps a rolling buffer that a document may stay in for an
    unbounded time, so no short replay reproduces it. Instead the state names the buffered documents
    by stream index and `fetch_docs` re-reads and re-tokenizes exactly those on restore.
    """

    def __init__(
        self,
        parent: grain.IterDataset,
        fetch_docs: Callable[[list[int]], list[np.ndarray]],
        batch_size: int,
        seq_len: int,
        buffer_size: int = BUFFER_SIZE,
    ):
        super().__init__(parent)
        self._fetch_docs = fetch_docs
        self._args = (batch_size, seq_len, buffer_size)

    def __iter__(self) -> grain.DatasetIterator:
        return _BestFitPackIterator(self._parent.__iter__(), self._fetch_docs, *self._args)

    def __str__(self) -> str:
        return (
            f"BestFitPackIterDataset(batch_size={self._args[0]}, seq_len={self._args[1]}, buffer_size={self._args[2]})"
        )


class _BestFitPackIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, fetch_docs, batch_size, seq_len, buffer_size):
        super().__init__(parent)
        self._fetch_docs = fetch_docs
        self._packer = BestFitPacker(batch_size, seq_len, buffer_size)
        self._next_doc = 0  # stream index of the first document not yet read from the parent

    def _refill(self) -> None:
        first, docs = next(self._parent)
        self._packer.add(range(first, first + len(docs)), docs)
        self._next_doc = first + len(docs)

    def __next__(self) -> np.ndarray:
        return self._packer.pack(self._refill)

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._parent.get_state(), "next_doc": self._next_doc, "buffer": self._packer.doc_ids()}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["parent"])
        ids = [int(i) for i in state["buffer"]]
        self._packer.clear()
        self._packer.add(ids, self._fetch_docs(ids))
        self._next_doc = int(state["next_doc"])


# -----------------------------------------------------------------------------
# One reader's document stream


class ReaderStream:
    """One reader's documents in reading order, cut into tokenizer batches; a Grain random-access source.

    The stream is the reader's `prefix` (documents an interrupted pass still owes, handed out when a run
    resumes on a different reader layout; [start, stop, epoch] global ranges) followed by epochs
    `first_epoch, first_epoch + 1, ...` of its shard, forever. Stream positions number its documents, so a
    loader state names documents by position. Tokenizer batches are cut per parquet row group, as in
    nanochat: a row group of 300 documents gives batches of 128, 128 and 44.
    """

    def __init__(
        self,
        docs: ParquetDocuments,
        tokenizer_batch_size: int = TOKENIZER_BATCH_SIZE,
        prefix: Sequence[Sequence[int]] = (),
        first_epoch: int = 1,
    ):
        tb = tokenizer_batch_size
        self.docs, self.first_epoch = docs, int(first_epoch)
        self.prefix = [tuple(int(x) for x in r) for r in prefix if r[1] > r[0]]
        self._prefix_offsets = np.cumsum([0] + [hi - lo for lo, hi, _ in self.prefix])
        self._prefix_starts = np.array([lo for lo, _, _ in self.prefix], np.int64)
        self.prefix_len, self.epoch_len = int(self._prefix_offsets[-1]), len(docs)
        # tokenizer batches as (stream position, global start, count): the prefix's, then one epoch's
        self._prefix_chunks = [
            (int(off) + k, lo + k, min(tb, hi - lo - k))
            for (lo, hi, _), off in zip(self.prefix, self._prefix_offsets)
            for k in range(0, hi - lo, tb)
        ]
        self._epoch_chunks = [
            (int(off) + k, lo + k, min(tb, hi - lo - k))
            for (lo, hi), off in zip(docs.units, docs._offsets)
            for k in range(0, hi - lo, tb)
        ]

    def __len__(self) -> int:
        return sys.maxsize  # epochs run on forever, like nanochat's loader

    def __getitem__(self, chunk: int) -> tuple[int, list[str]]:
        if chunk < len(self._prefix_chunks):
            pos, start, n = self._prefix_chunks[chunk]
        else:
            epoch, j = divmod(chunk - len(self._prefix_chunks), len(self._epoch_chunks))
            pos, start, n = self._epoch_chunks[j]
            pos += self.prefix_len + epoch * self.epoch_len
        return pos, self.docs.read(range(start, start + n))

    def global_index(self, positions: Sequence[int]) -> np.ndarray:
        """Global document indices of stream positions."""
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = np.empty_like(pos)
        early = pos < self.prefix_len
        if early.any():
            r = np.searchsorted(self._prefix_offsets, pos[early], side="right") - 1
            out[early] = self._prefix_starts[r] + pos[early] - self._prefix_offsets[r]
        if (~early).any():
            out[~early] = self.docs.global_index(pos[~early] - self.prefix_len)
        return out

    def epoch_at(self, position: int) -> int:
        """The epoch the document at stream `position` belongs to."""
        if position < self.prefix_len:
            return self.prefix[int(np.searchsorted(self._prefix_offsets, position, side="right") - 1)][2]
        return self.first_epoch + (position - self.prefix_len) // self.epoch_len

    def ranges(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Stream positions [start, stop) as (global start, global stop, times) ranges; whole epochs come
        back once with their count instead of once per epoch."""
        out = []
        for (lo, hi, _), off in zip(self.prefix, self._prefix_offsets.tolist()):
            a, b = max(start, off), min(stop, off + hi - lo)
            if a < b:
                out.append((lo + a - off, lo + b - off, 1))
        a, b = max(start, self.prefix_len) - self.prefix_len, stop - self.prefix_len
        if a >= b:
            return out
        n = self.epoch_len
        if b - a >= n and a % n == 0:  # whole epochs first
            whole = (b - a) // n
            out += [(lo, hi, whole) for lo, hi in self.docs.units]
            a += whole * n
        for e in range(a // n, -(-b // n)):  # what is left, epoch by epoch
            lo_e, hi_e = max(a, e * n) - e * n, min(b, (e + 1) * n) - e * n
            for (lo, hi), off in zip(self.docs.units, self.docs._offsets.tolist()):
                x, y = max(lo_e, off), min(hi_e, off + hi - lo)
                if x < y:
                    out.append((lo + x - off, lo + y - off, 1))
        return out


def _epoch_coverage(states: list[dict], streams: list[ReaderStream], total: int) -> tuple[np.ndarray, np.ndarray]:
    """How many epochs each document has been trained on, given every reader's state: (boundaries, counts)
    with counts[i] for documents boundaries[i]..boundaries[i+1]. Buffered documents are not trained on yet."""
    base = {s.first_epoch - 1 for s in streams}
    if len(base) != 1:
        raise ValueError("saved data loader states disagree on their epoch; they are not from one checkpoint")
    pieces = [(0, total, base.pop())]
    for state, stream in zip(states, streams):
        t = int(state["pipeline"]["next_doc"]) if state.get("pipeline") else 0
        buffered = np.asarray(state["pipeline"]["buffer"] if state.get("pipeline") else [], np.int64)
        # the prefix is owed: what is not yet taken from it counts -1; taken epoch documents count +1
        pieces += [(lo, hi, -k) for lo, hi, k in stream.ranges(t, stream.prefix_len)]
        pieces += [(lo, hi, k) for lo, hi, k in stream.ranges(stream.prefix_len, max(t, stream.prefix_len))]
        pieces += [(g, g + 1, -1) for g in stream.global_index(buffered).tolist()]  # read, not taken yet
    starts = np.array([p[0] for p in pieces], np.int64)
    stops = np.array([p[1] for p in pieces], np.int64)
    weights = np.array([p[2] for p in pieces], np.int64)
    bounds = np.unique(np.concatenate([starts, stops]))
    delta = np.zeros(len(bounds), np.int64)
    np.add.at(delta, np.searchsorted(bounds, starts), weights)
    np.add.at(delta, np.searchsorted(bounds, stops), -weights)
    return bounds, np.cumsum(delta)[:-1]


def carry_over(states: Sequence[dict], docs: ParquetDocuments) -> dict:
    """Reader `docs.shard`'s state on a new reader layout, from every reader's state saved on the old one.

    Nothing is trained on twice or skipped: the documents the interrupted epoch(s) still owe (unread,
    or read into a packing buffer but not yet placed in a row) are split evenly over the new readers as
    their stream's prefix, and every reader then goes on with the next epoch of its new shard.
    """
    index, count = docs.shard
    streams = []
    for st in states:
        old = docs.with_shard(tuple(st["shard"]))
        streams.append(ReaderStream(old, st["tokenizer_batch_size"], st.get("prefix", ()), st.get("first_epoch", 1)))
    bounds, counts = _epoch_coverage(list(states), streams, docs.total)
    low, high = int(counts.min()), int(counts.max())
    prefix = []
    for epoch in range(low + 1, high + 1):  # documents still owed to `epoch`, in order, cut into equal shares
        owed = [(int(a), int(b)) for a, b, c in zip(bounds[:-1], bounds[1:], counts) if c < epoch]
        ends = np.cumsum([b - a for a, b in owed])
        first, last = (int(ends[-1]) * k // count for k in (index, index + 1))
        for (a, b), end in zip(owed, ends.tolist()):
            lo, hi = max(a, a + first - (end - (b - a))), min(b, a + last - (end - (b - a)))
            if lo < hi:
                prefix.append([lo, hi, epoch])
    documents = sum(_documents_taken(st) for st in states) if index == 0 else 0
    return {"prefix": prefix, "first_epoch": high + 1, "documents": documents, "pipeline": None}


def _documents_taken(state: dict) -> int:
    """Documents a reader has placed in rows: carried over from earlier layouts, plus read minus still buffered."""
    pipeline = state.get("pipeline")
    read = (int(pipeline["next_doc"]) - len(pipeline["buffer"])) if pipeline else 0
    return int(state.get("documents", 0)) + read


# -----------------------------------------------------------------------------
# Building the pipeline for one reader


def tokenize_fn(tokenizer, num_threads: int = 1) -> Callable[[list[str]], list[np.ndarray]]:
    """texts -> int32 token arrays with BOS prepended (any object with encode/get_bos_token_id)."""
    bos = tokenizer.get_bos_token_id()

    def tokenize(texts: list[str]) -> list[np.ndarray]:
        out = [
            np.asarray(ids, dtype=np.int32)
            for ids in tokenizer.encode(list(texts), prepend=bos, num_threads=num_threads)
        ]
        if out and (len(out[0]) == 0 or out[0][0] != bos):
            raise ValueError("tokenizer.encode(texts, prepend=bos) must return ids that start with BOS")
        return out

    return tokenize


def _split_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return np.ascontiguousarray(rows[:, :-1]), np.ascontiguousarray(rows[:, 1:])


def build_pipeline(
    tokenizer,
    batch_size: int,
    seq_len: int,
    stream: ReaderStream,
    *,
    buffer_size: int = BUFFER_SIZE,
    tokenizer_threads: int = 1,
    read_threads: int = 2,
    prefetch: int = 2,
) -> grain.IterDataset:
    """The Grain pipeline of one reader: its stream -> (inputs, targets) numpy int32 (batch_size, seq_len)."""
    tokenize = tokenize_fn(tokenizer, tokenizer_threads)
    chunks = (
        grain.MapDataset.source(stream)
        .map(lambda chunk: (chunk[0], tokenize(chunk[1])))
        .to_iter_dataset(grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=max(2, 2 * read_threads)))
    )

    def fetch_docs(positions: list[int]) -> list[np.ndarray]:
        return tokenize(stream.docs.read(stream.global_index(positions))) if positions else []

    packed = BestFitPackIterDataset(chunks, fetch_docs, batch_size, seq_len, buffer_size).map(_split_rows)
    return grain.experimental.ThreadPrefetchIterDataset(packed, prefetch_buffer_size=prefetch)


class DataLoader:
    """Iterator of (inputs, targets) batches with a JSON-able, exactly resumable state.

    `place` turns the local numpy batch into whatever the caller wants (global jax arrays for training);
    None keeps numpy. The state records what defines the stream (split, data, reader, tokenizer batch),
    so a state that does not belong to this loader fails loudly instead of drifting; states saved on
    another reader layout go through `numpy_loader(states=...)`, which carries the position over.
    """

    def __init__(
        self,
        pipeline: grain.IterDataset,
        stream: ReaderStream,
        meta: dict[str, Any],
        place: Callable[[np.ndarray, np.ndarray], tuple[Any, Any]] | None = None,
        state: dict[str, Any] | None = None,
    ):
        self._it = iter(pipeline)
        self._stream, self._meta, self._place = stream, meta, place
        self._documents = int(state.get("documents", 0)) if state else 0
        if state is not None and state.get("pipeline") is not None:
            self.set_state(state)

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self):
        inputs, targets = next(self._it)
        return self._place(inputs, targets) if self._place else (inputs, targets)

    def get_state(self) -> dict[str, Any]:
        pipeline = self._it.get_state()
        return {
            "format": STATE_FORMAT,
            **self._meta,
            "num_docs": self._stream.epoch_len,
            "epoch": self._stream.epoch_at(pipeline["next_doc"]),
            "prefix": self._stream.prefix,
            "first_epoch": self._stream.first_epoch,
            "documents": self._documents,
            "pipeline": pipeline,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        expected = {
            "format": STATE_FORMAT,
            **self._meta,
            "num_docs": self._stream.epoch_len,
            "prefix": [list(r) for r in self._stream.prefix],
            "first_epoch": self._stream.first_epoch,
        }
        got = {**state, "prefix": [list(r) for r in state.get("prefix", ())]}
        diff = [k for k, v in expected.items() if got.get(k) != v and k not in ("batch_size", "seq_len", "buffer_size")]
        if diff:
            raise ValueError(
                "data loader state does not match this loader: saved "
                f"{ {k: got.get(k) for k in diff} }, loader has { {k: expected[k] for k in diff} }"
            )
        self._documents = int(state.get("documents", 0))
        self._it.set_state(state["pipeline"])

    @property
    def epoch(self) -> int:
        return self.get_state()["epoch"]

    @property
    def documents(self) -> int:
        """Documents this reader has placed in rows since the run began (summed over readers: the run's)."""
        return _documents_taken(self.get_state())

    def close(self) -> None:
        """Stop the prefetch threads. Dropping the iterator here, while Grain's modules are alive, also
        keeps its finalizer from running at interpreter exit (where it prints a spurious error)."""
        if getattr(self, "_it", None) is not None:
            self._it.close()
            self._it = None

    __del__ = close


def resume_state(states: dict | Sequence[dict], docs: ParquetDocuments, meta: dict[str, Any]) -> dict:
    """This reader's starting state from a saved state (one dict) or every process's saved states (a list).

    The reader's own saved state when the reader layout is unchanged (exact: the same batches follow);
    otherwise the position is carried over to the new layout (`carry_over`).
    """
    states = [states] if isinstance(states, dict) else list(states)
    if not states:
        raise ValueError("no saved data loader state to resume from")
    for st in states:
        if st.get("format") != STATE_FORMAT:
            raise ValueError(
                f"data loader state format {st.get('format')} is not {STATE_FORMAT} (saved by another "
                "flaxchat version); its data position cannot be carried over"
            )
        diff = {k: (st.get(k), meta[k]) for k in ("split", "data") if st.get(k) != meta[k]}
        if diff:
            raise ValueError(
                "data loader state does not match this loader: "
                + ", ".join(f"{k} saved {a!r}, loader has {b!r}" for k, (a, b) in diff.items())
            )
    readers = {tuple(st["shard"]): st for st in states}  # replicas saved the same state
    counts = {count for _, count in readers}
    if len(counts) != 1 or len(readers) != counts.copy().pop():
        raise ValueError(f"saved data loader states cover readers {sorted(readers)}, not one whole layout")
    own = readers.get(tuple(meta["shard"]))
    if own is not None and own["tokenizer_batch_size"] == meta["tokenizer_batch_size"]:
        return {**own, **{k: meta[k] for k in ("batch_size", "seq_len", "buffer_size")}}
    return {**meta, **carry_over(list(readers.values()), docs)}


def numpy_loader(
    tokenizer,
    batch_size: int,
    seq_len: int,
    split: str = "train",
    shard: tuple[int, int] = (0, 1),
    state: dict | Sequence[dict] | None = None,
    data_dir: str | None = None,
    *,
    place=None,
    buffer_size: int = BUFFER_SIZE,
    tokenizer_batch_size: int = TOKENIZER_BATCH_SIZE,
    **pipeline_kwargs,
) -> DataLoader:
    """The loader of one reader: `batch_size` local rows from shard `(index, count)` of the documents.

    `state` resumes it: this reader's saved state, or every process's states from a checkpoint (then a
    run saved on another number of processes or readers continues where it stopped). Yields numpy
    (inputs, targets) unless `place` maps them elsewhere (make_loader puts them on devices).
    """
    files = split_files(list_parquet_files(data_dir), split, data_dir)
    docs = ParquetDocuments(files, shard)
    meta = {
        "split": split,
        "data": docs.fingerprint,
        "shard": list(shard),
        "batch_size": batch_size,
        "seq_len": seq_len,
        "tokenizer_batch_size": tokenizer_batch_size,
        "buffer_size": buffer_size,
    }
    if state is not None:
        state = resume_state(state, docs, meta)
    stream = ReaderStream(
        docs, tokenizer_batch_size, (state or {}).get("prefix", ()), (state or {}).get("first_epoch", 1)
    )
    pipeline = build_pipeline(tokenizer, batch_size, seq_len, stream, buffer_size=buffer_size, **pipeline_kwargs)
    return DataLoader(pipeline, stream, meta, place=place, state=state)


# -----------------------------------------------------------------------------
# Devices and hosts


def reader_for_rows(rows_of_process: dict[int, Iterable[int]], process_index: int) -> tuple[int, int, int]:
    """(reader index, reader count, local rows) from which batch rows each process holds.

    Processes holding the same rows are replicas and must read the same data; processes holding
    different rows must read disjoint data. Sharding where row sets partially overlap has no such split.
    """
    groups = sorted({tuple(sorted(set(rows))) for rows in rows_of_process.values()})
    seen: set[int] = set()
    for g in groups:
        if seen & set(g):
            raise ValueError(
                "batch rows are split across processes in overlapping groups; use a mesh whose "
                "batch axes give each process whole rows"
            )
        seen |= set(g)
    mine = tuple(sorted(set(rows_of_process[process_index])))
    if mine != tuple(range(mine[0], mine[0] + len(mine))):
        raise ValueError("each process must hold a contiguous block of batch rows")
    return groups.index(mine), len(groups), len(mine)


def reader_shard(sharding: jax.sharding.Sharding, batch_size: int, seq_len: int) -> tuple[int, int, int]:
    """This process's (reader index, reader count, local batch size) under `sharding` of a (B, T) batch."""
    rows: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((batch_size, seq_len)).items():
        start, stop, _ = index[0].indices(batch_size)
        rows.setdefault(device.process_index, set()).update(range(start, stop))
    return reader_for_rows(rows, jax.process_index())


def make_loader(
    tokenizer,
    batch_size: int,
    seq_len: int,
    split: str = "train",
    mesh: jax.sharding.Mesh | None = None,
    state: dict | Sequence[dict] | None = None,
    data_dir: str | None = None,
    *,
    buffer_size: int = BUFFER_SIZE,
    tokenizer_batch_size: int = TOKENIZER_BATCH_SIZE,
    tokenizer_threads: int = 1,
    read_threads: int = 2,
    prefetch: int = 2,
) -> DataLoader:
    """Iterator of global (inputs, targets) int32 jax arrays of shape (batch_size, seq_len).

    batch_size is the global batch. With a mesh, batches are sharded with `batch_sharding(mesh)` and
    each process reads and builds only its own rows; without one (single process) they land on the
    default device. The val split (`split="val"`) read from a fresh loader is the same every time.
    """
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError("multi-host data loading needs a mesh: pass mesh= so each process builds its own rows")
        sharding, shard, local_batch = None, (0, 1), batch_size
    else:
        sharding = batch_sharding(mesh)
        rows_split = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
        if batch_size % rows_split:
            raise ValueError(f"batch_size {batch_size} must be a multiple of the mesh's data x fsdp size {rows_split}")
        index, count, local_batch = reader_shard(sharding, batch_size, seq_len)
        shard = (index, count)

    def place(inputs: np.ndarray, targets: np.ndarray):
        if sharding is None:
            return jnp.asarray(inputs), jnp.asarray(targets)
        shape = (batch_size, seq_len)
        return (
            jax.make_array_from_process_local_data(sharding, inputs, shape),
            jax.make_array_from_process_local_data(sharding, targets, shape),
        )

    return numpy_loader(
        tokenizer,
        local_batch,
        seq_len,
        split,
        shard,
        state,
        data_dir,
        place=place,
        buffer_size=buffer_size,
        tokenizer_batch_size=tokenizer_batch_size,
        tokenizer_threads=tokenizer_threads,
        read_threads=read_threads,
        prefetch=prefetch,
    )


def make_val_loader(tokenizer, batch_size: int, seq_len: int, mesh=None, data_dir=None, **kwargs) -> DataLoader:
    """The val loader: always starts at the first val document, so every evaluation sees the same batches."""
    return make_loader(tokenizer, batch_size, seq_len, "val", mesh, None, data_dir, **kwargs)
