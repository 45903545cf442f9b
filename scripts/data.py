"""Write the pretraining data: documents from one source as parquet shards in $FLAXCHAT_BASE_DIR/base_data/.

    # fully offline: the built-in synthetic story generator
    python -m scripts.data --source synthetic-stories --num-shards 4 --docs-per-shard 20000
    # nanochat's pretraining data (ClimbMix) from the HF hub: 8 train shards + the val shard
    python -m scripts.data --source parquet-download --num-shards 8
    # TinyStories from the HF hub, converted to 4 train shards + 1 val shard
    python -m scripts.data --source tinystories --num-shards 4
    # your own text: a file, or a folder of .txt/.md/.jsonl/.parquet files
    python -m scripts.data --source text --path ~/my_corpus --num-shards 2

Every source ends up as shards with a single `text` column named `shard_XXXXX.parquet`; the last one is the val
split (flaxchat.data.dataset reads them, and documents the format). A download resumes where it stopped; another
source never mixes into a folder one source wrote (--overwrite replaces it). The same command on a laptop, a GPU
box or a pod's host: it runs on the CPU.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from collections.abc import Sequence

from flaxchat.data.dataset import (
    BASE_URL,
    MAX_SHARD,
    SOURCES,
    default_data_dir,
    download,
    load_tinystories,
    prepare_out_dir,
    split_train_val,
    synthetic_documents,
    text_documents,
    tinystories_documents,
    write_shards,
)

# -----------------------------------------------------------------------------
# CLI


def source_documents(args):
    """(train docs, their count, docs per train shard, val docs, their count) for a streamed source.

    Loading happens here, before the output folder is touched, so a failing source leaves old shards alone.
    """
    n = args.num_shards
    if args.source == "synthetic-stories":
        per_shard = args.docs_per_shard
        train = itertools.islice(synthetic_documents("train", args.seed), n * per_shard)
        val = itertools.islice(synthetic_documents("val", args.seed), per_shard)
        return train, n * per_shard, per_shard, val, per_shard
    if args.source == "text":
        train, val = split_train_val(text_documents(args.path, args.max_doc_chars), args.val_fraction, args.seed)
        return train, len(train), math.ceil(len(train) / n), val, len(val)
    train_ds, val_ds = load_tinystories("train"), load_tinystories("val")
    return (
        tinystories_documents("train", train_ds),
        len(train_ds),
        math.ceil(len(train_ds) / n),
        tinystories_documents("val", val_ds),
        len(val_ds),
    )


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write pretraining documents as parquet shards (the last shard is val)."
    )
    parser.add_argument("--source", required=True, choices=SOURCES, help="where the documents come from")
    parser.add_argument("--num-shards", type=int, default=8, help="number of train shards (one val shard is added)")
    parser.add_argument("--out-dir", default=None, help="output folder (default: $FLAXCHAT_BASE_DIR/base_data)")
    parser.add_argument("--overwrite", action="store_true", help="replace shards another source wrote there")
    parser.add_argument("--path", default=None, help="text source: a file or a folder of .txt/.md/.jsonl/.parquet")
    parser.add_argument("--max-doc-chars", type=int, default=4000, help="text source: split longer texts at paragraphs")
    parser.add_argument("--val-fraction", type=float, default=0.05, help="text source: share of documents for val")
    parser.add_argument("--docs-per-shard", type=int, default=20000, help="synthetic-stories: documents per shard")
    parser.add_argument("--seed", type=int, default=0, help="synthetic-stories: generator seed; text: shuffle seed")
    parser.add_argument("--base-url", default=BASE_URL, help="parquet-download: where shard_XXXXX.parquet files live")
    parser.add_argument("--max-shard", type=int, default=MAX_SHARD, help="parquet-download: index of the val shard")
    parser.add_argument("--num-workers", type=int, default=4, help="parquet-download: parallel downloads")
    args = parser.parse_args(argv)
    if args.num_shards < 1:
        parser.error("--num-shards must be >= 1")
    if args.source == "text" and not args.path:
        parser.error("--source text needs --path (a text file or a folder)")
    if args.docs_per_shard < 1:
        parser.error("--docs-per-shard must be >= 1")
    if not 0 < args.val_fraction < 1:
        parser.error("--val-fraction must be between 0 and 1")
    out_dir = os.path.expanduser(args.out_dir) if args.out_dir else default_data_dir()
    try:
        if args.source == "parquet-download":
            paths = download(
                args.num_shards, out_dir, args.base_url, args.max_shard, args.num_workers, overwrite=args.overwrite
            )
        else:
            train, n_train, per_shard, val, n_val = source_documents(args)
            details = {"path": os.path.abspath(args.path)} if args.source == "text" else {}
            prepare_out_dir(out_dir, args.source, args.overwrite, **details)
            paths = write_shards(train, out_dir, per_shard, 0, total=n_train, desc="train shards")
            paths += write_shards(val, out_dir, n_val, len(paths), total=n_val, desc="val shard")
    except (OSError, ValueError, RuntimeError, ImportError) as e:
        parser.exit(1, f"error: {e}\n")
    print(f"{len(paths)} shards in {out_dir} (train: {len(paths) - 1}, val: {os.path.basename(paths[-1])})")


if __name__ == "__main__":
    main()
