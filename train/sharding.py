"""Data + FSDP sharding on a ``jax.sharding`` mesh, from one short table of logical axes.

Each parameter dimension gets a logical name from its role; ``RULES`` maps logical names to
mesh axes. The batch is split over every device ("data" x "fsdp"); parameters and optimizer state
are split over "fsdp" along their model width ("embed"), ZeRO-3 style, and XLA's SPMD partitioner
inserts the all-gathers and reduce-scatters. A dimension a mesh axis does not divide stays whole.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxllm import tree

MESH_AXES = ("data", "fsdp")
RULES = {"batch": ("data", "fsdp"), "embed": "fsdp", "vocab": None, "heads": None, "mlp": None}

# Logical axes of each parameter by its module name (kernels are [in, out]).
_KERNEL_AXES = {"q": ("embed", "heads"), "k": ("embed", "heads"), "v": ("embed", "heads"),
                "o": ("heads", "embed"), "up": ("embed", "mlp"), "gate": ("embed", "mlp"),
                "down": ("mlp", "embed"), "lm_head": ("embed", "vocab"),
                "project_in": ("embed", "embed"), "project_out": ("embed", "embed")}


def logical_axes(path: str, ndim: int) -> tuple:
    """Logical names of a parameter's dims, e.g. ``layer_0/mlp/up/kernel`` -> (embed, mlp)."""
    parts = path.split("/")
    if parts[0] == "layers":  # stacked blocks (scan_layers): the layer axis stays whole
        return (None,) + logical_axes("/".join(parts[1:]), ndim - 1)
    if parts[-1] == "embedding":
        return ("vocab", "embed")
    if parts[-1] == "kernel" and ndim == 2:
        return _KERNEL_AXES.get(parts[-2], ("embed", None))
    return (None,) * ndim  # biases, norm scales: small, replicated


def make_mesh(data: int = 0, fsdp: int = 1, devices=None) -> Mesh:
    """A (data, fsdp) mesh over ``devices`` (default: all); ``data=0`` takes what fsdp leaves."""
    devices = jax.devices() if devices is None else devices
    n = len(devices)
    if fsdp < 1 or n % fsdp:
        raise ValueError(f"fsdp={fsdp} must divide the {n} devices")
    data = data or n // fsdp
    if data * fsdp != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} = {data * fsdp} devices, but {n} are "
                         f"present; set mesh_data/mesh_fsdp so their product is {n}")
    return Mesh(np.asarray(devices).reshape(data, fsdp), MESH_AXES)


def spec(mesh: Mesh, axes: tuple, shape: tuple) -> P:
    """PartitionSpec for logical ``axes`` of an array of ``shape`` (undivisible dims stay whole)."""
    out = []
    for name, dim in zip(axes, shape):
        mesh_axes = RULES.get(name) if name else None
        if mesh_axes is None:
            out.append(None)
            continue
        size = math.prod(mesh.shape[a] for a in np.atleast_1d(mesh_axes))
        out.append(mesh_axes if dim % size == 0 else None)
    return P(*out)


def param_shardings(mesh: Mesh, params) -> dict:
    """A NamedSharding for every parameter (a pytree matching ``params``)."""
    flat = tree.flatten(params)
    return tree.unflatten({k: NamedSharding(mesh, spec(mesh, logical_axes(k, v.ndim), v.shape))
                           for k, v in flat.items()})


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(RULES["batch"]))


def put_batch(mesh: Mesh, batch: np.ndarray) -> jax.Array:
    """This process's rows of the global batch onto the mesh (multi-host: each host passes the
    rows it loaded, ``jax.make_array_from_process_local_data`` assembles the global array)."""
    return jax.make_array_from_process_local_data(batch_sharding(mesh), batch)
