"""Keep pixi.toml, .ci/run, the README and the package data honest: pixi cannot be installed here, so we
check its tasks."""

import fnmatch
import importlib.resources
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


def pyproject():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_pixi_is_conventional():
    p = pixi()
    assert "conda-forge" in p["workspace"]["channels"]
    assert p["dependencies"]["python"].startswith("3.11")
    for name, feature in p["feature"].items():
        flaxchat = feature["pypi-dependencies"]["flaxchat"]
        assert flaxchat["editable"] is True and flaxchat["path"] == ".", name
    assert "pypi-dependencies" not in p  # each environment's feature installs flaxchat once, with its extra


# pixi's manifest keys (pixi.sh, "Multi environment" and "System requirements"): a feature holds these tables.
FEATURE_KEYS = {
    "dependencies",
    "pypi-dependencies",
    "system-requirements",
    "platforms",
    "channels",
    "tasks",
    "activation",
    "target",
    "channel-priority",
    "pypi-options",
}


def test_pixi_tasks_run_with_huge_pages():
    """Every pixi task gets glibc's huge-page tunable, the one the demo and the tests use (flaxchat.common)."""
    from flaxchat.perf.machine import HUGE_PAGES_TUNABLE

    assert pixi()["activation"]["env"]["GLIBC_TUNABLES"] == HUGE_PAGES_TUNABLE


def test_pixi_environments_cover_cpu_cuda_tpu():
    p, extras = pixi(), pyproject()["project"]["optional-dependencies"]
    envs = {name: env if isinstance(env, list) else env["features"] for name, env in p["environments"].items()}
    assert {"default", "cuda", "cuda12", "tpu"} <= set(envs)
    for name, features in envs.items():
        missing = [f for f in features if f not in p["feature"]]
        assert not missing, f"environment {name} names undefined features {missing}"
        installs = [f for f in features if "flaxchat" in p["feature"][f].get("pypi-dependencies", {})]
        assert len(installs) == 1, f"environment {name} must install flaxchat exactly once, from one feature"
    for name, feature in p["feature"].items():
        assert set(feature) <= FEATURE_KEYS, f"feature {name}: unknown keys {set(feature) - FEATURE_KEYS}"
        assert set(feature.get("platforms", p["workspace"]["platforms"])) <= set(p["workspace"]["platforms"])
        wanted = feature["pypi-dependencies"]["flaxchat"]["extras"]
        assert "dev" in wanted and set(wanted) <= set(extras), (
            f"feature {name}: extras {wanted} vs pyproject {set(extras)}"
        )
        cuda = [e for e in wanted if re.fullmatch(r"cuda\d+", e)]
        if cuda:  # pixi must know which CUDA the driver offers; the extra pulls jax[cudaNN] for the same major
            assert feature["system-requirements"]["cuda"] == cuda[0].removeprefix("cuda"), name
            assert extras[cuda[0]] == [f"jax[{cuda[0]}]>={jax_lower_bound()}"]
            assert set(feature["platforms"]) <= {"linux-64", "linux-aarch64"}
    used = {f for features in envs.values() for f in features}
    assert used == set(p["feature"]), f"features no environment uses: {set(p['feature']) - used}"
    assert envs["cuda"] == ["cuda13"] and extras["gpu"] == extras["cuda13"]  # `cuda` and `gpu` mean CUDA 13
    assert envs["default"] == ["cpu"] and envs["tpu"] == ["tpu"]


def test_pixi_names_only_files_that_exist():
    """Paths in pixi.toml's tasks and comments (a recipe, a config, the module a comment points to) are there."""
    text = open(os.path.join(ROOT, "pixi.toml"), encoding="utf-8").read()
    named = set(re.findall(r"[\w.-]+(?:/[\w.-]+)+\.(?:py|sh|yaml|toml|md|txt)", text))
    assert {"runs/lint.sh", "configs/sft_cpu.yaml"} <= named  # the pattern finds them
    assert not [p for p in named if not os.path.exists(os.path.join(ROOT, p))]


def test_pixi_default_environment_installs_no_heavy_extras():
    """`pixi run demo` installs what `pip install -e .` does plus the test and lint tools; TensorFlow, torch,
    transformers and lm-eval come only with `-e all`, which turns on every test CI runs."""
    p, extras = pixi(), pyproject()["project"]["optional-dependencies"]
    default = p["feature"]["cpu"]["pypi-dependencies"]["flaxchat"]["extras"]
    assert set(default) == {"dev", "lint"}
    everything = p["feature"][p["environments"]["all"][0]]["pypi-dependencies"]["flaxchat"]["extras"]
    accelerators = {e for e in extras if e in ("gpu", "tpu") or re.fullmatch(r"cuda\d+", e)}
    assert set(everything) == set(extras) - accelerators


def task_commands():
    p = pixi()
    tasks = list(p["tasks"].items())
    for feature in p["feature"].values():
        tasks += [item for item in feature.get("tasks", {}).items() if item not in tasks]
    out = []
    for name, task in tasks:
        cmd = task if isinstance(task, str) else task["cmd"]
        out.append(pytest.param(name, cmd, id=name))
    return out


@pytest.mark.parametrize("name,cmd", task_commands())
def test_every_pixi_task_runs_with_help(name, cmd):
    argv = shlex.split(cmd)
    assert argv[0] == "python" or argv[0] == "bash" and argv[1].startswith("runs/"), (
        f"pixi task {name} should start with python (or run a recipe in runs/ with bash)"
    )
    if argv[0] == "python":
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


def test_package_data_ships_every_data_file():
    """A file the code reads from inside a package (the chat page, the stories' word lists) must be in the wheel."""
    package_data = pyproject()["tool"]["setuptools"]["package-data"]
    for top in ("flaxchat", "tasks"):
        for path in pathlib.Path(ROOT, top).rglob("*"):
            if path.is_dir() or path.suffix in (".py", ".pyc") or "__pycache__" in path.parts or path.name[0] == ".":
                continue
            rel = path.relative_to(ROOT)
            package = ".".join(rel.parent.parts)
            assert any(fnmatch.fnmatch(rel.name, g) for g in package_data.get(package, [])), (
                f"{rel} is not in pyproject's [tool.setuptools.package-data] for {package}"
            )
            assert importlib.resources.files(package).joinpath(rel.name).is_file()


def test_pyproject_declares_the_stack():
    deps = " ".join(pyproject()["project"]["dependencies"])
    for pkg in [
        "jax",
        "flax",
        "optax",
        "orbax-checkpoint",
        "grain",
        "tiktoken",
        "rustbpe",
        "datasets",
        "fastapi",
        "uvicorn",
        "pyarrow",
    ]:
        assert re.search(rf"(^|\s|\"){re.escape(pkg)}>=", deps), pkg


@pytest.mark.parametrize("path", sorted(pathlib.Path(ROOT, "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_preset_parses_with_its_script(path):
    """configs/<script>_<where>.yaml holds flag defaults for scripts/<script>.py: every key must be one of its flags."""
    import importlib

    from flaxchat.common import parse_args

    script = importlib.import_module(f"scripts.{path.stem.split('_')[0]}")
    args = parse_args(script.build_parser(), ["--config", str(path)])
    assert args.config == str(path)


# -----------------------------------------------------------------------------
# requirements/cuda*.txt: the tested versions for a fresh GPU install (pip constraints files)


def jax_lower_bound() -> str:
    (jax,) = [d for d in pyproject()["project"]["dependencies"] if re.match(r"jax\b", d)]
    return re.fullmatch(r"jax>=([\d.]+)", jax).group(1)


def constraint_files():
    return sorted(pathlib.Path(ROOT, "requirements").glob("cuda*.txt"))


def pins(path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[re.sub(r"[-_.]+", "-", name).lower()] = version
    return out


def test_constraints_files_exist_for_each_cuda_extra():
    extras = pyproject()["project"]["optional-dependencies"]
    cuda = sorted(e for e in extras if re.fullmatch(r"cuda\d+", e))
    assert cuda == ["cuda12", "cuda13"]
    assert [p.stem for p in constraint_files()] == cuda
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    for extra in cuda:
        assert f'pip install -e ".[{extra}]" -c requirements/{extra}.txt' in readme


@pytest.mark.parametrize("path", constraint_files(), ids=lambda p: p.name)
def test_constraints_pin_the_tested_jax_and_every_dependency(path):
    from packaging.requirements import Requirement

    cuda = path.stem.removeprefix("cuda")
    text, pinned = path.read_text(), pins(path)
    assert f"python -m scripts.gpu_check lock {path.stem}" in text and "not run, on a GPU" in text  # how it was made
    jax = jax_lower_bound()
    assert pinned["jax"] == jax, f"{path.name} pins jax {pinned['jax']}, pyproject.toml's lower bound is {jax}"
    for name in ("jaxlib", f"jax-cuda{cuda}-plugin", f"jax-cuda{cuda}-pjrt"):
        assert pinned[name] == jax, f"{path.name}: {name} {pinned.get(name)} != jax {jax}"
    assert any(n.startswith("nvidia-cudnn") for n in pinned)  # the CUDA libraries came with the plugin
    other = "13" if cuda == "12" else "12"
    assert not any(f"cuda{other}" in n or n.endswith(f"-cu{other}") for n in pinned), f"{path.name} mixes CUDA {other}"
    p = pyproject()["project"]
    for dep in p["dependencies"] + p["optional-dependencies"]["dev"]:
        req = Requirement(dep)
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        assert name in pinned, f"{path.name} does not pin {req.name}"
        assert req.specifier.contains(pinned[name]), f"{path.name} pins {name}=={pinned[name]}, pyproject says {req}"
