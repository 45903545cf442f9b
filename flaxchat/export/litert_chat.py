"""Generate from a LiteRT export (`scripts.export --format litert`) with no JAX or TensorFlow installed.

The loop an app runs: zeros for the KV cache, the prompt through the `prefill` signature in chunks of its
fixed length, then one `decode` call per new token, each call's caches fed into the next (flaxchat.export.litert
documents the signatures). Imports only numpy, tiktoken and ai_edge_litert (`pip install ai-edge-litert numpy
tiktoken` is all it needs); the tool (calculator) is not run. `python -m scripts.litert_chat` is its command line.
"""

from __future__ import annotations

import base64
import json
import os

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
    return tiktoken.Encoding(
        name="flaxchat", pat_str=data["pattern"], mergeable_ranks=ranks, special_tokens=dict(data["special_tokens"])
    )


class LiteRTModel:
    """model.tflite's prefill/decode signatures and the KV cache they pass along (batch 1).

    `pos` tokens are in the cache; the last token a caller was given by `generate` is not (it goes in with the
    next feed), as in any decode loop.
    """

    def __init__(self, model_dir: str, num_threads: int | None = None):
        from ai_edge_litert.interpreter import Interpreter

        path = os.path.join(model_dir, CONFIG_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no {CONFIG_FILE} in {model_dir}; export with `python -m scripts.export --format litert`"
            )
        with open(path) as f:
            self.config = json.load(f)
        self.interpreter = Interpreter(
            model_path=os.path.join(model_dir, self.config["model_file"]), num_threads=num_threads
        )
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
        out = self._decode(
            tokens=np.array([[token]], np.int32),
            prev_token=self._scalar(self.last_token),
            pos=self._scalar(self.pos),
            k_cache=self.k,
            v_cache=self.v,
        )
        return self._run(out, [token])

    def feed(self, ids: list[int]) -> np.ndarray:
        """Put ids in the cache, prefill chunk by chunk; returns the logits after the last one (V,)."""
        if not ids:
            raise ValueError("nothing to feed: a prompt needs at least one token")
        if self.pos + len(ids) > self.capacity:
            raise ValueError(
                f"{self.pos + len(ids)} tokens do not fit the exported {self.capacity}-token KV cache; "
                "shorten the prompt or start a new conversation"
            )
        if len(ids) == 1:
            return self.step(ids[0])
        P = self.prefill_len
        for start in range(0, len(ids), P):
            chunk = ids[start : start + P]
            tokens = np.array([chunk + [chunk[-1]] * (P - len(chunk))], np.int32)  # padding sits past pos, unseen
            out = self._prefill(
                tokens=tokens,
                prev_token=self._scalar(self.last_token),
                pos=self._scalar(self.pos),
                length=self._scalar(len(chunk)),
                k_cache=self.k,
                v_cache=self.v,
            )
            logits = self._run(out, chunk)
        return logits


# A tool call and the tool's reply shown as scripts.chat_cli shows them, [python: ...] and [output: ...], instead of
# the special tokens' names.
TOOL_MARKS = {
    "<|python_start|>": "[python: ",
    "<|python_end|>": "]",
    "<|output_start|>": "[output: ",
    "<|output_end|>": "]",
}


def shown_bytes(enc: tiktoken.Encoding, token: int) -> bytes:
    """What a terminal shows for one token: its text, or a bracket where a tool call or its output starts or ends."""
    text = enc.decode_single_token_bytes(token)
    mark = TOOL_MARKS.get(text.decode("utf-8", errors="replace")) if enc.is_special_token(token) else None
    return mark.encode() if mark else text


def sample(logits, rng, temperature: float = 0.0, top_k: int | None = None) -> int:
    """Greedy at temperature 0, else softmax(logits / temperature) over the top_k largest."""
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    p = np.exp(z - z.max())
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(
    model: LiteRTModel,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    stop_tokens=(),
):
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
