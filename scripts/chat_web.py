"""Chat in the browser: the chat page, a WebSocket chat and an OpenAI-compatible API, with continuous batching.

    python -m scripts.chat_web                                    # latest SFT model at http://127.0.0.1:8000
    python -m scripts.chat_web -i rl --slots 16 --port 8080       # the RL model, 16 conversations at once
    FLAXCHAT_API_KEY=$(openssl rand -hex 16) python -m scripts.chat_web --host 0.0.0.0 \
        --allowed-hosts chat.example.com --max-connections 200   # expose it on the network (docs/serving.md)
    python -m scripts.chat_web --limit-everyone --rate-limit 5000 # token-rate-limit this machine's own clients too
    python -m scripts.chat_web --random-init --depth 4            # an untrained model (tokenizer from the base dir)
    python -m scripts.chat_web -g d12 --draft-model d4            # speculative sampling, one conversation at a time
    # measure: 1 and then 16 concurrent WebSocket clients against an in-process server; prints JSON, exits
    python -m scripts.chat_web --random-init --depth 4 --slots 16 --load-test 1,16 --load-tokens 128

The same commands run on a GPU or TPU host (JAX picks the device). The API speaks OpenAI's chat format:

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Why is the sky blue?"}], "stream": true}'

With --api-key (or FLAXCHAT_API_KEY, which keeps the key out of `ps`), add -H "Authorization: Bearer $KEY".

Routes: flaxchat/serve/app.py; the WebSocket protocol: flaxchat/serve/websocket.py; the OpenAI API:
flaxchat/serve/openai.py; the limits: flaxchat/serve/server.py; key, origins, hosts, deadlines:
flaxchat/serve/security.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import os
import sys
import time

import uvicorn
import websockets
from flax import nnx

from flaxchat.common import enable_compilation_cache, get_base_dir, parse_args
from flaxchat.data.tokenizer import get_tokenizer
from flaxchat.generate.scheduler import STREAM_INTERVAL, Scheduler, SpeculativeScheduler, auto_slots
from flaxchat.generate.speculative import add_draft_flags
from flaxchat.model.config import GPTConfig
from flaxchat.model.gpt import GPT
from flaxchat.model.quantize import add_quantize_flag, quantize_for_generation
from flaxchat.serve.app import BackgroundServer, create_app, uvicorn_config
from flaxchat.serve.limits import LOOPBACK_HOSTS, is_loopback
from flaxchat.serve.security import normalize_hosts, normalize_origins
from flaxchat.serve.server import ServeConfig
from flaxchat.train.checkpoint import find_model, load_model, load_named_model, model_tag_arg, where_found

# -----------------------------------------------------------------------------
# Arguments


class DefaultsOnceFormatter(argparse.HelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter, but each default said once: not appended where the help already
    speaks of its default (here and in the shared flag groups), nor for a flag that is simply off by default."""

    def _get_help_string(self, action):
        text = action.help or ""
        off = action.default is None or action.default is False or action.default in ((), "", argparse.SUPPRESS)
        if "default:" in text.lower() or off or not action.option_strings:
            return text
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Serve a flaxchat model in the browser and over HTTP", formatter_class=DefaultsOnceFormatter
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("-i", "--source", choices=["base", "sft", "rl"], default="sft", help="which checkpoints to load")
    p.add_argument(
        "-g",
        "--model-tag",
        type=model_tag_arg,
        default=None,
        help="model tag (directory under the checkpoints); default: the largest",
    )
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step; default: the latest")
    p.add_argument(
        "--random-init", action="store_true", help="serve an untrained model of --depth (load tests, UI work)"
    )
    p.add_argument("--depth", type=int, default=4, help="model depth for --random-init")
    p.add_argument("--seq-len", type=int, default=512, help="context length for --random-init")
    p.add_argument("--seed", type=int, default=0, help="parameter seed for --random-init")
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help="conversations generated at once (rows of the KV cache); default: the largest power of two "
        "up to 32 whose KV cache fits in a quarter of the free memory",
    )
    p.add_argument("--chunk", type=int, default=8, help="most decode steps per scheduler iteration")
    p.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL,
        help="seconds a sampled token may wait before it is streamed: each iteration decodes as many steps as fit "
        "(at the measured step time, at most --chunk), so a slow model streams token by token",
    )
    p.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="prefill every prompt whole: do not keep a finished reply's KV cache for its conversation's next turn",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="most new tokens one reply may ask for")
    p.add_argument("--default-max-tokens", type=int, default=256, help="new tokens when a request does not say")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="longest prompt (default: 3/4 of the context)")
    p.add_argument("-t", "--temperature", type=float, default=0.8, help="default sampling temperature")
    p.add_argument("-k", "--top-k", type=int, default=50, help="default top-k (0 = the whole vocabulary)")
    p.add_argument("--max-connections", type=int, default=64, help="open WebSockets + in-flight HTTP requests")
    p.add_argument(
        "--max-connections-per-client",
        type=int,
        default=8,
        help="requests and WebSockets one client address may hold at once",
    )
    p.add_argument("--max-message-bytes", type=int, default=32768, help="largest WebSocket frame / HTTP body")
    p.add_argument(
        "--rate-limit",
        type=float,
        default=20000.0,
        help="new tokens a client address may ask for per minute (0 = off); a request costs prompts x n x "
        "max_tokens, a refused one --rate-min-cost; loopback clients (127.0.0.1, ::1) are exempt unless "
        "--limit-everyone",
    )
    p.add_argument("--rate-burst", type=int, default=8192, help="tokens a client may ask for at once")
    p.add_argument("--rate-min-cost", type=int, default=64, help="tokens the least request costs, refused ones too")
    p.add_argument(
        "--limit-everyone",
        action="store_true",
        help="apply the per-client limits (rate, connections) to loopback clients too (e.g. behind a reverse proxy "
        "on this machine without --forwarded-allow-ips, where every client arrives from 127.0.0.1)",
    )
    g = p.add_argument_group("exposing the server (docs/serving.md)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require this key: 'Authorization: Bearer KEY' on the API (every route but the page and /health), "
        "and the chat page asks for it once; without this flag $FLAXCHAT_API_KEY is read (it keeps the key out "
        "of the process list); default: no key",
    )
    g.add_argument(
        "--allowed-origins",
        type=comma_list,
        default=(),
        help="comma-separated browser origins (https://app.example.com) that may use /ws and the API, besides "
        "the page's own and loopback ones; '*' allows any",
    )
    g.add_argument(
        "--allowed-hosts",
        type=comma_list,
        default=(),
        help="comma-separated Host names to serve besides localhost, 127.0.0.1, [::1] (others get 400; this "
        "stops DNS rebinding); checked when --host is loopback or this is given; '*' serves any",
    )
    g.add_argument(
        "--forwarded-allow-ips",
        type=comma_list,
        default=(),
        help="comma-separated addresses (or networks) of reverse proxies whose X-Forwarded-For names the client "
        "for the limits; default: none (the header is ignored)",
    )
    g.add_argument("--idle-timeout", type=float, default=600.0, help="close a WebSocket after this many quiet seconds")
    g.add_argument("--header-timeout", type=float, default=10.0, help="seconds for an HTTP request's headers")
    g.add_argument("--body-timeout", type=float, default=10.0, help="seconds for an HTTP request's body (then 408)")
    g.add_argument(
        "--max-send-queue", type=int, default=1024, help="events queued for a WebSocket client that is not reading"
    )
    g.add_argument("--api-docs", action="store_true", help="serve /docs and /openapi.json")
    add_quantize_flag(p)
    add_draft_flags(p)
    p.add_argument(
        "--no-warmup", action="store_true", help="compile each program on its first use instead of ahead of it"
    )
    p.add_argument(
        "--warmup-all",
        action="store_true",
        help="compile every program before serving (a minute or more; by default the server compiles the widest "
        "programs, serves with them at once and compiles the narrower ones in the background)",
    )
    p.add_argument("--load-test", default=None, help="comma-separated client counts: measure them and exit")
    p.add_argument("--load-tokens", type=int, default=128, help="tokens each load-test client asks for")
    p.add_argument("--load-repeats", type=int, default=3, help="rounds of the load test (client counts interleaved)")
    return p


def comma_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def get_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.slots is not None and args.slots < 1:
        parser.error(f"--slots must be >= 1, got {args.slots}")
    for name in (
        "chunk",
        "draft_steps",
        "max_tokens",
        "default_max_tokens",
        "max_connections",
        "max_message_bytes",
        "depth",
        "seq_len",
        "load_tokens",
        "load_repeats",
        "rate_burst",
        "max_connections_per_client",
        "max_send_queue",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.no_warmup and args.warmup_all:
        parser.error("--no-warmup and --warmup-all contradict each other: choose one")
    if not args.stream_interval > 0:
        parser.error(f"--stream-interval must be > 0 seconds, got {args.stream_interval}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.temperature <= 2:
        parser.error(f"--temperature must be in [0, 2], got {args.temperature}")
    if not 0 <= args.top_k <= 200:
        parser.error(f"--top-k must be in 0..200, got {args.top_k}")
    if args.rate_limit < 0:
        parser.error(f"--rate-limit must be >= 0, got {args.rate_limit}")
    if args.rate_min_cost < 0:
        parser.error(f"--rate-min-cost must be >= 0, got {args.rate_min_cost}")
    for name in ("idle_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.api_key is None:
        args.api_key = os.environ.get("FLAXCHAT_API_KEY") or None
    if args.api_key is not None and len(args.api_key) < 8:
        parser.error("--api-key must be at least 8 characters")
    if args.load_test is not None:
        try:
            args.load_test = [int(x) for x in args.load_test.split(",")]
        except ValueError:
            parser.error(f"--load-test takes client counts like 1,16, got {args.load_test!r}")
        if any(n < 1 for n in args.load_test):
            parser.error("--load-test client counts must be >= 1")
    return args


# -----------------------------------------------------------------------------
# The model


def build_model(args):
    """(model, tokenizer, name): a checkpoint, or a fresh model of --depth sized to the base dir's tokenizer."""
    weights = "" if args.quantize == "none" else f"-{args.quantize}"
    if args.random_init:
        tokenizer = get_tokenizer()
        config = GPTConfig.from_depth(args.depth, vocab_size=tokenizer.get_vocab_size(), max_seq_len=args.seq_len)
        model = quantize_for_generation(GPT(config, rngs=nnx.Rngs(args.seed)), args.quantize)
        return model, tokenizer, f"d{args.depth}-random-init{weights}"
    base_dir, tag, places = find_model(args.source, args.model_tag)  # the base dir's, or the laptop demo's
    model, tokenizer, meta = load_model(args.source, tag, args.step, base_dir=base_dir)
    _, note = where_found(args.source, tag, meta.get("step", "?"), base_dir, places)
    if note:
        print(f"chat_web: {note}", file=sys.stderr)
    args.model_base_dir = base_dir  # where --draft-model is looked for too
    model = quantize_for_generation(model, args.quantize)
    return model, tokenizer, f"{tag}-{args.source}-step{meta.get('step', 'latest')}{weights}"


def build_draft(args, model):
    """The --draft-model checkpoint ([SOURCE:]TAG, SOURCE defaulting to -i), quantized like the model; or None."""
    if not args.draft_model:
        return None
    draft = load_named_model(
        args.draft_model, args.source, "--draft-model", base_dir=getattr(args, "model_base_dir", None)
    )
    if draft.config.vocab_size != model.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.config.vocab_size}) is not the model's "
            f"({model.config.vocab_size}); a draft must use the same tokenizer"
        )
    return quantize_for_generation(draft, args.quantize)


# -----------------------------------------------------------------------------
# Load test: many WebSocket clients at once against the server


async def one_client(ws_url: str, content: str, max_tokens: int, seed: int) -> dict:
    async with websockets.connect(ws_url, max_size=2**22) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        t0 = time.perf_counter()
        await ws.send(
            json.dumps(
                {
                    "type": "message",
                    "content": content,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "top_k": 50,
                    "seed": seed,
                }
            )
        )
        first = None
        while True:
            event = json.loads(await ws.recv())
            if event["type"] in ("token", "tool") and first is None:
                first = time.perf_counter() - t0
            if event["type"] == "error":
                raise RuntimeError(f"load-test client got an error: {event}")
            if event["type"] == "done":
                return {"tokens": event["usage"]["completion_tokens"], "ttft_s": first, "s": time.perf_counter() - t0}


async def load_test(url: str, clients: int, max_tokens: int) -> dict:
    """`clients` concurrent conversations, each asking for max_tokens tokens; aggregate generated tokens/s."""
    ws_url = url.replace("http://", "ws://") + "/ws"
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(one_client(ws_url, "Tell me a story about a cat.", max_tokens, i) for i in range(clients))
    )
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    ttft = sorted(r["ttft_s"] for r in results if r["ttft_s"] is not None)
    return {
        "clients": clients,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tok_per_s": round(tokens / wall, 1),
        "per_client_tok_per_s": round(tokens / wall / clients, 1),
        "ttft_median_s": round(ttft[len(ttft) // 2], 3) if ttft else None,
    }


def load_test_in_subprocess(url: str, clients: int, max_tokens: int) -> dict:
    """load_test from a separate process, so the clients' own work does not compete with the server's threads
    for this process's interpreter lock (real clients are elsewhere)."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(run_load_test, (url, clients, max_tokens))


def run_load_test(url: str, clients: int, max_tokens: int) -> dict:
    """load_test in a fresh event loop (the subprocess's entry point)."""
    return asyncio.run(load_test(url, clients, max_tokens))


# -----------------------------------------------------------------------------
# Main


def exposure(args) -> dict:
    """The ServeConfig fields that decide who may use the server. Host names are checked when it listens on
    loopback (any Host then means DNS rebinding) or when --allowed-hosts names them."""
    hosts = None
    listening_locally = args.host == "localhost" or is_loopback(args.host)
    if "*" not in args.allowed_hosts and (listening_locally or args.allowed_hosts):
        hosts = LOOPBACK_HOSTS + normalize_hosts(args.allowed_hosts)
    return dict(
        api_key=args.api_key,
        allowed_origins=normalize_origins(args.allowed_origins),
        allowed_hosts=hosts,
        forwarded_allow_ips=args.forwarded_allow_ips,
        api_docs=args.api_docs,
        max_connections_per_client=args.max_connections_per_client,
        idle_timeout=args.idle_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_send_queue=args.max_send_queue,
    )


def main(argv=None) -> int:
    args = get_args(argv)
    try:
        model, tokenizer, name = build_model(args)
        draft = build_draft(args, model)
    except (FileNotFoundError, ValueError) as e:
        print(f"chat_web: {e}", file=sys.stderr)
        return 1
    # compiled programs persist across restarts (a server compiles one decode program per batch size and span)
    enable_compilation_cache(os.path.join(get_base_dir(), "jax_cache"))
    c = model.config
    print(f"model {name}: {c.n_layer} layers, width {c.n_embd}, vocab {c.vocab_size}, context {c.sequence_len}")
    if draft is not None:
        if args.slots not in (None, 1):
            print(
                f"chat_web: --draft-model serves one conversation at a time (got --slots {args.slots})", file=sys.stderr
            )
            return 1
        args.slots = 1
        print(
            f"speculative sampling: draft {args.draft_model} ({draft.config.n_layer} layers) proposes "
            f"{args.draft_steps} tokens a round; one conversation at a time, the others wait"
        )
        scheduler = SpeculativeScheduler(
            model,
            tokenizer,
            draft,
            draft_steps=args.draft_steps,
            chunk=args.chunk,
            stream_interval=args.stream_interval,
        )
    else:
        if args.slots is None:
            args.slots, why = auto_slots(model)
            print(f"slots: {why} (--slots sets it)")
        scheduler = Scheduler(
            model,
            tokenizer,
            slots=args.slots,
            chunk=args.chunk,
            stream_interval=args.stream_interval,
            prefix_reuse=not args.no_prefix_reuse,
        )
    if args.warmup_all:
        print(f"compiling for {args.slots} slots...", flush=True)
        print(f"compiled in {scheduler.warmup(progress=True):.1f} s")
    elif not args.no_warmup:
        print(f"compiling the widest programs for {args.slots} slots...", flush=True)
        seconds = scheduler.warmup_in_background(progress=True)
        print(f"compiled in {seconds:.1f} s; the narrower ones compile in the background while it serves")
    config = ServeConfig(
        model_name=name,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_tokens,
        default_max_tokens=args.default_max_tokens,
        default_temperature=args.temperature,
        default_top_k=args.top_k,
        max_connections=args.max_connections,
        max_message_bytes=args.max_message_bytes,
        rate_limit=args.rate_limit,
        rate_burst=args.rate_burst,
        rate_min_cost=args.rate_min_cost,
        limit_loopback=args.limit_everyone,
        **exposure(args),
    )
    if args.load_test:  # in-process clients on loopback: no key, no per-client limits
        most = max(args.load_test) + 8
        config = dataclasses.replace(
            config, rate_limit=0.0, max_connections=most, max_connections_per_client=most, api_key=None
        )
        with BackgroundServer(create_app(scheduler, tokenizer, config)) as url:
            scheduler.wait_compiled()  # the load test measures the steady state: every program compiled
            load_test_in_subprocess(url, 1, 8)  # settles the first-request paths before measuring
            runs = {n: [] for n in args.load_test}
            for _ in range(args.load_repeats):  # interleaved, so a busy moment on the machine hits every count
                for clients in args.load_test:
                    cpu0 = time.process_time()  # this process is the server: CPU it used, whatever else runs
                    run = load_test_in_subprocess(url, clients, args.load_tokens)
                    run["tok_per_server_cpu_s"] = round(run["tokens"] / (time.process_time() - cpu0), 1)
                    runs[clients].append(run)
                    print(json.dumps({"run": run}), flush=True)
            median = lambda key: {n: sorted(r[key] for r in rs)[len(rs) // 2] for n, rs in runs.items()}
            wall, cpu = median("tok_per_s"), median("tok_per_server_cpu_s")
            print(
                json.dumps(
                    {
                        "model": name,
                        "slots": args.slots,
                        "chunk": args.chunk,
                        "tokens_per_client": args.load_tokens,
                        "median_tok_per_s": wall,
                        "vs_one_client": {n: round(v / wall[min(wall)], 2) for n, v in wall.items()},
                        "median_tok_per_server_cpu_s": cpu,
                        "cpu_vs_one_client": {n: round(v / cpu[min(cpu)], 2) for n, v in cpu.items()},
                    }
                )
            )
        return 0
    app = create_app(scheduler, tokenizer, config)
    if args.api_key is None and not (args.host == "localhost" or is_loopback(args.host)):
        print(f"chat_web: {args.host} is reachable from other machines and there is no --api-key", file=sys.stderr)
    print(f"flaxchat is serving {name} at http://{args.host}:{args.port}/  (Ctrl-C stops)", flush=True)
    uvicorn.Server(uvicorn_config(app, args.host, args.port)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
