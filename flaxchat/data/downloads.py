"""Checked downloads: every downloaded file's size and sha256 are written to a manifest beside it at its first
download and checked whenever it is used again, and against the server's own sha256 where it publishes one.

A dataset shard or an evaluation bundle that changes under the same name (a tampered mirror, a truncated copy, a
re-published file) would otherwise train or score silently on other data. The Hugging Face hub publishes the
sha256 of every LFS file in the `X-Linked-Etag` header of a download; other servers publish nothing, so there the
first download is the reference. Archives are also capped in size before and after unpacking.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import zipfile

MANIFEST = "downloads.json"  # {file name: {"url", "size", "sha256"}} in the folder of the files it describes
MAX_ARCHIVE_BYTES = 2 << 30  # an archive, and what it unpacks to, may not exceed this
MAX_ARCHIVE_MEMBERS = 100_000

_lock = threading.Lock()  # shards download in parallel threads into one folder, one manifest
_SHA256 = re.compile(r'^(?:W/)?"?([0-9a-f]{64})"?$')


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def published_sha256(headers) -> str | None:
    """The sha256 a server published for a download, from its response headers (the hub's X-Linked-Etag for LFS
    files, or an ETag that is a sha256), else None."""
    for name in ("X-Linked-Etag", "ETag"):
        m = _SHA256.match((headers.get(name) or "").strip().lower())
        if m:
            return m.group(1)
    return None


def _manifest_path(path: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(path)), MANIFEST)


def _read_manifest(path: str) -> dict:
    try:
        with open(_manifest_path(path), encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def recorded(path: str) -> dict | None:
    """The manifest's entry for `path` ({"url", "size", "sha256"}), or None if it was never recorded."""
    return _read_manifest(path).get(os.path.basename(path))


def record(path: str, url: str, expected_sha256: str | None = None, as_path: str | None = None) -> dict:
    """Record the size and sha256 of the file downloaded to `path`, as the file `as_path` (default: `path`; a
    download written to a temporary name first is recorded under its final one). ValueError when the server
    published another sha256, or when an earlier download under this name had other contents."""
    entry = {"url": url, "size": os.path.getsize(path), "sha256": sha256_file(path)}
    path = as_path or path
    name = os.path.basename(path)
    if expected_sha256 and entry["sha256"] != expected_sha256:
        raise ValueError(
            f"{name}: sha256 {entry['sha256'][:16]}... is not the {expected_sha256[:16]}... {url} publishes"
        )
    with _lock:
        manifest = _read_manifest(path)
        earlier = manifest.get(name)
        if earlier and (earlier["size"], earlier["sha256"]) != (entry["size"], entry["sha256"]):
            raise ValueError(
                f"{name} from {url} differs from its first download (sha256 {earlier['sha256'][:16]}..., "
                f"{earlier['size']:,} bytes): the source changed it; delete {_manifest_path(path)}'s entry to accept it"
            )
        manifest[name] = entry
        tmp = _manifest_path(path) + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        os.replace(tmp, _manifest_path(path))
    return entry


def matches_record(path: str) -> bool | None:
    """Whether `path` still has the size and sha256 recorded at its download; None when it was never recorded."""
    entry = recorded(path)
    if entry is None:
        return None
    return os.path.getsize(path) == entry["size"] and sha256_file(path) == entry["sha256"]


def check_archive(zf: zipfile.ZipFile, name: str, max_bytes: int | None = None) -> None:
    """ValueError when a zip would unpack to more than max_bytes (default MAX_ARCHIVE_BYTES) or MAX_ARCHIVE_MEMBERS
    files (a zip bomb, or the wrong file); zipfile itself keeps members inside the target folder."""
    max_bytes = MAX_ARCHIVE_BYTES if max_bytes is None else max_bytes
    members = zf.infolist()
    total = sum(m.file_size for m in members)
    if len(members) > MAX_ARCHIVE_MEMBERS or total > max_bytes:
        raise ValueError(
            f"{name} would unpack to {total:,} bytes in {len(members):,} files; the cap is {max_bytes:,} bytes and "
            f"{MAX_ARCHIVE_MEMBERS:,} files"
        )
