"""A rank's side of plans by rule (:mod:`dckpt.layout.rules`): the signature of its
flattened state (identical bytes on every rank of a job) and the hash of the boxes it
will really write. No collective, no I/O; O(tensors) plus O(ranks) once per distinct
mesh (its rank list, compressed to runs)."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch.distributed as dist

from ..format import codec
from ..layout import rules
from ..state.tensors import DTensor, _placements, is_sharded_tensor


def group_ranks(comm: Any) -> tuple[int, ...]:
    """The global rank of every rank of ``comm``'s group, by group rank."""
    if comm.own is not None:
        return tuple(comm.own.ranks)
    if comm.group is None or not comm.active:
        return (0,)
    return tuple(dist.get_process_group_ranks(comm.group))


def signature(tensors: dict[str, Any], ranks: tuple[int, ...],
              int_keys: list[str]) -> rules.Signature:
    """The :class:`dckpt.layout.rules.Signature` of ``tensors`` (flattened key -> tensor,
    in plan order), dtypes left for :func:`encode` to fill from the pieces. Raises what
    describing a placement raises (a Partial)."""
    sig = rules.Signature(ranks, int_keys=list(int_keys))
    index: dict = {}
    meshes: dict[int, tuple] = {}
    for key, t in tensors.items():
        if is_sharded_tensor(t):  # its metadata: .shape warns (ShardedTensor is deprecated)
            lid = rules.EXPLICIT
            shape = tuple(int(x) for x in t.metadata().size)
        elif isinstance(t, DTensor):
            shape = tuple(int(x) for x in t.shape)
            mesh = t.device_mesh
            got = meshes.get(id(mesh))
            if got is None:
                got = meshes[id(mesh)] = _mesh(mesh)
            pls = tuple(_placements(t, key))
            if got[2] is not None:  # a slice of a root mesh: placed on the root
                root_pls = [("R",)] * len(got[1])
                for i, p in zip(got[2], pls):
                    root_pls[i] = p
                pls = tuple(root_pls)
            lay = rules.Layout(got[0], got[1], pls)
            lid = index.get(lay)
            if lid is None:
                lid = index[lay] = len(sig.layouts)
                sig.layouts.append(lay)
        else:
            lid = rules.PLAIN
            shape = tuple(int(x) for x in t.shape)
        sig.items.append((key, "", shape, lid))
    return sig


def offer(tensors: dict[str, Any], int_keys: list[str], pieces: list,
          comm: Any) -> tuple[bytes, bytes, bytes] | None:
    """:func:`encode` of this rank's state, or None where it cannot be described by
    rule (then the rank offers its full plan). Never raises."""
    try:
        return encode(signature(tensors, group_ranks(comm), int_keys), pieces)
    except Exception:  # noqa: BLE001 - the gathered path plans it, and reports errors
        return None


def _mesh(mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...], list[int] | None]:
    """(ranks, shape, dims) of the mesh to describe ``mesh`` on: its root mesh when it
    is a slice of one along named dims in the root's order (FSDP2 over TP puts a norm
    on the dp slice: each tp coordinate has its own, so the slice's ranks differ from
    rank to rank but the root's do not), ``dims`` then being the root dims the slice
    keeps; else ``mesh`` itself, ``dims`` None. Any mistake here is caught by the plan
    hash check (the derived boxes would differ from the real ones)."""
    own = (tuple(mesh.mesh.reshape(-1).tolist()), tuple(mesh.shape), None)
    try:
        root = mesh._get_root_mesh()
    except Exception:  # noqa: BLE001 - a torch without it: the slice as it is
        return own
    names, rnames = mesh.mesh_dim_names, getattr(root, "mesh_dim_names", None)
    if root is None or root is mesh or not names or not rnames \
            or any(n not in rnames for n in names):
        return own
    dims = [rnames.index(n) for n in names]
    if dims != sorted(dims) or len(set(dims)) != len(dims):
        return own
    return tuple(root.mesh.reshape(-1).tolist()), tuple(root.shape), dims


def encode(sig: rules.Signature, pieces: list) -> tuple[bytes, bytes, bytes]:
    """(signature bytes, its 16-byte hash, the plan hash of ``pieces``: the boxes this
    rank writes, one or more per signature item in order). The items' dtypes are taken
    from the pieces. Raises ValueError when the pieces do not follow the items."""
    dtypes: dict[str, str] = {}
    ki, bi, offs, sizes = [], [], [], []
    pos = {k: i for i, (k, *_) in enumerate(sig.items)}
    last, n = None, 0
    for p in pieces:
        n = n + 1 if p.key == last else 0
        last = p.key
        ki.append(pos[p.key])
        bi.append(n)
        offs.append(p.box.offsets)
        sizes.append(p.box.sizes)
        dtypes[p.key] = p.dtype
    sig.items = [(k, dtypes[k], s, lid) for k, _, s, lid in sig.items]
    data = rules.encode(sig)
    h = codec._xxh().xxh3_128_digest(data)
    return data, h, rules.plan_hash(np.asarray(ki, np.int64), np.asarray(bi, np.int64), offs, sizes)
