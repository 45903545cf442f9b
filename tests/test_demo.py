"""The laptop demo end to end in --quick mode (the README's first command, shrunk)."""

import os
import re
import subprocess
import sys

import pytest

from flaxchat.perf.machine import HUGE_PAGES_TUNABLE
from scripts import run_tinystories

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_demo(base):
    """The demo as a user runs it: its own process, one CPU device (not this suite's 8 fake ones), so it leaves
    nothing behind in the test process (JAX's device count is fixed when JAX starts)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "PYTHONPATH": ROOT}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scripts.run_tinystories",
            "--quick",
            "--base-dir",
            str(base),
            "--source",
            "synthetic-stories",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_demo_runs_every_stage_and_resumes(tmp_path):
    base = tmp_path / "demo"
    out = run_demo(base)
    for stage in ("=== data", "=== tokenizer", "=== pretrain", "=== samples", "=== sft", "=== chat"):
        assert stage in out
    assert "python -m scripts.chat_cli -i sft" in out and "python -m scripts.chat_web -i sft" in out
    assert (base / "chatsft_checkpoints" / "demo-d2-quick").is_dir()
    report = (base / "report" / "report.md").read_text()
    assert "## pretrain" in report and "## demo" in report
    # the closing held-out check: a score per category, printed and on the report card
    assert re.search(r"held-out check .*: identity \d+/12, arithmetic \d+/24, stories \d/8, multi_turn \d+/12", out)
    assert "held-out identity" in report and "held-out multi_turn" in report

    # a second run reuses every finished stage instead of training again
    out = run_demo(base)
    for stage in ("data", "tokenizer", "pretrain", "sft"):
        assert f"=== {stage}: already done" in out


def test_demo_writes_under_the_base_dir(tmp_path, monkeypatch, capsys):
    """The laptop demo's default folder is tinystories/ inside $FLAXCHAT_BASE_DIR (so it never replaces that
    base dir's own tokenizer or data), and its --help says so."""
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "mine"))
    args = run_tinystories.build_parser().parse_args([])
    assert args.base_dir == str(tmp_path / "mine" / "tinystories")
    assert run_tinystories.build_parser().parse_args(["--base-dir", "/elsewhere"]).base_dir == "/elsewhere"
    with pytest.raises(SystemExit):
        run_tinystories.build_parser().parse_args(["--help"])
    assert "$FLAXCHAT_BASE_DIR" in capsys.readouterr().out
    monkeypatch.delenv("FLAXCHAT_BASE_DIR")
    default = run_tinystories.build_parser().parse_args([]).base_dir
    assert default == os.path.join(os.path.expanduser("~"), ".cache", "flaxchat", "tinystories")
    assert not (tmp_path / "mine").exists(), "building the parser creates nothing"
    demo = run_tinystories.Demo(run_tinystories.build_parser().parse_args(["--base-dir", str(tmp_path / "d")]))
    assert demo.env["FLAXCHAT_BASE_DIR"] == str(tmp_path / "d")
    assert HUGE_PAGES_TUNABLE in demo.env["GLIBC_TUNABLES"].split(":")  # its stages start with huge pages


def test_demo_trains_in_bf16_where_the_cpu_multiplies_bf16(tmp_path, monkeypatch):
    from scripts import run_tinystories

    def demo(native_bf16):
        monkeypatch.setattr(run_tinystories, "cpu_bf16_instructions", lambda: native_bf16)
        return run_tinystories.Demo(run_tinystories.build_parser().parse_args(["--base-dir", str(tmp_path)]))

    monkeypatch.delenv("FLAXCHAT_DTYPE", raising=False)
    assert demo(True).dtype == ["--dtype", "bfloat16"] and demo(False).dtype == []
    monkeypatch.setenv("FLAXCHAT_DTYPE", "float32")  # the user's choice wins
    assert demo(True).dtype == []
    full = demo(False).size
    # the SFT mixture leans on arithmetic, the skill that takes the most practice
    assert full["arithmetic_size"] > max(full["identity_size"], full["story_size"], full["multi_turn_size"])
