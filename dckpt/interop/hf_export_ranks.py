"""Export a dckpt checkpoint as a Hugging Face model folder from many processes at once.

Each of ``world`` processes (ranks of a job, or workers of ``dckpt export --ranks N``)
writes a balanced share of whole tensors, assembled by range reads from the committed
files (:class:`dckpt.engine.reader.ChunkReader`: any layout saved it, every block's
checksum verified, memory about ``read_budget`` bytes), as
``model-0000i-of-0000N.safetensors``; rank 0 then waits until every file of the plan is
in place and writes ``model.safetensors.index.json`` last, so the folder is loadable
only when complete. No collective and no process group: the plan is a pure function of
the manifest, ``world`` and ``max_shard_size``, so every rank derives the same one, and
completion is seen on the file system (each file appears under its name only whole).

A re-run (a killed export, a resume) derives the same plan and the same names: a file
already in place holds the same bytes (they come from the same committed checkpoint),
so a mix of a killed run's files and a new run's is the same model.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

from ..errors import CheckpointError
from ..engine.reader import ChunkReader
from ..progress import Progress
from ..protocol.restore import read_manifest
from ..storage.fsspec_storage import make_storage
from .common import norm_prefix, parse_dtype, parse_size
from ..format.shards import MAX_HEADER, load_json
from .hf_export import (DEFAULT_BUDGET, INDEX, SINGLE, _TEMP, _Out, _header, _remove,
                        _select, _shards, _weight_file, _write_file)

log = logging.getLogger(__name__)
WAIT_S = float(os.environ.get("DCKPT_EXPORT_WAIT_S", "1800"))  # rank 0's wait for the others


@dataclass(frozen=True)
class SharePlan:
    """The files of a many-process export, in index order: ``owners[i]`` writes
    ``names[i]`` holding ``groups[i]``."""

    names: tuple[str, ...]
    owners: tuple[int, ...]
    groups: tuple[tuple[_Out, ...], ...]

    # what every file of this export records (``dckpt.export``): the checkpoint's
    # save id and the plan's inputs. Rank 0 indexes only files that record it: an
    # earlier export's file of the same name and size (another checkpoint, another
    # plan) is never taken for this one's
    token: str = ""

    def meta(self) -> dict[str, str]:
        return {"dckpt.export": self.token}

    def sizes(self) -> list[int]:
        """Each file's size (its header and its tensors' bytes). Pure."""
        return [len(_header(list(g), self.meta())[0]) + sum(o.nbytes for o in g)
                for g in self.groups]


def plan_shares(outs: list[_Out], world: int, limit: int, token: str = "") -> SharePlan:
    """Split ``outs`` over ``world`` writers, balanced by bytes (largest first, each to
    the least-loaded writer; ties by rank), each writer's tensors kept in checkpoint
    order and cut into files of at most ``limit`` bytes; files numbered in rank order.
    Pure, deterministic: O(n log n + n * world)."""
    if world < 1:
        raise CheckpointError(f"an export over {world} processes: give at least 1")
    load = [0] * world
    mine: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(outs)), key=lambda i: (-outs[i].nbytes, i)):
        r = min(range(world), key=lambda r: (load[r], r))
        mine[r].append(i)
        load[r] += outs[i].nbytes
    owners, groups = [], []
    for r in range(world):
        for g in _shards([outs[i] for i in sorted(mine[r])], limit) if mine[r] else []:
            owners.append(r)
            groups.append(tuple(g))
    n = len(groups)
    names = (SINGLE,) if n == 1 else tuple(f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                           for i in range(n))
    return SharePlan(names, tuple(owners), tuple(groups), token)


def export_share(ckpt: str, out_dir: str, rank: int, world: int, prefix: str | None = None,
                 max_shard_size: int | str = "5GB", dtype=None, *,
                 storage_options: dict | None = None,
                 read_budget: int = DEFAULT_BUDGET, read_workers: int = 4,
                 wait_s: float | None = None, overwrite: bool = False,
                 before_index=None) -> SharePlan:
    """Rank ``rank`` of ``world``'s part of the export of checkpoint ``ckpt``'s tensors
    under ``prefix`` to ``out_dir`` (local or an object store; may be ``ckpt`` itself:
    a checkpoint that is also a model folder): its files, and on rank 0, once every
    other file is in place, the index (one file: ``model.safetensors`` itself, written
    by rank 0, needs none). ``dtype`` converts floating-point tensors as
    :func:`.hf_export.export` does. ``out_dir`` must hold nothing but this export's
    own files (another rank's, a killed run's) unless ``overwrite``, which keeps other
    files (a checkpoint exporting into itself) and replaces an earlier export: its
    index is removed first (the folder does not load until the new index), its shard
    files not in the new plan last. No collective. Blocking I/O: this rank's share read once
    (verified) and written once. Raises CheckpointError (as :func:`.hf_export.export`;
    rank 0: another rank's file not in place within ``wait_s`` seconds, default
    ``DCKPT_EXPORT_WAIT_S`` or 1800), IntegrityError naming file and tensor, OSError.
    ``before_index()``: called once this rank's files are in place (tests' faults)."""
    if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
        raise CheckpointError(f"export rank {rank!r} of {world!r}: need 0 <= rank < world")
    t0 = time.perf_counter()
    limit = parse_size(max_shard_size)
    storage, root = make_storage(ckpt, storage_options)
    manifest, _ = read_manifest(storage, root)
    out_dtype = parse_dtype(dtype)
    pre = norm_prefix(prefix)
    token = f"{manifest.save_id}:{world}:{limit}:{pre}:{out_dtype}"
    plan = plan_shares(_select(manifest, pre, out_dtype, ckpt), world, limit, token)
    ostore, oroot = make_storage(out_dir, storage_options)
    ostore.makedirs(oroot)
    old = _check_target(ostore, oroot, out_dir, plan, overwrite)
    if rank == 0:  # an earlier export's index: the folder loads again only when complete
        _remove(ostore, ostore.join(oroot, INDEX))
    reader = ChunkReader(storage, root, manifest)
    own = [i for i, r in enumerate(plan.owners) if r == rank]
    total = sum(o.nbytes for i in own for o in plan.groups[i])
    progress = Progress(f"export {ckpt} -> {out_dir} (rank {rank} of {world})", total, log)
    budget = max(1, min(int(read_budget), limit))
    for i in own:
        _write_file(ostore, oroot, plan.names[i], list(plan.groups[i]), reader, budget,
                    read_workers, progress, plan.meta())
    if before_index is not None:  # crash tests: this rank's files written
        before_index()
    if rank == 0 and len(plan.names) > 1:
        _await_files(ostore, oroot, plan, out_dir, WAIT_S if wait_s is None else wait_s)
        index = {"metadata": {"total_size": sum(o.nbytes for g in plan.groups for o in g)},
                 "weight_map": {o.name: n for n, g in zip(plan.names, plan.groups) for o in g}}
        ostore.put_atomic(ostore.join(oroot, INDEX), json.dumps(index, indent=2).encode())
    if rank == 0:
        for stale in sorted(old - set(plan.names)):  # an earlier export's shards
            _remove(ostore, ostore.join(oroot, stale))
    log.info("export rank %d of %d: %d file(s), %.1f MiB in %.2f s", rank, world, len(own),
             total / 2**20, time.perf_counter() - t0)
    return plan


def _check_target(storage, root: str, shown: str, plan: SharePlan,
                  overwrite: bool) -> set[str]:
    """Refuse (CheckpointError naming ``shown``) an output folder holding anything but
    this export's files (its names, the index, temporary files) unless ``overwrite``;
    return the names of an earlier export's shard files there. I/O: a listing."""
    names = {e.name for e in storage.listdir(root)}
    own = set(plan.names) | {INDEX}
    other = sorted(n for n in names if n not in own and not _TEMP.match(n))
    if other and not overwrite:
        raise CheckpointError(
            f"export target {shown} is not empty (it holds {', '.join(other[:5])}); pass "
            "overwrite=True (--overwrite) to replace the weights there (other files are "
            "kept)")
    return {n for n in names if _weight_file(n) and n not in (INDEX, SINGLE)}


def _await_files(storage, root: str, plan: SharePlan, shown: str, wait_s: float) -> None:
    """Rank 0: wait until every file of ``plan`` is at its name with its size and this
    export's token in its header (a file appears there only whole; an earlier export's
    file of the same name and size is not this one's). Polls; I/O: a listing per poll
    and a header read per file once its size matches. Raises CheckpointError naming
    the missing files and their ranks after ``wait_s`` seconds."""
    want = dict(zip(plan.names, plan.sizes()))
    ours: set[str] = set()
    deadline = time.monotonic() + wait_s
    delay = 0.05
    while True:
        have = {e.name: e.size for e in storage.listdir(root)}
        for n, s in want.items():
            if n not in ours and have.get(n) == s and \
                    _token(storage, storage.join(root, n)) == plan.token:
                ours.add(n)
        missing = [n for n in want if n not in ours]
        if not missing:
            return
        if time.monotonic() >= deadline:
            who = sorted({plan.owners[plan.names.index(n)] for n in missing})
            raise CheckpointError(
                f"export to {shown}: {len(missing)} file(s) of ranks {who[:8]} not in place "
                f"after {wait_s:.0f} s ({missing[0]}...): a rank died or is still writing; "
                "the folder has no index (it does not load); rerun the export")
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


def _token(storage, path: str) -> str | None:
    """The ``dckpt.export`` token an output file's header records (None: unreadable,
    absent, or being replaced). I/O: two small reads, bounded by the header cap."""
    try:
        hlen = int.from_bytes(storage.read(path, 0, 8), "little")
        if not 0 < hlen <= MAX_HEADER:
            return None
        meta = load_json(storage.read(path, 8, hlen)).get("__metadata__") or {}
        tok = meta.get("dckpt.export") if isinstance(meta, dict) else None
        return tok if isinstance(tok, str) else None
    except (OSError, ValueError):
        return None


def clear_temps(out_dir: str, storage_options: dict | None = None) -> None:
    """Remove temporary files a killed export left in ``out_dir``. I/O: a listing."""
    storage, root = make_storage(out_dir, storage_options)
    try:
        names = [e.name for e in storage.listdir(root)]
    except FileNotFoundError:
        return
    for n in names:
        if _TEMP.match(n):
            _remove(storage, storage.join(root, n))
