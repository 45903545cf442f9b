"""Chat with a trained model in the terminal; the reply streams as it is sampled.

    python -m scripts.chat_cli                                   # latest SFT model, interactive
    python -m scripts.chat_cli -i rl                             # the RL model
    python -m scripts.chat_cli -p "What is 23*17?" -t 0          # one greedy reply, then exit
    python -m scripts.chat_cli -i base --model-tag d4 --step 2000 -t 0.8 -k 50
    python -m scripts.chat_cli --quantize int8                   # int8 matmul weights: a quarter of fp32's memory
    python -m scripts.chat_cli -g d12 --draft-model d4           # speculative sampling with a small draft model

In the chat, /clear starts a new conversation and /quit (or Ctrl-D) leaves. Tool calls appear dimmed as
[python: ...] and their results as [output: ...]; the tool is the calculator, as in training and evaluation
(--sandbox also runs other Python the model writes, in flaxchat.generate.sandbox's sandbox, and refuses to start where
no operating-system sandbox can run unless --allow-python-guard says the code is trusted). The same command runs on
a CPU or a GPU (JAX picks the device); the model is loaded from
<base_dir>/{base,chatsft,chatrl}_checkpoints/<model_tag>/ or, after the laptop demo, from the same under
<base_dir>/tinystories/: the newer of the two, and it says which.
"""

from __future__ import annotations

import argparse
import os
import sys

from flaxchat.common import enable_compilation_cache, get_base_dir, parse_args
from flaxchat.generate.engine import Engine
from flaxchat.generate.reply import Reply
from flaxchat.generate.sandbox import SandboxUnavailable, sandbox_kind
from flaxchat.generate.speculative import add_draft_flags
from flaxchat.model.quantize import add_quantize_flag, quantize_for_generation
from flaxchat.train.checkpoint import find_model, load_model, load_named_model, model_tag_arg, where_found

DIM, RESET = "\033[2m", "\033[0m"
# How each part of an assistant message is shown; the brackets stand for the special tokens around it.
PART_STYLE = {"python": ("[python: ", "]"), "python_output": ("[output: ", "]")}


# -----------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Chat with a flaxchat model")
    p.add_argument(
        "-i", "--source", choices=["base", "sft", "rl"], default="sft", help="which checkpoints to load (default: sft)"
    )
    p.add_argument(
        "-g",
        "--model-tag",
        type=model_tag_arg,
        default=None,
        help="model tag, a directory under the checkpoints (default: the largest)",
    )
    p.add_argument("-s", "--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("-p", "--prompt", default="", help="ask one question, print the reply and exit")
    p.add_argument(
        "-t", "--temperature", type=float, default=0.6, help="sampling temperature, 0 = greedy (default: 0.6)"
    )
    p.add_argument(
        "-k", "--top-k", type=int, default=50, help="sample among the k most likely tokens, 0 = all (default: 50)"
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=None,
        help="nucleus sampling: the smallest set of tokens with this much mass (default: off)",
    )
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens per reply (default: 256)")
    p.add_argument("--seed", type=int, default=42, help="sampling seed; turn n uses seed + n (default: 42)")
    p.add_argument(
        "--sandbox",
        action="store_true",
        help="let tool calls run any Python in the sandbox (5 s limit), not only the calculator "
        "(default: calculator only, as in training and evaluation)",
    )
    p.add_argument(
        "--allow-python-guard",
        action="store_true",
        help="with --sandbox, where bubblewrap cannot run (macOS, no user namespaces), run the code under the "
        "in-process Python guard instead of refusing; it stops accidents, not code written to escape, so only for "
        "code you trust (the same as FLAXCHAT_SANDBOX=allow-guard)",
    )
    p.add_argument("--no-color", action="store_true", help="plain text even on a terminal")
    add_quantize_flag(p)
    add_draft_flags(p)
    return p


def get_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k < 0:
        parser.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.draft_steps < 1:
        parser.error(f"--draft-steps must be >= 1, got {args.draft_steps}")
    if args.allow_python_guard and not args.sandbox:
        parser.error("--allow-python-guard goes with --sandbox (without it, tool calls run only the calculator)")
    return args


# -----------------------------------------------------------------------------
# Streaming one reply


class ReplyPrinter:
    """Prints a reply as its tokens stream in, through the Engine's own tool state machine (`Reply`, following
    the tokens only: the Engine has already run the tool). Text appears a whole character at a time; a tool
    call and its output appear, dimmed, once complete."""

    def __init__(self, tokenizer, out, color: bool):
        self.reply, self.out, self.color = Reply(tokenizer), out, color

    def _show(self) -> None:
        for event in self.reply.take_events():
            if event["type"] == "token":
                self.out.write(event["text"])
            else:
                opening, closing = PART_STYLE["python" if event["kind"] == "call" else "python_output"]
                text = f"{opening}{event['text']}{closing}"
                self.out.write(f"{DIM}{text}{RESET}" if self.color else text)
        self.out.flush()

    def add(self, token: int) -> bool:
        """Show one token; False once the reply has ended."""
        ended, _ = self.reply.feed(token)
        self._show()
        return not ended

    def finish(self) -> list[dict]:
        parts = self.reply.finish()
        self._show()
        return parts


def stream_reply(engine, tokenizer, prompt: list[int], args, seed: int, out, color: bool) -> list[dict]:
    """Sample one assistant reply to `prompt`, printing it as it comes; returns the message's parts."""
    printer = ReplyPrinter(tokenizer, out, color)
    stream = engine.generate(
        prompt,
        num_samples=1,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k or None,
        top_p=args.top_p,
        seed=seed,
    )
    try:
        for column, _ in stream:
            if not printer.add(column[0]):
                break
    except KeyboardInterrupt:  # Ctrl-C stops the reply; what was said so far stays in the conversation
        out.write(" [stopped]")
    return printer.finish()


def render_prompt(tokenizer, messages: list[dict], capacity: int, reserve: int) -> tuple[list[int], int]:
    """Prompt ids for the next reply, dropping the oldest exchanges while it leaves < reserve tokens of room.

    Returns (ids, number of messages dropped); raises ValueError if even the last message alone is too long.
    """
    dropped = 0
    while True:
        conversation = {"messages": messages[dropped:] + [{"role": "assistant", "content": ""}]}
        ids = tokenizer.render_for_completion(conversation, max_tokens=10**9)
        if len(ids) + reserve <= capacity:
            return ids, dropped
        if len(messages) - dropped <= 1:
            raise ValueError(f"that message is {len(ids)} tokens; the model's context holds {capacity}")
        dropped += 2  # one user message and the reply to it


# -----------------------------------------------------------------------------
# The conversation loop


def run_chat(engine, tokenizer, args, read_line=input, out=None) -> list[dict]:
    """Interactive chat (or one reply with args.prompt); returns the conversation's messages at the end."""
    out = out or sys.stdout
    color = not args.no_color and out.isatty()
    capacity = engine.capacity
    reserve = min(args.max_tokens, capacity // 2)
    messages: list[dict] = []
    if not args.prompt:
        out.write("flaxchat: type a message; /clear starts over, /quit leaves.\n")
    turn = 0
    while True:
        if args.prompt:
            user = args.prompt
        else:
            try:
                user = read_line("\nUser: ").strip()
            except (EOFError, KeyboardInterrupt):
                out.write("\n")
                return messages
            if user in ("/quit", "/exit"):
                return messages
            if user == "/clear":
                messages = []
                out.write("(new conversation)\n")
                continue
            if not user:
                continue
        messages.append({"role": "user", "content": user})
        try:
            prompt, dropped = render_prompt(tokenizer, messages, capacity, reserve)
        except ValueError as e:
            messages.pop()
            out.write(f"({e}; try a shorter message)\n")
            if args.prompt:
                return messages
            continue
        if dropped:
            messages = messages[dropped:]
            out.write(f"(the conversation outgrew the context: dropped the oldest {dropped} messages)\n")
        if not args.prompt:
            out.write("\nAssistant: ")
        parts = stream_reply(engine, tokenizer, prompt, args, args.seed + turn, out, color)
        out.write("\n")
        messages.append({"role": "assistant", "content": parts})
        turn += 1
        if args.prompt:
            return messages


def load(args):
    """(model, draft or None, tokenizer, meta, where): the newest model of -i (and -g) in the base dir or the laptop
    demo's folder (flaxchat.train.checkpoint.find_model), saying on stderr which when there was a choice."""
    base_dir, tag, places = find_model(args.source, args.model_tag)
    model, tokenizer, meta = load_model(args.source, tag, args.step, base_dir=base_dir)
    draft = None
    if args.draft_model:
        draft = load_named_model(args.draft_model, args.source, "--draft-model", base_dir=base_dir)
    where, note = where_found(args.source, tag, meta.get("step", "?"), base_dir, places)
    if note:
        print(f"chat_cli: {note}", file=sys.stderr)
    return model, draft, tokenizer, meta, where


def main(argv=None) -> int:
    args = get_args(argv)
    if args.allow_python_guard:
        os.environ["FLAXCHAT_SANDBOX"] = "allow-guard"
    if args.sandbox:
        try:  # before loading anything: where no sandbox may run, say so at once
            sandbox_kind()
        except SandboxUnavailable as e:
            print(f"chat_cli: {e}", file=sys.stderr)
            return 1
    # compiled prefill/decode programs survive restarts, so a second session starts answering at once (also on CPU)
    enable_compilation_cache(os.path.join(get_base_dir(), "jax_cache"))

    try:
        model, draft, tokenizer, meta, where = load(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"chat_cli: {e}", file=sys.stderr)
        return 1
    if draft is not None and draft.config.vocab_size != model.config.vocab_size:
        print(
            f"chat_cli: the draft model's vocabulary ({draft.config.vocab_size}) is not the model's "
            f"({model.config.vocab_size}); a draft must use the same tokenizer",
            file=sys.stderr,
        )
        return 1
    quantize = lambda m: None if m is None else quantize_for_generation(m, args.quantize)
    engine = Engine(
        quantize(model), tokenizer, use_sandbox=args.sandbox, draft_model=quantize(draft), draft_steps=args.draft_steps
    )
    if not args.prompt:
        print(f"loaded {where} ({model.config.n_layer} layers)")
    run_chat(engine, tokenizer, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
