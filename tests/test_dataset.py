"""Document sources: parquet shards, sharding across readers, text/TinyStories conversion, downloads."""

import hashlib
import http.server
import itertools
import json
import os
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flaxchat.data import dataset
from flaxchat.data.dataset import (
    ParquetDocuments,
    download,
    iter_documents,
    list_parquet_files,
    split_files,
    text_documents,
    write_shards,
)
from scripts.data import main

DOCS = [f"doc{i}: " + "word " * (i % 37) for i in range(500)]


def _write(data_dir, train_docs, val_docs, docs_per_shard=150, row_group_size=20):
    write_shards(train_docs, str(data_dir), docs_per_shard, row_group_size=row_group_size)
    n = len(list_parquet_files(str(data_dir)))
    write_shards(val_docs, str(data_dir), 10**9, first_index=n, row_group_size=row_group_size)


@pytest.fixture
def data_dir(tmp_path):
    d = tmp_path / "base_data"
    _write(d, DOCS[:450], DOCS[450:])
    return str(d)


# -----------------------------------------------------------------------------
# Parquet shards


def test_last_shard_is_val_and_documents_round_trip(data_dir):
    files = list_parquet_files(data_dir)
    assert [os.path.basename(f) for f in files] == [f"shard_0000{i}.parquet" for i in range(4)]
    assert split_files(files, "val") == files[-1:]
    assert list(iter_documents(split="train", data_dir=data_dir)) == DOCS[:450]
    assert list(iter_documents(split="val", data_dir=data_dir)) == DOCS[450:]


def test_default_data_dir_is_base_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "b"))
    _write(tmp_path / "b" / "base_data", DOCS[:10], DOCS[10:12])
    assert list(iter_documents(split="val")) == DOCS[10:12]


@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_reader_shards_are_disjoint_and_cover_the_split(data_dir, count):
    shards = [list(iter_documents(split="train", shard=(i, count), data_dir=data_dir)) for i in range(count)]
    assert all(shards)
    flat = [d for s in shards for d in s]
    assert len(flat) == len(set(flat)) == 450
    assert set(flat) == set(DOCS[:450])


def test_more_readers_than_row_groups_falls_back_to_documents(data_dir):
    # the val shard has 50 docs in 3 row groups: 5 readers still each get a disjoint part
    shards = [list(iter_documents(split="val", shard=(i, 5), data_dir=data_dir)) for i in range(5)]
    assert all(len(s) == 10 for s in shards)
    assert sorted(d for s in shards for d in s) == sorted(DOCS[450:])
    with pytest.raises(ValueError, match="need at least 51 documents"):
        ParquetDocuments(split_files(list_parquet_files(data_dir), "val"), (0, 51))


def test_start_resumes_a_reader(data_dir):
    full = list(iter_documents(split="train", shard=(1, 3), data_dir=data_dir))
    for start in (0, 1, 19, 20, 77, len(full)):
        assert list(iter_documents(split="train", shard=(1, 3), start=start, data_dir=data_dir)) == full[start:]


def test_random_access_matches_sequential_order(data_dir):
    src = ParquetDocuments(split_files(list_parquet_files(data_dir), "train"), (2, 3))
    seq = list(src.iter_from(0))
    assert len(src) == len(seq)
    idx = [5, 0, len(seq) - 1, 17, 5, len(seq) + 3]  # indices past the end wrap around (epochs)
    assert src._getitems(idx) == [seq[i % len(seq)] for i in idx]


def test_corrupt_parquet_error_names_the_file(data_dir):
    bad = os.path.join(data_dir, "shard_00001.parquet")
    with open(bad, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="shard_00001.parquet"):
        list(iter_documents(split="train", data_dir=data_dir))


def test_textless_parquet_error_names_the_file(data_dir):
    bad = os.path.join(data_dir, "shard_00000.parquet")
    pq.write_table(pa.table({"content": ["a", "b"]}), bad)
    with pytest.raises(ValueError, match=r"shard_00000\.parquet has no 'text' column"):
        list(iter_documents(split="train", data_dir=data_dir))


def test_missing_data_says_which_command_gets_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m scripts.data --source"):
        list(iter_documents(data_dir=str(tmp_path / "nothing")))
    with pytest.raises(ValueError, match="split must be"):
        list(iter_documents(split="test", data_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="shard must be"):
        list(iter_documents(shard=(2, 2), data_dir=str(tmp_path)))


# -----------------------------------------------------------------------------
# Local text, TinyStories, the CLI


def test_text_folder_documents(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("first file")
    (root / "sub" / "b.md").write_text("para one\n\npara two\n\n" + "x" * 50)
    (root / "c.jsonl").write_text(json.dumps({"text": "json doc"}) + "\n\n" + json.dumps("bare string") + "\n")
    pq.write_table(pa.table({"text": ["pq doc", ""]}), root / "d.parquet")
    (root / "ignored.bin").write_bytes(b"\x00")
    docs = text_documents(str(root), max_doc_chars=30)
    assert docs == ["first file", "json doc", "bare string", "pq doc", "para one\n\npara two", "x" * 50]


def test_text_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"title": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2 has no 'text'"):
        text_documents(str(bad))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_documents(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text documents"):
        text_documents(str(tmp_path / "empty"))


def test_cli_text_source_writes_shards_and_refuses_to_mix(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:100]))
    out = tmp_path / "out"
    main(["--source", "text", "--path", str(corpus), "--num-shards", "3", "--out-dir", str(out)])
    files = list_parquet_files(str(out))
    assert len(files) == 4
    train = list(iter_documents(split="train", data_dir=str(out)))
    val = list(iter_documents(split="val", data_dir=str(out)))
    assert len(train) == 95 and len(val) == 5 and sorted(train + val) == sorted(DOCS[:100])
    assert train != DOCS[:95]  # shuffled: file order is not the curriculum
    assert list(iter_documents("text", "val", path=str(corpus))) == val
    assert list(iter_documents("text", "train", shard=(1, 2), path=str(corpus))) == train[1::2]
    with pytest.raises(SystemExit):
        main(["--source", "text", "--path", str(corpus), "--num-shards", "2", "--out-dir", str(out)])
    assert "--overwrite" in capsys.readouterr().err
    main(["--source", "text", "--path", str(corpus), "--num-shards", "2", "--out-dir", str(out), "--overwrite"])
    assert len(list_parquet_files(str(out))) == 3


def test_cli_bad_flags_give_one_line_errors(tmp_path, capsys):
    for argv in (["--source", "text"], ["--source", "text", "--path", "x", "--num-shards", "0"]):
        with pytest.raises(SystemExit):
            main(argv + ["--out-dir", str(tmp_path)])
        assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--source", "text", "--path", str(tmp_path / "missing"), "--out-dir", str(tmp_path / "o")])
    assert "does not exist" in capsys.readouterr().err


def test_tinystories_converts_the_hub_dataset(tmp_path, monkeypatch):
    import datasets  # a core dependency (imported here: it takes a second)

    splits = {"train": [f"story {i}" for i in range(30)], "validation": ["val a", "val b"]}
    calls = []

    def fake_load_dataset(repo, split):  # stands in for the hub; the conversion code is the real one
        calls.append((repo, split))
        return datasets.Dataset.from_dict({"text": splits[split]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = str(tmp_path / "ts")
    main(["--source", "tinystories", "--num-shards", "3", "--out-dir", out])
    assert ("roneneldan/TinyStories", "train") in calls
    assert len(list_parquet_files(out)) == 4
    assert list(iter_documents(split="train", data_dir=out)) == splits["train"]
    assert list(iter_documents(split="val", data_dir=out)) == splits["validation"]
    assert list(iter_documents("tinystories", "train", shard=(1, 2), start=2)) == splits["train"][5::2]

    def offline(repo, split):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(RuntimeError, match="synthetic-stories"):
        list(iter_documents("tinystories"))


# -----------------------------------------------------------------------------
# Synthetic stories (flaxchat/data/stories.py)


def test_synthetic_source_is_deterministic_and_splits_disjoint():
    a = list(itertools.islice(iter_documents("synthetic-stories", "train", seed=3), 200))
    b = list(itertools.islice(iter_documents("synthetic-stories", "train", seed=3), 200))
    val = list(itertools.islice(iter_documents("synthetic-stories", "val", seed=3), 200))
    assert a == b and all(isinstance(s, str) and s for s in a)
    assert not set(a) & set(val)
    assert list(itertools.islice(iter_documents("synthetic-stories", "train", seed=3, start=50), 10)) == a[50:60]


def test_synthetic_reader_shards_interleave():
    full = list(itertools.islice(iter_documents("synthetic-stories", "train"), 60))
    r0 = list(itertools.islice(iter_documents("synthetic-stories", "train", shard=(0, 3)), 20))
    r2 = list(itertools.islice(iter_documents("synthetic-stories", "train", shard=(2, 3), start=4), 16))
    assert r0 == full[0::3] and r2 == full[2::3][4:]


def test_cli_synthetic_writes_train_and_val_shards(tmp_path):
    out = str(tmp_path / "syn")
    main(["--source", "synthetic-stories", "--num-shards", "2", "--docs-per-shard", "40", "--out-dir", out])
    files = list_parquet_files(out)
    assert len(files) == 3
    train = list(iter_documents(split="train", data_dir=out))
    val = list(iter_documents(split="val", data_dir=out))
    assert len(train) == 80 and len(val) == 40 and not set(train) & set(val)


# -----------------------------------------------------------------------------
# Downloads, against a loopback HTTP server


class _Server:
    """Serves named files with Range support; can truncate or corrupt chosen responses."""

    def __init__(self, files):
        self.files, self.requests, self.truncate_first, self.corrupt = dict(files), [], set(), set()
        self.published = {}  # name -> the sha256 sent as X-Linked-Etag, as the Hugging Face hub does
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                server.requests.append((name, self.headers.get("Range")))
                if name not in server.files:
                    self.send_error(404)
                    return
                body = server.files[name]
                if name in server.corrupt:
                    body = b"x" * len(body)
                start = int(self.headers["Range"].split("=")[1].rstrip("-")) if self.headers.get("Range") else 0
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                self.send_header("Content-Length", str(len(body) - start))
                if name in server.published:
                    self.send_header("X-Linked-Etag", f'"{server.published[name]}"')
                self.end_headers()
                if name in server.truncate_first:  # drop the connection halfway through, once
                    server.truncate_first.discard(name)
                    self.wfile.write(body[start : start + (len(body) - start) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(body[start:])

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/data"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(tmp_path):
    src = tmp_path / "remote"
    for i in (0, 1, 2, 9):
        write_shards([f"remote shard {i} doc {j}" for j in range(300)], str(src), 10**9, first_index=i)
    files = {n: (src / n).read_bytes() for n in os.listdir(src)}
    s = _Server(files)
    yield s
    s.close()


def test_download_fetches_train_shards_and_the_val_shard(server, tmp_path):
    out = str(tmp_path / "dl")
    paths = download(2, out, base_url=server.url, max_shard=9, num_workers=3, backoff=0)
    assert [os.path.basename(p) for p in paths] == ["shard_00000.parquet", "shard_00001.parquet", "shard_00009.parquet"]
    assert list(iter_documents(split="val", data_dir=out))[0] == "remote shard 9 doc 0"
    n = len(server.requests)
    download(3, out, base_url=server.url, max_shard=9, backoff=0)  # existing valid shards are not fetched again
    assert [name for name, _ in server.requests[n:]] == ["shard_00002.parquet"]


def test_download_resumes_a_partial_file(server, tmp_path):
    out = tmp_path / "dl"
    out.mkdir()
    body = server.files["shard_00000.parquet"]
    (out / "shard_00000.parquet.tmp").write_bytes(body[:1000])
    download(1, str(out), base_url=server.url, max_shard=9, backoff=0)
    assert ("shard_00000.parquet", "bytes=1000-") in server.requests
    assert (out / "shard_00000.parquet").read_bytes() == body
    assert not (out / "shard_00000.parquet.tmp").exists()


def test_download_retries_a_dropped_connection_and_continues(server, tmp_path):
    server.truncate_first.add("shard_00001.parquet")
    out = tmp_path / "dl"
    download(2, str(out), base_url=server.url, max_shard=9, backoff=0)
    body = server.files["shard_00001.parquet"]
    ranges = [r for name, r in server.requests if name == "shard_00001.parquet"]
    assert ranges == [None, f"bytes={len(body) // 2}-"]
    assert (out / "shard_00001.parquet").read_bytes() == body


def test_download_rejects_corrupt_shards_after_retries(server, tmp_path):
    server.corrupt.add("shard_00009.parquet")
    out = tmp_path / "dl"
    with pytest.raises(RuntimeError, match="shard_00009.parquet after 3 attempts"):
        download(1, str(out), base_url=server.url, max_shard=9, max_attempts=3, backoff=0)
    assert sum(name == "shard_00009.parquet" for name, _ in server.requests) == 3
    assert not os.path.exists(out / "shard_00009.parquet")
    assert (out / "shard_00000.parquet").exists()  # the good shard still landed


def test_download_refuses_a_folder_of_another_source(server, tmp_path):
    out = str(tmp_path / "dl")
    _write(out, DOCS[:20], DOCS[20:25])
    dataset.prepare_out_dir(out, "text", overwrite=True, path="x")
    _write(out, DOCS[:20], DOCS[20:25])
    with pytest.raises(FileExistsError, match="from text; pass --overwrite"):
        download(1, out, base_url=server.url, max_shard=9, backoff=0)


def test_download_records_each_shard_and_fetches_an_altered_one_again(server, tmp_path):
    out = tmp_path / "dl"
    download(1, str(out), base_url=server.url, max_shard=9, backoff=0)
    manifest = json.loads((out / "downloads.json").read_text())
    for name in ("shard_00000.parquet", "shard_00009.parquet"):
        body = server.files[name]
        assert manifest[name]["sha256"] == hashlib.sha256(body).hexdigest() and manifest[name]["size"] == len(body)
    (out / "shard_00000.parquet").write_bytes(server.files["shard_00001.parquet"])  # valid parquet, other data
    n = len(server.requests)
    download(1, str(out), base_url=server.url, max_shard=9, backoff=0)
    assert [name for name, _ in server.requests[n:]] == ["shard_00000.parquet"]
    assert (out / "shard_00000.parquet").read_bytes() == server.files["shard_00000.parquet"]


def test_download_checks_the_sha256_the_server_publishes(server, tmp_path):
    good = hashlib.sha256(server.files["shard_00000.parquet"]).hexdigest()
    server.published = {"shard_00000.parquet": good, "shard_00009.parquet": "0" * 64}
    with pytest.raises(RuntimeError, match="shard_00009.parquet after 2 attempts.*publishes"):
        download(1, str(tmp_path / "dl"), base_url=server.url, max_shard=9, max_attempts=2, backoff=0)
    assert (tmp_path / "dl" / "shard_00000.parquet").exists()
    assert not (tmp_path / "dl" / "shard_00009.parquet").exists()


def test_a_shard_changed_at_the_source_is_refused(server, tmp_path):
    out = tmp_path / "dl"
    download(1, str(out), base_url=server.url, max_shard=9, backoff=0)
    server.files["shard_00000.parquet"] = server.files["shard_00002.parquet"]  # re-published under the same name
    os.remove(out / "shard_00000.parquet")
    with pytest.raises(RuntimeError, match="differs from its first download"):
        download(1, str(out), base_url=server.url, max_shard=9, max_attempts=1, backoff=0)
