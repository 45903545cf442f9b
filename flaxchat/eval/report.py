"""Run reports: metrics logs (JSONL) and charts (PNG)."""

from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

from flaxchat.common import get_base_dir, is_main_process, print0
from flaxchat.train.checkpoint import git_commit
from flaxchat.train.optim import skip_report


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


TRAINING_PANELS = [
    (["loss"], "train loss"),
    (["val_bpb"], "val bits per byte"),
    (["lrm"], "learning-rate multiplier"),
    (["mfu"], "MFU (%)"),
]


def restart_metrics(path: str, resumed_from: int | None = None) -> None:
    """Before a run logs to `path` (main process only): a fresh run removes the rows an earlier run left there; a
    resumed run keeps those up to the step it resumed from, as the steps after it are run and logged again."""
    if not is_main_process():
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    if resumed_from is None:
        if os.path.exists(path):
            os.remove(path)
        return
    rows = [r for r in read_jsonl(path) if r["step"] <= resumed_from]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def step_metrics(loop: dict, done, tokens: int, flops_per_token: float, peak_flops: float, first: int) -> dict:
    """A finished training step (InFlight's ((loss, optimizer stats), (step, epoch), seconds)) as its metrics row:
    the loss and nanochat's smoothed loss (an EMA, bias-corrected), the LR multiplier, tok/s and MFU against
    `peak_flops` (all devices'), the updates skipped so far. Updates the run's `loop` state: the EMA, and the
    training time, which leaves out the two steps after `first` (the first step run, which compile)."""
    (loss, stats), (i, epoch), dt = done
    loss, ema = float(loss), 0.9
    loop["smooth_train_loss"] = ema * loop["smooth_train_loss"] + (1 - ema) * loss
    if i - first >= 2:  # the first steps compile; keep them out of the timing
        loop["total_training_time"] += dt
    return {
        "step": i + 1,
        "loss": loss,
        "smooth_loss": loop["smooth_train_loss"] / (1 - ema ** (i + 1)),
        "lrm": float(stats["lr_multiplier"]),
        "dt": dt,
        "tok_per_s": tokens / dt,
        "mfu": 100 * flops_per_token * tokens / dt / peak_flops,
        "skipped_steps": int(stats["skipped_steps"]),
        "epoch": epoch,
    }


class StepLog:
    """Logs a training loop's finished steps, each InFlight's ((loss, optimizer stats), (step, epoch), seconds) or
    None (nothing finished): its step_metrics row to `log`, the progress bar's postfix, and a line when the optimizer
    skipped the update (skipped: the count so far, as restored)."""

    def __init__(self, log, bar, loop: dict, tokens: int, flops_per_token, peak_flops, first: int, skipped: int):
        self.log, self.bar, self.loop, self.skipped = log, bar, loop, skipped
        self.rates = (tokens, flops_per_token, peak_flops, first)

    def __call__(self, done) -> None:
        if done is None:
            return
        row = step_metrics(self.loop, done, *self.rates)
        self.log(row)
        shown = dict(loss=f"{row['smooth_loss']:.4f}", tok_s=f"{row['tok_per_s']:,.0f}", mfu=f"{row['mfu']:.1f}%")
        self.bar.set_postfix(**shown, lrm=f"{row['lrm']:.2f}", refresh=False)
        self.bar.update(1)
        report = skip_report(row["step"], row["loss"], self.skipped, row["skipped_steps"])
        self.skipped = row["skipped_steps"]
        if report and is_main_process():
            self.bar.write(report)


class SFTStepLog:
    """Logs scripts.sft's finished steps, each InFlight's (loss, (steps done, LR multiplier, progress, epoch),
    seconds) or None (nothing finished): nanochat's smoothed loss (an EMA, bias-corrected), tok/s and MFU against
    `peak_flops` (all devices') to `log` and the progress bar. Updates the run's `loop` state (the EMA, and the
    training time, which leaves out the two steps after `first`, which compile). Without a horizon (num_iterations
    <= 0) the bar's total is the steps of one epoch, estimated from the progress through the data."""

    def __init__(self, log, bar, loop: dict, tokens: int, flops_per_token, peak_flops, first: int, num_iterations):
        self.log, self.bar, self.loop, self.num_iterations = log, bar, loop, num_iterations
        self.tokens, self.flops_per_token, self.peak_flops, self.first = tokens, flops_per_token, peak_flops, first

    def __call__(self, done) -> None:
        if done is None:
            return
        loss, (n, lrm, progress, epoch), dt = done  # n: steps done, this one included
        loss, ema, loop = float(loss), 0.9, self.loop
        loop["smooth"] = ema * loop["smooth"] + (1 - ema) * loss
        debiased = loop["smooth"] / (1 - ema**n)
        tok_per_s = self.tokens / dt
        mfu = 100 * self.flops_per_token * self.tokens / dt / self.peak_flops
        if n - self.first > 2:  # the first steps compile
            loop["train_time"] += dt
        row = {"step": n, "loss": loss, "smooth_loss": debiased, "lrm": lrm, "dt": dt, "tok_per_s": tok_per_s}
        self.log({**row, "mfu": mfu, "epoch": epoch, "progress": progress})
        if self.num_iterations <= 0 and progress > 0:
            self.bar.total = max(n, round(n / progress))  # steps in one epoch, estimated as we go
        shown = dict(loss=f"{debiased:.4f}", lrm=f"{lrm:.2f}", tok_s=f"{tok_per_s:,.0f}", epoch=epoch)
        self.bar.set_postfix(**shown, refresh=False)
        self.bar.update(1)


def metrics_logger(metrics_path: str, run: str, project: str, config: dict):
    """log(row): append the row to metrics_path on the main process, and to wandb when a run name is given
    ('dummy' = local only, nanochat's convention)."""
    wandb_run = None
    if run != "dummy" and is_main_process():
        try:
            import wandb

            wandb_run = wandb.init(project=project, name=run, config=config)
        except ImportError:
            print0("warning: --run given but wandb is not installed (pip install wandb); logging locally only")

    def log(row: dict) -> None:
        if is_main_process():
            append_jsonl(metrics_path, row)
            if wandb_run is not None:
                wandb_run.log(row)

    return log


def plot_panels(rows: list[dict], path: str, panels, title: str = "") -> str | None:
    """2x2 chart: each panel plots its metric keys (a legend when several) against step; None if nothing to plot."""
    series = {key: [(r["step"], r[key]) for r in rows if r.get(key) is not None] for keys, _ in panels for key in keys}
    if not any(series.values()):
        return None
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (keys, label) in zip(axes.flat, panels):
        keys = list(dict.fromkeys(keys))
        for key in keys:
            if series[key]:
                ax.plot(*zip(*series[key]), marker="o" if len(series[key]) < 30 else None, markersize=3, label=key)
        if not any(series[key] for key in keys):
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")
        elif len(keys) > 1:
            ax.legend()
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)  # readers never see a half-written chart
    return path


def plot_training(rows: list[dict], path: str, title: str = "") -> str | None:
    """Train loss, val bpb, learning-rate multiplier and MFU against step; None if nothing to plot."""
    return plot_panels(rows, path, TRAINING_PANELS, title)


def plot_rl(rows, path, title=""):
    """2x2 chart: mean reward, pass@1 and pass@k, LR multiplier, mean sampled length."""
    k_keys = sorted({key for r in rows for key in r if key.startswith("pass@")}, key=lambda s: int(s[5:]))
    panels = [
        (["reward"], "mean reward (train rollouts)"),
        ([k_keys[0], k_keys[-1]] if k_keys else [], "held-out pass@k"),
        (["lrm"], "learning-rate multiplier"),
        (["sequence_length"], "mean rollout length (tokens)"),
    ]
    return plot_panels(rows, path, panels, title)


# -----------------------------------------------------------------------------
# The report card: each stage writes its own section; `generate()` assembles report.md

STAGE_ORDER = [
    "data",
    "tokenizer",
    "tokenizer-eval",
    "pretrain",
    "base-eval",
    "sft",
    "sft-eval",
    "rl",
    "rl-eval",
    "chat-eval",
    "bench",
    "demo",
]


def _system_info() -> list[str]:
    import platform
    import subprocess

    import jax

    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gb = float("nan")
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), cpu)
    except (OSError, subprocess.SubprocessError):
        pass
    devices = jax.devices()
    return [
        f"- git commit: `{git_commit()[:12]}`",
        f"- python {platform.python_version()}, jax {jax.__version__}, backend {jax.default_backend()}",
        f"- devices: {len(devices)} x {devices[0].device_kind} ({jax.process_count()} process(es))",
        f"- host: {cpu}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM",
    ]


def _format_value(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


class Report:
    """Markdown report under <base_dir>/report/: one file per stage, assembled into report.md."""

    def __init__(self, base_dir: str | None = None):
        self.dir = os.path.join(base_dir or get_base_dir(), "report")

    def log(self, stage: str, metrics: dict | None = None, text: str = "", charts: list[str] | None = None) -> str:
        """Write (replace) one stage's section: a metrics table, free text, and links to PNG charts."""
        import datetime

        path = os.path.join(self.dir, f"{stage}.md")
        if not is_main_process():
            return path
        os.makedirs(self.dir, exist_ok=True)
        lines = [f"## {stage}", "", f"_{datetime.datetime.now().isoformat(timespec='seconds')}_", ""]
        if metrics:
            lines += ["| metric | value |", "| --- | --- |"]
            lines += [f"| {k} | {_format_value(v)} |" for k, v in metrics.items()]
            lines.append("")
        if text:
            lines += [text.rstrip(), ""]
        for chart in charts or []:
            if chart and os.path.exists(chart):
                lines += [f"![{stage}]({os.path.relpath(chart, self.dir)})", ""]
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("\n".join(lines))
        os.replace(tmp, path)
        return path

    def generate(self) -> str:
        """report.md: system info, then every stage's section in pipeline order (unknown stages last)."""
        os.makedirs(self.dir, exist_ok=True)
        sections = [f[:-3] for f in os.listdir(self.dir) if f.endswith(".md") and f != "report.md"]
        order = {s: i for i, s in enumerate(STAGE_ORDER)}
        sections.sort(key=lambda s: (order.get(s, len(order)), s))
        parts = ["# flaxchat report card", "", *_system_info(), ""]
        for s in sections:
            with open(os.path.join(self.dir, f"{s}.md"), encoding="utf-8") as f:
                parts += [f.read().rstrip(), ""]
        path = os.path.join(self.dir, "report.md")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(parts))
        return path

    def reset(self) -> None:
        if os.path.isdir(self.dir):
            for f in os.listdir(self.dir):
                if f.endswith(".md"):
                    os.remove(os.path.join(self.dir, f))
