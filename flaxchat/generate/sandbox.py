"""Sandboxed Python for the tool-using assistant and for HumanEval, plus the calculator tool.

`execute_code` runs a program in a fresh `python -I` subprocess:
- its own session (process group), killed as a whole on the wall-clock timeout;
- resource limits: address space (memory), CPU seconds, file size (which also caps stdout/stderr,
  as they go to files), no core dumps, and RLIMIT_NPROC=0 so it can start no processes or threads;
- a fresh temporary working directory, deleted afterwards; stdin closed; a scrubbed environment;
- an audit hook (PEP 578) installed before the program runs that refuses sockets, process creation
  (fork, exec, spawn, subprocess, os.system), signals to other processes, ctypes, changing limits,
  links, and any write, delete, rename or chdir outside the working directory.

It guards against accidents and careless generated code (fork bombs, runaway loops, huge allocations,
`rm -rf`, network calls). It is not a security boundary against code written to escape: Python's
introspection can reach the hook's helpers, and there is no kernel isolation (seccomp, namespaces).

`run_python` is the tool's sandbox half (the Engine's use_sandbox=True): code the model wrote, run as an
interactive prompt would run it.

`use_calculator` is the chat model's calculator tool: arithmetic and `str.count` evaluated by walking
the `ast`, never by `eval`.
"""

from __future__ import annotations

import ast
import math
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass

# The sandboxed program's own files (and its stdout/stderr files) may not exceed this size.
MAX_FILE_BYTES = 32 * 1024 * 1024


@dataclass
class ExecutionResult:
    """What happened when a program ran in the sandbox."""

    success: bool  # exited with status 0 inside every limit
    stdout: str
    stderr: str
    error: str | None = None  # one line: the exception, or which limit stopped the program
    timed_out: bool = False  # wall-clock or CPU-time limit hit
    memory_exceeded: bool = False  # the program died of MemoryError under the address-space limit


# Runs inside the child as `python -I -c PRELUDE program_path workdir mem cpu fsize`. The limits are set
# here, as the child's first statements, rather than in Popen's preexec_fn: preexec_fn is documented
# as unsafe when the parent has threads, and the Engine process always has JAX runtime threads.
PRELUDE = r"""
import sys, os, resource
_program_path, _workdir = sys.argv[1], sys.argv[2]
_mem, _cpu, _fsize = (int(v) for v in sys.argv[3:6])
resource.setrlimit(resource.RLIMIT_AS, (_mem, _mem))
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (_fsize, _fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # ignored for root; the audit hook covers that case
with open(_program_path, encoding="utf-8") as _f:
    _source = _f.read()

def _install_guard(workdir):
    import os.path
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    root = realpath(workdir)
    denied = ("os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn",
              "subprocess.Popen", "os.kill", "os.killpg", "signal.pthread_kill", "os.symlink", "os.link",
              "resource.setrlimit", "resource.prlimit", "sys.addaudithook")
    path_events = ("os.mkdir", "os.remove", "os.rmdir", "os.rename", "shutil.rmtree", "os.chmod",
                   "os.chown", "os.truncate", "os.utime", "os.chdir", "os.chflags", "os.setxattr",
                   "os.removexattr", "os.mkfifo", "os.mknod")

    def inside(path):
        if isinstance(path, int):  # an already-open file descriptor
            return True
        full = realpath(fsdecode(path))
        return full == root or full.startswith(root + sep)

    def hook(event, args):
        if event in denied or event.startswith(("socket.", "ctypes.")):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & write_flags)
            if writing and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing outside the working directory: {path}")
        elif event in path_events:
            paths = args[:2] if event == "os.rename" else args[:1]
            for path in paths:
                if path is not None and not inside(path):
                    raise PermissionError(f"sandbox: {event} outside the working directory: {path}")

    sys.addaudithook(hook)

_install_guard(_workdir)
import _posixsubprocess  # subprocess's fork primitive raises no audit event of its own
def _no_fork_exec(*args, **kwargs):
    raise PermissionError("sandbox: subprocess is not allowed")
_posixsubprocess.fork_exec = _no_fork_exec
del _f, _install_guard, _no_fork_exec, _program_path, _workdir, _mem, _cpu, _fsize
exec(compile(_source, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""

# Signals that mean "a limit stopped the program", with the one-line error we report.
_SIGNAL_ERRORS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: f"file or output size limit exceeded ({MAX_FILE_BYTES // (1024 * 1024)} MiB)",
    signal.SIGKILL: "killed (SIGKILL)",
    signal.SIGSEGV: "crashed (SIGSEGV), possibly out of memory",
}


def _read_capped(path: str, max_output: int) -> str:
    """First max_output bytes of a file as text, with a note saying how much was cut."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read(max_output)
    text = data.decode("utf-8", errors="replace")
    if size > max_output:
        text += f"\n[output truncated: {size} bytes, showing the first {max_output}]"
    return text


def _error_line(returncode: int, stderr_path: str) -> str:
    """One line explaining a failed run: the signal's meaning or the traceback's last line."""
    if returncode < 0:
        sig = -returncode
        return _SIGNAL_ERRORS.get(sig, f"killed by signal {signal.Signals(sig).name}")
    # read the end of the file, not the capped text: the exception line comes last
    with open(stderr_path, "rb") as f:
        f.seek(max(os.path.getsize(stderr_path) - 4096, 0))
        lines = f.read().decode("utf-8", errors="replace").strip().splitlines()
    return lines[-1] if lines else f"exited with status {returncode}"


def execute_code(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 16_384) -> ExecutionResult:
    """Run `code` as a Python program in the sandbox and report what happened.

    timeout: wall-clock seconds (the CPU limit is one second more); memory_mb: address-space limit;
    max_output: bytes of stdout and of stderr kept (the rest is cut, with a note).
    """
    if timeout <= 0 or memory_mb <= 0 or max_output <= 0:
        raise ValueError("timeout, memory_mb and max_output must all be positive")
    cpu_seconds = math.ceil(timeout) + 1
    with tempfile.TemporaryDirectory(prefix="flaxchat-sandbox-", ignore_cleanup_errors=True) as root:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        program_path = os.path.join(root, "program.py")
        with open(program_path, "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        argv = [
            sys.executable,
            "-I",
            "-B",
            "-X",
            "utf8",
            "-c",
            PRELUDE,
            program_path,
            workdir,
            str(memory_mb * 1024 * 1024),
            str(cpu_seconds),
            str(MAX_FILE_BYTES),
        ]
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                argv,
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        stdout, stderr = _read_capped(out_path, max_output), _read_capped(err_path, max_output)
        if timed_out:
            return ExecutionResult(False, stdout, stderr, error=f"timed out after {timeout:g} s", timed_out=True)
        success = proc.returncode == 0
        error = None if success else _error_line(proc.returncode, err_path)
    return ExecutionResult(
        success=success,
        stdout=stdout,
        stderr=stderr,
        error=error,
        timed_out=proc.returncode == -signal.SIGXCPU,
        memory_exceeded=error is not None and "MemoryError" in error,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (anything it managed to start dies with it), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone
    proc.wait()


def run_python(code: str, timeout: float = 5.0) -> str | None:
    """The sandbox half of the chat model's tool: run code like an interactive prompt (a final expression's value
    is printed) and return what it printed, its error line, or None when it printed nothing."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        tree = None  # let the sandbox report it in Python's own words
    if tree is not None and tree.body and isinstance(tree.body[-1], ast.Expr):
        value = tree.body[-1].value
        show = ast.parse("if _ is not None: print(repr(_))").body[0]
        tree.body[-1:] = [ast.Assign(targets=[ast.Name("_", ast.Store())], value=value), show]
        code = ast.unparse(ast.fix_missing_locations(tree))
    result = execute_code(code, timeout=timeout)
    text = result.stdout.strip() if result.success else (result.error or "error")
    return text or None


# -----------------------------------------------------------------------------
# Calculator tool

_ARITH_CHARS = set("0123456789+-*/%.() ")
_BINOPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
}
_MAX_POW_BITS = 10_000  # refuse 9**9**9-style requests that would hang the tool
_STR_METHODS = {"lower", "upper", "strip"}  # allowed on the way to .count(...)


def _pow(base, exponent):
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0:
        if exponent * max(abs(base).bit_length(), 1) > _MAX_POW_BITS:
            raise OverflowError("result too large")
    return base**exponent


def _eval_arith(node):
    """Evaluate an arithmetic AST: numbers, + - * / // % **, unary signs, parentheses."""
    if isinstance(node, ast.Expression):
        return _eval_arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _eval_arith(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp):
        left, right = _eval_arith(node.left), _eval_arith(node.right)
        if isinstance(node.op, ast.Pow):
            return _pow(left, right)
        if type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](left, right)
    raise ValueError("not arithmetic")


def _eval_string(node):
    """A string literal, optionally through .lower()/.upper()/.strip(), as in "'Strawberry'.lower()"."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in _STR_METHODS
        and not node.args
        and not node.keywords
    ):
        return getattr(_eval_string(node.func.value), node.func.attr)()
    raise ValueError("not a string expression")


def _eval_count(node):
    """`<string>.count(<string>)`: how the assistant counts letters (SpellingBee)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "count"
        and len(node.args) == 1
        and not node.keywords
    ):
        return _eval_string(node.func.value).count(_eval_string(node.args[0]))
    raise ValueError("not a count expression")


def use_calculator(expr: str) -> str | None:
    """The calculator tool: the result of `expr` as text, or None when it is not a calculator expression.

    Two kinds of expression, as in nanochat's engine: arithmetic over numbers (thousands separators
    "1,000" allowed; + - * / // % ** and parentheses), and string counting such as "'strawberry'.count('r')".
    Anything else (names, other calls, errors such as division by zero) gives None, which the Engine treats
    as "no tool output". Results print as Python prints them (12/60 -> "0.2", 0.2*50 -> "10.0").
    """
    if not isinstance(expr, str) or not expr.strip() or len(expr) > 1000:
        return None
    arith = expr.replace(",", "")
    try:
        with warnings.catch_warnings():  # model-written text like "3x" would print a SyntaxWarning per call
            warnings.simplefilter("ignore", SyntaxWarning)
            if set(arith) <= _ARITH_CHARS:
                value = _eval_arith(ast.parse(arith.strip(), mode="eval"))
            else:
                value = _eval_count(ast.parse(expr.strip(), mode="eval").body)
        if type(value) not in (int, float):  # e.g. (-8) ** 0.5 is complex
            return None
        return str(value)
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError, MemoryError):
        return None
