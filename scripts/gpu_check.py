"""Helpers for runs/gpu_check.sh: the steps that need more than a line of shell.

    python -m scripts.gpu_check requirements        # flaxchat[dev]'s requirements except JAX (what to pip download)
    python -m scripts.gpu_check missing             # those of them this environment lacks (what to install offline)
    python -m scripts.gpu_check pins                # name==version of the installed JAX / CUDA / TPU packages
    python -m scripts.gpu_check env --expect-backend gpu   # backend and devices as JSON; exit 1 if not that backend
    python -m scripts.gpu_check tokenizer --vocab-size 32768 --base-dir DIR   # a tokenizer for serving, offline
    python -m scripts.gpu_check report DIR --mode gpu       # DIR's step outputs -> DIR/report.json + DIR/summary.md
    python -m scripts.gpu_check lock cuda12         # rewrite requirements/cuda12.txt (needs PyPI; maintainers)

Nothing here imports JAX, flax, torch or the flaxchat modules that need them before a subcommand does:
`requirements`, `missing` and `pins` run before flaxchat's dependencies are installed. JAX itself (and its CUDA plugin)
is never installed or replaced here.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import tomllib

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare GPU image may lack packaging; pip always carries it
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

# the standard library only: importable before flaxchat's dependencies
from flaxchat.perf.gpu_report import SECTIONS, collect, summary_markdown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What an accelerator install brings: installed ones are kept exactly as they are (pins), never resolved here.
ACCELERATOR = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|libtpu|libtpu-nightly|nvidia-.*)$")
PYPI = "https://pypi.org/simple"


# -----------------------------------------------------------------------------
# Requirements: pyproject.toml is the single source


def project_requirements(extras=("dev",)) -> list[Requirement]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    return [Requirement(r) for r in reqs]


def satisfied(req: Requirement) -> bool:
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return False
    return req.specifier.contains(version, prereleases=True)


def non_jax(reqs):
    return [r for r in reqs if not ACCELERATOR.match(canonicalize_name(r.name))]


def installed_pins() -> list[str]:
    """name==version of every installed JAX / CUDA-plugin / NVIDIA / libtpu distribution."""
    pins = {}
    for dist in metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if ACCELERATOR.match(name):
            pins[name] = dist.version
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def cmd_requirements(args):
    print("\n".join(str(r) for r in non_jax(project_requirements())))


def cmd_missing(args):
    reqs = project_requirements()
    for r in reqs:
        if ACCELERATOR.match(canonicalize_name(r.name)) and not satisfied(r):
            have = metadata.version(r.name) if _installed(r.name) else "none"
            print(
                f"gpu_check: warning: flaxchat is tested with {r}, this environment has {r.name} {have}; "
                "it is kept as it is",
                file=sys.stderr,
            )
    missing = [str(r) for r in non_jax(reqs) if not satisfied(r)]
    print("\n".join(missing))


def _installed(name) -> bool:
    try:
        metadata.version(name)
        return True
    except metadata.PackageNotFoundError:
        return False


def cmd_pins(args):
    print("\n".join(installed_pins()))


# -----------------------------------------------------------------------------
# Environment: which backend, which devices


def nvidia_smi() -> dict | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return {"error": (out.stderr or out.stdout).strip()[-500:]}
    head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", head)
    return {
        "gpus": [line.strip() for line in out.stdout.strip().splitlines()],
        "driver_cuda_version": cuda.group(1) if cuda else None,
    }


def cmd_env(args):
    info = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "packages": installed_pins(),
        "nvidia_smi": nvidia_smi(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "JAX_PLATFORMS",
                "XLA_PYTHON_CLIENT_MEM_FRACTION",
                "JAX_COMPILATION_CACHE_DIR",
                "XLA_FLAGS",
                "CUDA_VISIBLE_DEVICES",
            )
        },
    }
    try:
        import jax

        devices = jax.devices()
        info.update(
            backend=jax.default_backend(),
            jax=jax.__version__,
            device_count=len(devices),
            device_kind=devices[0].device_kind,
            devices=[str(d) for d in devices],
        )
        stats = devices[0].memory_stats() or {}
        if "bytes_limit" in stats:
            info["device_memory_gb"] = round(stats["bytes_limit"] / 2**30, 2)
        error = None
        if args.expect_backend:
            from flaxchat.sharding import check_backend  # here: the pin checks run before JAX is installed

            try:
                check_backend(args.expect_backend)
            except ValueError as e:
                error = str(e)
    except (RuntimeError, AssertionError) as e:  # JAX_PLATFORMS names a backend that cannot start
        platforms = os.environ.get("JAX_PLATFORMS") or "default"
        reason = (str(e).strip().splitlines() or [""])[0][:500]
        if not reason:  # what JAX raises when no plugin provides the platform at all
            plugins = [p for p in info["packages"] if re.match(r"jax-cuda\d+-plugin", p)]
            reason = f"no backend provides it (installed CUDA plugins: {', '.join(plugins) or 'none'})"
        info.update(backend=None, error=reason)
        error = f"JAX could not start its {platforms} backend: {reason}"
    print(json.dumps(info, indent=2))
    if error:
        where = "a GPU" if args.expect_backend == "gpu" else f"the {args.expect_backend} backend"
        print(
            f"gpu_check: JAX is not on {where}: {error}\n"
            "gpu_check: install JAX with CUDA first (pip install -e '.[cuda12]' -c requirements/cuda12.txt, or "
            "'.[cuda13]'), check that nvidia-smi sees the GPU, or run `bash runs/gpu_check.sh --cpu` for the CPU "
            "smoke run.",
            file=sys.stderr,
        )
        sys.exit(1)


# -----------------------------------------------------------------------------
# A serving tokenizer with nanochat's vocabulary size, without a corpus


def pseudo_text(n_words, n_types, seed=0):
    """Lines of made-up words with Zipf-distributed frequencies. flaxchat's synthetic stories use ~4k distinct
    tokens' worth of merges; these give BPE enough distinct pairs for a 32k-65k vocabulary, so an offline serving
    benchmark pays for a real-sized lm_head and sampler."""
    import numpy as np

    rng = np.random.default_rng(seed)
    onsets = list("bcdfghjklmnprstvwz") + ["ch", "sh", "th", "tr", "st", "br", "pl"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ee", "y"]
    syllables = np.array([c + v for c in onsets for v in vowels] + [c + v + "n" for c in onsets for v in vowels[:5]])
    words = np.array(["".join(rng.choice(syllables, n)) for n in rng.integers(1, 5, n_types)])
    p = 1.0 / np.arange(1, n_types + 1)
    tokens = words[rng.choice(n_types, n_words, p=p / p.sum())]
    for i in range(0, n_words, 100):
        yield " ".join(tokens[i : i + 100]) + ".\n"


def cmd_tokenizer(args):
    from flaxchat.data.tokenizer import Tokenizer, get_tokenizer  # here: the pin checks run without it

    target = os.path.join(args.base_dir, "tokenizer")
    try:
        if get_tokenizer(args.base_dir).get_vocab_size() == args.vocab_size:
            print(f"tokenizer: reusing {target} (vocab {args.vocab_size:,})")
            return
    except FileNotFoundError:
        pass
    n_words = args.words or max(50_000, 60 * args.vocab_size)
    tok = Tokenizer.train_from_iterator(pseudo_text(n_words, n_types=6 * args.vocab_size), args.vocab_size)
    tok.save(target)
    print(f"tokenizer: vocab {tok.get_vocab_size():,} from {n_words:,} made-up words -> {target}")


# -----------------------------------------------------------------------------
# Report: every step's output in one JSON and one markdown page (flaxchat.perf.gpu_report)


def cmd_report(args):
    sections = set(args.sections.split(","))
    unknown = sections - set(SECTIONS)
    if unknown:
        sys.exit(f"error: --sections: unknown {', '.join(sorted(unknown))} (choose from {', '.join(SECTIONS)})")
    report = collect(args.out, args.mode, sections)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    md = summary_markdown(report)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md)
    print(md)
    sys.exit(0 if report["ok"] else 1)


# -----------------------------------------------------------------------------
# Lock: the tested versions + the CUDA wheels pip resolves for them (maintainers; needs PyPI)


def dependency_closure(reqs) -> dict[str, str]:
    """name -> installed version for every distribution `reqs` pull in here (markers evaluated, extras followed)."""
    found, stack = {}, [(r, tuple(sorted(r.extras))) for r in reqs]
    seen = set()
    while stack:
        req, extras = stack.pop()
        key = (canonicalize_name(req.name), extras)
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)
        found[canonicalize_name(req.name)] = dist.version
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in (extras or ("",))):
                stack.append((sub, tuple(sorted(sub.extras))))
    return found


def pip_dry_run(*args) -> None:
    """pip's resolver against PyPI, installing nothing (CalledProcessError if it finds no solution)."""
    pip = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", "install", "--dry-run"]
    subprocess.run([*pip, "--ignore-installed", "--quiet", "--index-url", PYPI, *args], check=True)


def cmd_lock(args):
    flavour = args.flavour
    tested = dependency_closure(project_requirements())
    jax_version = tested["jax"]
    with tempfile.TemporaryDirectory() as tmp:
        pins = os.path.join(tmp, "tested.txt")
        with open(pins, "w") as f:
            f.write("\n".join(f"{n}=={v}" for n, v in sorted(tested.items())) + "\n")
        report = os.path.join(tmp, "report.json")
        pip_dry_run("--report", report, "-c", pins, f"jax[{flavour}]=={jax_version}")
        resolved = {
            canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"]
            for i in json.load(open(report))["install"]
        }
        extra = {n: v for n, v in resolved.items() if n not in tested}
        path = os.path.join(ROOT, "requirements", f"{flavour}.txt")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        cuda = flavour.removeprefix("cuda")
        header = "".join(
            f"# {line}\n"
            for line in [
                f"flaxchat with CUDA {cuda}: the versions the test suite runs against, as a pip constraints file:",
                f'  pip install -e ".[{flavour}]" -c requirements/{flavour}.txt',
                f"Produced by `python -m scripts.gpu_check lock {flavour}` on {datetime.date.today()}. "
                "The first block is",
                "the installed closure of flaxchat[dev]'s dependencies where `python -m pytest -n 2` passes",
                f"(Linux {platform.machine()}, CPython {platform.python_version()}, CPU). The second is what pip "
                f"{metadata.version('pip')} resolved against",
                f"PyPI for jax[{flavour}]=={jax_version} under those pins; a dry-run install of "
                f'-e ".[{flavour},dev]" with this file',
                "then resolved. Resolved, not run, on a GPU: `bash runs/gpu_check.sh` on a GPU machine checks it "
                "works.",
                "The pins are plain versions, so other Linux platforms and Pythons with wheels of them can use it too.",
            ]
        )
        body = (
            "\n# tested stack (flaxchat[dev] closure)\n"
            + "".join(f"{n}=={v}\n" for n, v in sorted(tested.items()))
            + f"\n# CUDA {cuda} plugin and NVIDIA libraries for jax {jax_version} (resolved against PyPI)\n"
            + "".join(f"{n}=={v}\n" for n, v in sorted(extra.items()))
        )
        with open(path, "w") as f:
            f.write(header + body)
        pip_dry_run("-c", path, "-e", f"{ROOT}[{flavour},dev]")
    print(f"wrote {path}: {len(tested)} tested + {len(extra)} CUDA {cuda} pins; a dry-run install resolved with it")


# -----------------------------------------------------------------------------


def build_parser():
    p = argparse.ArgumentParser(
        description="Helpers for runs/gpu_check.sh (install, environment, tokenizer, report, lock).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("requirements", help="flaxchat[dev] requirements except JAX and its CUDA/TPU packages, one a line")
    sub.add_parser("missing", help="the requirements above that this environment does not satisfy")
    sub.add_parser("pins", help="name==version of the installed JAX / CUDA plugin / NVIDIA / libtpu packages")
    e = sub.add_parser("env", help="JAX backend and devices as JSON; exit 1 unless on --expect-backend")
    e.add_argument("--expect-backend", choices=["cpu", "gpu", "tpu"], default=None)
    t = sub.add_parser("tokenizer", help="train a tokenizer on made-up words into BASE_DIR/tokenizer (for serving)")
    t.add_argument("--vocab-size", type=int, default=32768)
    t.add_argument("--base-dir", required=True)
    t.add_argument("--words", type=int, default=None, help="words of text (default: 60 per vocabulary entry)")
    r = sub.add_parser("report", help="collect a gpu_check output folder into report.json and summary.md")
    r.add_argument("out")
    r.add_argument("--mode", choices=["gpu", "cpu"], default="gpu")
    r.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="the sections gpu_check.sh ran (its --only), comma-separated; the others are not checked",
    )
    lk = sub.add_parser("lock", help="rewrite requirements/<flavour>.txt (needs PyPI)")
    lk.add_argument("flavour", choices=["cuda12", "cuda13"])
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    {
        "requirements": cmd_requirements,
        "missing": cmd_missing,
        "pins": cmd_pins,
        "env": cmd_env,
        "tokenizer": cmd_tokenizer,
        "report": cmd_report,
        "lock": cmd_lock,
    }[args.command](args)


if __name__ == "__main__":
    main()
