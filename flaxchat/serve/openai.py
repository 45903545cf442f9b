"""The OpenAI-compatible HTTP API, so existing clients (the openai package, lm-evaluation-harness) work unchanged.

    POST /v1/chat/completions   chat completions; "stream": true answers with server-sent events. Honours messages
                                (system / user / assistant; text parts, and python / python_output parts of
                                flaxchat's own tool calls for round trips), temperature, top_p, top_k, seed,
                                max_tokens / max_completion_tokens, n, stop, stream_options.include_usage and
                                (not streamed) logprobs / top_logprobs.
    POST /v1/completions        legacy completions of raw prompts (text, ids, or lists of either): max_tokens,
                                temperature, top_p, top_k, seed, n, stop, echo, logprobs, stream (one prompt, no
                                logprobs) and stream_options.include_usage; echo + logprobs scores the prompt
                                (max_tokens 0: only the prompt).

The request bodies, OpenAI's error shape, messages and text prompts live in openai_schema.py; vLLM's tokenizer routes
(/tokenize, /detokenize, /tokenizer_info) in tokenize.py.

Logprobs are the raw model's (log_softmax of its logits, before temperature, top-k or top-p), as vLLM reports them
by default (OpenAI does not say which it reports); they are reduced on the device to the chosen token's and the top
alternatives' (flaxchat.generate.sampling.token_logprobs). Each request holds one of the server's connections until
its answer (or its stream) has been sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from flaxchat.generate.scheduler import Request, new_seed
from flaxchat.serve.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    encode_prompt,
    openai_error,
    openai_messages,
    read_request,
)
from flaxchat.serve.server import ChatServer, ClientError, thread_emitter

# -----------------------------------------------------------------------------
# Holding connections


class HeldStream(StreamingResponse):
    """A streaming response that holds one of the server's connections until it has been sent (or the client
    left): the handler returns long before the stream ends."""

    def __init__(self, server: ChatServer, content, **kwargs):
        super().__init__(content, **kwargs)
        self.server = server

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.server.release()


def holding_connection(server: ChatServer, handler):
    """An HTTP route around `handler(server, request)` that holds one of the server's connections while it runs
    (a stream: until it has been sent)."""

    async def route(request: HTTPRequest):
        if not server.acquire():
            return openai_error(ClientError("too_many_connections", "the server is at its connection limit", 503))
        response = None
        try:
            response = await handler(server, request)
            return response
        finally:
            if not isinstance(response, HeldStream):  # a stream gives its connection back when it ends
                server.release()

    return route


# -----------------------------------------------------------------------------
# Choices: the n scheduler requests behind one completion


def reply_text(event: dict) -> str:
    """How a scheduler event reads in OpenAI content: text as is, tool calls and outputs as fenced blocks."""
    if event["type"] == "token":
        return event["text"]
    if event["type"] == "tool":
        return f"\n```{'python' if event['kind'] == 'call' else 'output'}\n{event['text']}\n```\n"
    return ""


class StopFilter:
    """One choice's text with OpenAI's `stop` strings: the reply ends before the first occurrence of any.
    Text that could still be the start of a stop string is held back until the next piece decides it."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """The text that is safe to send now."""
        if self.stopped or not self.stops:
            return "" if self.stopped else text
        self.held += text
        cut = min((i for i in (self.held.find(x) for x in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped, out, self.held = True, self.held[:cut], ""
            return out
        keep = max((k for x in self.stops for k in range(1, len(x)) if self.held.endswith(x[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


class Choices:
    """The n scheduler requests behind one OpenAI completion, their stop filters and finish reasons."""

    def __init__(self, server: ChatServer, jobs: list[Request], stops: list[str]):
        self.server, self.jobs = server, jobs
        self.filters = [StopFilter(stops) for _ in jobs]
        self.reasons: list[str | None] = [None] * len(jobs)

    def handle(self, index: int, event: dict) -> tuple[str, bool]:
        """An event of choice `index` -> (text to send, whether the choice just ended)."""
        f = self.filters[index]
        if self.reasons[index] is not None:
            return "", False  # after a stop string: the cancelled request's stragglers
        if event["type"] == "done":
            self.reasons[index] = self.jobs[index].finish_reason
            return f.flush(), True
        text = f.feed(reply_text(event))
        if f.stopped:
            self.reasons[index] = "stop"
            self.server.scheduler.cancel(self.jobs[index])
            return text, True
        return text, False

    @property
    def done(self) -> bool:
        return all(r is not None for r in self.reasons)

    def usage(self) -> dict:
        prompt = len(self.jobs[0].prompt)  # counted once, as OpenAI does for n > 1
        completion = sum(j.completion_tokens for j in self.jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def cancel_unfinished(self) -> None:
        for job in self.jobs:
            if not job.finished:
                self.server.scheduler.cancel(job)

    def scored(self, index: int, text: str, keep_stop: bool) -> list[tuple[int, float, list]]:
        """Choice `index`'s generated tokens with their logprobs, [(id, logprob, [(id, logprob)] * k)], the
        scheduler recorded (Request.logprobs): those that wrote `text` when a stop string cut it, else all of them
        (the stop token that ended the reply only with keep_stop: lm-evaluation-harness's echo + max_tokens 1 reads
        one generated token, whatever it is)."""
        job = self.jobs[index]
        n = min(len(job.tokens), len(job.token_logprobs))  # the scheduler may still be appending (cancelled)
        if self.filters[index].stopped:
            need, have, i = len(text.encode()), 0, 0
            while i < n and have < need:
                have += len(self.server.tokenizer.decode_single_token_bytes(job.tokens[i]))
                i += 1
            n = i
        elif not keep_stop and n and job.tokens[n - 1] in self.server.scheduler.stop_tokens:
            n -= 1
        return list(zip(job.tokens[:n], job.token_logprobs[:n], job.top_logprobs[:n]))


def submit_choices(
    server: ChatServer, prompt: list[int], settings: dict, n: int, seeded: bool, events: asyncio.Queue
) -> list[Request]:
    """n scheduler requests for one prompt, seeds seed+i when the client gave a seed (all or none are queued)."""
    jobs = []
    try:
        for i in range(n):
            seed = settings["seed"] + i if seeded else (settings["seed"] if i == 0 else new_seed())
            jobs.append(server.submit(prompt, {**settings, "seed": seed % 2**63}, thread_emitter(events, i)))
    except ClientError:
        for job in jobs:
            server.scheduler.cancel(job)
        raise
    return jobs


async def _gather(request, choices: Choices, events) -> list[str]:
    texts = [[] for _ in choices.jobs]
    try:
        while not choices.done:
            try:
                index, event = await asyncio.wait_for(events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientError("cancelled", "the client went away", 499) from None
                continue
            if event["type"] == "error":
                raise ClientError(event["reason"], event["message"], 500)
            texts[index].append(choices.handle(index, event)[0])
    finally:
        choices.cancel_unfinished()
    return ["".join(t) for t in texts]


# -----------------------------------------------------------------------------
# Chat completions


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def chat_logprobs(server: ChatServer, req: ChatCompletionRequest) -> int | None:
    """The alternatives per token a chat request's logprobs ask for (None: no logprobs)."""
    if req.top_logprobs and not req.logprobs:
        raise ClientError("invalid_message", "top_logprobs: needs logprobs: true")
    if not req.logprobs:
        return None
    if req.stream:
        raise ClientError("invalid_message", "logprobs: returned only without streaming")
    if not server.scheduler.returns_logprobs:
        raise ClientError("invalid_message", "logprobs: this server's speculative decoding does not compute them")
    return req.top_logprobs or 0


def chat_logprobs_object(choices: Choices, index: int, text: str) -> dict | None:
    """OpenAI's chat logprobs of choice `index`: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    if choices.jobs[index].logprobs is None:
        return None
    tok = choices.server.tokenizer
    entry = lambda t, lp: {"token": tok.decode([t]), "logprob": lp, "bytes": list(tok.decode_single_token_bytes(t))}
    content = [
        {**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in top]}
        for t, lp, top in choices.scored(index, text, keep_stop=False)
    ]
    return {"content": content, "refusal": None}


async def completions(server: ChatServer, request: HTTPRequest):
    """POST /v1/chat/completions. Returns a JSONResponse, or a StreamingResponse of SSE chunks."""
    try:
        req = await read_request(server, request, ChatCompletionRequest)
        stops, top = req.stops(), chat_logprobs(server, req)
        settings = server.sampling(
            req.temperature, req.top_k, req.max_completion_tokens or req.max_tokens, req.seed, req.top_p
        ) | {"logprobs": top}
        prompt, _ = server.render(openai_messages(req), drop_old=False)
        server.check_rate(request.client.host if request.client else "unknown", req.n * settings["max_tokens"])
        events: asyncio.Queue = asyncio.Queue()
        choices = Choices(server, submit_choices(server, prompt, settings, req.n, req.seed is not None, events), stops)
    except ClientError as e:
        return openai_error(e)
    meta = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
        "object": "",
        "created": int(time.time()),
        "model": server.config.model_name,
    }  # "object" is filled in per response, keeping OpenAI's key order
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return HeldStream(
            server,
            _sse(choices, events, _chat_chunks(meta), include_usage),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    return await _collect(request, choices, events, meta)


async def _collect(request, choices: Choices, events, meta):
    try:
        texts = await _gather(request, choices, events)
    except ClientError as e:  # 499: nobody is waiting (the slots are already freed)
        return JSONResponse({}, status_code=499) if e.status == 499 else openai_error(e)
    out = [
        {
            "index": i,
            "message": {"role": "assistant", "content": text},
            "finish_reason": reason,
            "logprobs": chat_logprobs_object(choices, i, text),
        }
        for i, (text, reason) in enumerate(zip(texts, choices.reasons))
    ]
    return JSONResponse({**meta, "object": "chat.completion", "choices": out, "usage": choices.usage()})


def _sse_chunk(meta: dict, delta: dict, finish_reason=None, index: int = 0, **extra) -> str:
    chunk = {
        **meta,
        "object": "chat.completion.chunk",
        "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
        **extra,
    }
    return f"data: {json.dumps(chunk)}\n\n"


def _chat_chunks(meta: dict):
    """The chat endpoint's SSE lines: (opening lines per choice, chunk(index, text, finish), usage line)."""
    opening = lambda n: [_sse_chunk(meta, {"role": "assistant", "content": ""}, index=i) for i in range(n)]
    chunk = lambda index, text, finish: _sse_chunk(meta, {"content": text} if text else {}, finish, index)
    usage = lambda u: f"data: {json.dumps({**meta, 'object': 'chat.completion.chunk', 'choices': [], 'usage': u})}\n\n"
    return opening, chunk, usage


async def _sse(choices: Choices, events, lines, include_usage):
    """Server-sent events for a streamed request: lines = (opening, chunk, usage) as _chat_chunks makes them."""
    opening, chunk, usage = lines
    try:
        for line in opening(len(choices.jobs)):
            yield line
        while not choices.done:
            index, event = await events.get()
            if event["type"] == "error":
                yield f"data: {json.dumps({'error': {'message': event['message'], 'code': event['reason']}})}\n\n"
                break
            text, ended = choices.handle(index, event)
            if text:
                yield chunk(index, text, None)
            if ended:
                yield chunk(index, "", choices.reasons[index])
        else:
            if include_usage:
                yield usage(choices.usage())
        yield "data: [DONE]\n\n"
    finally:  # also runs when the client disconnects mid-stream (the response task is cancelled)
        choices.cancel_unfinished()


# -----------------------------------------------------------------------------
# Legacy completions (raw text in and out; lm-evaluation-harness scores prompts through it)


def legacy_prompts(server: ChatServer, req: CompletionRequest) -> list[tuple[str, list[int]]]:
    """The request's prompts as (text, ids): text by encode_prompt (after <|bos|> unless add_special_tokens is false),
    token ids as given."""
    p = req.prompt
    items = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if not items or any(len(x) == 0 for x in items):
        raise ClientError("invalid_message", "prompt: give at least one non-empty prompt")
    vocab = server.tokenizer.get_vocab_size()
    out = []
    for x in items:
        ids = encode_prompt(server.tokenizer, x, req.add_special_tokens) if isinstance(x, str) else list(x)
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ClientError("invalid_message", f"prompt: token ids must be in 0..{vocab - 1}")
        out.append((x if isinstance(x, str) else server.tokenizer.decode(ids), ids))
    return out


async def prompt_logprobs(server: ChatServer, ids: list[int], top: int) -> list[tuple[int, float | None, list | None]]:
    """A prompt's tokens with their logprobs and `top` alternatives, [(id, logprob, [(id, logprob)])] (the first
    token's are None: nothing precedes it). One forward pass, reduced on the device (Scheduler.score)."""
    chosen, alt, values = await asyncio.to_thread(server.scheduler.score, ids, top)
    rest = [(t, float(c), list(zip(a.tolist(), v.tolist()))) for t, c, a, v in zip(ids[1:], chosen[1:], alt, values)]
    return [(ids[0], None, None)] + rest


def legacy_logprobs(tokenizer, entries: list[tuple[int, float | None, list | None]]) -> dict:
    """OpenAI's legacy logprobs object for [(id, logprob, [(id, logprob)])]: token texts, their logprobs, the
    alternatives as {text: logprob} with the chosen token's included (so up to k + 1, as OpenAI documents; the
    likeliest first) and each token's offset in the text."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for t, logprob, top in entries:
        piece = tokenizer.decode([t])
        out["tokens"].append(piece)
        out["token_logprobs"].append(logprob)
        out["text_offset"].append(offset)
        offset += len(piece)
        alternatives = None
        if top is not None:
            alternatives = {}
            for a, v in [*top, (t, logprob)]:
                alternatives.setdefault(tokenizer.decode([a]), v)  # two tokens of one text: the likelier's
        out["top_logprobs"].append(alternatives)
    return out


async def check_connected(request: HTTPRequest) -> None:
    """Raise ClientError 499 when the client went away: work for a long list of prompts stops between pieces."""
    if await request.is_disconnected():
        raise ClientError("cancelled", "the client went away", 499)


async def legacy_completions(server: ChatServer, request: HTTPRequest):
    """POST /v1/completions: text completion of raw prompts; with logprobs, those of the generated tokens (and with
    echo of the prompt's: lm-evaluation-harness scores a continuation with echo + logprobs + max_tokens 1)."""
    try:
        req = await read_request(server, request, CompletionRequest)
        stops, prompts = req.stops(), legacy_prompts(server, req)
        if req.logprobs is not None and req.max_tokens > 0 and not server.scheduler.returns_logprobs:
            raise ClientError("invalid_message", "logprobs: this server's speculative decoding does not compute them")
        limit = server.max_prompt_tokens if req.max_tokens else server.scheduler.capacity
        if any(len(ids) > limit for _, ids in prompts):
            raise ClientError("prompt_too_long", f"a prompt is over the {limit}-token limit")
        settings = server.sampling(req.temperature, req.top_k, req.max_tokens or None, req.seed, req.top_p) | {
            "logprobs": req.logprobs
        }
        if req.stream and (len(prompts) > 1 or req.max_tokens == 0 or req.logprobs is not None):
            raise ClientError("invalid_message", "stream: one prompt, max_tokens > 0 and no logprobs")
        server.check_rate(request.client.host if request.client else "unknown", len(prompts) * req.n * req.max_tokens)
        if req.stream:
            return legacy_stream(server, req, prompts[0], settings, stops)
        out, usage = [], {"prompt_tokens": sum(len(ids) for _, ids in prompts), "completion_tokens": 0}
        for p, (text, ids) in enumerate(prompts):
            await check_connected(request)
            scored = await prompt_logprobs(server, ids, req.logprobs) if req.logprobs is not None and req.echo else []
            choices = None
            if req.max_tokens == 0:
                replies, reasons = [""] * req.n, ["length"] * req.n
            else:
                await check_connected(request)
                events: asyncio.Queue = asyncio.Queue()
                choices = Choices(
                    server, submit_choices(server, ids, settings, req.n, req.seed is not None, events), stops
                )
                replies = await _gather(request, choices, events)
                reasons = choices.reasons
                usage["completion_tokens"] += choices.usage()["completion_tokens"]
            for i, (reply, reason) in enumerate(zip(replies, reasons)):
                logprobs = None
                if req.logprobs is not None:
                    generated = choices.scored(i, reply, keep_stop=True) if choices else []
                    logprobs = legacy_logprobs(server.tokenizer, scored + generated)
                out.append(
                    {
                        "text": (text if req.echo else "") + reply,
                        "index": p * req.n + i,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    }
                )
    except ClientError as e:
        return openai_error(e)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return JSONResponse(
        {
            "id": f"cmpl-{uuid.uuid4().hex[:24]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": server.config.model_name,
            "choices": out,
            "usage": usage,
        }
    )


def legacy_stream(server: ChatServer, req: CompletionRequest, prompt: tuple[str, list[int]], settings, stops):
    """A streamed legacy completion: text_completion chunks (the echoed prompt first, with echo), then [DONE]."""
    text, ids = prompt
    events: asyncio.Queue = asyncio.Queue()
    choices = Choices(server, submit_choices(server, ids, settings, req.n, req.seed is not None, events), stops)
    meta = {
        "id": f"cmpl-{uuid.uuid4().hex[:24]}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": server.config.model_name,
    }

    def chunk(index, piece, finish):
        body = {**meta, "choices": [{"text": piece, "index": index, "logprobs": None, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    opening = lambda n: [chunk(i, text, None) for i in range(n)] if req.echo else []
    usage = lambda u: f"data: {json.dumps({**meta, 'choices': [], 'usage': u})}\n\n"
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return HeldStream(
        server,
        _sse(choices, events, (opening, chunk, usage), include_usage),
        media_type="text/event-stream",
        headers=SSE_HEADERS,
    )
