"""nanochat's BOS-aligned best-fit packing, on numpy, independent of Grain and JAX.

Each row holds T+1 tokens; it is filled by repeatedly taking the largest buffered document that still fits whole;
when none fits, the shortest buffered document is cropped to fill the row exactly. No padding, and every row starts
with BOS (every document does). The buffer is topped up to `buffer_size` documents (one tokenizer batch at a time)
before every placement. `BestFitPacker` is the algorithm; `pack_documents` runs it over a plain stream of documents;
flaxchat.data.dataloader runs it inside the Grain pipeline, with a state that names the buffered documents.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

BUFFER_SIZE = 1000  # documents kept to choose from (nanochat's default)
TOKENIZER_BATCH_SIZE = 128  # documents tokenized per call (nanochat's default)


class BestFitPacker:
    """nanochat's BOS-aligned best-fit packer over a buffer of tokenized documents.

    The buffer is kept in stream order (taking a document leaves a hole, compacted at the next refill),
    so ties resolve like nanochat's linear scan: the earliest of equally long documents wins.
    Each document carries its stream index so the buffer can be saved as a list of ints.
    """

    def __init__(self, batch_size: int, seq_len: int, buffer_size: int = BUFFER_SIZE):
        if min(batch_size, seq_len, buffer_size) < 1:
            raise ValueError(
                f"batch_size, seq_len and buffer_size must be >= 1, got {batch_size}, {seq_len}, {buffer_size}"
            )
        self.batch_size, self.row_capacity, self.buffer_size = batch_size, seq_len + 1, buffer_size
        self.clear()

    def clear(self) -> None:
        self._docs: list[np.ndarray | None] = []
        self._ids: list[int] = []
        self._lens = np.zeros(0, np.int64)  # 0 marks a hole left by a taken document
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def add(self, ids: Iterable[int], docs: Iterable[Sequence[int]]) -> None:
        if self._live < len(self._docs):
            keep = (self._lens > 0).tolist()
            self._docs = [d for d, k in zip(self._docs, keep) if k]
            self._ids = [i for i, k in zip(self._ids, keep) if k]
            self._lens = self._lens[self._lens > 0]
        new = [(int(i), np.asarray(d, dtype=np.int32)) for i, d in zip(ids, docs) if len(d)]
        self._ids += [i for i, _ in new]
        self._docs += [d for _, d in new]
        self._lens = np.concatenate([self._lens, np.array([len(d) for _, d in new], np.int64)])
        self._live += len(new)

    def doc_ids(self) -> list[int]:
        """Stream indices of the buffered documents, in buffer order."""
        return [i for i, n in zip(self._ids, self._lens.tolist()) if n > 0]

    def take_document(self, i: int) -> np.ndarray:
        doc = self._docs[i]
        self._docs[i], self._lens[i] = None, 0
        self._live -= 1
        return doc

    def pack(self, refill: Callable[[], None]) -> np.ndarray:
        """One batch of rows, (B, T+1) int32. `refill()` must add documents (it is called as needed)."""
        cap = self.row_capacity
        rows = np.empty((self.batch_size, cap), np.int32)
        for r in range(self.batch_size):
            pos = 0
            while pos < cap:
                while self._live < self.buffer_size:
                    refill()
                remaining = cap - pos
                fits = np.where(self._lens <= remaining, self._lens, 0)
                i = int(fits.argmax())  # argmax picks the first maximum, like nanochat's strict '>' scan
                if fits[i] > 0:
                    doc = self.take_document(i)
                    rows[r, pos : pos + len(doc)] = doc
                    pos += len(doc)
                else:  # nothing fits whole: crop the shortest document to fill the row exactly
                    i = int(np.where(self._lens > 0, self._lens, np.iinfo(np.int64).max).argmin())
                    rows[r, pos:] = self.take_document(i)[:remaining]
                    pos = cap
        return rows


def pack_documents(
    docs: Iterable[Sequence[int]],
    batch_size: int,
    seq_len: int,
    buffer_size: int = BUFFER_SIZE,
    refill_size: int = TOKENIZER_BATCH_SIZE,
) -> Iterator[np.ndarray]:
    """Pack a stream of tokenized documents (each starting with BOS) into (B, T+1) int32 row batches.

    The numpy-level packer: refills take `refill_size` documents at a time, and the stream
    ends when a refill finds no more documents (a partial last batch is dropped).
    """
    stream = iter(docs)
    packer = BestFitPacker(batch_size, seq_len, buffer_size)
    next_id = 0

    def refill():
        nonlocal next_id
        chunk = list(itertools.islice(stream, refill_size))
        if not chunk:
            raise _StreamEnd
        packer.add(range(next_id, next_id + len(chunk)), chunk)
        next_id += len(chunk)

    while True:
        try:
            yield packer.pack(refill)
        except _StreamEnd:
            return


class _StreamEnd(Exception):
    pass
