"""nanochat's training step, timed the way `scripts.bench` times flaxchat's (`bench --what train --nanochat DIR`).

It runs in a process of its own and imports torch and the nanochat checkout at DIR, nothing of JAX: nanochat's
GPT with its own weight init, the MuonAdamW of `GPT.setup_optimizer()`, the model compiled with
`torch.compile(dynamic=False)` as nanochat's scripts/base_train.py compiles it, and base_train's micro-step loop
(each micro-batch's loss divided by the accumulation steps, one optimizer step, gradients set to None). Threads
and dtype are nanochat's own defaults: torch's thread count, fp32 on a CPU unless NANOCHAT_DTYPE says otherwise,
bf16 on a recent CUDA GPU, where TF32 matmuls are allowed as nanochat's compute_init allows them. Attention is
whatever nanochat picks: Flash Attention 3 where its `kernels` package can load it, else PyTorch's SDPA (the JSON
says which). Tokens are random, as in the flaxchat benchmark's random-token rows. One JSON object on stdout. Its
`matmul_peak_flops` is PyTorch's rate for one n^3 matmul in the compute dtype, which shows whether its BLAS runs at
full speed (the stock CPU wheel's MKL takes its AVX2 kernels on AMD CPUs; `bench --nanochat-mkl avx512` gives it
its AVX-512 ones):

    python -m scripts.nanochat_bench --dir ~/src/nanochat --config '{"n_layer": 4, "n_head": 4, ...}' \\
        --batch-size 16 --grad-accum 1 --steps 10 --warmup 2

The config is a flaxchat GPTConfig as a dict (the same field names as nanochat's); fields nanochat's GPTConfig
does not have are dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

from flaxchat.perf.trace import summarize_ops  # imports nothing of JAX


def load_nanochat(directory: str):
    """nanochat's gpt module from a checkout (the folder holding nanochat/gpt.py); a clear error if it is not one."""
    directory = os.path.abspath(os.path.expanduser(directory))
    if not os.path.isfile(os.path.join(directory, "nanochat", "gpt.py")):
        raise SystemExit(f"error: {directory} is not a nanochat checkout (no nanochat/gpt.py in it)")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("error: timing nanochat needs PyTorch (pip install torch; a CPU build is enough)") from None
    sys.path.insert(0, directory)
    from nanochat import gpt

    return gpt


def build(gpt, config: dict, device: str = "cpu"):
    """nanochat's model on `device` (weights initialised by its own init_weights) and its MuonAdamW."""
    import torch

    torch.manual_seed(42)  # as nanochat's compute_init, which base_train calls first
    if device == "cuda":
        torch.set_float32_matmul_precision("high")
    fields = {f.name for f in dataclasses.fields(gpt.GPTConfig)}
    cfg = gpt.GPTConfig(**{k: v for k, v in config.items() if k in fields})
    with torch.device("meta"):  # as base_train builds it: shapes first, storage and init after
        model = gpt.GPT(cfg)
    model.to_empty(device=device)
    model.init_weights()
    return model, model.setup_optimizer()


def time_steps(
    model,
    optimizer,
    vocab_size: int,
    batch_size: int,
    seq_len: int,
    grad_accum: int,
    steps: int,
    warmup: int,
    seed: int = 0,
    device: str = "cpu",
    profile: int = 0,
) -> dict:
    """The first step (compilation included), `warmup` more, then the median of `steps` timed steps; with
    `profile`, that many more steps under torch.profiler, summarized as flaxchat.perf.trace summarizes JAX's traces."""
    import torch

    compiled = torch.compile(model, dynamic=False)
    generator = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=generator) for _ in range(2)]
    tokens = [t.to(device) for t in tokens]
    batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]  # as nanochat's loader yields them

    def step(i):
        for micro in range(grad_accum):
            inputs, targets = batches[(i * grad_accum + micro) % 2]
            loss = compiled(inputs, targets)
            (loss / grad_accum).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss.item()  # waits for the step (on a GPU too), as base_train's logging does

    t0 = time.perf_counter()
    step(0)
    first_step_s = time.perf_counter() - t0
    for i in range(warmup):
        step(1 + i)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        step(1 + warmup + i)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    out = {
        "tok_per_s": batch_size * seq_len * grad_accum / step_s,
        "step_s": step_s,
        "step_s_min": min(times),
        "compile_s": max(first_step_s - step_s, 0.0),
        "first_step_s": first_step_s,
    }
    if profile:
        out["profile"] = profile_steps(lambda i: step(1 + warmup + steps + i), profile, device)
    return out


def matmul_peak(device: str, dtype, repeats: int = 5) -> float:
    """FLOP/s of PyTorch's best of `repeats` n^3 matmuls in `dtype` on `device` (n = 2048 on a CPU, 4096 on a GPU), as
    flaxchat's benchmark measures XLA's (perf.machine.measured_matmul_peak): whether nanochat's BLAS runs at full
    speed."""
    import torch

    n = 4096 if device == "cuda" else 2048
    a = torch.randn(n, n, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=dtype)
    a @ a  # the first call picks and loads the kernels
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        (a @ a).sum().item()  # waits for the product, on a GPU too
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def profile_steps(step, n: int, device: str) -> dict:
    """n steps under torch.profiler: per step, the ops' self time by kind and the slowest ops (flaxchat.perf.trace's
    summary). On a GPU the CUDA kernels' device time; on a CPU the self time of the ops torch records on the
    calling thread (its intra-op threads work inside them; the fused code torch.compile generates for a CPU
    counts as its compiled region's own time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    times = []
    with profile(activities=activities) as prof:
        for i in range(n):
            t0 = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - t0)
    op_ms, counts = {}, {}
    for e in prof.key_averages():
        if device == "cuda":
            if "CUDA" not in str(getattr(e, "device_type", "")):
                continue  # the kernels themselves, not the CPU ops that launched them
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        else:
            us = e.self_cpu_time_total
        if us > 0:
            op_ms[e.key], counts[e.key] = us / 1e3, e.count
    summary = summarize_ops(op_ms, n, 1e3 * statistics.median(times), counts=counts)
    return {"device": "accelerator" if device == "cuda" else "cpu", "torch_profiler": torch.__version__, **summary}


def main(argv=None):
    p = argparse.ArgumentParser(description="Time nanochat's training step (prints one JSON object).")
    p.add_argument("--dir", required=True, help="a nanochat checkout (the folder holding nanochat/gpt.py)")
    p.add_argument("--config", required=True, help="the model as a JSON object of GPTConfig fields")
    p.add_argument("--batch-size", type=int, required=True, help="sequences per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=10, help="timed steps (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where nanochat runs (default: cpu)")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="after timing, N more steps under torch.profiler: the JSON adds where the step's time goes",
    )
    args = p.parse_args(argv)
    if args.profile < 0:
        p.error("--profile takes a number of steps (0: no profile)")
    try:
        config = json.loads(args.config)
    except json.JSONDecodeError as e:
        p.error(f"--config is not JSON: {e}")
    gpt = load_nanochat(args.dir)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device cuda, but this PyTorch ({torch.__version__}) sees no CUDA GPU")
    with contextlib.redirect_stdout(sys.stderr):  # nanochat prints what it chose; stdout holds only the JSON
        model, optimizer = build(gpt, config, args.device)
        out = time_steps(
            model,
            optimizer,
            config["vocab_size"],
            args.batch_size,
            config["sequence_len"],
            args.grad_accum,
            args.steps,
            args.warmup,
            device=args.device,
            profile=args.profile,
        )
    dtype = getattr(gpt, "COMPUTE_DTYPE", None)
    flash = sys.modules.get("nanochat.flash_attention")  # nanochat's choice of attention kernel, where it has one
    extra = {"attention": "fa3" if flash.USE_FA3 else "sdpa"} if hasattr(flash, "USE_FA3") else {}
    if args.device == "cuda":
        extra.update(device=torch.cuda.get_device_name(), peak_mem_gb=torch.cuda.max_memory_allocated() / 2**30)
    peak = matmul_peak(args.device, dtype if dtype is not None else torch.float32)
    print(
        json.dumps(
            {
                **out,
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
                "matmul_peak_flops": peak,
                **extra,
            }
        )
    )


if __name__ == "__main__":
    main()
