"""Reading a compiled program: the collectives and matmul FLOPs of one execution, loops unrolled.

XLA prints no such summary, and `compiled.cost_analysis()` counts a loop body once whatever its trip count
(the fused loss and the accumulation loop are scans). Tests and `scripts.bench --what comms` read these off
the optimised HLO text instead: `program_stats(jitted.lower(...).compile().as_text())`. Before compilation,
`jaxpr_equations` walks a traced program's equations with how often each runs.
"""

from __future__ import annotations

import math
import os
import re

from flaxchat.model import cpu
from flaxchat.perf.trace import kind_of_name


def jaxpr_equations(jaxpr, times: int = 1):
    """(equation, executions per call) for every equation of a jaxpr and of the jaxprs inside it (a scan's body
    runs `length` times; lax.map and the accumulation loop are scans)."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    for eqn in jaxpr.eqns:
        yield eqn, times
        inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, (Jaxpr, ClosedJaxpr)):
                    yield from jaxpr_equations(getattr(sub, "jaxpr", sub), inner)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(\S+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(\S+) .*\{\s*$")


def _dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _shape_bytes(shape: str) -> int:
    return sum(
        _DTYPE_BYTES.get(t, 0) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in _ARRAY.findall(shape)
    )


def _group_size(attrs: str) -> int:
    """Devices per replica group, from any of XLA's three spellings of replica_groups."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attrs)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", m.group(1))}
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", attrs)
    return len(m.group(1).split(",")) if m else 1


def _wire_bytes(kind: str, result_bytes: int, n: int) -> float:
    """Bytes each device sends for one collective under ring algorithms (the usual cost model)."""
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes
    if kind == "reduce-scatter":
        return (n - 1) * result_bytes
    if kind in ("all-gather", "all-to-all"):
        return (n - 1) / n * result_bytes
    return result_bytes  # collective-permute


def _parse(hlo_text: str):
    """{computation: [(name, shape, opcode, rest)]} and the entry computation's name."""
    comps, current, entry = {}, None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = comps.setdefault(m.group(1), [])
            entry = m.group(1) if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (i := _INSTRUCTION.match(line)):
            current.append(i.groups())
    return comps, entry


def _executions(comps, entry):
    """How many times each computation runs per execution of the entry (while bodies x known trip counts)."""
    callers: dict[str, list] = {}
    unknown = 0
    for name, instructions in comps.items():
        for _, _, opcode, rest in instructions:
            if opcode == "while":
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
                unknown += trip is None
                body = re.search(r"body=%([\w.\-]+)", rest).group(1)
                callers.setdefault(body, []).append((name, int(trip.group(1)) if trip else 1))
                continue
            for group in re.findall(r"(?:calls|to_apply|branch_computations)=\{?([^}]*?)(?:\}|,\s*\w+=|$)", rest):
                for callee in re.findall(r"%([\w.\-]+)", group):
                    callers.setdefault(callee, []).append((name, 1))
    memo = {entry: 1}

    def times(name, depth=0):
        if name not in memo:
            memo[name] = 0 if depth > 64 else sum(t * times(c, depth + 1) for c, t in callers.get(name, []))
        return memo[name]

    return {name: times(name) for name in comps}, unknown


def _dot_flops(shape: str, rest: str, shapes: dict) -> int:
    """2 x (result elements) x (contracted elements) of a dot, from its lhs operand's shape."""
    lhs = re.match(r"\s*%([\w.\-]+)", rest)
    contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", rest)
    if not lhs or lhs.group(1) not in shapes:
        return 0
    lhs_dims = _dims(shapes[lhs.group(1)])
    k = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d) if contracting else 1
    return 2 * math.prod(_dims(shape)) * k


def program_stats(hlo_text: str) -> dict:
    """Per execution of a compiled program: collectives and matmul FLOPs (per device, for an SPMD program).

    Returns {"collectives", "bytes" (sent per device, ring model), "by_kind": {kind: {"count", "bytes"}},
    "matmul_flops", "ops": [(kind, shape, times, op_name)], "unknown_trip_counts"}.
    """
    comps, entry = _parse(hlo_text)
    times, unknown = _executions(comps, entry)
    by_kind = {k: {"count": 0, "bytes": 0.0} for k in COLLECTIVES}
    ops, flops = [], 0
    for comp, instructions in comps.items():
        n = times[comp]
        shapes = {name: shape for name, shape, _, _ in instructions}
        for name, shape, opcode, rest in instructions:
            if n and opcode == "dot":
                flops += n * _dot_flops(shape, rest, shapes)
            kind = opcode.removesuffix("-start")
            if not n or kind not in COLLECTIVES:
                continue
            if opcode.endswith("-start") and shape.startswith("("):  # async: (operands..., results...)
                arrays = _ARRAY.findall(shape)
                shape = " ".join(f"{t}[{d}]" for t, d in arrays[len(arrays) // 2 :])
            by_kind[kind]["count"] += n
            by_kind[kind]["bytes"] += n * _wire_bytes(kind, _shape_bytes(shape), _group_size(rest))
            op_name = re.search(r'op_name="([^"]*)"', rest)
            ops.append((kind, shape, n, op_name.group(1) if op_name else ""))
    return {
        "collectives": sum(v["count"] for v in by_kind.values()),
        "bytes": sum(v["bytes"] for v in by_kind.values()),
        "by_kind": by_kind,
        "matmul_flops": flops,
        "ops": ops,
        "unknown_trip_counts": unknown,
    }


def dot_types(hlo_text: str) -> list[tuple[str, str, int]]:
    """Every dot instruction of the program as (lhs element type, rhs element type, FLOPs of one execution),
    loops not unrolled. A CPU program of a bf16 model should multiply bf16: XLA:CPU converts the operands of a
    product its bf16 kernels do not take and runs it at the fp32 rate (see model.cpu.split_in_two)."""
    comps, _ = _parse(hlo_text)
    shapes = {name: shape for instrs in comps.values() for name, shape, _, _ in instrs}
    element = lambda name: m.group(1) if (m := _ARRAY.search(shapes.get(name, ""))) else "?"
    dots = []
    for instrs in comps.values():
        for _, shape, opcode, rest in instrs:
            if opcode == "dot":
                lhs, rhs = re.findall(r"%([^\s,)]+)", rest)[:2]
                dots.append((element(lhs), element(rhs), _dot_flops(shape, rest, shapes)))
    return dots


# What each op of a compiled program computes, for reading a profile (flaxchat.perf.trace): its kind.
_LAYOUT_OPS = {
    "copy",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "parameter",
    "constant",
    "iota",
    "tuple",
    "get-tuple-element",
    "copy-start",
    "copy-done",
    "gather",
    "reverse",
}
_CONTAINERS = {"while", "conditional", "call"}
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_ELEMENTWISE = {
    "add",
    "subtract",
    "multiply",
    "divide",
    "exponential",
    "log",
    "tanh",
    "logistic",
    "maximum",
    "minimum",
    "select",
    "compare",
    "convert",
    "negate",
    "sqrt",
    "rsqrt",
    "power",
    "abs",
    "sign",
    "and",
    "or",
    "not",
    "clamp",
    "exponential-minus-one",
    "log-plus-one",
    "floor",
    "ceil",
    "round-nearest-even",
    "is-finite",
    "xor",
    "shift-left",
    "shift-right-logical",
    "remainder",
    "atan2",
    "cosine",
    "sine",
    "erf",
}


def _fused(comps: dict, comp: str, depth: int = 0):
    """The instructions of a fused computation and of the computations they call, in program order."""
    for instruction in comps.get(comp, []):
        yield instruction
        if depth < 8:
            for callee in _CALLS.findall(instruction[3]):
                yield from _fused(comps, callee, depth + 1)


def op_kinds(hlo_text: str) -> dict[str, str]:
    """{instruction name: kind} for every instruction of an optimised HLO module; kinds as flaxchat.perf.trace.KINDS.
    A fusion is a matmul if it holds a dot, convolution or GEMM call (a GEMM with its epilogue), a reduction if it
    holds a reduce, layout if it only moves data, else elementwise."""
    comps, _ = _parse(hlo_text)

    def custom_kind(rest: str) -> str:
        target = re.search(r'custom_call_target="([^"]*)"', rest)
        kind = kind_of_name(target.group(1)) if target else "other"
        return kind if kind in ("matmul", "attention", "collective") else "other"

    kinds = {}
    for instructions in comps.values():
        for name, _, opcode, rest in instructions:
            base = opcode.removesuffix("-start").removesuffix("-done")
            if opcode in ("dot", "convolution"):
                kind = "matmul"
            elif opcode == "custom-call":
                kind = custom_kind(rest)
            elif base in COLLECTIVES:
                kind = "collective"
            elif opcode == "fusion":
                callee = _CALLS.search(rest)  # its opcodes, custom-calls as their kind
                inner = {
                    custom_kind(r) if o == "custom-call" else o
                    for _, _, o, r in (_fused(comps, callee.group(1)) if callee else ())
                }
                if inner & {"dot", "convolution", "matmul"} or "__triton_gemm" in rest:
                    kind = "matmul"
                elif "attention" in inner:
                    kind = "attention"
                elif inner & set(COLLECTIVES):
                    kind = "collective"
                elif inner & {"reduce", "reduce-window"}:
                    kind = "reduction"
                elif inner <= _LAYOUT_OPS:
                    kind = "layout"
                else:
                    kind = "elementwise"
            elif opcode in _LAYOUT_OPS:
                kind = "layout"
            elif opcode in ("reduce", "reduce-window"):
                kind = "reduction"
            elif opcode in _CONTAINERS:
                kind = "control"
            else:
                kind = "elementwise" if opcode in _ELEMENTWISE else "other"
            kinds[name] = kind
    return kinds


def scatter_combiners(hlo_text: str) -> list[tuple[str, tuple[str, ...]]]:
    """(element type, the opcodes of its combining computation) of every scatter in an HLO module. A scatter-add
    whose combiner is a lone fp32 `add` can run as a GPU's atomic add instruction (sharding.native_gpu_atomics);
    other combiners (a bf16 add as a CPU compiles it: add, convert, convert) become compare-and-swap loops."""
    comps, _ = _parse(hlo_text)
    found = []
    for instructions in comps.values():
        for _, shape, opcode, rest in instructions:
            combiner = re.search(r"to_apply=%([\w.\-]+)", rest)
            if opcode == "scatter" and combiner:
                ops = tuple(o for _, _, o, _ in comps.get(combiner.group(1), []) if o != "parameter")
                found.append((_ARRAY.search(shape).group(1), ops))
    return found


# The folder holding the flaxchat package: a checkout's root (or site-packages). Sources are named from here, so a
# checkout cloned into a folder itself called "flaxchat" still names tests/test_trace.py, not flaxchat/tests/...
_PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))


def source_line(path: str, line: int, function: str) -> str:
    """How op sources are named: "flaxchat/model/loss.py:124 step" (the path from the project's root when the file
    is the project's, else from the last flaxchat/scripts/tasks folder in it, else the file's folder and name;
    line; function)."""
    if os.path.isabs(path):
        relative = os.path.relpath(os.path.realpath(path), _PROJECT_ROOT)
        if not relative.startswith("..") and "site-packages" not in relative:  # not a venv inside the checkout
            return f"{relative}:{line} {function}"
    parts = path.split("/")
    top = max((i for i, p in enumerate(parts[:-1]) if p in ("flaxchat", "scripts", "tasks")), default=len(parts) - 2)
    return f"{'/'.join(parts[top:])}:{line} {function}"


def _stack_frames(hlo_text: str) -> dict[int, str]:
    """{stack_frame_id: "flaxchat/model/loss.py:124 step"}: the innermost user frame of each of the module's stack
    frames (its FileNames / FunctionNames / FileLocations / StackFrames tables)."""
    tables, section = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}, None
    for line in hlo_text.splitlines():
        text = line.strip()
        if text in tables:
            section = text
        elif section and (m := re.match(r"(\d+) (.*)$", text)):
            tables[section][int(m.group(1))] = m.group(2)
        elif text:
            section = None
    field = lambda entry, key: int(re.search(rf"\b{key}=(\d+)", entry).group(1))
    unquote = lambda name: name.strip().strip('"')

    def where(frame_id: int) -> tuple[str, int, str]:
        location = tables["FileLocations"][field(tables["StackFrames"][frame_id], "file_location_id")]
        path = unquote(tables["FileNames"][field(location, "file_name_id")])
        return path, field(location, "line"), unquote(tables["FunctionNames"][field(location, "function_name_id")])

    frames = {}
    for start in tables["StackFrames"]:
        try:
            frame_id, seen = start, {start}
            path, line, function = where(frame_id)
            # a pass-through helper is named by its caller; the printed parent is the parent's id + 1 (1 = none)
            while path.endswith("flaxchat/model/cpu.py") and function in cpu.PASS_THROUGH:
                parent = field(tables["StackFrames"][frame_id], "parent_frame_id") - 1
                if parent < 1 or parent in seen:
                    break
                seen.add(parent)
                frame_id = parent
                path, line, function = where(parent)
        except (AttributeError, KeyError):  # a table this XLA prints differently: no source for that frame
            continue
        frames[start] = source_line(path, line, function)
    return frames


def op_sources(hlo_text: str) -> dict[str, str]:
    """{instruction name: where it came from}: the source line that made it and the end of its JAX op_name, e.g.
    "flaxchat/model/loss.py:124 step (nv,vc->nc/dot_general)": what a profile's "ynn_fusion.168" or "custom-call.3"
    computes. A fusion is named by the product it holds (a GEMM with a norm's backward fused after it is the
    product's line, not the norm's), else by its root. Only the op_name where the program has no stack frames."""
    comps, _ = _parse(hlo_text)
    frames = _stack_frames(hlo_text)

    def product(comp: str) -> str | None:
        """The metadata of the first product (dot, convolution) inside a fused computation, or None."""
        products = (r for _, _, o, r in _fused(comps, comp) if o in ("dot", "convolution") and "op_name=" in r)
        return next(products, None)

    sources = {}
    for instructions in comps.values():
        for name, _, opcode, rest in instructions:
            callee = _CALLS.search(rest) if opcode == "fusion" else None
            rest = (product(callee.group(1)) if callee else None) or rest
            op_name = re.search(r'op_name="([^"]*)"', rest)
            if not op_name:
                continue
            frame = re.search(r"stack_frame_id=(\d+)", rest)
            where = frames.get(int(frame.group(1))) if frame else None
            tail = "/".join(op_name.group(1).split("/")[-2:])
            sources[name] = f"{where} ({tail})" if where else op_name.group(1)
    return sources
