"""Devices, meshes and logical-axis rules: the only module that knows about devices.

Modules name parameter axes logically (`embed`, `mlp`, `heads`, `kv_heads`, `vocab`); the rules below map them
onto a mesh ('data', 'fsdp', 'tensor'). Batches are split over data and fsdp; parameters are split over fsdp
(ZeRO-3 style: gathered per layer by XLA) and tensor (Megatron-style head/MLP splits).
"""

from __future__ import annotations

import contextlib
import os

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as core_spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flaxchat.common import enable_compilation_cache

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (None = replicated)
LOGICAL_RULES = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
)


# LLVM's NVPTX backend (in jaxlib 0.10.2 and later) lowers a fp32 atomic add to a compare-and-swap loop unless the
# kernel flushes denormals, because `atom.add.f32` on global memory flushes them; XLA's kernels keep denormals. A
# scatter-add whose indices repeat (an embedding's gradient: a common token thousands of times a batch) then
# retries each add while the token's other copies change the sum, far slower than the native atomic (jax issue
# 38806). This LLVM option restores the native atomic, whose only difference is a denormal sum flushed to zero (as
# torch's atomicAdd, and XLA before 0.10.2).
FTZ_ATOMICS = "-nvptx-allow-ftz-atomics"


def cuda_plugin_library() -> str | None:
    """The shared library of JAX's CUDA plugin (jax[cuda13] or jax[cuda12]), or None if neither is installed."""
    import glob
    import importlib.util

    for name in ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12"):
        try:
            spec = importlib.util.find_spec(name)
        except ImportError:
            continue
        for folder in (spec.submodule_search_locations or []) if spec else []:
            found = sorted(glob.glob(os.path.join(folder, "*.so")))
            if found:
                return found[0]
    return None


def knows_option(library: str, option: str) -> bool:
    """Whether the compiler in `library` registers the LLVM option (its name is a C string in the binary): XLA
    passes unknown options to LLVM, which stops the process."""
    import mmap

    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(option.lstrip("-").encode() + b"\0") >= 0


def native_gpu_atomics(env=None) -> bool:
    """Before JAX starts its backend: ask XLA's CUDA compiler for native fp32 atomic adds (FTZ_ATOMICS above), by
    adding the option to --xla_backend_extra_options in XLA_FLAGS. Only with a CUDA plugin whose compiler knows it
    and a JAX_PLATFORMS that allows CUDA; not if XLA_FLAGS already names the option or sets --xla_gpu_ftz, or with
    FLAXCHAT_NATIVE_GPU_ATOMICS=0. Returns whether XLA_FLAGS changed."""
    env = os.environ if env is None else env
    flags = env.get("XLA_FLAGS", "")
    opted_out = env.get("FLAXCHAT_NATIVE_GPU_ATOMICS", "1") == "0"
    if opted_out or FTZ_ATOMICS.lstrip("-") in flags or "--xla_gpu_ftz" in flags:
        return False
    platforms = [p.strip() for p in env.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return False
    library = cuda_plugin_library()
    if library is None or not knows_option(library, FTZ_ATOMICS):
        return False
    words = flags.split()
    for i, word in enumerate(words):
        if word.startswith("--xla_backend_extra_options="):
            words[i] = f"{word},{FTZ_ATOMICS}" if not word.endswith("=") else word + FTZ_ATOMICS
            break
    else:
        words.append(f"--xla_backend_extra_options={FTZ_ATOMICS}")
    env["XLA_FLAGS"] = " ".join(words)
    return True


def init_distributed() -> None:
    """Join a multi-process job when launched as one (coordinator env vars, SLURM, TPU pod); else no-op.

    jax.distributed.initialize() auto-detects TPU pods and SLURM; for a hand-launched multi-process run set
    JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (see runs/multihost.sh).
    """
    if jax.distributed.is_initialized():
        return
    env = os.environ
    if "JAX_COORDINATOR_ADDRESS" in env:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]),
            process_id=int(env["JAX_PROCESS_ID"]),
        )
    elif "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()
    elif env.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        jax.distributed.initialize()


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over all devices of all processes; -1 takes what is left."""
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    shape = [data, fsdp, tensor]
    if shape.count(-1) > 1:
        raise ValueError("at most one of --data/--fsdp/--tensor may be -1")
    known = int(np.prod([s for s in shape if s != -1]))
    if known < 1 or n % known:
        raise ValueError(f"mesh data={data} fsdp={fsdp} tensor={tensor} does not divide {n} devices")
    shape = [n // known if s == -1 else s for s in shape]
    if int(np.prod(shape)) != n:
        raise ValueError(f"mesh {dict(zip(MESH_AXES, shape))} uses {int(np.prod(shape))} devices, but there are {n}")
    return jax.make_mesh(tuple(shape), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices)


def add_mesh_flags(parser) -> None:
    """The scripts' --data/--fsdp/--tensor flags (the axes of make_mesh) and --expect-backend."""
    parser.add_argument("--data", type=int, default=-1, help="data-parallel mesh axis (-1 = all remaining devices)")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP mesh axis (parameters and optimizer state sharded)")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel mesh axis (heads / MLP split)")
    parser.add_argument(
        "--expect-backend",
        type=str,
        default=None,
        choices=["cpu", "gpu", "tpu"],
        help="stop at start-up unless JAX runs on this backend (catches a silent fall-back to CPU)",
    )


def check_backend(expected: str | None) -> None:
    """Raise if JAX's backend is not `expected` (JAX falls back to CPU, with one log line, when CUDA is missing)."""
    actual = jax.default_backend()
    if expected and actual != expected:
        raise ValueError(
            f"--expect-backend {expected}: JAX is running on {actual} ({jax.devices()[0].device_kind}); "
            f"check the jax[cuda12|cuda13] or jax[tpu] install (pip install -e '.[gpu]')"
        )


def mesh_from_args(parser, args) -> jax.sharding.Mesh:
    """Join the other processes (if any), then the mesh the flags ask for; a shape that does not fit is a CLI error.
    Also turns on the persistent compilation cache on accelerators (common.enable_compilation_cache) and, first,
    native fp32 atomic adds on CUDA GPUs (native_gpu_atomics)."""
    native_gpu_atomics()  # before anything below starts JAX's backend
    init_distributed()
    enable_compilation_cache()
    try:
        check_backend(getattr(args, "expect_backend", None))
        return make_mesh(args.data, args.fsdp, args.tensor)
    except ValueError as e:
        parser.error(str(e))


BATCH_AXES = dict(LOGICAL_RULES)["batch"]
# Batch axes that no parameter is split over: parameters are whole copies along them (pure data parallelism).
REPLICA_AXES = tuple(
    a
    for a in BATCH_AXES
    if not any(a == m or (isinstance(m, tuple) and a in m) for name, m in LOGICAL_RULES if name != "batch")
)
# Mesh axes that split the model (FSDP, tensor parallelism): the others' devices hold whole copies of it.
MODEL_AXES = tuple(a for a in MESH_AXES if a not in REPLICA_AXES)


def logical_to_spec(axes) -> P:
    """Logical axis names -> PartitionSpec under LOGICAL_RULES (a mesh axis is used at most once)."""
    return P(*core_spmd.from_sharding_rules(tuple(axes), LOGICAL_RULES))


# -----------------------------------------------------------------------------
# Inside jitted code: the mesh of the enclosing `jax.set_mesh`, activation constraints, per-shard functions.
# Model code calls these with logical names only; without a mesh (one device, or none set) they do nothing.


def context_mesh():
    """The abstract mesh of the enclosing `jax.set_mesh`, or None outside one (or for a single device)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh


def free_axes(candidates) -> tuple[str, ...]:
    """The mesh axes among `candidates` of size > 1 that are not already manual (inside a shard_map)."""
    mesh = context_mesh()
    if mesh is None:
        return ()
    return tuple(a for a in candidates if mesh.shape[a] > 1 and a not in set(mesh.manual_axes))


def split_axes(logical: str) -> tuple[str, ...]:
    """The free mesh axes (see free_axes) that the logical axis `logical` is split over."""
    entry = logical_to_spec((logical,))[0]
    return free_axes(entry if isinstance(entry, tuple) else (entry,) if entry else ())


def axes_size(axes) -> int:
    """Devices along the mesh `axes` of the enclosing mesh (1 for none)."""
    mesh = context_mesh()
    return int(np.prod([mesh.shape[a] for a in axes])) if mesh is not None and axes else 1


def stack_layouts(axes) -> list[P]:
    """Layouts that take a stack (K, ...) of matrices laid out by logical `axes` to a split along K alone.

    Used to share out same-shape matrices among devices (Muon): mesh axes the matrices are copied along
    come first (a local slice), then each axis a matrix is split along moves onto K one at a time, which
    XLA does with an all-to-all; asked for in one jump from a 2-D split, XLA gathers everything instead.
    The first layout is the matrices' own: walk the list forwards to stack, backwards to unstack.
    [] without a mesh.
    """
    mesh = context_mesh()
    if mesh is None:
        return []
    manual = set(mesh.manual_axes)
    free = lambda n: n is not None and n not in manual and mesh.shape[n] > 1
    dims = [[n for n in (e if isinstance(e, tuple) else (e,)) if free(n)] for e in logical_to_spec(axes)]
    used = {n for d in dims for n in d}
    k = [n for n in mesh.axis_names if free(n) and n not in used]
    spec = lambda: P(tuple(k) or None, *(tuple(d) or None for d in dims))
    chain = [P(None, *(tuple(d) or None for d in dims)), spec()]  # the first: as the matrices lie
    for d in dims:
        while d:
            k.append(d.pop(0))
            chain.append(spec())
    return chain


def stack_size() -> int:
    """How many devices a stack split by `stack_layouts` is shared among (1 without a mesh)."""
    mesh = context_mesh()
    if mesh is None:
        return 1
    return int(np.prod([mesh.shape[n] for n in mesh.axis_names if n not in set(mesh.manual_axes)]))


def constrain(x, axes):
    """Pin activation x to the sharding its logical axis names give (with_sharding_constraint).

    Without it XLA guesses activation layouts from the parameters', e.g. splits attention over heads *and*
    head_dim under FSDP and then rematerialises whole tensors to undo it. Axes already manual, and axes
    that do not divide their dimension, are left out; no mesh, no constraint.
    """
    mesh = context_mesh()
    if mesh is None:
        return x
    manual = set(mesh.manual_axes)
    entries = []
    for dim, entry in zip(x.shape, logical_to_spec(axes)):
        names = tuple(n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None and n not in manual)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        entries.append(names if names and dim % size == 0 else None)
    return jax.lax.with_sharding_constraint(x, P(*entries))


def psum(tree, axes):
    return jax.lax.psum(tree, axes) if axes else tree


def per_shard(f, axes, in_specs, out_specs):
    """f run once per shard of the manual `axes` (jax.shard_map); the other mesh axes stay automatic.

    Specs name mesh axes as PartitionSpecs do; with no axes, f itself. Inside, values are plain per-device
    arrays: gradients taken inside stay per device until an explicit psum (check_vma=False, which Pallas
    kernels such as Splash attention also need).
    """
    if not axes:
        return f
    return jax.shard_map(f, in_specs=in_specs, out_specs=out_specs, axis_names=set(axes), check_vma=False)


def batch_sharding(mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of (B, T) token batches, or of any array of ndim axes with one row per sequence: rows over
    data x fsdp."""
    return NamedSharding(mesh, P(("data", "fsdp"), *[None] * (ndim - 1)))


@contextlib.contextmanager
def rules():
    """Make LOGICAL_RULES the active logical-axis rules (for nnx.get_partition_spec and friends)."""
    with core_spmd.logical_axis_rules(LOGICAL_RULES):
        yield


def state_shardings(state, mesh):
    """NamedShardings for an nnx State (or model), from each Variable's logical `out_sharding`."""
    with rules():
        specs = nnx.get_partition_spec(state)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def pin_state(tree):
    """Inside jitted code on a mesh: constrain every Variable of an nnx object to the layout its annotation gives,
    the layout it was created with. A step that returned XLA's own choice for some (an optimizer buffer split
    the way its gradient happened to be) would be compiled a second time when fed its own output."""
    mesh = context_mesh()
    if mesh is None:
        return
    state = nnx.state(tree)
    with rules():
        specs = nnx.get_partition_spec(state)
    nnx.update(tree, jax.tree.map(jax.lax.with_sharding_constraint, state, specs))


def shard_model(model, mesh):
    """Place an existing model's state onto the mesh (in place)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    return model


def create_sharded(make_model, mesh):
    """Build a model with its parameters born sharded: init runs under nnx.jit with sharded outputs,
    so no device ever holds the full unsharded model."""

    @nnx.jit
    def init():
        model = make_model()
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, state_shardings(state, mesh)))
        return model

    with jax.set_mesh(mesh):
        return init()


def per_shard_heads(local, q, k, v):
    """local(q, k, v) per shard of the batch axes (and of the heads over 'tensor' when the kv heads divide): for
    attention kernels XLA's partitioner cannot see into. q (B, T, H, D), k and v (B, T, Hkv, D)."""
    Hkv = k.shape[2]
    heads = split_axes("kv_heads")
    heads = heads if Hkv % axes_size(heads) == 0 and heads == split_axes("heads") else ()
    axes = free_axes(BATCH_AXES)
    spec = P(axes or None, None, heads or None, None)
    return per_shard(local, axes + heads, (spec, spec, spec), spec)(q, k, v)
