"""The Grain BOS best-fit loader: packing, exact resume, per-process shards, device placement."""

import json
import random

import jax
import numpy as np
import pyarrow.parquet as pq
import pytest

from flaxchat.data.dataloader import (
    batch_sharding,
    make_loader,
    make_val_loader,
    numpy_loader,
    reader_for_rows,
    reader_shard,
)
from flaxchat.data.dataset import iter_documents, list_parquet_files, split_files, write_shards
from flaxchat.data.packing import BestFitPacker, pack_documents
from flaxchat.data.tokenizer import Tokenizer
from flaxchat.perf.measure import measure_throughput

BOS = 256
SMALL = dict(buffer_size=48, tokenizer_batch_size=16)  # small buffers keep the tests fast


class ByteTokenizer:
    """Stand-in tokenizer: UTF-8 bytes, BOS = 256."""

    def get_bos_token_id(self):
        return BOS

    def encode(self, texts, prepend=None, num_threads=1):
        return [([prepend] if prepend is not None else []) + list(t.encode()) for t in texts]


def _doc_text(i, rng):
    return f"<{i}>" + "abcdefghij"[i % 10] * rng.choice([1, 5, 20, 40, 90, 150, 300])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("loader") / "base_data")
    rng = random.Random(0)
    docs = [_doc_text(i, rng) for i in range(700)]
    write_shards(docs[:600], d, 200, row_group_size=25)
    write_shards(docs[600:], d, 10**9, first_index=3, row_group_size=25)
    return d


@pytest.fixture(scope="module")
def texts(data_dir):
    return set(iter_documents(split="train", data_dir=data_dir)) | set(iter_documents(split="val", data_dir=data_dir))


# -----------------------------------------------------------------------------
# Packing


def reference_best_fit(chunks, B, T, buffer_size, max_batches=None):
    """nanochat's packing written the plain way: a list buffer refilled a whole tokenizer batch (chunk) at a
    time, linear scans, row by row; stops when the chunks run out (or after max_batches)."""
    chunks = iter(chunks)
    buffer, batches = [], []
    while max_batches is None or len(batches) < max_batches:
        rows = []
        for _ in range(B):
            row = []
            while len(row) < T + 1:
                while len(buffer) < buffer_size:
                    chunk = next(chunks, None)
                    if chunk is None:
                        return batches
                    buffer.extend(chunk)
                space = T + 1 - len(row)
                best = None
                for i, d in enumerate(buffer):
                    if len(d) <= space and (best is None or len(d) > len(buffer[best])):
                        best = i
                if best is not None:
                    row.extend(buffer.pop(best))
                else:
                    shortest = min(range(len(buffer)), key=lambda i: len(buffer[i]))
                    row.extend(buffer.pop(shortest)[:space])
            rows.append(row)
        batches.append(np.array(rows, dtype=np.int32))
    return batches


def nanochat_chunks(files, tokenize, tokenizer_batch_size, rank=0, world=1):
    """nanochat's document batches, forever: each file in turn, row groups rank, rank + world, ..., each row
    group cut into tokenizer batches (read with pyarrow directly, not through flaxchat.data.dataset)."""
    while True:
        for path in files:
            pf = pq.ParquetFile(path)
            for rg in range(rank, pf.num_row_groups, world):
                texts = pf.read_row_group(rg).column("text").to_pylist()
                for i in range(0, len(texts), tokenizer_batch_size):
                    yield tokenize(texts[i : i + tokenizer_batch_size])


@pytest.mark.parametrize("B,T,buffer_size,refill", [(2, 16, 8, 3), (4, 64, 50, 16), (1, 7, 1, 1), (3, 128, 200, 128)])
def test_packing_equals_reference(B, T, buffer_size, refill):
    rng = np.random.default_rng(B * 1000 + T)
    # lengths include ties, exact fits, and documents longer than a row
    lengths = rng.choice([1, 2, 3, 5, 8, T // 2, T, T + 1, T + 2, 3 * T], size=3000)
    docs = [[BOS] + rng.integers(0, 256, n - 1).tolist() for n in lengths]
    got = list(pack_documents(docs, B, T, buffer_size, refill))
    want = reference_best_fit((docs[i : i + refill] for i in range(0, len(docs), refill)), B, T, buffer_size)
    assert len(got) == len(want) > 5
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_packer_steps_by_hand():
    def doc(k, n):
        return [BOS] + [k] * (n - 1)

    incoming = [(4, doc(4, 4)), (5, doc(5, 5)), (6, doc(6, 7)), (7, doc(7, 8)), (8, doc(8, 12))]

    def refill(n=1):
        for _ in range(n):
            k, d = incoming.pop(0)
            packer.add([k], [d])

    packer = BestFitPacker(1, 8, buffer_size=4)
    packer.add(range(4), [doc(0, 3), doc(1, 10), doc(2, 6), doc(3, 2)])
    # doc 2 (6 tokens) is the largest that fits whole; the buffer drops below 4 so doc 4 arrives;
    # doc 0 (3 tokens) then fills the last 3 slots exactly
    np.testing.assert_array_equal(packer.pack(refill), [doc(2, 6) + doc(0, 3)])
    assert packer.doc_ids() == [1, 3, 4] and len(packer) == 3
    np.testing.assert_array_equal(packer.pack(refill), [doc(5, 5) + doc(4, 4)])
    assert packer.doc_ids() == [1, 3, 6]
    # doc 7 (8 tokens) fits; 1 slot is left and nothing fits whole: the shortest (doc 3) is cropped to its BOS
    np.testing.assert_array_equal(packer.pack(refill), [doc(7, 8) + [BOS]])
    assert packer.doc_ids() == [1, 6, 8]


def _segments(row):
    starts = np.flatnonzero(row == BOS).tolist() + [len(row)]
    return [bytes(row[a + 1 : b].tolist()).decode() for a, b in zip(starts, starts[1:])]


def test_rows_start_with_bos_and_are_documents_without_padding(data_dir, texts):
    loader = numpy_loader(ByteTokenizer(), 4, 96, data_dir=data_dir, **SMALL)
    for _ in range(20):
        inputs, targets = next(loader)
        assert inputs.dtype == targets.dtype == np.int32 and inputs.shape == (4, 96)
        np.testing.assert_array_equal(inputs[:, 1:], targets[:, :-1])
        rows = np.concatenate([inputs, targets[:, -1:]], axis=1)
        assert (rows[:, 0] == BOS).all()
        for row in rows:
            segs = _segments(row)
            assert all(s in texts for s in segs[:-1])  # whole documents...
            assert any(t.startswith(segs[-1]) for t in texts)  # ...and the last one possibly cropped
    loader.close()


# -----------------------------------------------------------------------------
# State


def _take(loader, n):
    return [tuple(np.asarray(a) for a in next(loader)) for _ in range(n)]


def test_save_restore_continues_with_identical_batches(data_dir):
    loader = make_loader(ByteTokenizer(), 8, 64, data_dir=data_dir, **SMALL)
    _take(loader, 45)  # > one epoch of the documents
    state = json.loads(json.dumps(loader.get_state()))
    assert state["epoch"] >= 2 and len(json.dumps(state)) < 4000
    expected = _take(loader, 12)
    restored = make_loader(ByteTokenizer(), 8, 64, data_dir=data_dir, state=state, **SMALL)
    assert all((a == c).all() and (b == d).all() for (a, b), (c, d) in zip(expected, _take(restored, 12)))
    loader.set_state(state)  # rewinding the same loader works too
    assert all((a == c).all() for (a, _), (c, _) in zip(expected, _take(loader, 12)))
    loader.close()
    restored.close()


def test_state_from_another_stream_is_rejected(data_dir):
    loader = numpy_loader(ByteTokenizer(), 4, 64, data_dir=data_dir, **SMALL)
    next(loader)
    state = loader.get_state()
    other = numpy_loader(ByteTokenizer(), 4, 64, data_dir=data_dir, buffer_size=48, tokenizer_batch_size=8)
    with pytest.raises(ValueError, match="tokenizer_batch_size"):
        other.set_state(state)  # an existing loader only rewinds within its own stream
    with pytest.raises(ValueError, match="split saved 'train', loader has 'val'"):
        numpy_loader(ByteTokenizer(), 4, 64, "val", state=state, data_dir=data_dir, **SMALL)
    with pytest.raises(ValueError, match="format"):
        numpy_loader(ByteTokenizer(), 4, 64, state={**state, "format": 1}, data_dir=data_dir, **SMALL)
    with pytest.raises(ValueError, match="not one whole layout"):
        numpy_loader(ByteTokenizer(), 4, 64, state=[{**state, "shard": [0, 2]}], data_dir=data_dir, **SMALL)
    loader.close()
    other.close()


def test_val_loader_is_deterministic(data_dir):
    a = make_val_loader(ByteTokenizer(), 2, 32, data_dir=data_dir, **SMALL)
    b = make_val_loader(ByteTokenizer(), 2, 32, data_dir=data_dir, **SMALL)
    first, second = _take(a, 5), _take(b, 5)
    assert all((x[0] == y[0]).all() for x, y in zip(first, second))
    train = _take(make_loader(ByteTokenizer(), 2, 32, data_dir=data_dir, **SMALL), 1)
    assert not (train[0][0] == first[0][0]).all()
    a.close()
    b.close()


# -----------------------------------------------------------------------------
# Processes and devices


def _byte_ids(texts):
    return [[BOS] + list(t.encode()) for t in texts]


def test_two_processes_read_disjoint_documents(data_dir):
    """Simulate 2 processes: each packs exactly nanochat's rank's documents, and the shards share nothing."""
    tok = ByteTokenizer()
    files = split_files(list_parquet_files(data_dir), "train")
    seen = []
    for p in range(2):
        loader = numpy_loader(tok, 2, 48, shard=(p, 2), data_dir=data_dir, **SMALL)
        got = _take(loader, 6)
        loader.close()
        want = reference_best_fit(
            nanochat_chunks(files, _byte_ids, SMALL["tokenizer_batch_size"], p, 2),
            2,
            48,
            SMALL["buffer_size"],
            max_batches=6,
        )
        for (inputs, targets), rows in zip(got, want):
            np.testing.assert_array_equal(inputs, rows[:, :-1])
            np.testing.assert_array_equal(targets, rows[:, 1:])
        seen.append(
            {s.split(">")[0] for x, y in got for row in np.concatenate([x, y[:, -1:]], 1) for s in _segments(row)[:-1]}
        )
    assert seen[0] and seen[1] and not seen[0] & seen[1]


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory):
    """4 train files whose row groups are not a multiple of the tokenizer batch (nor of each other), + val."""
    d = str(tmp_path_factory.mktemp("uneven") / "base_data")
    rng = random.Random(1)
    docs = [_doc_text(i, rng) for i in range(1000)]
    bounds = [0, 130, 390, 470, 800, 1000]
    for k, (row_group, (a, b)) in enumerate(zip([37, 100, 29, 64, 50], zip(bounds, bounds[1:]))):
        write_shards(docs[a:b], d, 10**9, first_index=k, row_group_size=row_group)
    return d


def test_batches_equal_nanochat_across_files_with_uneven_row_groups(uneven_dir):
    files = split_files(list_parquet_files(uneven_dir), "train")
    assert len(files) == 4
    loader = numpy_loader(
        ByteTokenizer(), 2, 64, data_dir=uneven_dir, buffer_size=40, tokenizer_batch_size=16, prefetch=0
    )
    got = _take(loader, 300)  # ~1.5 passes over the 800 train documents
    loader.close()
    want = reference_best_fit(nanochat_chunks(files, _byte_ids, 16), 2, 64, 40, max_batches=300)
    for i, ((inputs, targets), rows) in enumerate(zip(got, want)):
        assert (inputs == rows[:, :-1]).all() and (targets == rows[:, 1:]).all(), f"batch {i} differs"


# -----------------------------------------------------------------------------
# Resuming on another reader layout


class IdTokenizer(ByteTokenizer):
    """Documents "<i>..." become [BOS, 1000 + i, bytes...]: the second token names the document."""

    def encode(self, texts, prepend=None, num_threads=1):
        return [[prepend, 1000 + int(t[1 : t.index(">")])] + list(t.encode()) for t in texts]


@pytest.fixture
def taken(monkeypatch):
    """Every document the packer places in a row, as (stream position, document number), in order."""
    log = []
    take = BestFitPacker.take_document

    def logged(self, i):
        doc = take(self, i)
        log.append((self._ids[i], int(doc[1]) - 1000))
        return doc

    monkeypatch.setattr(BestFitPacker, "take_document", logged)
    return log


def _run(shard, state, n, taken, data_dir, **kw):
    """Run reader `shard` for n batches (no prefetch, so the log is exactly what was yielded); its takes and state."""
    start = len(taken)
    loader = numpy_loader(IdTokenizer(), 4, 128, shard=shard, state=state, data_dir=data_dir, prefetch=0, **SMALL, **kw)
    for _ in range(n):
        next(loader)
    state = json.loads(json.dumps(loader.get_state()))
    loader.close()
    return taken[start:], state


@pytest.mark.parametrize("old,new", [(2, 1), (1, 3), (3, 2)])
def test_resume_on_another_layout_trains_each_document_once(uneven_dir, taken, old, new):
    """Readers stop at uneven points (one already in its second epoch); the new layout first finishes exactly the
    documents the old one still owed (each once), then every reader goes on with its own shard's next epoch."""
    total = len(list(iter_documents(split="train", data_dir=uneven_dir)))
    counts = np.zeros(total, int)
    old_states = []
    for r, n in enumerate({1: [130], 2: [60, 20], 3: [60, 20, 10]}[old]):
        logged, state = _run((r, old), None, n, taken, uneven_dir)
        np.add.at(counts, [d for _, d in logged], 1)
        old_states.append(state)
    assert counts.max() == 2  # the first reader has wrapped into its second epoch
    for j in range(new):
        logged, state = _run((j, new), old_states, 150, taken, uneven_dir)
        owed = sum(hi - lo for lo, hi, _ in state["prefix"])
        prefix_takes = [d for pos, d in logged if pos < owed]
        assert len(prefix_takes) == owed  # 150 batches are enough to finish the owed share
        np.add.at(counts, prefix_takes, 1)
        # after its share, the reader runs through its own shard in order (as nanochat's rank j would)
        mine = [int(t[1 : t.index(">")]) for t in iter_documents(split="train", shard=(j, new), data_dir=uneven_dir)]
        later = sorted(pos - owed for pos, _ in logged if pos >= owed)
        assert sorted(d for pos, d in logged if pos >= owed) == sorted(mine[p % len(mine)] for p in later)
        assert state["first_epoch"] == 3
    assert (counts == counts.max()).all(), "every document once per epoch, none twice, none skipped"


def test_resume_chained_across_layouts_and_counts_documents(uneven_dir, taken):
    """2 readers -> 3 (stopped before their owed share is done) -> 1: still every document exactly once per
    epoch, and the documents counter summed over readers equals the documents placed in rows."""
    total = len(list(iter_documents(split="train", data_dir=uneven_dir)))
    counts = np.zeros(total, int)
    states, placed = [], 0
    for r, n in enumerate([50, 20]):
        logged, st = _run((r, 2), None, n, taken, uneven_dir)
        np.add.at(counts, [d for _, d in logged], 1)
        states.append(st)
        placed += len(logged)
    mid = []
    for j, n in enumerate([5, 1, 8]):
        logged, st = _run((j, 3), states, n, taken, uneven_dir)
        np.add.at(counts, [d for _, d in logged], 1)
        mid.append(st)
        placed += len(logged)
    assert sum(st["documents"] + st["pipeline"]["next_doc"] - len(st["pipeline"]["buffer"]) for st in mid) == placed
    logged, final = _run((0, 1), mid, 200, taken, uneven_dir)
    owed = sum(hi - lo for lo, hi, _ in final["prefix"])
    np.add.at(counts, [d for pos, d in logged if pos < owed], 1)
    assert (counts == counts.max()).all()


def test_reader_for_rows():
    assert reader_for_rows({0: range(0, 4), 1: range(4, 8)}, 1) == (1, 2, 4)
    assert reader_for_rows({0: range(8), 1: range(8)}, 1) == (0, 1, 8)  # replicas read the same data
    assert reader_for_rows({0: [0, 1], 1: [2, 3], 2: [0, 1], 3: [2, 3]}, 3) == (1, 2, 2)
    with pytest.raises(ValueError, match="overlapping"):
        reader_for_rows({0: [0, 1, 2], 1: [2, 3]}, 0)


def test_sharded_loader_matches_unsharded(data_dir):
    n = len(jax.devices())
    mesh = jax.make_mesh((n, 1, 1), ("data", "fsdp", "tensor"))
    sharding = batch_sharding(mesh)
    assert reader_shard(sharding, 8, 32) == (0, 1, 8)  # one process holds every row
    sharded = make_loader(ByteTokenizer(), 8, 32, mesh=mesh, data_dir=data_dir, **SMALL)
    plain = make_loader(ByteTokenizer(), 8, 32, data_dir=data_dir, **SMALL)
    for _ in range(3):
        (x, y), (u, v) = next(sharded), next(plain)
        assert x.sharding.is_equivalent_to(sharding, 2) and x.dtype == np.int32 and x.shape == (8, 32)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(u))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(v))
    sharded.close()
    plain.close()


@pytest.mark.eight_devices
def test_batch_must_split_over_the_mesh(data_dir):
    mesh = jax.make_mesh((len(jax.devices()), 1, 1), ("data", "fsdp", "tensor"))
    with pytest.raises(ValueError, match="multiple of the mesh"):
        make_loader(ByteTokenizer(), len(jax.devices()) + 1, 16, mesh=mesh, data_dir=data_dir)


def test_missing_data_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m scripts.data"):
        make_loader(ByteTokenizer(), 2, 16, data_dir=str(tmp_path))


def test_corrupt_shard_error_names_the_file(tmp_path):
    d = tmp_path / "bad"
    write_shards(["a", "b"], str(d), 1)
    (d / "shard_00000.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="shard_00000.parquet"):
        make_loader(ByteTokenizer(), 2, 16, data_dir=str(d))


def test_real_tokenizer_and_throughput(data_dir):
    docs = list(iter_documents(split="train", data_dir=data_dir))
    tok = Tokenizer.train_from_iterator(iter(docs), 300)
    bos = tok.get_bos_token_id()
    loader = make_loader(tok, 2, 64, data_dir=data_dir, **SMALL)
    inputs, _ = (np.asarray(a) for a in next(loader))
    assert (inputs[:, 0] == bos).all()
    row = inputs[0]
    starts = np.flatnonzero(row == bos).tolist()
    whole = [tok.decode(row[a + 1 : b].tolist()) for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 2 and all(w in docs for w in whole)
    loader.close()
    stats = measure_throughput(tok, 2, 64, num_batches=5, warmup=1, data_dir=data_dir, **SMALL)
    assert stats["tokens_per_s"] > 0 and stats["batches_per_s"] > 0 and stats["num_batches"] == 5
