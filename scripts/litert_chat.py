"""Chat with a LiteRT export (`scripts.export --format litert`) in the terminal, with no JAX or TensorFlow installed.

    pip install ai-edge-litert numpy tiktoken         # all this needs
    python -m scripts.litert_chat exports/d4-litert -p "Tell me a story about a cat."    # one reply
    python -m scripts.litert_chat exports/d4-litert                                       # chat in the terminal
    python -m scripts.litert_chat exports/base-litert -p "Once upon a time" --complete    # plain continuation

The model, its KV cache and the decode loop are flaxchat.export.litert_chat's (numpy, tiktoken and ai_edge_litert
only); this file is their command line: one prompt or a chat, a base model's plain continuation, the reply streamed
as it is sampled. The tool (calculator) is not run; a tool call the model writes shows as [python: ...], as in
scripts.chat_cli.
"""

from __future__ import annotations

import argparse
import codecs
import sys
import time

from flaxchat.export.litert_chat import LiteRTModel, generate, load_tokenizer, shown_bytes  # numpy, tiktoken, litert

# -----------------------------------------------------------------------------
# CLI


def build_parser():
    p = argparse.ArgumentParser(
        description="Generate from a LiteRT export (model.tflite) without JAX: "
        "prefill + a KV-cache decode loop in the LiteRT interpreter."
    )
    p.add_argument("model_dir", help="directory written by `python -m scripts.export --format litert`")
    p.add_argument(
        "-p", "--prompt", type=str, default=None, help="one prompt, one reply (default: chat in the terminal)"
    )
    p.add_argument(
        "--complete",
        action="store_true",
        help="continue the prompt as plain text (default for base "
        "models) instead of answering it as a chat turn (default for sft/rl models)",
    )
    p.add_argument(
        "-m", "--max-tokens", type=int, default=256, help="most new tokens per reply (the cache also limits)"
    )
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("-k", "--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=None, help="interpreter threads (default: LiteRT's choice)")
    p.add_argument("--stats", action="store_true", help="print prefill time and decode tokens/s to stderr")
    return p


def stream_reply(model, enc, prompt, args, stops) -> int:
    """Stream one reply to stdout; returns the last token produced (not in the cache yet)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    max_tokens = max(1, min(args.max_tokens, model.capacity - model.pos - len(prompt) + 1))
    t0 = time.perf_counter()
    t_first, token, n = None, None, 0
    for token in generate(model, prompt, max_tokens, args.temperature, args.top_k, args.seed, stops):
        t_first, n = t_first or time.perf_counter(), n + 1
        if token not in stops:
            print(decoder.decode(shown_bytes(enc, token)), end="", flush=True)
    print(decoder.decode(b"", final=True), flush=True)
    if args.stats and t_first is not None:
        decode_s = time.perf_counter() - t_first
        rate = f"{(n - 1) / decode_s:.1f} tok/s" if n > 1 and decode_s > 0 else "n/a"
        print(
            f"[prefill {len(prompt)} tokens: {1000 * (t_first - t0):.1f} ms; decode {n - 1} tokens: {rate}]",
            file=sys.stderr,
        )
    return token


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        model = LiteRTModel(args.model_dir, args.threads)
        enc = load_tokenizer(args.model_dir)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    special = model.config["special_tokens"]
    chat = not args.complete and model.config.get("phase", "sft") != "base" and "<|user_start|>" in special
    stops = set(model.config["stop_token_ids"])
    turn = lambda text: [
        special["<|user_start|>"],
        *enc.encode_ordinary(text),
        special["<|user_end|>"],
        special["<|assistant_start|>"],
    ]
    pending = [model.config["bos_token_id"]]  # tokens not yet in the cache
    try:
        if args.prompt is not None:
            prompt = turn(args.prompt) if chat else enc.encode_ordinary(args.prompt)
            stream_reply(model, enc, pending + prompt, args, stops)
            return
        print(f"LiteRT chat ({model.config.get('quantize')} weights, {model.capacity}-token cache). Ctrl-D quits.")
        while True:
            try:
                text = input("\nUser: ")
            except EOFError:
                return
            print("Assistant: ", end="", flush=True)
            last = stream_reply(model, enc, pending + (turn(text) if chat else enc.encode_ordinary(text)), args, stops)
            end = special.get("<|assistant_end|>")
            pending = [last] + ([end] if chat and last != end else [])
    except ValueError as e:  # the cache is full
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
