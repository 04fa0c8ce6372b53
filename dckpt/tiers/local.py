"""The fast tier: a checkpoint committed under each node's own ``local_root``.

A local save runs the same plan -> write -> vote -> manifest protocol as
:func:`dckpt.save`, with two differences that make every rank able to restore from its
own node, without reading or listing another node's files:

* every rank writes everything it holds. The chunks the global plan gives it go to its
  ``data-<id>-<rank>.safetensors`` file (exactly the file a durable save would write);
  the replicated chunks the plan gives to another rank go to its
  ``replica-<id>-<rank>.safetensors`` file, which never leaves the node;
* there is no shared ``manifest.json``: rank 0 builds the global manifest (the one the
  stager later commits in the durable tier) and sends it to every rank; each rank then
  writes its own view of it, ``manifest-<rank>.json``, in which the chunks it holds
  point at its own files. The ranks agree that every view was written: a local
  checkpoint exists for step N when every rank holds a view of the same save id (see
  :mod:`dckpt.tiers.chooser`); a crash half-way leaves views of different save ids or
  missing ones, and the step is not used.

Ranks of one node may share one ``local_root``: every name carries its rank.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .. import _faults
from ..errors import CheckpointError, ManifestError
from ..format import manifest as mf
from ..engine import devstream
from ..format import shards
from ..format.runs import Runs
from ..layout import plan as gplan
from ..protocol.collectives import Comm, agree, error_payload, raise_gathered, rank0_bytes
from ..protocol.commit import local_plan, write_file
from ..protocol.coordinator import _pack, _unpack, dckpt_version, validate_plans, vote_files
from ..format.filenames import data_name
from ..protocol.restore import MAX_MANIFEST
from ..catalog.verify import check_tensor
from .chooser import Held, timeline_of
from .localnames import STEP_DIR, step_name, view_name  # noqa: F401 (re-exported)

log = logging.getLogger(__name__)
_OWN_FILE = re.compile(r"^(?:data|replica)-[0-9a-f]{16}-(\d{5,})\.safetensors$|^manifest-(\d{5,})\.json$")


def replica_name(save_id: str, rank: int) -> str:
    return f"replica-{save_id}-{rank:05d}.safetensors"


@dataclass(frozen=True)
class LocalCommit:
    """A committed local save, as each rank sees it."""

    step: int
    step_dir: str
    save_id: str
    manifest: bytes  # the global manifest: what the durable tier commits
    files: tuple[str, ...]  # this rank's data files (what it uploads when staging)
    bytes_written: int  # this rank's bytes, replicas included
    seconds: float
    total_bytes: int = 0  # the global manifest's, every rank (what a durable copy writes)


def save_local(state_dict: Any, step: int, step_dir: str, storage, comm: Comm,
               written: Callable[[], None] | None = None,
               after: dict | None = None, owner: str | None = None) -> LocalCommit:
    """Save ``state_dict`` under ``step_dir`` on every rank's own node. Collective over
    ``comm``: four small collectives plus the manifest's broadcast. Blocking I/O of this
    rank's bytes (its share and its replicas), into its own directory only.

    Raises on every rank alike what :func:`dckpt.save` raises for a bad state, a failed
    write or a dead rank. On failure every rank removes the files of this save it wrote;
    a local checkpoint of another step (or an earlier one of this step) is untouched
    until this save's views are all written.

    ``written()``, if given, is called once this rank's tensors are no longer read: its
    data and replica files are written (or their writing failed, or the save failed
    before). A save written from live tensors (a fenced snapshot) lets training change
    them from then on. CUDA tensors are written through a bounded pinned bounce
    buffer, after ``after`` ({device: CUDA event recorded at the call}), never copied
    to the host whole (see :mod:`dckpt.engine.devstream`).

    ``owner``: the identity of the durable root this step belongs to (see
    :func:`own_steps`), recorded in every view."""
    try:
        return _save_local(state_dict, step, step_dir, storage, comm, written, after, owner)
    finally:
        if written is not None:
            written()  # idempotent for the callers (an Event's set)


def _save_local(state_dict: Any, step: int, step_dir: str, storage, comm: Comm,
                written: Callable[[], None] | None, after: dict | None,
                owner: str | None) -> LocalCommit:
    t0 = time.perf_counter()
    r = comm.rank
    _, _, pieces, blob, _ = local_plan(state_dict, step_dir, None, r)
    blobs = comm.gather_bytes(blob)
    gp = None
    reply = None
    if r == 0:
        try:
            gp, errors = validate_plans(blobs, step_dir)
            reply = (_pack({"errors": errors}) if errors else
                     _pack({"save_id": uuid.uuid4().hex[:16]}, gplan.encode_writes(gp)))
        except Exception as e:
            reply = _pack({"errors": {0: error_payload(e)}})
    doc, tail = _unpack(comm.broadcast_bytes(reply))
    if doc.get("errors"):
        raise_gathered({int(k): v for k, v in doc["errors"].items()}, f"local save to {step_dir}")
    save_id = doc["save_id"]
    mask = gplan.decode_writes(tail, r)
    mine = [p for p, w in zip(pieces, mask) if w]
    replicas = [p for p, w in zip(pieces, mask) if not w and all(s > 0 for s in p.box.sizes)]

    ok = False
    try:
        vote: dict[str, Any]
        try:
            storage.makedirs(step_dir)
            vote = write_file(storage, step_dir, data_name(save_id, r), r, mine, after=after)
            vote["replica"] = write_file(storage, step_dir, replica_name(save_id, r), r,
                                         replicas, after=after)
            if written is not None:
                written()
                # a streamed (GPU) tensor was checked on its device (its fingerprint
                # before and after the copy): its checksums came from the bytes written
                recheck(storage, step_dir, vote, r,
                        {p.key for p in mine + replicas if devstream.streams(p.local)})
            _faults.fault("vote", r)
        except Exception as e:
            vote = {"error": error_payload(e)}
        votes = comm.gather_bytes(json.dumps(vote).encode())

        def global_manifest() -> bytes:  # rank 0
            vs = [json.loads(v) for v in votes]
            errors = {i: v["error"] for i, v in enumerate(vs) if v.get("error")}
            if errors:
                raise_gathered(errors, f"local save to {step_dir}")
            m = gplan.to_manifest(gp, vote_files(vs), save_id, comm.size,
                                  {"dckpt_version": dckpt_version(), "step": step})
            return mf.to_json(m)

        data = rank0_bytes(comm, global_manifest, f"local save to {step_dir}")
        err = None
        try:
            m = mf.parse(data, f"{step_dir} (global manifest)")
            view = local_view(m, r, vote.get("replica") or {}, replicas, owner)
            storage.put_atomic(storage.join(step_dir, view_name(r)), mf.to_json(view))
            _faults.fault("committed", r)
        except Exception as e:
            err = e
        agree(comm, err, f"local save to {step_dir}")
        ok = True
    finally:
        drop_save(storage, step_dir, r, save_id, failed=not ok)
    nbytes = int(vote.get("size") or 0) + int((vote.get("replica") or {}).get("size") or 0)
    files = (vote["file"],) if vote.get("file") else ()
    return LocalCommit(step, step_dir, save_id, data, files, nbytes, time.perf_counter() - t0,
                       m.total_bytes)


_RECHECK = 4 << 20  # bytes per read: a multiple of any checksum block, little memory


def recheck(storage, step_dir: str, vote: dict, rank: int, skip: set = frozenset()) -> None:
    """After a save written straight from live tensors (no snapshot): read this rank's
    files back and check every block against the checksums computed while writing.
    Those were computed from a second read of the same tensors, so a tensor changed
    during the write (by something the fence does not cover) shows as a mismatch, and
    the save fails on every rank instead of committing a checkpoint that cannot load.
    Blocking I/O of this rank's bytes (out of the page cache or tmpfs: about a memcpy
    and a CRC pass), in the background after training was released; memory 4 MiB.
    ``skip``: names not to read (tensors whose checksums came from the bytes written).
    Raises CheckpointError naming the tensor."""
    for v in (vote, vote.get("replica") or {}):
        if not v.get("file"):
            continue
        path = storage.join(step_dir, v["file"])
        tensors, block = shards.parse_header(storage.read(path, 0, 8 + v["hlen"]), path, v["size"])
        for st in tensors.values():
            if st.name in skip:
                continue
            try:
                check_tensor(storage, path, st, block, _RECHECK)
            except CheckpointError as e:
                raise CheckpointError(
                    f"rank {rank}: tensor {st.name!r} changed while the fast tier was "
                    "written from it (no snapshot copy is made for a fenced save): "
                    "something modified it before the fenced optimizer step or module "
                    "forward; fence that too (save(..., fence=)) or call "
                    f"wait_snapshot() before changing it. The save is not committed "
                    f"({e})") from None


def local_view(m: mf.Manifest, rank: int, replica_vote: dict, replicas: list,
               owner: str | None = None) -> mf.Manifest:
    """``m`` with the chunks ``rank`` holds as replicas pointing at its replica file
    (an extra file entry), and ``owner`` (the durable root's identity) in its meta.
    Pure. Raises ManifestError if a replica's box is not a chunk of ``m`` (the plan
    and the manifest disagree: a bug, never silently)."""
    meta = {**m.meta, "view_of_rank": rank}
    if owner is not None:
        meta["owner"] = owner
    if not replica_vote.get("file"):
        return dataclasses.replace(m, meta=meta)
    fidx = len(m.files)
    files = (*m.files, mf.FileEntry(replica_vote["file"], replica_vote["size"],
                                    replica_vote["hlen"], replica_vote["crc"], rank))
    tensors = dict(m.tensors)
    for p in replicas:
        e = tensors[p.key]
        c = e.chunks
        # by rule for a grid (issue 47): no rank expands every rank's chunks
        hit = c.find(p.box.offsets, p.box.sizes)
        if len(hit) != 1:
            raise ManifestError(f"rank {rank}: replica of {p.key!r} at {list(p.box.offsets)} "
                                "is not a chunk of the global manifest")
        ids = c.file_ids
        if isinstance(ids, Runs):  # one entry differs: split its run, expand nothing
            file = ids.replaced(int(hit[0]), fidx)
        else:
            file = np.array(ids, np.int64)
            file[hit[0]] = fidx
        tensors[p.key] = dataclasses.replace(e, chunks=dataclasses.replace(c, file_ids=file))
    return dataclasses.replace(m, files=files, tensors=tensors, meta=meta)


def own_steps(storage, local_root: str, rank: int, world: int,
              owner: str | None = None) -> dict[int, Held]:
    """This rank's usable local steps: {step: (save id, commit time)} for every step
    directory holding its view, made by a save of ``world`` ranks for the durable root
    ``owner`` identifies, with its own files present at their recorded sizes. Reads
    only this rank's directory (each view is small). A step that fails a check is left
    out with an info log saying why; one of another root (another run that used this
    ``local_root``, or a view that records no root) with a warning: it is never
    restored (nor deleted here: the fast-tier cleanup after this run's next local
    commit removes it, as any step not its own). Never raises."""
    out: dict[int, Held] = {}
    try:
        entries = storage.listdir(local_root)
    except OSError:
        return out
    for e in entries:
        m = STEP_DIR.match(e.name)
        if not (m and e.is_dir):
            continue
        d = storage.join(local_root, e.name)
        try:
            view = mf.parse(storage.read_file(storage.join(d, view_name(rank)), MAX_MANIFEST),
                            storage.join(d, view_name(rank)))
            if view.meta.get("owner") != owner:
                log.warning("rank %d: local checkpoint %s was saved for another durable root "
                            "(%s, not %s): not restored", rank, d, view.meta.get("owner"), owner)
                continue
            if view.world_size != world:
                raise CheckpointError(f"saved by {view.world_size} ranks, not {world}")
            sizes = {x.name: x.size for x in storage.listdir(d)}
            for f in view.files:
                if f.rank == rank and sizes.get(f.name) != f.size:
                    raise CheckpointError(f"{f.name} is missing or has the wrong size")
        except FileNotFoundError:
            continue  # no view of this rank: not a step this rank holds
        except (OSError, CheckpointError) as err:
            log.info("rank %d: local checkpoint %s is not usable: %s", rank, d, err)
            continue
        out[int(m.group(1))] = Held(view.save_id, *timeline_of(view))
    return out


def _own(storage, step_dir: str, rank: int) -> tuple[str | None, list[tuple[str, str]]]:
    """This rank's view (or None) and its data files as (name, save id) in ``step_dir``."""
    view, data = None, []
    for e in storage.listdir(step_dir):
        m = _OWN_FILE.match(e.name)
        if not m or int(m.group(1) or m.group(2)) != rank:
            continue
        if m.group(2) is not None:
            view = e.name
        else:
            data.append((e.name, e.name.split("-")[1]))
    return view, data


def _remove(storage, step_dir: str, names: list[str]) -> None:
    for name in names:
        try:
            storage.remove(storage.join(step_dir, name))
        except OSError as err:
            log.debug("could not remove %s: %s", name, err)
    try:
        if not storage.listdir(step_dir):
            storage.remove_tree(step_dir)
    except OSError:
        pass


# any rank's file, and what a crashed put_atomic leaves of a view (".name.tmp-<hex>")
_RANK_FILE = re.compile(r"^(?:(?:data|replica)-[0-9a-f]{16}-(\d{5,})\.safetensors"
                        r"|\.?manifest-(\d{5,})\.json(?:\.tmp-[0-9a-f]+)?)$")


def drop_step(storage, step_dir: str, rank: int, sharers: set[int] | None = None) -> None:
    """Remove this rank's part of a local step: its view first (so the step stops
    counting as held before any of its data goes), then its files; the directory when
    it is empty. Never raises: a leftover is retried by the next cleanup.

    ``sharers`` (given to the lowest of the ranks that share this ``local_root``): the
    ranks of the job using this directory. The files of every other rank go too, views
    first: ranks that no longer exist (the job shrank) or that wrote here in an earlier
    world (they now run on another node, or under another number), whose files nobody
    else would ever remove. The caller passes only steps beyond retention on every rank
    of the node and never one being written or staged (those belong to live ranks)."""
    try:
        view, data = _own(storage, step_dir, rank)
        stale = [] if sharers is None else _others(storage, step_dir, sharers | {rank})
    except OSError:
        return
    if stale:
        log.info("rank %d: removing the files of rank(s) %s (not in this job's use of "
                 "this local_root) from %s", rank, sorted({r for r, _ in stale}), step_dir)
    names = ([view] if view else []) + [n for _, n in stale if "manifest-" in n]  # views first
    names += [n for n, _ in data] + [n for _, n in stale if "manifest-" not in n]
    _remove(storage, step_dir, names)


def _others(storage, step_dir: str, keep: set[int]) -> list[tuple[int, str]]:
    """(rank, name) of the files in ``step_dir`` of ranks not in ``keep``."""
    out = []
    for e in storage.listdir(step_dir):
        m = _RANK_FILE.match(e.name)
        if m and int(m.group(1) or m.group(2)) not in keep:
            out.append((int(m.group(1) or m.group(2)), e.name))
    return out


def drop_save(storage, step_dir: str, rank: int, save_id: str, *, failed: bool) -> None:
    """After a local save of ``save_id``: if it ``failed``, remove this rank's files of
    it (and its view if the view names it); else remove this rank's files of any other
    save of the step (an earlier save its view replaced). Never raises."""
    try:
        view, data = _own(storage, step_dir, rank)
    except OSError:
        return
    if failed:
        names = [n for n, sid in data if sid == save_id]
        if view and _view_save_id(storage, step_dir, view) == save_id:
            names.insert(0, view)
    else:
        names = [n for n, sid in data if sid != save_id]
    _remove(storage, step_dir, names)


def _view_save_id(storage, step_dir: str, name: str) -> str | None:
    try:
        data = storage.read_file(storage.join(step_dir, name), MAX_MANIFEST)
        return mf.parse(data, name).save_id
    except (OSError, CheckpointError):
        return None

