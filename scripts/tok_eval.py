"""Compression of the trained tokenizer: bytes per token on a few kinds of text, as a table.

Domains: English prose, Python code, LaTeX math, multilingual text, and the val split of the
training source (when it has one). GPT-2 and GPT-4 (cl100k_base) columns appear only when
tiktoken already has their files in its local cache (this script never downloads them).

    python -m scripts.tok_eval                                  # tokenizer + data in the base dir
    python -m scripts.tok_eval --source path/to/texts/          # val split of another source (as in tok_train)
    TIKTOKEN_CACHE_DIR=~/tiktoken_cache python -m scripts.tok_eval --compare gpt2,cl100k_base

Runs on the CPU; the same command on a laptop, a GPU box or a pod's host.
"""

from __future__ import annotations

import argparse
from unittest import mock

import tiktoken
import tiktoken.load

from flaxchat.data.dataset import iter_source_documents
from flaxchat.data.tokenizer import get_tokenizer

# -----------------------------------------------------------------------------
# Sample texts (written for this script)

PROSE = """\
The lighthouse keeper kept a ledger of every ship that passed the point, and by the end of his
thirty-first winter it filled eleven volumes. Most entries were short: a name, an hour, the state
of the sea. But on the night of the great storm in November he wrote four pages, describing how a
small fishing boat, its mast snapped and its lantern drowned, had found the harbour by following
nothing but the sweep of his light. "I have never been so glad," he wrote, "to be of so little use
to myself and so much to strangers." The ledgers are now kept in the town library, where anyone may
read them on Tuesdays between ten and four."""

CODE = '''\
from collections import OrderedDict


class LRUCache:
    """A fixed-size cache that forgets the least recently used key first."""

    def __init__(self, capacity: int = 128):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, bytes] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str) -> bytes | None:
        if key in self._items:
            self._items.move_to_end(key)
            self.hits += 1
            return self._items[key]
        self.misses += 1
        return None

    def put(self, key: str, value: bytes) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)
'''

MATH = r"""\
\begin{proposition}
For every integer $n \geq 1$, the sum of the first $n$ odd numbers is a perfect square:
\[
  \sum_{k=1}^{n} (2k - 1) = n^{2}.
\]
\end{proposition}
\begin{proof}
We argue by induction on $n$. For $n = 1$ both sides equal $1$. Suppose the claim holds for
some $n \geq 1$. Then
\begin{align*}
  \sum_{k=1}^{n+1} (2k - 1) &= \sum_{k=1}^{n} (2k - 1) + \bigl(2(n+1) - 1\bigr) \\
                            &= n^{2} + 2n + 1 = (n + 1)^{2},
\end{align*}
which is the claim for $n + 1$. Alternatively, the $L$-shaped layers of an $n \times n$ grid of
dots contain $1, 3, 5, \dots, 2n - 1$ dots, so $\int_0^n 2x \, dx = n^2$ is no coincidence.
\end{proof}"""

MULTILINGUAL = """\
Français : Le train de sept heures arrive toujours en retard, mais personne ne s'en plaint.
Deutsch: Im Winter trinken wir heißen Tee und lesen lange Bücher am Fenster.
Español: La biblioteca abre a las nueve y cierra cuando el último lector se va.
Русский: Утром в городе шёл дождь, а вечером небо стало совсем ясным.
中文：我们明天早上八点在图书馆门口见面，然后一起去吃早饭。
日本語：今日はとても暑いので、冷たい水をたくさん飲んでください。
한국어: 오늘 저녁에 친구들과 함께 공원에서 산책을 했습니다.
العربية: ذهبت إلى السوق صباحاً واشتريت الخبز والفاكهة.
हिन्दी: मुझे सुबह की ठंडी हवा में टहलना बहुत पसंद है।
Ελληνικά: Η θάλασσα ήταν ήρεμη και ο ουρανός γαλάζιος όλη την ημέρα."""

DOMAINS = [("prose", PROSE), ("code", CODE), ("math", MATH), ("multilingual", MULTILINGUAL)]

# -----------------------------------------------------------------------------
# Helpers


class _NotCached(Exception):
    pass


def load_cached_encoding(name: str) -> tiktoken.Encoding | None:
    """tiktoken's encoding `name` if its files are in tiktoken's local cache, else None.

    tiktoken has no offline switch: on a cache miss it downloads. Its downloads all go through
    tiktoken.load.read_file, so refusing remote paths there turns a cache miss into None.
    """
    original = tiktoken.load.read_file

    def local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _NotCached(blobpath)
        return original(blobpath)

    with mock.patch.object(tiktoken.load, "read_file", local_only):
        try:
            return tiktoken.get_encoding(name)
        except _NotCached:
            return None


def val_text(source: str | None, max_chars: int) -> str | None:
    """The first ~max_chars of the source's val split joined by newlines; None if it has none."""
    docs, n = [], 0
    for doc in iter_source_documents(source, "val"):
        docs.append(doc)
        n += len(doc)
        if n >= max_chars:
            break
    return "\n".join(docs) if docs else None


def measure(encode, text: str, decode) -> int:
    ids = encode(text)
    if decode(ids) != text:
        raise RuntimeError("decode(encode(text)) != text")  # would mean a broken tokenizer
    return len(ids)


def format_table(rows: list[tuple[str, str]], columns: dict[str, dict[str, int]]) -> str:
    """One line per domain: bytes, then tokens and bytes/token for each tokenizer."""
    names = list(columns)
    head = f"{'domain':<14}{'bytes':>10}" + "".join(f"{n + ' tok':>16}{'B/tok':>8}" for n in names)
    lines = [head, "-" * len(head)]
    for domain, text in rows:
        nbytes = len(text.encode("utf-8"))
        cells = "".join(f"{columns[n][domain]:>16,}{nbytes / columns[n][domain]:>8.2f}" for n in names)
        lines.append(f"{domain:<14}{nbytes:>10,}" + cells)
    return "\n".join(lines)


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description="Bytes per token of the trained tokenizer on several kinds of text")
    parser.add_argument(
        "--source",
        default=None,
        help="source whose val split is measured, as in tok_train (default: <base_dir>/base_data/ shards, if any)",
    )
    parser.add_argument(
        "--max-val-chars", type=int, default=1_000_000, help="characters of the val split to measure (default 1M)"
    )
    parser.add_argument(
        "--compare",
        default="gpt2,cl100k_base",
        help="comma-separated tiktoken encodings to compare with, if cached locally ('' for none)",
    )
    args = parser.parse_args(argv)
    if args.max_val_chars <= 0:
        parser.error("--max-val-chars must be positive")

    try:
        tokenizer = get_tokenizer()
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    rows = list(DOMAINS)
    try:
        val = val_text(args.source, args.max_val_chars)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        if args.source is not None:  # asked for explicitly, so a bad source is an error
            parser.error(str(e))
        val = None
        print(f"(no source-val row: {e})")
    if val is not None:
        rows.append(("source-val", val))
    elif args.source is not None:
        print("(no source-val row: the source's val split is empty)")

    # --- tokenize every domain with ours and with each cached tiktoken encoding
    encoders = {"ours": (tokenizer.encode, tokenizer.decode, tokenizer.get_vocab_size())}
    for name in filter(None, (n.strip() for n in args.compare.split(","))):
        enc = load_cached_encoding(name)
        if enc is None:
            print(
                f"({name}: not in tiktoken's local cache, so not compared; run once online or set TIKTOKEN_CACHE_DIR)"
            )
        else:
            encoders[name] = (enc.encode_ordinary, enc.decode, enc.n_vocab)
    columns = {name: {d: measure(enc, text, dec) for d, text in rows} for name, (enc, dec, _) in encoders.items()}

    # --- report
    print("vocab sizes: " + ", ".join(f"{name} {n_vocab:,}" for name, (_, _, n_vocab) in encoders.items()))
    table = format_table(rows, columns)
    print(table)
    return table


if __name__ == "__main__":
    main()
