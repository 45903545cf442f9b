"""Train the BPE tokenizer (rustbpe) and save it to <base_dir>/tokenizer/.

Writes tokenizer.json (ranks, pattern, specials, content hash) and token_bytes.npy (bytes per
token id, for bits-per-byte). The tokenizer is nanochat's: same split pattern, same specials.

    # default: the train split of the parquet shards in <base_dir>/base_data/ (2B chars max),
    # e.g. after `python -m scripts.data --source synthetic-stories --num-shards 4`
    python -m scripts.tok_train
    # smaller vocab and budget, on a text file or a folder of .txt/.md/.jsonl/.parquet files
    python -m scripts.tok_train --vocab-size 4096 --max-chars 100000000 --source path/to/texts/
    # any document source of flaxchat.data.dataset by name (synthetic-stories never ends: cap it)
    python -m scripts.tok_train --source synthetic-stories --max-chars 50000000

Tokenizer training runs on the CPU (rustbpe uses every core); the same command serves a laptop,
one GPU box or a pod's host.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator

from flaxchat.common import get_base_dir, progress_bar
from flaxchat.data.dataset import iter_source_documents
from flaxchat.data.tokenizer import Tokenizer

# -----------------------------------------------------------------------------
# Document sources: every --source goes through flaxchat.data.dataset (iter_source_documents), so "a folder of
# text" means the same thing here as for pretraining and for scripts.tok_eval.


def capped_documents(docs: Iterator[str], max_chars: int, doc_cap: int, stats: dict) -> Iterator[str]:
    """Crop each document to doc_cap chars; stop once more than max_chars have been yielded.

    stats["chars"] / stats["bytes"] count what was yielded (for the speed report).
    """
    stats.update(chars=0, bytes=0, docs=0)
    with progress_bar(unit="char", unit_scale=True, desc="reading") as bar:
        for doc in docs:
            doc = doc[:doc_cap]
            stats["chars"] += len(doc)
            stats["bytes"] += len(doc.encode("utf-8"))
            stats["docs"] += 1
            bar.update(len(doc))
            yield doc
            if stats["chars"] > max_chars:
                return


SAMPLE_TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Numbers: 3.14159, 2025-07-09, 1234567",
    "def add(a, b):\n    return a + b\n",
    "Unicode: naïve café, 你好世界, Привет, 🌍🚀",
]


def _piece(token: bytes) -> str | bytes:
    # Tokens that split a multi-byte character are shown as bytes rather than as '\ufffd'.
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return token


def show_samples(tokenizer: Tokenizer) -> None:
    for text in SAMPLE_TEXTS:
        ids = tokenizer.encode(text)
        if tokenizer.decode(ids) != text:
            raise RuntimeError(f"round trip failed for {text!r}")  # would mean a broken tokenizer
        pieces = [_piece(tokenizer.decode_single_token_bytes(i)) for i in ids]
        print(f"{len(text.encode()):>3} bytes -> {len(ids):>2} tokens  {pieces!r}")


# -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> Tokenizer:
    parser = argparse.ArgumentParser(description="Train the BPE tokenizer and save it to <base_dir>/tokenizer/")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=32768,
        help="vocabulary size incl. the 9 special tokens (default 32768 = 2^15)",
    )
    parser.add_argument(
        "--max-chars", type=int, default=2_000_000_000, help="stop after this many characters (default 2B)"
    )
    parser.add_argument(
        "--doc-cap", type=int, default=10_000, help="crop each document to this many characters (default 10,000)"
    )
    parser.add_argument(
        "--source",
        default=None,
        help="a text file or folder (.txt/.md/.jsonl/.parquet), a folder of parquet shards, "
        "or a flaxchat.data.dataset source name: parquet, synthetic-stories, tinystories "
        "(default: <base_dir>/base_data/ shards)",
    )
    args = parser.parse_args(argv)
    if args.vocab_size < 256 + 9:
        parser.error(f"--vocab-size must be at least 265 (256 bytes + 9 special tokens), got {args.vocab_size}")
    if args.max_chars <= 0 or args.doc_cap <= 0:
        parser.error("--max-chars and --doc-cap must be positive")
    print(
        f"vocab_size: {args.vocab_size:,}  max_chars: {args.max_chars:,}  doc_cap: {args.doc_cap:,}  "
        f"source: {args.source or 'base_data'}"
    )

    # --- train (a source that fails while streaming, e.g. the hub being unreachable, is reported too)
    stats: dict = {}
    t0 = time.perf_counter()
    try:
        docs = capped_documents(iter_source_documents(args.source, "train"), args.max_chars, args.doc_cap, stats)
        tokenizer = Tokenizer.train_from_iterator(docs, args.vocab_size)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        parser.error(str(e))
    train_time = time.perf_counter() - t0
    if stats["chars"] == 0:
        parser.error("the source yielded no text to train on")
    print(
        f"Training time: {train_time:.2f}s on {stats['docs']:,} documents, {stats['chars']:,} chars "
        f"({stats['chars'] / train_time:,.0f} chars/s, {stats['bytes'] / 1e6 / train_time:.2f} MB/s)"
    )

    # --- save
    tokenizer_dir = os.path.join(get_base_dir(), "tokenizer")
    path = tokenizer.save(tokenizer_dir)
    print(
        f"Saved {path} and token_bytes.npy (vocab {tokenizer.get_vocab_size():,}, hash {tokenizer.content_hash[:16]})"
    )
    if tokenizer.get_vocab_size() < args.vocab_size:
        # rustbpe merges only within the split pattern's chunks; it stops when each chunk of the text is one token
        print(
            f"vocab {tokenizer.get_vocab_size():,} of the {args.vocab_size:,} asked: every chunk of the training text "
            "(a word, number or run of punctuation, as the split pattern cuts it) is already one token, so nothing "
            "was left to merge; more varied text would fill the rest"
        )

    # --- a look at what it learned
    show_samples(tokenizer)
    return tokenizer


if __name__ == "__main__":
    main()
