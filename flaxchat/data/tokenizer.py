"""GPT-4-style byte-level BPE: trained with rustbpe, run with tiktoken.

The tokenizer is nanochat's (same split pattern, same 9 special tokens in the same order, same
conversation rendering), so a tokenizer trained here on the same text gives the same ids as
nanochat's. Only the file format differs: instead of a pickled tiktoken object (which runs code
when loaded) it is a plain JSON file with base64 token bytes and a content hash that checkpoints
record, so a model is never paired with the wrong tokenizer by accident.

Layout of `<base_dir>/tokenizer/`:
    tokenizer.json    pattern, mergeable ranks (base64 bytes -> rank), special tokens, content hash
    token_bytes.npy   int32 (vocab_size,): UTF-8 bytes of each token, 0 for special tokens (bits per byte)
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import pickle

import numpy as np
import rustbpe
import tiktoken

from flaxchat.common import get_base_dir

# Special tokens, in nanochat's order (their ids follow the merged tokens in this order).
SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document; documents are packed BOS-aligned
    # The rest only appear when conversations are rendered for finetuning and chat.
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",  # the assistant calls the Python tool...
    "<|python_end|>",
    "<|output_start|>",  # ...and the tool's output comes back
    "<|output_end|>",
]

# GPT-4's (cl100k) pre-tokenization regex, except digits group in runs of at most 2 (`\p{N}{1,2}`
# rather than `{1,3}`): nanochat found this spends fewer of a small vocabulary's slots on numbers.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

BOS_TOKEN = "<|bos|>"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
FORMAT_NAME = "flaxchat-tokenizer"
FORMAT_VERSION = 1


def _content_hash(pattern: str, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int], bos: str) -> str:
    """sha256 over everything that decides which ids a text becomes (and the BOS choice)."""
    h = hashlib.sha256()
    h.update(json.dumps({"pattern": pattern, "bos": bos, "special_tokens": sorted(special_tokens.items())}).encode())
    for token, rank in sorted(mergeable_ranks.items(), key=lambda kv: kv[1]):
        h.update(b"%d %s\n" % (rank, base64.b64encode(token)))
    return h.hexdigest()


def _build_encoding(
    pattern: str, mergeable_ranks: dict[bytes, int], special_tokens: dict[str, int]
) -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name="flaxchat", pat_str=pattern, mergeable_ranks=mergeable_ranks, special_tokens=special_tokens
    )


class Tokenizer:
    """A tiktoken Encoding plus the BOS choice, the save format and chat rendering."""

    def __init__(self, enc: tiktoken.Encoding, bos_token: str = BOS_TOKEN):
        self.enc = enc
        self.bos_token = bos_token
        self.bos_token_id = self.encode_special(bos_token)

    # ------------------------------------------------------------------ construction

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size: int) -> "Tokenizer":
        """Learn BPE merges over an iterator of strings; vocab_size counts the 9 special tokens."""
        n_merged = vocab_size - len(SPECIAL_TOKENS)
        if n_merged < 256:
            raise ValueError(
                f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes + specials), got {vocab_size}"
            )
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(text_iterator, n_merged, pattern=SPLIT_PATTERN)
        ranks = {bytes(token): rank for token, rank in trainer.get_mergeable_ranks()}
        # Specials sit right after the learned tokens, in SPECIAL_TOKENS order (as in nanochat).
        specials = {name: len(ranks) + i for i, name in enumerate(SPECIAL_TOKENS)}
        return cls(_build_encoding(trainer.get_pattern(), ranks, specials))

    @classmethod
    def load(cls, tokenizer_dir: str) -> "Tokenizer":
        """Read `tokenizer.json` from a directory written by `save`, checking its content hash."""
        path = os.path.join(tokenizer_dir, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no {TOKENIZER_FILE} in {tokenizer_dir}; train one with `python -m scripts.tok_train`"
            )
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if data.get("format") != FORMAT_NAME or data.get("version") != FORMAT_VERSION:
            raise ValueError(f"{path} is not a {FORMAT_NAME} v{FORMAT_VERSION} file")
        ranks = {base64.b64decode(token): rank for token, rank in data["mergeable_ranks"].items()}
        specials = dict(data["special_tokens"])
        bos = data["bos_token"]
        digest = _content_hash(data["pattern"], ranks, specials, bos)
        if digest != data["content_hash"]:
            raise ValueError(f"{path} is corrupt: its content hash does not match its contents")
        return cls(_build_encoding(data["pattern"], ranks, specials), bos)

    @classmethod
    def from_nanochat(cls, tokenizer_dir: str) -> "Tokenizer":
        """Import nanochat's `tokenizer.pkl` (a pickled tiktoken Encoding) without executing pickle code."""
        path = os.path.join(tokenizer_dir, "tokenizer.pkl")
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no tokenizer.pkl in {tokenizer_dir} (nanochat writes it with `python -m scripts.tok_train`)"
            )
        with open(path, "rb") as f:
            state = _EncodingOnlyUnpickler(f).load()
        if not isinstance(state, _PickledEncoding) or not isinstance(state.state, dict):
            raise ValueError(f"{path} does not hold a tiktoken Encoding")
        s = state.state
        ranks, specials = s.get("mergeable_ranks"), s.get("special_tokens")
        if not (isinstance(s.get("pat_str"), str) and isinstance(ranks, dict) and isinstance(specials, dict)):
            raise ValueError(f"{path} holds an Encoding without pat_str/mergeable_ranks/special_tokens")
        if not all(isinstance(k, bytes) and isinstance(v, int) for k, v in ranks.items()):
            raise ValueError(f"{path} has mergeable_ranks that are not bytes -> int")
        if BOS_TOKEN not in specials:
            raise ValueError(f"{path} has no {BOS_TOKEN} special token, so it is not a nanochat tokenizer")
        return cls(_build_encoding(s["pat_str"], ranks, specials), BOS_TOKEN)

    @classmethod
    def from_pretrained(cls, tiktoken_name: str) -> "Tokenizer":
        """A tiktoken encoding such as "gpt2" or "cl100k_base" (for comparisons; its BOS is <|endoftext|>)."""
        return cls(tiktoken.get_encoding(tiktoken_name), "<|endoftext|>")

    # ------------------------------------------------------------------ saving

    @functools.cached_property
    def content_hash(self) -> str:
        """sha256 hex digest of pattern, ranks, specials and BOS; checkpoints store it."""
        return _content_hash(self.enc._pat_str, self.enc._mergeable_ranks, self.enc._special_tokens, self.bos_token)

    def save(self, tokenizer_dir: str) -> str:
        """Write tokenizer.json and token_bytes.npy (each atomically); returns the json path."""
        os.makedirs(tokenizer_dir, exist_ok=True)
        ranks = sorted(self.enc._mergeable_ranks.items(), key=lambda kv: kv[1])
        data = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "content_hash": self.content_hash,
            "vocab_size": self.get_vocab_size(),
            "bos_token": self.bos_token,
            "pattern": self.enc._pat_str,
            "special_tokens": self.enc._special_tokens,
            "mergeable_ranks": {base64.b64encode(token).decode("ascii"): rank for token, rank in ranks},
        }
        path = os.path.join(tokenizer_dir, TOKENIZER_FILE)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
        os.replace(path + ".tmp", path)
        bytes_path = os.path.join(tokenizer_dir, TOKEN_BYTES_FILE)
        with open(bytes_path + ".tmp", "wb") as f:
            np.save(f, self.token_bytes())
        os.replace(bytes_path + ".tmp", bytes_path)
        return path

    def token_bytes(self) -> np.ndarray:
        """int32 (vocab_size,): byte length of every token; 0 for specials so they add no bytes to bpb."""
        out = np.zeros(self.get_vocab_size(), dtype=np.int32)
        for token, rank in self.enc._mergeable_ranks.items():
            out[rank] = len(token)
        return out

    # ------------------------------------------------------------------ vocabulary

    def get_vocab_size(self) -> int:
        return self.enc.n_vocab

    def get_special_tokens(self) -> set[str]:
        return set(self.enc.special_tokens_set)

    def get_bos_token_id(self) -> int:
        return self.bos_token_id

    def encode_special(self, text: str) -> int:
        token_id = self.enc._special_tokens.get(text)
        if token_id is None:
            raise ValueError(f"{text!r} is not a special token of this tokenizer")
        return token_id

    def id_to_token(self, token_id: int) -> str:
        return self.enc.decode([token_id])

    def decode_single_token_bytes(self, token_id: int) -> bytes:
        return self.enc.decode_single_token_bytes(token_id)

    # ------------------------------------------------------------------ encode / decode

    def _special_id(self, token: int | str) -> int:
        return token if isinstance(token, int) else self.encode_special(token)

    def encode(self, text, prepend=None, append=None, num_threads: int = 8):
        """str -> list[int]; list[str] -> list[list[int]] (threads in tiktoken).

        Special-token strings inside `text` are encoded as ordinary text, never as special ids;
        `prepend` / `append` (an id or a special token's name) add one id at either end.
        """
        head = [] if prepend is None else [self._special_id(prepend)]
        tail = [] if append is None else [self._special_id(append)]
        if isinstance(text, str):
            return head + self.enc.encode_ordinary(text) + tail
        if isinstance(text, list):
            rows = self.enc.encode_ordinary_batch(text, num_threads=num_threads)
            return [head + row + tail for row in rows] if head or tail else rows
        raise TypeError(f"encode takes a str or a list of str, got {type(text).__name__}")

    __call__ = encode

    def decode(self, ids) -> str:
        if hasattr(ids, "tolist"):  # numpy / jax arrays
            ids = ids.tolist()
        return self.enc.decode(ids)

    # ------------------------------------------------------------------ conversations

    def render_conversation(self, conversation: dict, max_tokens: int = 2048) -> tuple[list[int], list[int]]:
        """Token ids of a chat and a mask that is 1 exactly where the assistant is trained to write.

        A leading system message is folded into the first user message. Messages must alternate
        user / assistant. Assistant content is a string or a list of parts {"type", "text"} with
        type "text", "python" (a tool call, supervised) or "python_output" (the tool's reply,
        not supervised: at run time Python writes it, not the model). Truncated to max_tokens.
        """
        messages = _fold_system_message(conversation["messages"])
        sp = {name: self.encode_special(name) for name in SPECIAL_TOKENS}
        ids, mask = [], []

        def add(token_ids, supervised: int):
            ids.extend(token_ids)
            mask.extend([supervised] * len(token_ids))

        add([self.get_bos_token_id()], 0)
        for i, message in enumerate(messages):
            expected = "user" if i % 2 == 0 else "assistant"
            if message["role"] != expected:
                raise ValueError(
                    f"message {i} is from {message['role']!r} but should be from {expected!r} (turns alternate)"
                )
            content = message["content"]
            if expected == "user":
                if not isinstance(content, str):
                    raise ValueError(f"user message {i} must be a string, got {type(content).__name__}")
                add([sp["<|user_start|>"], *self.encode(content), sp["<|user_end|>"]], 0)
                continue
            add([sp["<|assistant_start|>"]], 0)
            for part in _assistant_parts(content):
                part_ids = self.encode(part["text"])
                if part["type"] == "text":
                    add(part_ids, 1)
                elif part["type"] == "python":
                    add([sp["<|python_start|>"], *part_ids, sp["<|python_end|>"]], 1)
                elif part["type"] == "python_output":
                    add([sp["<|output_start|>"], *part_ids, sp["<|output_end|>"]], 0)
                else:
                    raise ValueError(f"unknown assistant part type {part['type']!r} (text, python, python_output)")
            add([sp["<|assistant_end|>"]], 1)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation: dict, max_tokens: int = 2048) -> list[int]:
        """Prompt ids for sampling the assistant's reply: the chat minus its last (assistant) message."""
        messages = conversation["messages"]
        if not messages or messages[-1]["role"] != "assistant":
            raise ValueError("render_for_completion needs a conversation that ends with an assistant message")
        ids, _ = self.render_conversation({**conversation, "messages": messages[:-1]}, max_tokens)
        return ids + [self.encode_special("<|assistant_start|>")]

    def visualize_tokenization(self, ids, mask, with_token_id: bool = False) -> str:
        """Tokens joined by '|', green where mask is 1 and red where 0 (ANSI colours)."""
        green, red, gray, reset = "\033[92m", "\033[91m", "\033[90m", "\033[0m"
        pieces = []
        for token_id, m in zip(ids, mask):
            piece = f"{green if m == 1 else red}{self.decode([token_id])}{reset}"
            if with_token_id:
                piece += f"{gray}({token_id}){reset}"
            pieces.append(piece)
        return "|".join(pieces)


def _fold_system_message(messages: list[dict]) -> list[dict]:
    """nanochat has no system turn: prefix the system text to the first user message instead."""
    if not messages:
        raise ValueError("a conversation needs at least one message")
    if messages[0]["role"] != "system":
        return messages
    if len(messages) < 2 or messages[1]["role"] != "user":
        raise ValueError("a system message must be followed by a user message")
    merged = {**messages[1], "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}
    return [merged, *messages[2:]]


def _assistant_parts(content) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if isinstance(content, list):
        return content
    raise ValueError(f"assistant content must be a string or a list of parts, got {type(content).__name__}")


class _PickledEncoding:
    """Receives a pickled tiktoken Encoding's state instead of building the Encoding."""

    def __setstate__(self, state):
        self.state = state


class _EncodingOnlyUnpickler(pickle.Unpickler):
    # nanochat's tokenizer.pkl is `pickle.dump(tiktoken.Encoding)`: one class reference plus a
    # dict of plain data. Anything else a pickle could name (callables, other classes) is refused,
    # so loading a hostile file cannot run code.
    def find_class(self, module, name):
        if (module, name) == ("tiktoken.core", "Encoding"):
            return _PickledEncoding
        raise pickle.UnpicklingError(f"tokenizer.pkl refers to {module}.{name}; only tiktoken Encodings are accepted")


# ---------------------------------------------------------------------- base-dir conveniences


def _tokenizer_dir(base_dir: str | None) -> str:
    return os.path.join(base_dir or get_base_dir(), "tokenizer")


def get_tokenizer(base_dir: str | None = None) -> Tokenizer:
    """The tokenizer saved in `<base_dir>/tokenizer/` (base_dir defaults to get_base_dir())."""
    tokenizer_dir = _tokenizer_dir(base_dir)
    if not os.path.isfile(os.path.join(tokenizer_dir, TOKENIZER_FILE)):
        raise FileNotFoundError(f"no tokenizer in {tokenizer_dir}; create it with `python -m scripts.tok_train`")
    return Tokenizer.load(tokenizer_dir)


def get_token_bytes(base_dir: str | None = None) -> np.ndarray:
    """int32 (vocab_size,) bytes per token id (0 for specials), from `<base_dir>/tokenizer/token_bytes.npy`."""
    path = os.path.join(_tokenizer_dir(base_dir), TOKEN_BYTES_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {TOKEN_BYTES_FILE} at {path}; create it with `python -m scripts.tok_train`")
    return np.load(path, allow_pickle=False).astype(np.int32, copy=False)
