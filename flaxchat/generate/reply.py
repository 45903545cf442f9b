"""The tool state machine: what a reply's tokens mean, as they come.

A reply ends at <|assistant_end|> or <|bos|> (`stop_tokens`). `<|python_start|>expr<|python_end|>` is a tool
call: `Reply` runs the tool on the expression and hands back `<|output_start|>result<|output_end|>` for the
decode loop to force into the row (at most `FORCED_CAPACITY` tokens, the size of each row's forced queue on the
device). For streaming it also decodes the text incrementally and keeps the reply as assistant-message parts.
The Engine (plain or speculative) and the server's schedulers follow their rows through it.
"""

from __future__ import annotations

import codecs
from typing import Callable

FORCED_CAPACITY = 128  # tokens a tool call may force into a row; longer outputs are cut to fit


def stop_tokens(tokenizer) -> tuple[int, int]:
    """The tokens that end a reply: <|assistant_end|> and <|bos|> (a model that starts a new document is done)."""
    return tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()


def until_stop(tokens: list[int], stop_tokens) -> list[int]:
    """tokens up to and including the first stop token (all of them when none is there)."""
    for i, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[: i + 1]
    return tokens


class Reply:
    """One reply's tool state machine and text stream (nanochat's RowState, plus incremental decoding).

    `feed` each generated token (forced ones included). `<|python_start|>expr<|python_end|>` is a tool call:
    `run_tool(expr)` runs and, when it returns text, `<|output_start|>result<|output_end|>` is to be forced into
    the row. With text=True, text between special tokens is decoded with an incremental UTF-8 decoder (a
    character split over several tokens comes out whole) and the reply is kept as assistant-message parts and
    stream events:
        {"type": "token", "text": str}                     text the model wrote (consecutive tokens coalesced)
        {"type": "tool", "kind": "call"|"output", "text"}  a complete tool call, then the tool's output
    run_tool=None follows the tokens without running anything (a display of someone else's stream).
    """

    def __init__(self, tokenizer, run_tool: Callable[[str], str | None] | None = None, *, text: bool = True):
        sp = tokenizer.encode_special
        self.tokenizer, self.run_tool, self.track_text = tokenizer, run_tool, text
        self.python_start, self.python_end = sp("<|python_start|>"), sp("<|python_end|>")
        self.output_start, self.output_end = sp("<|output_start|>"), sp("<|output_end|>")
        self.stop_tokens = set(stop_tokens(tokenizer))
        self.specials = {sp(name) for name in tokenizer.get_special_tokens()}
        self.mode = "text"  # text | python | python_output
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # the current text part
        self.pending = ""  # text not yet sent
        self.block: list[int] = []  # tokens of the current tool call or output
        self.parts: list[dict] = []
        self.events: list[dict] = []
        self.ended = False

    def feed(self, token: int) -> tuple[bool, list[int] | None]:
        """Take one generated token -> (reply ended, tokens to force next or None)."""
        if self.ended or token in self.stop_tokens:
            self.ended = True
            return True, None
        if token == self.python_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python", []
        elif token == self.python_end and self.mode == "python":
            expr = self._close_block("call")
            result = self.run_tool(expr) if self.run_tool is not None and expr.strip() else None
            if result is not None:
                body = self.tokenizer.encode(result)[: FORCED_CAPACITY - 2]
                return False, [self.output_start, *body, self.output_end]
        elif token == self.output_start and self.mode == "text":
            self._close_text()
            self.mode, self.block = "python_output", []
        elif token == self.output_end and self.mode == "python_output":
            self._close_block("output")
        elif self.mode != "text":
            self.block.append(token)
        elif self.track_text and token not in self.specials:  # a stray special token in text carries no text
            piece = self.decoder.decode(self.tokenizer.decode_single_token_bytes(token))
            self.text += piece
            self.pending += piece
        return False, None

    def _flush_pending(self) -> None:
        if self.pending:
            self.events.append({"type": "token", "text": self.pending})
            self.pending = ""

    def _close_text(self) -> None:
        tail = self.decoder.decode(b"", final=True)
        self.text += tail
        self.pending += tail
        self._flush_pending()
        if self.text:
            self.parts.append({"type": "text", "text": self.text})
        self.text = ""
        self.decoder.reset()

    def _close_block(self, kind: str) -> str:
        text = self.tokenizer.decode(self.block)
        if self.track_text:
            self.events.append({"type": "tool", "kind": kind, "text": text})
            self.parts.append({"type": self.mode, "text": text})
        self.mode, self.block = "text", []
        return text

    def take_events(self) -> list[dict]:
        """Events since the last call (pending text is sent as one token event)."""
        self._flush_pending()
        events, self.events = self.events, []
        return events

    def finish(self) -> list[dict]:
        """Close whatever part is open (an unfinished tool call is shown as it stands); returns the parts."""
        if self.mode == "text":
            self._close_text()
        else:
            self._close_block("call" if self.mode == "python" else "output")
        return self.parts
