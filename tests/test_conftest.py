"""The suite's own guard (tests/conftest.py): a test that leaves process-wide state changed fails, by name."""

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LEAKY_TESTS = """
import os

import jax


def test_a_env(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")  # undone by monkeypatch: fine
    os.environ["FLAXCHAT_LEAKED"] = "1"


def test_b_cwd(tmp_path):
    os.chdir(tmp_path)


def test_c_jax_config():
    jax.config.update("jax_enable_x64", True)


def test_d_after_the_leaks():
    assert jax.device_count() == 8 and "FLAXCHAT_LEAKED" not in os.environ and not jax.config.jax_enable_x64
"""


def test_a_leaking_test_errors_and_the_next_one_starts_clean(tmp_path):
    shutil.copy(os.path.join(ROOT, "tests", "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTEST_XDIST_WORKER")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "-rA",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 1, out[-3000:]
    assert "4 passed, 3 errors" in out, out[-3000:]
    for name, leak in [
        ("test_a_env", "FLAXCHAT_LEAKED was None, is '1'"),
        ("test_b_cwd", "working directory"),
        ("test_c_jax_config", "jax_enable_x64 was False, is True"),
    ]:
        assert f"ERROR at teardown of {name}" in out and leak in out, out[-3000:]
    assert "XLA_FLAGS" not in out  # the monkeypatched change was undone before the check
