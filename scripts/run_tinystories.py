"""The laptop demo: the whole pipeline on one machine, from stories to a model you can chat with.

    python -m scripts.run_tinystories            # sized for a laptop's 2 CPU cores
    python -m scripts.run_tinystories --quick    # the same stages, a tiny model, a few minutes
    pixi run demo

Stages (each one is a normal flaxchat command, printed as it runs; a second run reuses finished stages):
  1. data        TinyStories when the Hugging Face hub is reachable, else the built-in synthetic stories
  2. tokenizer   BPE on the training shards
  3. pretrain    a small GPT, with val bits-per-byte
  4. samples     stories the base model writes
  5. sft         story requests, identity, arithmetic and multi-turn conversations (offline synthetic mixture)
  6. chat        two replies from the chat model, then how to chat in the terminal or the browser
  7. check       the held-out check (tasks/heldout_chat.py): identity, arithmetic, stories, multi-turn, greedy
Everything lives under --base-dir, by default the folder tinystories/ inside the base dir ($FLAXCHAT_BASE_DIR,
else ~/.cache/flaxchat), so the demo's data, tokenizer and checkpoints never mix with (or overwrite) other runs'.
"""

import argparse
import os
import shlex
import subprocess
import sys
import time

from flaxchat.common import get_base_dir, parse_args
from flaxchat.eval.report import Report
from flaxchat.generate.engine import Engine
from flaxchat.perf.machine import cpu_bf16_instructions, with_huge_pages
from flaxchat.train.checkpoint import committed_steps, load_model
from tasks import heldout_chat
from tasks.common import hub_reachable

# name -> (full, quick) settings. Sized so the full demo fits 10 minutes on 2 CPU cores.
SIZES = {
    "docs_per_shard": (20000, 4000),
    "num_shards": (3, 1),
    "vocab_size": (4096, 2048),
    "tok_max_chars": (30_000_000, 5_000_000),
    "depth": (4, 2),
    "max_seq_len": (256, 256),
    "device_batch_size": (32, 16),
    "total_batch_size": (8192, 4096),
    "pretrain_iterations": (300, 50),
    "sft_iterations": (600, 15),
    "sft_batch_size": (16, 8),
    # the SFT mixture: arithmetic takes the most practice; stories that follow the request and conversations that
    # need an earlier turn come next
    "story_size": (2000, 300),
    "identity_size": (1500, 300),
    "arithmetic_size": (18000, 600),
    "multi_turn_size": (4000, 300),
}
STORY_PROMPTS = ["Once upon a time, there was a little", "One day, a girl named Lily", "Tom had a red ball."]
CHAT_PROMPTS = ["Tell me a story about a fox who finds a red hat.", "Who are you?"]


def build_parser():
    p = argparse.ArgumentParser(description="Run the whole flaxchat pipeline on stories, laptop-sized.")
    p.add_argument("--quick", action="store_true", help="a tiny model in a few minutes (the same stages)")
    p.add_argument(
        "--base-dir",
        type=str,
        default=os.path.join(get_base_dir(create=False), "tinystories"),
        help="where the demo's data, tokenizer and checkpoints go (default: tinystories/ inside "
        "$FLAXCHAT_BASE_DIR, or inside ~/.cache/flaxchat when that is unset; now %(default)s)",
    )
    p.add_argument(
        "--source",
        choices=["auto", "tinystories", "synthetic-stories"],
        default="auto",
        help="stories to train on (auto: TinyStories if the hub is reachable)",
    )
    p.add_argument("--fresh", action="store_true", help="redo every stage even if its output exists")
    return p


class Demo:
    def __init__(self, args):
        self.args = args
        self.size = {k: v[1] if args.quick else v[0] for k, v in SIZES.items()}
        self.tag = f"demo-d{self.size['depth']}" + ("-quick" if args.quick else "")
        # huge pages: each stage's XLA:CPU temporaries without a page fault per 4 KB (flaxchat.common)
        self.env = with_huge_pages({**os.environ, "FLAXCHAT_BASE_DIR": args.base_dir})
        self.timings = {}
        # bf16 products where the CPU multiplies bf16 in hardware: faster for the same val bpb (docs/cpu-speed.md);
        # FLAXCHAT_DTYPE, when set, decides instead
        native = cpu_bf16_instructions() and not os.environ.get("FLAXCHAT_DTYPE")
        self.dtype = ["--dtype", "bfloat16"] if native else []

    def path(self, *parts):
        return os.path.join(self.args.base_dir, *parts)

    def run(self, stage, module, *flags):
        """Run one pipeline command in a fresh process (its own progress bars), timing it."""
        cmd = [sys.executable, "-m", module, *map(str, flags)]
        print(
            f"\n=== {stage}: FLAXCHAT_BASE_DIR={self.args.base_dir} python -m {module} {shlex.join(map(str, flags))}",
            flush=True,
        )
        t0 = time.perf_counter()
        result = subprocess.run(cmd, env=self.env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.timings[stage] = self.timings.get(stage, 0.0) + time.perf_counter() - t0
        if result.returncode != 0:
            sys.exit(
                f"error: the {stage} stage failed (exit {result.returncode}); fix what it says and rerun, "
                "finished stages are kept"
            )

    def done(self, stage, *paths):
        if not self.args.fresh and all(os.path.exists(p) for p in paths):
            print(f"\n=== {stage}: already done, reusing {paths[0]}", flush=True)
            return True
        return False

    # --- stages ----------------------------------------------------------------

    def data(self):
        marker = self.path("base_data", "source.json")
        if self.done("data", marker):
            return
        source = self.args.source
        if source == "auto":
            source = "tinystories" if hub_reachable() else "synthetic-stories"
            print(
                f"stories: {source} ({'hub reachable' if source == 'tinystories' else 'offline: built-in generator'})"
            )
        flags = ["--source", source, "--num-shards", self.size["num_shards"], "--overwrite"]
        if source == "synthetic-stories":
            flags += ["--docs-per-shard", self.size["docs_per_shard"]]
        self.run("data", "scripts.data", *flags)

    def tokenizer(self):
        if self.done("tokenizer", self.path("tokenizer", "tokenizer.json")):
            return
        self.run(
            "tokenizer",
            "scripts.tok_train",
            "--vocab-size",
            self.size["vocab_size"],
            "--max-chars",
            self.size["tok_max_chars"],
        )

    def pretrain(self):
        s = self.size
        final = self.path("base_checkpoints", self.tag, str(s["pretrain_iterations"]))
        if self.done("pretrain", final):
            return
        flags = [
            "--depth",
            s["depth"],
            "--max-seq-len",
            s["max_seq_len"],
            "--device-batch-size",
            s["device_batch_size"],
            "--total-batch-size",
            s["total_batch_size"],
            "--num-iterations",
            s["pretrain_iterations"],
            "--warmup-steps",
            10,
            "--eval-every",
            max(s["pretrain_iterations"] // 3, 1),
            "--eval-tokens",
            65536,
            "--sample-every",
            -1,
            "--save-every",
            max(s["pretrain_iterations"] // 3, 1),
            "--model-tag",
            self.tag,
            "--no-hparam-scaling",
            *self.dtype,
        ]  # small batches: nanochat's sqrt(B) LR rule would stall a run this short
        ckpt_dir = self.path("base_checkpoints", self.tag)
        if not self.args.fresh and committed_steps(ckpt_dir):
            flags.append("--resume")  # an interrupted earlier run continues where it stopped
        self.run("pretrain", "scripts.pretrain", *flags)

    def sft(self):
        s = self.size
        final = self.path("chatsft_checkpoints", self.tag, str(s["sft_iterations"]))
        if self.done("sft", final):
            return
        self.run(
            "sft",
            "scripts.sft",
            "--model-tag",
            self.tag,
            "--mixture",
            "offline",
            "--num-iterations",
            s["sft_iterations"],
            "--device-batch-size",
            s["sft_batch_size"],
            "--total-batch-size",
            s["sft_batch_size"] * s["max_seq_len"],
            "--mc-epochs",
            0,
            "--spelling-size",
            0,
            "--story-size",
            s["story_size"],
            "--identity-size",
            s["identity_size"],
            "--arithmetic-size",
            s["arithmetic_size"],
            "--multi-turn-size",
            s["multi_turn_size"],
            "--eval-every",
            -1,
            "--eval-tokens",
            16384,
            "--chatcore-every",
            -1,
            "--reply-check",
            16,
            *self.dtype,
        )

    def samples(self, phase, prompts, chat):
        os.environ["FLAXCHAT_BASE_DIR"] = self.args.base_dir
        t0 = time.perf_counter()
        model, tokenizer, _ = load_model(phase, self.tag)
        engine = Engine(model, tokenizer)
        print(f"\n=== {'chat' if chat else 'samples'}: the {phase} model", flush=True)
        if chat:
            convs = [
                {"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": ""}]} for p in prompts
            ]
            inputs = [tokenizer.render_for_completion(conv) for conv in convs]
        else:
            inputs = [tokenizer.encode(prompt, prepend="<|bos|>") for prompt in prompts]
        outs = engine.generate_batches(inputs, max_tokens=200, temperature=0.7, top_k=50, seeds=range(len(prompts)))
        for prompt, tokens, (out, _) in zip(prompts, inputs, outs):  # prompt i samples with seed i
            text = tokenizer.decode(out[0][len(tokens) :])
            print(f"\n[{prompt}]\n{text.strip() if chat else prompt + text}", flush=True)
        self.timings[f"{phase} samples"] = time.perf_counter() - t0

    def heldout(self) -> dict[str, tuple[int, int]]:
        """The chat model on the check no stage trained on (tasks.heldout_chat: phrasings, names and story
        subjects of the generators' check banks), greedy: a score per category, every reply printed whole."""
        t0 = time.perf_counter()
        model, tokenizer, _ = load_model("sft", self.tag)
        results = heldout_chat.run_check(Engine(model, tokenizer), tokenizer, heldout_chat.demo_prompts())
        scores = heldout_chat.score(results)
        print(f"\n=== held-out check (greedy; prompts no stage trained on): {heldout_chat.summary(scores)}", flush=True)
        heldout_chat.print_results(results)
        self.timings["held-out check"] = time.perf_counter() - t0
        return scores


def main(argv=None):
    parser = build_parser()
    args = parse_args(parser, argv)
    args.base_dir = os.path.abspath(os.path.expanduser(args.base_dir))
    os.makedirs(args.base_dir, exist_ok=True)
    demo = Demo(args)
    t0 = time.perf_counter()
    demo.data()
    demo.tokenizer()
    demo.pretrain()
    demo.samples("base", STORY_PROMPTS, chat=False)
    demo.sft()
    demo.samples("sft", CHAT_PROMPTS, chat=True)
    scores = demo.heldout()
    total = time.perf_counter() - t0
    report = Report(args.base_dir)
    report.log(
        "demo",
        {
            "mode": "quick" if args.quick else "full",
            "total minutes": total / 60,
            **{f"held-out {k}": f"{p}/{n}" for k, (p, n) in scores.items()},
            **{f"{k} (s)": v for k, v in demo.timings.items()},
        },
    )
    path = report.generate()
    env = f"FLAXCHAT_BASE_DIR={args.base_dir}"
    print(f"\nDone in {total / 60:.1f} minutes. Report card: {path}\n")
    print("Chat with your model:")
    print(f"  in the terminal:  {env} python -m scripts.chat_cli -i sft --model-tag {demo.tag}")
    print(
        f"  in the browser:   {env} python -m scripts.chat_web -i sft --model-tag {demo.tag}   (then open http://127.0.0.1:8000)"
    )


if __name__ == "__main__":
    main()
