"""The sandbox (flaxchat.generate.sandbox.execute_code), the tool's sandbox half (run_python) and the calculator
tool (use_calculator).

Every dangerous program here runs only inside the sandbox, and each must be stopped within its limit. Tests
taking `kind` run under both sandboxes (bubblewrap is skipped, with the reason, where it cannot run); the escape
tests first defeat the Python guard from inside, as hostile code would, to show what the OS boundary holds.
"""

import ast
import os
import signal
import socket
import sys
import time
import uuid
import warnings

import pytest

from flaxchat.generate import sandbox
from flaxchat.generate.sandbox import ExecutionResult, execute_code, run_python, sandbox_kind, use_calculator

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


def test_output_is_kept_up_to_the_timeout():
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


def test_missing_bubblewrap_warns_once_and_falls_back(monkeypatch):
    monkeypatch.setattr(sandbox, "find_bubblewrap", lambda: (None, "no bwrap here (test)"))
    monkeypatch.setenv("FLAXCHAT_SANDBOX", "auto")
    sandbox.warn_fallback.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert sandbox_kind() == "python-guard" and sandbox_kind() == "python-guard"
            assert execute_code("print(2)").stdout == "2\n"
        assert len(caught) == 1 and "no bwrap here (test)" in str(caught[0].message)
        assert "Python guard" in str(caught[0].message) and "not code written to escape" in str(caught[0].message)
        monkeypatch.setenv("FLAXCHAT_SANDBOX", "bubblewrap")
        with pytest.raises(RuntimeError, match="no bwrap here"):
            sandbox_kind()
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
