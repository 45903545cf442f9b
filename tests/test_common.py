"""flaxchat/common.py: progress bars that suit logs, out-of-memory detection, the base dir (and the demo's)."""

import io
import os

import jax

from flaxchat import common


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_in_a_log_is_whole_lines(monkeypatch):
    """Not a terminal: plain newline-terminated lines (no carriage returns), at most one per interval."""
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)  # the default file, as when stderr goes to a file or a pipe
    bar = common.progress_bar(total=20_000, desc="pretrain", dynamic_ncols=True)
    for i in range(20_000):
        bar.update(1)
        bar.set_postfix_str(f"loss {i}")  # forces a redraw on a terminal; waits for the next line in a log
        if i % 5_000 == 0:
            bar.write(f"step {i}: a message")
    bar.close()
    for _ in common.progress_bar(range(50_000), desc="val bpb", leave=False):
        pass
    text = log.getvalue()
    assert "\r" not in text and "\x1b" not in text and text.endswith("\n")
    lines = [line for line in text.splitlines() if not line.startswith("step ")]
    # the first and the last line of each bar (a fast loop never waits the 30 s between lines)
    assert len(lines) <= 4, lines
    assert lines[0].startswith("pretrain:   0%") and "20000/20000" in lines[1] and "loss 19999" in lines[1]
    assert lines[2].startswith("val bpb:   0%") and "50000/50000" in lines[3]  # leave=False: still a last line
    assert all(ord(c) < 128 for c in text)


def test_progress_interval_comes_from_the_environment(monkeypatch):
    log = io.StringIO()
    monkeypatch.setenv("FLAXCHAT_PROGRESS_SECONDS", "0")
    for _ in common.progress_bar(range(5), desc="every step", file=log, miniters=1):
        pass
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue()
    assert [f"{i}/5" in line for i, line in enumerate(lines[:6])] == [True] * 6  # a line per step
    assert "it/s" in lines[-1] and "5/5" in lines[-1]  # then the closing line (overall rate)


def test_progress_on_a_terminal_is_tqdms_bar():
    tty = Terminal()
    for _ in common.progress_bar(range(3), desc="bar", file=tty):
        pass
    assert "\r" in tty.getvalue()  # redrawn in place, as tqdm does


def test_out_of_memory_is_recognised():
    assert common.is_out_of_memory(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while allocating"))
    assert common.is_out_of_memory(MemoryError())
    assert common.is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not common.is_out_of_memory(RuntimeError("shapes do not match"))
    assert not common.is_out_of_memory(FileNotFoundError("no such pack"))


def test_base_dir_follows_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("FLAXCHAT_BASE_DIR", str(tmp_path / "mine"))
    assert common.get_base_dir(create=False) == str(tmp_path / "mine") and not (tmp_path / "mine").exists()
    assert common.get_base_dir() == str(tmp_path / "mine") and (tmp_path / "mine").is_dir()
    monkeypatch.delenv("FLAXCHAT_BASE_DIR")
    assert common.get_base_dir(create=False) == os.path.join(os.path.expanduser("~"), ".cache", "flaxchat")
