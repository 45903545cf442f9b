"""SFT batches: conversations -> (ids, mask) -> BOS-aligned best-fit rows padded to a fixed length.

nanochat's chat_sft loader, with static shapes for jit:

- every conversation is rendered with `tokenizer.render_conversation` (mask 1 = the assistant's own tokens)
  and cut to the row capacity T + 1, so any single conversation fits an empty row;
- each row is filled by repeatedly taking the largest buffered conversation that still fits whole; when none
  fits, the rest of the row is padded (with BOS) instead of cropping a conversation, so no token is lost;
- inputs = row[:-1]; targets = row[1:], set to -1 wherever the mask of the target token is 0 (user turns,
  BOS, special tokens around user turns, tool outputs, padding), so the loss counts assistant tokens only.

Every batch is (B, T) int32 whatever the conversations, so the train step compiles once. Multi-process: each
reader starts at its own index and strides by the number of readers (nanochat's rank / world size), and the
rows are assembled into one global array sharded like pretraining batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flaxchat.data.dataloader import batch_sharding, reader_shard

BUFFER_SIZE = 100  # conversations to choose from when filling a row (nanochat's default)


def conversation_targets(ids: Sequence[int], mask: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, targets) of one token row: targets are the next tokens, -1 where the next token's mask is 0."""
    ids, mask = np.asarray(ids, np.int32), np.asarray(mask, np.int32)
    targets = ids[1:].copy()
    targets[mask[1:] == 0] = -1
    return ids[:-1], targets


class SFTLoader:
    """Iterator of (inputs, targets) (B, T) batches over a Task (or any indexable of conversations).

    State nanochat's training loop reads: `last_step` (the epoch is used up, or num_batches batches were made),
    `progress` (0 -> 1 over the run, for the LR schedule), `epoch`. num_batches counts micro-batches: a run of
    N optimizer steps with gradient accumulation A passes N * A. The val loader is a fresh
    SFTLoader over the val dataset, so every evaluation sees the same batches. `get_state()` / `set_state()`
    carry the position (the buffered conversations by index) across a resume.
    """

    def __init__(
        self,
        dataset,
        tokenizer,
        batch_size: int,
        seq_len: int,
        *,
        num_batches: int = -1,
        buffer_size: int = BUFFER_SIZE,
        reader: tuple[int, int] = (0, 1),
        place=None,
    ):
        if batch_size < 1 or seq_len < 2:
            raise ValueError(f"need batch_size >= 1 and seq_len >= 2, got {batch_size} and {seq_len}")
        if len(dataset) == 0:
            raise ValueError("the SFT dataset is empty")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.batch_size, self.row_capacity = batch_size, seq_len + 1  # +1: the last input's target
        self.num_batches, self.buffer_size = num_batches, buffer_size
        self.rank, self.world = reader
        self.place = place
        self.bos = tokenizer.get_bos_token_id()
        self.buffer: list[tuple[list[int], list[int]]] = []
        self.buffer_index: list[int] = []  # the dataset index of each buffered conversation
        self.cursor = self.consumed = self.rank  # consumed: conversations taken, counted for all readers
        self.epoch, self.it = 1, 0
        self.last_step, self.progress = False, 0.0

    def __iter__(self):
        return self

    def _refill(self) -> None:
        n = len(self.dataset)
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(self._render(self.cursor))
            self.buffer_index.append(self.cursor)
            self.cursor += self.world
            if self.cursor >= n:
                self.cursor %= n
                self.epoch += 1

    def _render(self, index: int) -> tuple[list[int], list[int]]:
        return self.tokenizer.render_conversation(self.dataset[index], max_tokens=self.row_capacity)

    STATE = ("cursor", "consumed", "epoch", "it", "last_step", "progress")

    def get_state(self) -> dict:
        return {**{k: getattr(self, k) for k in self.STATE}, "buffer_index": list(self.buffer_index)}

    def set_state(self, state: dict) -> None:
        for k in self.STATE:
            setattr(self, k, state[k])
        self.buffer_index = list(state["buffer_index"])
        self.buffer = [self._render(i) for i in self.buffer_index]

    def _row(self) -> tuple[list[int], list[int]]:
        row, mask = [], []
        while len(row) < self.row_capacity:
            self._refill()
            remaining = self.row_capacity - len(row)
            best, best_len = -1, 0
            for i, (ids, _) in enumerate(self.buffer):  # the largest that fits; ties go to the oldest
                if best_len < len(ids) <= remaining:
                    best, best_len = i, len(ids)
            if best < 0:  # nothing fits: pad instead of cropping, padding is never a target
                row += [self.bos] * remaining
                mask += [0] * remaining
                break
            ids, m = self.buffer.pop(best)
            self.buffer_index.pop(best)
            row += ids
            mask += m
            self.consumed += self.world
        return row, mask

    def __next__(self):
        inputs = np.empty((self.batch_size, self.row_capacity - 1), np.int32)
        targets = np.empty_like(inputs)
        for b in range(self.batch_size):
            inputs[b], targets[b] = conversation_targets(*self._row())
        self.it += 1
        if self.num_batches > 0:
            self.progress = self.it / self.num_batches
            self.last_step = self.it >= self.num_batches
        else:
            self.progress = self.consumed / len(self.dataset)
        if self.consumed >= len(self.dataset):  # one epoch, as nanochat (counted by consumption, not fetching)
            self.last_step = True
        if self.place is not None:
            return self.place(inputs, targets)
        return inputs, targets


def make_sft_loader(dataset, tokenizer, batch_size: int, seq_len: int, mesh=None, **kwargs) -> SFTLoader:
    """An SFTLoader yielding global (batch_size, seq_len) jax arrays, rows sharded over the mesh's batch axes.

    batch_size is global. Each process renders only its own rows: processes holding the same rows read the
    same conversations, processes holding different rows read disjoint ones.
    """
    if mesh is None:
        if jax.process_count() > 1:
            raise ValueError("multi-host SFT needs a mesh: pass mesh= so each process builds its own rows")
        return SFTLoader(
            dataset, tokenizer, batch_size, seq_len, place=lambda x, y: (jnp.asarray(x), jnp.asarray(y)), **kwargs
        )
    rows_split = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    if batch_size % rows_split:
        raise ValueError(f"batch size {batch_size} must be a multiple of the mesh's data x fsdp size {rows_split}")
    sharding = batch_sharding(mesh)
    index, count, local_batch = reader_shard(sharding, batch_size, seq_len)

    def place(inputs, targets):
        shape = (batch_size, seq_len)
        return (
            jax.make_array_from_process_local_data(sharding, inputs, shape),
            jax.make_array_from_process_local_data(sharding, targets, shape),
        )

    return SFTLoader(dataset, tokenizer, local_batch, seq_len, reader=(index, count), place=place, **kwargs)
