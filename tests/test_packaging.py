"""Keep pixi.toml, .ci/run and the README honest: pixi cannot be installed here, so we check its tasks."""

import os
import pathlib
import re
import shlex
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pixi():
    with open(os.path.join(ROOT, "pixi.toml"), "rb") as f:
        return tomllib.load(f)


def readme_test_command():
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"```bash\n# run the tests\n(.+?)\n```", text)
    assert m, "README must show the test command in a ```bash block starting with '# run the tests'"
    return m.group(1).strip()


def test_pixi_is_conventional():
    p = pixi()
    assert "conda-forge" in p["workspace"]["channels"]
    assert p["dependencies"]["python"].startswith("3.11")
    assert p["pypi-dependencies"]["flaxchat"]["editable"] is True
    assert p["pypi-dependencies"]["flaxchat"]["path"] == "."


def task_commands():
    out = []
    for name, task in pixi()["tasks"].items():
        cmd = task if isinstance(task, str) else task["cmd"]
        out.append(pytest.param(name, cmd, id=name))
    return out


@pytest.mark.parametrize("name,cmd", task_commands())
def test_every_pixi_task_runs_with_help(name, cmd):
    argv = shlex.split(cmd)
    assert argv[0] == "python", f"pixi task {name} should start with python"
    argv[0] = sys.executable
    if name == "test":  # running the suite inside the suite would recurse; check pytest itself answers
        argv = [sys.executable, "-m", "pytest", "--version"]
    else:
        argv.append("--help")
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pixi task {name!r} failed with --help:\n{r.stderr[-2000:]}"
    assert r.stdout.strip() or r.stderr.strip()


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    cmd = readme_test_command()
    assert cmd in ci.splitlines(), f".ci/run must run the README's test command: {cmd}"
    assert pixi()["tasks"]["test"] == cmd


def test_pyproject_declares_the_stack():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = " ".join(tomllib.load(f)["project"]["dependencies"])
    for pkg in ["jax", "flax", "optax", "orbax-checkpoint", "grain", "tiktoken", "rustbpe", "datasets",
                "fastapi", "uvicorn", "pyarrow"]:
        assert re.search(rf"(^|\s|\"){re.escape(pkg)}>=", deps), pkg


@pytest.mark.parametrize("path", sorted(pathlib.Path(ROOT, "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_preset_parses_with_its_script(path):
    """configs/<script>_<where>.yaml holds flag defaults for scripts/<script>.py: every key must be one of its flags."""
    import importlib

    from flaxchat.common import parse_args

    script = importlib.import_module(f"scripts.{path.stem.split('_')[0]}")
    args = parse_args(script.build_parser(), ["--config", str(path)])
    assert args.config == str(path)
