"""Document sources for pretraining: one interface, four origins, one on-disk format.

Every source ends up as parquet shards with a single `text` column in `$FLAXCHAT_BASE_DIR/base_data/`,
named `shard_XXXXX.parquet`; the last shard (in sorted order) is the val split, everything before it
is train. Later stages (tokenizer training, the dataloader, bpb evaluation) read only that format.

`python -m scripts.data` writes the shards from any source (its docstring gives the commands). In Python,
`iter_documents(source, split, shard=(index, count), start)` streams the documents of any source for one of
`count` readers, starting after `start` of that reader's documents; `iter_source_documents(source, split)` does
the same for what a script's --source names (a path or a source name).
"""

from __future__ import annotations

import copy
import hashlib
import http.client
import itertools
import json
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flaxchat.common import get_base_dir, print0, progress_bar
from flaxchat.data.downloads import matches_record, published_sha256, record
from flaxchat.data.stories import generate_stories, iter_stories

# -----------------------------------------------------------------------------
# Conventions shared with nanochat's data (karpathy/climbmix-400b-shuffle on the HF hub)

BASE_URL = "https://huggingface.co/datasets/karpathy/climbmix-400b-shuffle/resolve/main"
MAX_SHARD = 6542  # the highest shard index; nanochat pins it as the val shard
TINYSTORIES_REPO = "roneneldan/TinyStories"
SOURCES = ("parquet-download", "tinystories", "text", "synthetic-stories")
ROW_GROUP_SIZE = 1024  # documents per parquet row group, as in nanochat's repackaged shards
SOURCE_MARKER = "source.json"  # records which source wrote a base_data folder, so sources never mix
_SHARD_RE = re.compile(r"^shard_\d{5}\.parquet(\.tmp)?$")
GET_DATA_HINT = (
    "run `python -m scripts.data --source synthetic-stories --num-shards 4` (offline) or "
    "`python -m scripts.data --source parquet-download --num-shards 8` to get some"
)


def index_to_filename(index: int) -> str:
    return f"shard_{index:05d}.parquet"


def default_data_dir() -> str:
    return os.path.join(get_base_dir(), "base_data")


def list_parquet_files(data_dir: str | None = None) -> list[str]:
    """Sorted full paths of the finished parquet shards in data_dir (partial `.tmp` downloads excluded)."""
    data_dir = data_dir or default_data_dir()
    if not os.path.isdir(data_dir):
        return []
    names = sorted(n for n in os.listdir(data_dir) if n.endswith(".parquet"))
    return [os.path.join(data_dir, n) for n in names]


def split_files(files: Sequence[str], split: str, data_dir: str | None = None) -> list[str]:
    """The files of one split: the last shard is val, all earlier ones are train."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    where = data_dir or default_data_dir()
    if not files:
        raise FileNotFoundError(f"no parquet shards in {where}; {GET_DATA_HINT}")
    if len(files) < 2:
        raise FileNotFoundError(
            f"only one parquet shard in {where} (the last shard is val, so train is empty); {GET_DATA_HINT}"
        )
    return list(files[:-1]) if split == "train" else list(files[-1:])


def _check_shard(shard: tuple[int, int]) -> tuple[int, int]:
    index, count = (int(x) for x in shard)
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {tuple(shard)}")
    return index, count


def read_parquet_metadata(path: str) -> pq.FileMetaData:
    """Open a shard's footer; a corrupt file or one without a `text` column raises naming the file."""
    try:
        meta = pq.read_metadata(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path} is not a readable parquet file ({e}); delete it and recreate it") from e
    if "text" not in meta.schema.names:
        raise ValueError(f"{path} has no 'text' column (columns: {', '.join(meta.schema.names)})")
    return meta


# -----------------------------------------------------------------------------
# Parquet shards: random access by document index, sharded across readers by row group


class ParquetDocuments:
    """The documents of some parquet files as one indexable sequence, for reader `shard=(index, count)`.

    Every document has a global index (files in order, rows in order) that all readers share; a reader's
    own sequence is row groups `index, index + count, ...` of each file in turn, exactly as nanochat's DDP
    ranks read them, so each reader decodes only its own data. When some reader would get nothing that
    way (fewer row groups in every file than readers) the split falls back to single documents.
    `units` are the reader's row groups as [start, stop) global ranges, in reading order. Random access
    (`_getitems` by reader position, `read` by global index) lets the loader re-read exactly the
    documents a checkpoint names.
    """

    def __init__(self, files: Sequence[str], shard: tuple[int, int] = (0, 1), cache_row_groups: int = 8):
        index, count = _check_shard(shard)
        self._files = list(files)
        self._metas = [read_parquet_metadata(f) for f in self._files]
        groups, pos = [], 0  # (file, row group, global start, global stop) of every non-empty row group
        for fi, m in enumerate(self._metas):
            for rg in range(m.num_row_groups):
                if n := m.row_group(rg).num_rows:
                    groups.append((fi, rg, pos, pos + n))
                    pos += n
        self.total = pos
        self._groups = groups
        self._group_starts = np.array([g[2] for g in groups], np.int64)
        self._cache: OrderedDict[tuple[int, int], list[str]] = OrderedDict()
        self._cache_size = cache_row_groups
        self._lock = threading.Lock()
        self._set_shard(index, count)

    def _set_shard(self, index: int, count: int) -> None:
        self.shard = (index, count)
        self.units = self._reader_units(index, count)
        self._offsets = np.cumsum([0] + [hi - lo for lo, hi in self.units])
        self._unit_starts = np.array([lo for lo, _ in self.units], np.int64)

    def with_shard(self, shard: tuple[int, int]) -> ParquetDocuments:
        """The same files for another reader (footers and row-group cache shared, nothing re-read)."""
        other = copy.copy(self)
        other._set_shard(*_check_shard(shard))
        return other

    def _reader_units(self, index: int, count: int) -> list[tuple[int, int]]:
        per_file: dict[int, list[tuple[int, int]]] = {}
        for fi, _, lo, hi in self._groups:
            per_file.setdefault(fi, []).append((lo, hi))
        if count <= max((len(g) for g in per_file.values()), default=0):
            return [u for fi in sorted(per_file) for u in per_file[fi][index::count]]
        if self.total < count:
            raise ValueError(
                f"{count} readers need at least {count} documents but {', '.join(self._files)} hold {self.total}"
            )
        return [(d, d + 1) for d in range(index, self.total, count)]

    @property
    def fingerprint(self) -> str:
        """Names the data: file names and row-group sizes (a saved position is only valid for the same data)."""
        spec = [
            [
                os.path.basename(f),
                [self._metas[fi].row_group(rg).num_rows for rg in range(self._metas[fi].num_row_groups)],
            ]
            for fi, f in enumerate(self._files)
        ]
        return hashlib.sha1(json.dumps(spec).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self._offsets[-1])

    def __getitem__(self, index: int) -> str:
        return self._getitems([index])[0]

    def _read_row_group(self, fi: int, rg: int) -> list[str]:
        try:
            pf = pq.ParquetFile(self._files[fi], metadata=self._metas[fi])
            return pf.read_row_group(rg, columns=["text"]).column("text").to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise ValueError(
                f"{self._files[fi]}: cannot read row group {rg} ({e}); delete the file and recreate it"
            ) from e

    def _row_group(self, fi: int, rg: int) -> list[str]:
        # Grain reads with several threads; one lock keeps the small LRU cache consistent.
        with self._lock:
            key = (fi, rg)
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
            texts = self._read_row_group(fi, rg)
            self._cache[key] = texts
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return texts

    def global_index(self, positions: Sequence[int]) -> np.ndarray:
        """Global document indices of reader positions (positions past the end wrap around: epochs)."""
        pos = np.asarray(positions, dtype=np.int64) % len(self)
        unit = np.searchsorted(self._offsets, pos, side="right") - 1
        return self._unit_starts[unit] + pos - self._offsets[unit]

    def read(self, indices: Sequence[int]) -> list[str]:
        """Documents by global index."""
        idx = np.asarray(indices, dtype=np.int64)
        group = np.searchsorted(self._group_starts, idx, side="right") - 1
        out = []
        for i, g in zip(idx.tolist(), group.tolist()):
            fi, rg, lo, _ = self._groups[g]
            out.append(self._row_group(fi, rg)[i - lo])
        return out

    def _getitems(self, positions: Sequence[int]) -> list[str]:
        return self.read(self.global_index(positions))

    def iter_from(self, start: int = 0) -> Iterator[str]:
        """One pass over this reader's documents from position `start` (row groups come through the cache,
        so the one-document-per-unit fallback does not re-read a row group for every document)."""
        first = int(np.searchsorted(self._offsets, start, side="right") - 1) if start < len(self) else len(self.units)
        for u in range(first, len(self.units)):
            lo, hi = self.units[u]
            skip = max(0, start - int(self._offsets[u]))
            yield from self.read(range(lo + skip, hi))


# -----------------------------------------------------------------------------
# Other sources, streamed as documents


_SPLITS = (r"\n\s*\n", r"\n", r"(?<=[.!?])\s+")  # paragraphs, then lines, then sentences


def _split_long_text(text: str, max_doc_chars: int, level: int = 0) -> list[str]:
    """Cut a long text (a book) into documents of at most ~max_doc_chars, at the coarsest break that works.

    Best-fit packing keeps only the first T+1 tokens of a document longer than a row, so a whole
    book as one document would be almost entirely cropped away.
    """
    if len(text) <= max_doc_chars or level == len(_SPLITS):
        return [text] if text.strip() else []
    pieces = [p for part in re.split(_SPLITS[level], text) for p in _split_long_text(part, max_doc_chars, level + 1)]
    joiner = ("\n\n", "\n", " ")[level]
    docs, cur = [], ""
    for piece in pieces:  # merge small neighbours back up to the size limit
        if cur and len(cur) + len(joiner) + len(piece) > max_doc_chars:
            docs.append(cur)
            cur = ""
        cur = f"{cur}{joiner}{piece}" if cur else piece
    if cur.strip():
        docs.append(cur)
    return docs


def _text_file_documents(path: str, max_doc_chars: int) -> Iterator[str]:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".txt", ".md"):
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from _split_long_text(f.read(), max_doc_chars)
    elif ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno} is not valid JSON ({e})") from e
                text = obj if isinstance(obj, str) else obj.get("text") if isinstance(obj, dict) else None
                if not isinstance(text, str):
                    raise ValueError(f"{path}:{lineno} has no 'text' string field")
                yield from _split_long_text(text, max_doc_chars)
    elif ext == ".parquet":
        read_parquet_metadata(path)
        for text in pq.read_table(path, columns=["text"]).column("text").to_pylist():
            if text:
                yield from _split_long_text(text, max_doc_chars)
    else:
        raise ValueError(f"{path}: unsupported file type {ext!r}; use .txt, .md, .jsonl or .parquet")


TEXT_EXTENSIONS = (".txt", ".md", ".jsonl", ".parquet")


def text_documents(path: str, max_doc_chars: int = 4000) -> list[str]:
    """All documents of a text file, or of every .txt/.md/.jsonl/.parquet file under a folder (sorted)."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = sorted(
            os.path.join(root, n)
            for root, _, names in os.walk(path)
            for n in names
            if n.lower().endswith(TEXT_EXTENSIONS)
        )
    else:
        raise FileNotFoundError(
            f"{path} does not exist; pass a text file or a folder of {'/'.join(TEXT_EXTENSIONS)} files"
        )
    docs = [d for f in files for d in _text_file_documents(f, max_doc_chars)]
    if not docs:
        raise ValueError(f"{path} holds no text documents (looked for {'/'.join(TEXT_EXTENSIONS)} files)")
    return docs


def split_train_val(docs: Sequence[str], val_fraction: float, seed: int | None = 0) -> tuple[list[str], list[str]]:
    """Shuffle (unless seed is None), then the last max(1, val_fraction * n) documents are val, the rest train.

    Shuffling matters for local text: files usually come in an order (book by book, year by year)
    that would otherwise become the training curriculum and make val unlike train.
    """
    if len(docs) < 2:
        raise ValueError(f"need at least 2 documents to make a train and a val split, got {len(docs)}")
    docs = list(docs)
    if seed is not None:
        random.Random(seed).shuffle(docs)
    n_val = min(len(docs) - 1, max(1, round(val_fraction * len(docs))))
    return list(docs[:-n_val]), list(docs[-n_val:])


def load_tinystories(split: str):
    """TinyStories as an HF Dataset (its `validation` split is our val); one clear error when offline."""
    import datasets  # heavy import, only for this source

    hf_split = "train" if split == "train" else "validation"
    try:
        return datasets.load_dataset(TINYSTORIES_REPO, split=hf_split)
    except Exception as e:  # the hub raises many error types when offline; all mean the same to the user
        raise RuntimeError(
            f"could not load {TINYSTORIES_REPO} from the Hugging Face hub ({type(e).__name__}); "
            "offline, use `python -m scripts.data --source synthetic-stories` instead"
        ) from e


def tinystories_documents(split: str, ds=None) -> Iterator[str]:
    ds = load_tinystories(split) if ds is None else ds
    for batch in ds.iter(batch_size=4096):  # column batches: much faster than row dicts
        yield from (t for t in batch["text"] if t)


def synthetic_documents(split: str, seed: int = 0, start: int = 0, shard: tuple[int, int] = (0, 1)) -> Iterator[str]:
    """Built-in stories; reader (index, count) takes stream positions index, index+count, ... from `start`."""
    index, count = _check_shard(shard)
    if count == 1:
        yield from iter_stories(split=split, seed=seed, start=start)
        return
    # a story depends only on (split, seed, position), so a reader generates just its own positions
    for k in itertools.count(start):
        yield generate_stories(1, split=split, seed=seed, start=index + k * count)[0]


def iter_documents(
    source: str = "parquet",
    split: str = "train",
    shard: tuple[int, int] = (0, 1),
    start: int | None = None,
    data_dir: str | None = None,
    *,
    path: str | None = None,
    seed: int = 0,
    val_fraction: float = 0.05,
) -> Iterator[str]:
    """Documents (strings) of `split` for reader `shard=(index, count)`, skipping its first `start`.

    source: "parquet" (shards in data_dir, one pass), "synthetic-stories" (infinite), "tinystories"
    (HF hub), "text" (`path` = a file or folder, shuffled with `seed`, the last `val_fraction` is val).
    The readers' document sets are disjoint and together
    cover the split; `start` counts documents of this reader, so a reader resumes where it stopped.
    """
    index, count = _check_shard(shard)
    start = int(start or 0)
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    if source == "parquet":
        files = split_files(list_parquet_files(data_dir), split, data_dir)
        return ParquetDocuments(files, (index, count)).iter_from(start)
    if source == "synthetic-stories":
        return synthetic_documents(split, seed, start, (index, count))
    if source == "tinystories":
        docs: Iterable[str] = tinystories_documents(split)
    elif source == "text":
        if path is None:
            raise ValueError("the 'text' source needs path= (a text file or a folder)")
        train, val = split_train_val(text_documents(path), val_fraction, seed)
        docs = train if split == "train" else val
    else:
        raise ValueError(f"unknown source {source!r}; choose one of parquet, {', '.join(SOURCES[1:])}")
    return itertools.islice(docs, index + start * count, None, count)


def resolve_source(source: str | None) -> tuple[str, dict]:
    """(iter_documents source name, its kwargs) for what a script's --source names.

    None -> the parquet shards in <base_dir>/base_data/ (last shard = val); a folder holding two or
    more parquet shards -> those shards; any other existing file or folder -> the "text" source
    (.txt/.md/.jsonl/.parquet files, last 5% of documents = val); otherwise a source name.
    """
    if source is None:
        return "parquet", {}
    if os.path.exists(source):
        if os.path.isdir(source) and len(list_parquet_files(source)) >= 2:
            return "parquet", {"data_dir": source}
        return "text", {"path": source}
    if os.sep in source or source.startswith("."):
        raise FileNotFoundError(f"--source {source} does not exist")
    if source in ("text", "parquet-download"):
        raise ValueError(
            f"--source {source} is not a readable source here; pass the path of your text or shards instead"
        )
    return source, {}


def iter_source_documents(source: str | None, split: str = "train") -> Iterator[str]:
    """Documents (strings) of a --source value (resolve_source) for one split; errors about the source come before
    any reading."""
    name, kwargs = resolve_source(source)
    return iter_documents(name, split, **kwargs)


# -----------------------------------------------------------------------------
# Writing shards


def write_shards(
    docs: Iterable[str],
    out_dir: str,
    docs_per_shard: int,
    first_index: int = 0,
    total: int | None = None,
    desc: str = "writing shards",
    row_group_size: int = ROW_GROUP_SIZE,
) -> list[str]:
    """Write documents to consecutive shards of `docs_per_shard` docs each (atomically: .tmp then rename)."""
    if docs_per_shard < 1:
        raise ValueError(f"docs_per_shard must be >= 1, got {docs_per_shard}")
    os.makedirs(out_dir, exist_ok=True)
    paths, buf, index = [], [], first_index

    def flush():
        nonlocal buf, index
        path = os.path.join(out_dir, index_to_filename(index))
        table = pa.table({"text": pa.array(buf, type=pa.string())})
        pq.write_table(table, path + ".tmp", row_group_size=row_group_size, compression="zstd")
        os.replace(path + ".tmp", path)
        paths.append(path)
        buf, index = [], index + 1

    for doc in progress_bar(docs, total=total, desc=desc, unit="doc", leave=False):
        if not isinstance(doc, str):
            raise ValueError(f"documents must be strings, got {type(doc).__name__}")
        if doc:
            buf.append(doc)
        if len(buf) == docs_per_shard:
            flush()
    if buf:
        flush()
    return paths


def prepare_out_dir(out_dir: str, source: str, overwrite: bool = False, **details) -> None:
    """Refuse to mix sources in one base_data folder (the last shard would no longer be the val split)."""
    os.makedirs(out_dir, exist_ok=True)
    marker = os.path.join(out_dir, SOURCE_MARKER)
    existing = [n for n in os.listdir(out_dir) if _SHARD_RE.match(n)]
    previous = None
    if os.path.exists(marker):
        with open(marker) as f:
            previous = json.load(f)
    # a download continues into its own folder, or one without a marker (e.g. shards copied from nanochat)
    resumable = source == "parquet-download" and previous in (None, {"source": source, **details})
    if existing and not resumable:
        if not overwrite:
            was = previous["source"] if previous else "an unknown source"
            raise FileExistsError(
                f"{out_dir} already holds {len(existing)} shards from {was}; pass --overwrite to replace them"
            )
        for n in existing:
            os.remove(os.path.join(out_dir, n))
    with open(marker, "w") as f:
        json.dump({"source": source, **details}, f)


# -----------------------------------------------------------------------------
# Downloading shards over HTTP (the HF hub, or any server with the same file layout)


def _fetch(url: str, tmp_path: str, timeout: float) -> str | None:
    """Download url into tmp_path, continuing a partial file with an HTTP Range request; returns the sha256 the
    server publishes for it, if any (downloads.published_sha256)."""
    have = os.path.getsize(tmp_path) if os.path.exists(tmp_path) else 0
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # our partial file is not a prefix of the remote one: start over
            os.remove(tmp_path)
        raise
    with resp:
        published = published_sha256(resp.headers)
        if have and resp.status == 206:
            mode, total = "ab", int(resp.headers.get("Content-Range", "/-1").rsplit("/", 1)[1])
        else:  # the server ignored the Range header: take the whole file
            mode, total = "wb", int(resp.headers.get("Content-Length", -1))
        with open(tmp_path, mode) as f:
            while chunk := resp.read(1 << 20):
                f.write(chunk)
    size = os.path.getsize(tmp_path)
    if total >= 0 and size != total:
        raise IOError(f"got {size} of {total} bytes")
    return published


def download_file(url: str, path: str, max_attempts: int = 5, timeout: float = 30.0, backoff: float = 2.0) -> str:
    """Fetch one shard with retries; a partial download resumes; the result must be a valid text shard, and its
    size and sha256 those the server publishes (if it does) and those of its first download (downloads.py)."""
    if os.path.exists(path):
        try:
            read_parquet_metadata(path)
            if matches_record(path) is not False:
                return path
            print0(f"{os.path.basename(path)} is not the file that was downloaded (size or sha256): fetching it again")
        except ValueError:
            pass
        os.remove(path)  # a corrupt or altered earlier download: fetch it again
    tmp = path + ".tmp"
    error = None
    for attempt in range(1, max_attempts + 1):
        try:
            published = _fetch(url, tmp, timeout)
            try:
                read_parquet_metadata(tmp)  # integrity: size matched, now the footer and schema must parse
                record(tmp, url, published, as_path=path)
            except ValueError:
                os.remove(tmp)  # complete but corrupt: no point resuming it
                raise
            os.replace(tmp, path)
            return path
        except (OSError, ValueError, http.client.HTTPException) as e:  # URLError and timeouts are OSErrors
            error = e
            if attempt < max_attempts:
                time.sleep(backoff * 2 ** (attempt - 1))
    raise RuntimeError(f"failed to download {url} after {max_attempts} attempts: {error}")


def download(
    num_shards: int,
    data_dir: str | None = None,
    base_url: str = BASE_URL,
    max_shard: int = MAX_SHARD,
    num_workers: int = 4,
    max_attempts: int = 5,
    timeout: float = 30.0,
    backoff: float = 2.0,
    overwrite: bool = False,
) -> list[str]:
    """Download train shards 0..num_shards-1 and the val shard `max_shard` (always last), in parallel.

    Plain HTTP GETs on `{base_url}/shard_XXXXX.parquet` (nanochat's layout) rather than
    huggingface_hub, so the same code serves any mirror and a loopback server in tests.
    """
    data_dir = data_dir or default_data_dir()
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    prepare_out_dir(data_dir, "parquet-download", overwrite, base_url=base_url, max_shard=max_shard)
    ids = list(range(min(num_shards, max_shard))) + [max_shard]
    paths, failures = [], []
    with ThreadPoolExecutor(max_workers=num_workers) as pool:
        futures = {
            pool.submit(
                download_file,
                f"{base_url}/{index_to_filename(i)}",
                os.path.join(data_dir, index_to_filename(i)),
                max_attempts,
                timeout,
                backoff,
            ): i
            for i in ids
        }
        for fut in progress_bar(as_completed(futures), total=len(ids), desc="downloading shards", unit="shard"):
            try:
                paths.append(fut.result())
            except RuntimeError as e:
                failures.append(str(e))
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(ids)} shards failed; first: {failures[0]}")
    return sorted(paths)
