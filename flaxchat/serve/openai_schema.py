"""What goes over the wire of the OpenAI-compatible API (the routes are in openai.py): the request bodies as pydantic
models, read and checked; OpenAI's error shape; OpenAI messages as a flaxchat conversation; text prompts as token ids.

OpenAI's other request fields are accepted and ignored; those it cannot honour (tools, json response formats) are
refused. Errors have OpenAI's shape, {"error": {"message", "type", "param", "code"}}, with the WebSocket protocol's
reasons as codes (invalid_message, prompt_too_long, rate_limited...). Text prompts read special-token names
(<|bos|>...) as those tokens, as vLLM's tokenizers do, and begin with <|bos|> as training documents did (unless
"add_special_tokens": false), so /tokenize counts what /v1/completions reads.
"""

from __future__ import annotations

import re
from typing import Literal

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flaxchat.generate.sampling import MAX_TOP_LOGPROBS
from flaxchat.generate.scheduler import MAX_TOP_K
from flaxchat.serve.server import ChatServer, ClientError, describe_errors, parse_json

# -----------------------------------------------------------------------------
# Requests


class OpenAIModel(BaseModel):
    """OpenAI's request shapes: fields this server does not use (presence_penalty, logit_bias, user, store,
    metadata...) are accepted and ignored, as clients send them routinely; the fields it uses stay strict."""

    model_config = ConfigDict(extra="ignore", strict=True)


MAX_CHOICES = 8  # most choices (`n`) one request may ask for: each takes a scheduler slot
MAX_STOPS = 4  # as OpenAI


class ContentPart(OpenAIModel):
    type: Literal["text", "python", "python_output"]  # python parts: flaxchat's tool calls, for round trips
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class ResponseFormat(OpenAIModel):
    type: Literal["text"]  # json_object / json_schema cannot be honoured, so they are refused


class ChatCompletionRequest(OpenAIModel):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None  # any name is accepted; this server has one model
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)  # not OpenAI's, but nanochat's main knob
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    logprobs: bool | None = None  # each generated token's logprob in choices[].logprobs.content
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)  # and its k likeliest alternatives
    tools: list[dict] | None = Field(None, max_length=0)  # the model calls only its own calculator
    response_format: ResponseFormat | None = None

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not x for x in stops):
            raise ClientError("invalid_message", f"stop: at most {MAX_STOPS} non-empty strings")
        return stops


class CompletionRequest(OpenAIModel):
    prompt: str | list[int] | list[str] | list[list[int]]
    model: str | None = None
    max_tokens: int = Field(16, ge=0)  # OpenAI's default; 0 with echo scores the prompt only
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, le=MAX_TOP_K)
    seed: int | None = Field(None, ge=0, lt=2**63)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[str] | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit; the chosen token is always reported too
    stream: bool = False
    stream_options: StreamOptions | None = None
    add_special_tokens: bool = True  # vLLM's, and its default: <|bos|> before a text prompt, as before each training
    # document (issue 86); token-id prompts are read as given

    stops = ChatCompletionRequest.stops


# -----------------------------------------------------------------------------
# Reading requests, answering errors


def openai_error(e: ClientError) -> JSONResponse:
    body = {
        "error": {
            "message": e.message,
            "type": "invalid_request_error" if e.status < 500 else "server_error",
            "param": None,
            "code": e.reason,
        }
    }
    return JSONResponse(body, status_code=e.status)


async def read_body(request: HTTPRequest, max_bytes: int) -> bytes:
    """The request body, refused as soon as it passes max_bytes (a large body is never held whole)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ClientError("message_too_large", f"request body is {declared} bytes; the limit is {max_bytes}", 413)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise ClientError("message_too_large", f"request body is over the {max_bytes}-byte limit", 413)
    return bytes(body)


async def read_request(server: ChatServer, request: HTTPRequest, model: type[BaseModel]):
    """The request body parsed and validated as `model`; ClientError (400/413) otherwise."""
    limit = server.config.max_message_bytes
    try:
        return model.model_validate(parse_json(await read_body(request, limit), limit))
    except ValidationError as e:
        raise ClientError("invalid_message", describe_errors(e)) from None


# -----------------------------------------------------------------------------
# Messages and prompts


def openai_messages(req, last_user: bool = True) -> list[dict]:
    """OpenAI messages -> flaxchat conversation messages (text parts joined; tool parts kept for assistants);
    last_user: the last must be the user's (the prompt of a reply)."""
    out = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            if m.role != "assistant":
                if any(p.type != "text" for p in content):
                    raise ClientError("invalid_message", f"{m.role} content parts must be of type text")
                content = "".join(p.text for p in content)
            else:
                content = [p.model_dump() for p in content]
        out.append({"role": m.role, "content": content})
    if last_user and out[-1]["role"] != "user":
        raise ClientError("invalid_message", "messages: the last message must be from the user")
    return out


def encode_text(tokenizer, text: str) -> list[int]:
    """Text -> ids, special-token names (<|bos|>, <|user_start|>...) read as those tokens, as vLLM's tokenizers read
    them: lm-evaluation-harness finds the EOS and BOS ids by tokenizing their names."""
    names = sorted(tokenizer.get_special_tokens(), key=len, reverse=True)
    ids = []
    for i, piece in enumerate(re.split("(" + "|".join(map(re.escape, names)) + ")", text)):
        if i % 2:
            ids.append(tokenizer.encode_special(piece))
        elif piece:
            ids.extend(tokenizer.encode(piece))
    return ids


def encode_prompt(tokenizer, text: str, add_bos: bool = True) -> list[int]:
    """A text prompt's ids (encode_text's) after the <|bos|> that began every document the model trained on, as
    nanochat's sampling and CORE put it, and Llama-style tokenizers by default; not twice when the text spells it."""
    ids = encode_text(tokenizer, text)
    bos = tokenizer.get_bos_token_id()
    return [bos] + ids if add_bos and ids[:1] != [bos] else ids
