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
from jax.sharding import NamedSharding, PartitionSpec as P

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
    """The scripts' --data/--fsdp/--tensor flags (the axes of make_mesh)."""
    parser.add_argument("--data", type=int, default=-1, help="data-parallel mesh axis (-1 = all remaining devices)")
    parser.add_argument("--fsdp", type=int, default=1, help="FSDP mesh axis (parameters and optimizer state sharded)")
    parser.add_argument("--tensor", type=int, default=1, help="tensor-parallel mesh axis (heads / MLP split)")


def mesh_from_args(parser, args) -> jax.sharding.Mesh:
    """Join the other processes (if any), then the mesh the flags ask for; a shape that does not fit is a CLI error."""
    init_distributed()
    try:
        return make_mesh(args.data, args.fsdp, args.tensor)
    except ValueError as e:
        parser.error(str(e))


def logical_to_spec(axes) -> P:
    """Logical axis names -> PartitionSpec under LOGICAL_RULES (a mesh axis is used at most once)."""
    return P(*core_spmd.from_sharding_rules(tuple(axes), LOGICAL_RULES))


def batch_sharding(mesh) -> NamedSharding:
    """Sharding of (B, T) token batches: rows over data x fsdp."""
    return NamedSharding(mesh, P(("data", "fsdp"), None))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


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
