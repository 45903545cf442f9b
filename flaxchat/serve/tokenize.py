"""vLLM's tokenizer routes, in its request and response shapes, so that lm-evaluation-harness's
`tokenizer_backend=remote` counts context lengths with the server's own tokenizer (no Hugging Face tokenizer needed):

    POST /tokenize        {"prompt" | "messages", "add_special_tokens"} -> {"count", "max_model_len", "tokens"}
    POST /detokenize      {"tokens"} -> {"prompt"}
    GET  /tokenizer_info  the tokenizer's settings under Hugging Face's config names

Text reads special-token names as those tokens, as in /v1/completions (openai_schema.py), so /tokenize counts exactly
what a completion reads.
"""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from pydantic import Field

from flaxchat.serve.openai import holding_connection
from flaxchat.serve.openai_schema import (
    ChatMessage,
    OpenAIModel,
    encode_prompt,
    openai_error,
    openai_messages,
    read_request,
)
from flaxchat.serve.server import ChatServer, ClientError


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True  # prompt: <|bos|> first, as /v1/completions reads it (vLLM's default too)
    add_generation_prompt: bool = True  # messages: end with <|assistant_start|>, as a chat prompt does
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


def chat_ids(server: ChatServer, req: TokenizeRequest) -> list[int]:
    """Messages' ids as /v1/chat/completions renders them (add_generation_prompt: ending with <|assistant_start|>)."""
    messages = openai_messages(req, last_user=req.add_generation_prompt)
    try:
        if req.add_generation_prompt:
            conversation = {"messages": messages + [{"role": "assistant", "content": ""}]}
            return server.tokenizer.render_for_completion(conversation, max_tokens=10**9)
        return server.tokenizer.render_conversation({"messages": messages}, max_tokens=10**9)[0]
    except (ValueError, KeyError, TypeError, UnicodeError) as e:
        raise ClientError("invalid_message", f"messages: {e}") from None


async def tokenize(server: ChatServer, request: HTTPRequest):
    """POST /tokenize: {"prompt" | "messages", "add_special_tokens"} -> {"count", "max_model_len", "tokens"}."""
    try:
        req = await read_request(server, request, TokenizeRequest)
        if (req.prompt is None) == (req.messages is None):
            raise ClientError("invalid_message", "give either prompt or messages")
        if req.prompt is not None:
            ids = encode_prompt(server.tokenizer, req.prompt, req.add_special_tokens)
        else:
            ids = chat_ids(server, req)
    except ClientError as e:
        return openai_error(e)
    strs = [server.tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": server.scheduler.capacity, "tokens": ids, "token_strs": strs}


async def detokenize(server: ChatServer, request: HTTPRequest):
    """POST /detokenize: {"tokens"} -> {"prompt"}."""
    try:
        req = await read_request(server, request, DetokenizeRequest)
        vocab = server.tokenizer.get_vocab_size()
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ClientError("invalid_message", f"tokens: token ids must be in 0..{vocab - 1}")
    except ClientError as e:
        return openai_error(e)
    return {"prompt": server.tokenizer.decode(req.tokens)}


def tokenizer_info(server: ChatServer) -> dict:
    """GET /tokenizer_info: the tokenizer's settings in Hugging Face's config names, as vLLM answers. <|bos|> is both
    BOS and EOS: every document starts with it, so a base model that writes it has ended its document (a chat reply
    ends at <|assistant_end|>; generation stops at either). There is no Jinja chat_template: chats render in
    flaxchat's tokenizer (render_conversation), reachable through /tokenize's messages and /v1/chat/completions."""
    tok = server.tokenizer
    bos = tok.decode([tok.get_bos_token_id()])
    return {
        "tokenizer_class": type(tok).__name__,
        "bos_token": bos,
        "eos_token": bos,
        "pad_token": None,
        "unk_token": None,
        "additional_special_tokens": sorted(tok.get_special_tokens() - {bos}, key=tok.encode_special),
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": server.scheduler.capacity,
        "vocab_size": tok.get_vocab_size(),
    }


def tokenizer_routes(app, server: ChatServer) -> None:
    """Register /tokenize, /detokenize and /tokenizer_info on the app; each holds a connection while it runs."""
    app.post("/tokenize")(holding_connection(server, tokenize))
    app.post("/detokenize")(holding_connection(server, detokenize))

    @app.get("/tokenizer_info")
    async def info():
        return tokenizer_info(server)
