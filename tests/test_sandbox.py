"""The sandbox (flaxchat.generate.sandbox.execute_code), the tool's sandbox half (run_python) and the calculator
tool (use_calculator).

Every dangerous program here runs only inside the sandbox, and each must be stopped within its limit.
"""

import os
import time

import pytest

from flaxchat.generate.sandbox import ExecutionResult, execute_code, run_python, use_calculator


def test_runs_code_and_captures_output():
    result = execute_code("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert isinstance(result, ExecutionResult)
    assert result.success and result.error is None and not result.timed_out
    assert result.stdout == "hello\n"
    assert result.stderr == "oops\n"


def test_exception_gives_one_line_error():
    result = execute_code("def f():\n    return 1 / 0\nf()")
    assert not result.success
    assert result.error == "ZeroDivisionError: division by zero"
    assert "Traceback" in result.stderr


def test_nonzero_exit_is_failure():
    assert execute_code("import sys; sys.exit(0)").success
    result = execute_code("import sys; sys.exit(3)")
    assert not result.success and result.error == "exited with status 3"


def test_infinite_loop_is_killed_at_the_timeout():
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
def test_fork_bomb_is_stopped(bomb):
    start = time.perf_counter()
    result = execute_code(bomb, timeout=2.0)
    assert not result.success and not result.timed_out, "the bomb must fail at once, not run to the timeout"
    assert "PermissionError" in result.error
    assert time.perf_counter() - start < 2.0


def test_ten_gigabyte_allocation_fails_with_memory_error():
    result = execute_code("x = bytearray(10 * 1024**3)\nprint('allocated')", memory_mb=256)
    assert not result.success and result.memory_exceeded
    assert result.error == "MemoryError" and result.stdout == ""


def test_writes_stay_inside_the_working_directory(tmp_path):
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


def test_files_inside_the_working_directory_work_and_vanish():
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
def test_no_network(net):
    result = execute_code(net)
    assert not result.success and "socket" in result.error


def test_signals_ctypes_and_stdin_are_refused():
    assert "os.kill" in execute_code("import os\nos.kill(1, 0)").error
    assert "ctypes" in execute_code("import ctypes").error
    assert "EOFError" in execute_code("input()").error


def test_output_is_capped():
    result = execute_code("print('y' * 100_000)", max_output=1000)
    assert result.success
    assert result.stdout.startswith("y" * 1000) and "[output truncated: 100001 bytes" in result.stdout
    flood = execute_code("while True:\n    print('x' * 10_000)", timeout=5.0, max_output=100)
    assert not flood.success and not flood.timed_out and "File too large" in flood.error


def test_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("FLAXCHAT_FAKE_SECRET", "hunter2")
    result = execute_code("import os\nprint('FLAXCHAT_FAKE_SECRET' in os.environ)")
    assert result.stdout == "False\n"


def test_quotes_and_braces_survive():
    code = "s = 'it\\'s \"quoted\" {braces} \\\\ \\u00e9'\nprint(s)"
    result = execute_code(code)
    assert result.success and result.stdout == 'it\'s "quoted" {braces} \\ \u00e9\n'


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="positive"):
        execute_code("print(1)", timeout=0)


def test_run_python_prints_like_an_interactive_prompt():
    assert run_python("print('hi')") == "hi" and run_python("sorted([3, 1, 2])") == "[1, 2, 3]"
    assert run_python("x = 1") is None
    assert "NameError" in run_python("undefined_name + 1")


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
