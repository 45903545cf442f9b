"""Generate from a LiteRT export (`scripts.export --format litert`) with no JAX or TensorFlow installed.

    pip install ai-edge-litert numpy tiktoken         # all this file needs
    python -m flaxchat.export.litert_chat exports/d4-litert -p "Tell me a story about a cat."    # one reply
    python -m flaxchat.export.litert_chat exports/d4-litert                                       # chat in the terminal
    python -m flaxchat.export.litert_chat exports/base-litert -p "Once upon a time" --complete    # plain continuation

The loop an app runs: zeros for the KV cache, the prompt through the `prefill` signature in chunks of its
fixed length, then one `decode` call per new token, each call's caches fed into the next (flaxchat.export.litert
documents the signatures). Imports only numpy, tiktoken and ai_edge_litert; the tool (calculator) is not run.
"""

from __future__ import annotations

import argparse
import base64
import codecs
import json
import os
import sys
import time

import numpy as np
import tiktoken

CONFIG_FILE = "litert_config.json"  # = flaxchat.export.litert.CONFIG_FILE (not imported: that module needs JAX)


def load_tokenizer(model_dir: str) -> tiktoken.Encoding:
    """The export's tokenizer/tokenizer.json as a tiktoken Encoding. flaxchat.data.tokenizer reads the same file but
    imports JAX (through flaxchat.common), so the few lines that build the Encoding are repeated here."""
    path = os.path.join(model_dir, "tokenizer", "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer at {path}; export with `python -m scripts.export --format litert`")
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    ranks = {base64.b64decode(token): rank for token, rank in data["mergeable_ranks"].items()}
    return tiktoken.Encoding(name="flaxchat", pat_str=data["pattern"], mergeable_ranks=ranks,
                             special_tokens=dict(data["special_tokens"]))


class LiteRTModel:
    """model.tflite's prefill/decode signatures and the KV cache they pass along (batch 1).

    `pos` tokens are in the cache; the last token a caller was given by `generate` is not (it goes in with the
    next feed), as in any decode loop.
    """

    def __init__(self, model_dir: str, num_threads: int | None = None):
        from ai_edge_litert.interpreter import Interpreter

        path = os.path.join(model_dir, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no {CONFIG_FILE} in {model_dir}; export with `python -m scripts.export --format litert`")
        with open(path) as f:
            self.config = json.load(f)
        self.interpreter = Interpreter(model_path=os.path.join(model_dir, self.config["model_file"]),
                                       num_threads=num_threads)
        self._prefill = self.interpreter.get_signature_runner("prefill")
        self._decode = self.interpreter.get_signature_runner("decode")
        self.capacity, self.prefill_len = self.config["capacity"], self.config["prefill_len"]
        self.reset()

    def reset(self) -> None:
        self.k = np.zeros(self.config["cache_shape"], np.float32)
        self.v = np.zeros(self.config["cache_shape"], np.float32)
        self.pos, self.last_token = 0, 0

    def _run(self, out, tokens) -> np.ndarray:
        self.k, self.v = out["k_cache"], out["v_cache"]
        self.pos += len(tokens)
        self.last_token = tokens[-1]
        return out["logits"][0]

    def _scalar(self, x):
        return np.array([x], np.int32)

    def step(self, token: int) -> np.ndarray:
        """Put one token in the cache; returns the next token's logits (V,)."""
        if self.pos >= self.capacity:
            raise ValueError(f"the KV cache is full ({self.capacity} tokens); start a new conversation")
        out = self._decode(tokens=np.array([[token]], np.int32), prev_token=self._scalar(self.last_token),
                           pos=self._scalar(self.pos), k_cache=self.k, v_cache=self.v)
        return self._run(out, [token])

    def feed(self, ids: list[int]) -> np.ndarray:
        """Put ids in the cache, prefill chunk by chunk; returns the logits after the last one (V,)."""
        if not ids:
            raise ValueError("nothing to feed: a prompt needs at least one token")
        if self.pos + len(ids) > self.capacity:
            raise ValueError(f"{self.pos + len(ids)} tokens do not fit the exported {self.capacity}-token KV cache; "
                             "shorten the prompt or start a new conversation")
        if len(ids) == 1:
            return self.step(ids[0])
        P = self.prefill_len
        for start in range(0, len(ids), P):
            chunk = ids[start:start + P]
            tokens = np.array([chunk + [chunk[-1]] * (P - len(chunk))], np.int32)  # padding sits past pos, unseen
            out = self._prefill(tokens=tokens, prev_token=self._scalar(self.last_token), pos=self._scalar(self.pos),
                                length=self._scalar(len(chunk)), k_cache=self.k, v_cache=self.v)
            logits = self._run(out, chunk)
        return logits


def sample(logits, rng, temperature: float = 0.0, top_k: int | None = None) -> int:
    """Greedy at temperature 0, else softmax(logits / temperature) over the top_k largest."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(model: LiteRTModel, prompt: list[int], max_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, stop_tokens=()):
    """Yield up to max_tokens new ids after `prompt` (continuing the model's cache); a stop token ends it (and
    is yielded). The last id yielded is not in the cache yet."""
    rng = np.random.default_rng(seed)
    logits = model.feed(list(prompt))
    for i in range(max_tokens):
        token = sample(logits, rng, temperature, top_k)
        yield token
        if token in stop_tokens or i == max_tokens - 1 or model.pos >= model.capacity:
            return
        logits = model.step(token)


# -----------------------------------------------------------------------------
# Command line


def build_parser():
    p = argparse.ArgumentParser(description="Generate from a LiteRT export (model.tflite) without JAX: "
                                "prefill + a KV-cache decode loop in the LiteRT interpreter.")
    p.add_argument("model_dir", help="directory written by `python -m scripts.export --format litert`")
    p.add_argument("-p", "--prompt", type=str, default=None, help="one prompt, one reply (default: chat in the terminal)")
    p.add_argument("--complete", action="store_true", help="continue the prompt as plain text (default for base "
                   "models) instead of answering it as a chat turn (default for sft/rl models)")
    p.add_argument("-m", "--max-tokens", type=int, default=256, help="most new tokens per reply (the cache also limits)")
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("-k", "--top-k", type=int, default=None, help="sample among the k likeliest tokens")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--threads", type=int, default=None, help="interpreter threads (default: LiteRT's choice)")
    p.add_argument("--stats", action="store_true", help="print prefill time and decode tokens/s to stderr")
    return p


def _reply(model, enc, prompt, args, stops) -> int:
    """Stream one reply to stdout; returns the last token produced (not in the cache yet)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    max_tokens = max(1, min(args.max_tokens, model.capacity - model.pos - len(prompt) + 1))
    t0 = time.perf_counter()
    t_first, token, n = None, None, 0
    for token in generate(model, prompt, max_tokens, args.temperature, args.top_k, args.seed, stops):
        t_first, n = t_first or time.perf_counter(), n + 1
        if token not in stops:
            print(decoder.decode(enc.decode_single_token_bytes(token)), end="", flush=True)
    print(decoder.decode(b"", final=True), flush=True)
    if args.stats and t_first is not None:
        decode_s = time.perf_counter() - t_first
        rate = f"{(n - 1) / decode_s:.1f} tok/s" if n > 1 and decode_s > 0 else "n/a"
        print(f"[prefill {len(prompt)} tokens: {1000 * (t_first - t0):.1f} ms; decode {n - 1} tokens: {rate}]",
              file=sys.stderr)
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
    turn = lambda text: [special["<|user_start|>"], *enc.encode_ordinary(text), special["<|user_end|>"],
                         special["<|assistant_start|>"]]
    pending = [model.config["bos_token_id"]]  # tokens not yet in the cache
    try:
        if args.prompt is not None:
            _reply(model, enc, pending + (turn(args.prompt) if chat else enc.encode_ordinary(args.prompt)), args, stops)
            return
        print(f"LiteRT chat ({model.config.get('quantize')} weights, {model.capacity}-token cache). Ctrl-D quits.")
        while True:
            try:
                text = input("\nUser: ")
            except EOFError:
                return
            print("Assistant: ", end="", flush=True)
            last = _reply(model, enc, pending + (turn(text) if chat else enc.encode_ordinary(text)), args, stops)
            end = special.get("<|assistant_end|>")
            pending = [last] + ([end] if chat and last != end else [])
    except ValueError as e:  # the cache is full
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
