"""Read the built-in synthetic children's stories (flaxchat.data.stories), or measure the corpus they make.

    python -m scripts.stories --n 3 --seed 0          # print three sample stories
    python -m scripts.stories --stats 10000           # corpus statistics (and generation speed) as JSON
    python -m scripts.stories --n 5 --split val       # validation stories

Stories are pure Python and need no accelerator: the same command runs on a laptop, a GPU box or a pod's host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

from flaxchat.common import progress_bar
from flaxchat.data.stories import SPLITS, corpus_stats, generate_stories, iter_stories


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Print synthetic children's stories or corpus statistics.")
    parser.add_argument("--n", type=int, default=3, help="number of stories to print")
    parser.add_argument("--seed", type=int, default=0, help="stream seed")
    parser.add_argument("--split", default="train", choices=SPLITS, help="which split to draw from")
    parser.add_argument("--start", type=int, default=0, help="position of the first story in the split")
    parser.add_argument(
        "--stats",
        type=int,
        default=0,
        metavar="N",
        help="instead of printing stories, generate N and print corpus statistics as JSON",
    )
    args = parser.parse_args(argv)
    if args.n < 0 or args.stats < 0 or args.start < 0:
        parser.error("--n, --stats and --start must be >= 0")

    # --- corpus statistics
    if args.stats:
        t0 = time.perf_counter()
        stream = itertools.islice(iter_stories(args.split, args.seed, args.start), args.stats)
        stories = list(
            progress_bar(stream, total=args.stats, desc="stories", unit="story", disable=args.stats < 50_000)
        )
        seconds = time.perf_counter() - t0
        stats = corpus_stats(stories)
        stats.update(
            seconds=round(seconds, 2),
            words_per_s=round(stats["words"] / seconds),
            mb_per_s=round(stats["bytes"] / seconds / 1e6, 3),
            mean_words=round(stats["mean_words"], 1),
        )
        print(json.dumps(stats, indent=2))
        return

    # --- sample stories
    for i, story in enumerate(generate_stories(args.n, args.split, args.seed, args.start)):
        print(f"--- {args.split} story {args.start + i} (seed {args.seed}) ---\n{story}\n")


if __name__ == "__main__":
    main()
