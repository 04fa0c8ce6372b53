"""The save protocol: plan -> write -> vote -> manifest -> everyone returns or raises.

Call order (all collective over the group; rank 0 coordinates):
  1. every rank flattens its state and sends its local plan to rank 0 (gather);
  2. rank 0 checks the path, validates the plans, assigns writers and broadcasts the
     save id and each rank's write mask, or the error (no file written yet);
  3. every rank writes and fsyncs one new shard file (unique name per save) and sends
     its size and header checksum, or its error (gather);
  4. rank 0 checks that every file is still there with its size, writes manifest.json
     atomically (an exclusive create unless ``overwrite``) only if every rank succeeded,
     removes the files of the checkpoint it replaced, and broadcasts the outcome; every
     rank returns the same CheckpointInfo or raises the same error.

Rank 0 holds a lease on the save (an intent file, see :mod:`dckpt.protocol.intent`) from
before any data file exists until after the commit, so gc never removes a save in
progress.
"""
from __future__ import annotations

import json
import logging
import re
import struct
import time
import uuid
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _faults
from ..errors import AlreadyExistsError, CheckpointError, IntegrityError
from ..format import manifest as mf
from ..format import codec, shards
from ..layout import delta, localplan, plan as gplan
from ..reader import ChunkReader, file_path
from ..engine import encode
from ..engine.encode import Encoding
from ..progress import CountingWriter, Progress
from ..state.flatten import flatten
from ..state.tensors import as_bytes, describe
from ..storage.fsspec_storage import make_storage
from .collectives import Comm, error_payload, raise_gathered
from . import plancache
from .intent import Intent

log = logging.getLogger(__name__)
DATA_FILE = re.compile(r"^data-([0-9a-f]{16})-(\d{5,})\.safetensors$")
TEMP_MANIFEST = re.compile(r"^\.manifest\.json\.tmp-[0-9a-f]+$")
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a committed save produced (identical on every rank)."""

    path: str
    bytes_written: int
    num_files: int
    seconds: float
    world_size: int
    save_id: str
    plan_cached: bool = False  # the coordinator reused the previous save's plan


def _pack(doc: dict, tail: bytes = b"") -> bytes:
    head = json.dumps(doc).encode()
    return _U64.pack(len(head)) + head + tail


def _unpack(data: bytes) -> tuple[dict, bytes]:
    (n,) = _U64.unpack_from(data, 0)
    return json.loads(data[8:8 + n]), data[8 + n:]


def _raise_if_error(doc: dict, what: str) -> None:
    if doc.get("errors"):
        raise_gathered({int(r): e for r, e in doc["errors"].items()}, what)


def save(state_dict: Any, path: str, *, process_group: Any = None,
         storage_options: dict | None = None, overwrite: bool = False,
         base: str | None = None, compression: str | None = None) -> CheckpointInfo:
    """Save ``state_dict`` to ``path`` atomically. Collective: call on every rank.

    ``base``: a committed checkpoint in the same parent directory (or prefix): the save
    is incremental, writing only the blocks (1 MiB of a chunk's bytes) whose content
    hash differs from the base's chunk at the same key and box, and referencing the
    base's bytes for the rest; a block that changed sparsely is stored as a delta
    against the base's when that is at most half its size.
    ``compression``: None, "zstd" or "lz4" (``pip install dckpt[compress]``):
    lossless, per block, bytes grouped by significance for floating-point dtypes; a
    block that does not shrink is stored raw. ``bytes_written`` counts only the bytes
    this save wrote. See docs/INCREMENTAL.md.

    Cost: each rank writes only its own shards (plus its share of replicated tensors),
    once, with fsync; four small collectives. Raises on every rank alike:
    UnsupportedValueError (a leaf dckpt cannot store; nothing written),
    StateMismatchError (ranks disagree about a tensor), AlreadyExistsError (a
    checkpoint is there and ``overwrite`` is False, or another save committed there
    first), IntegrityError (a data file vanished before the commit), RankFailure (I/O
    error on a rank), CommunicationError (a rank died or the group broke). On any error
    no manifest is written: the path keeps what it had before.

    Concurrency: with ``overwrite=False`` the commit is an exclusive create, so of two
    saves racing to one path at most one succeeds. With ``overwrite=True`` the last
    commit wins and each commit removes only the files of the checkpoint it replaced."""
    t0 = time.perf_counter()
    comm = Comm(process_group)
    storage, root = None, path

    # 1. local plan (its errors travel to every rank through the coordinator)
    flag = [codec.RAW]
    storage, root, pieces, blob, lp = local_plan(
        state_dict, path, storage_options, comm.rank,
        check=lambda: flag.__setitem__(0, codec.compression_flag(compression)))
    rcache, ccache = plancache.caches(id(comm.own or comm.group), comm.own or comm.group)
    offer, full = rcache.offer(blob, lp, comm.rank)
    blobs = comm.gather_bytes(offer)

    coord = _Coordinator(storage, root, overwrite, comm.size, ccache) if comm.rank == 0 else None
    try:
        # 2. coordinator: validate and assign writers (or reuse the last plan), and read
        # the base's manifest
        reply = coord.plan(blobs, base, storage_options) if coord else None
        doc, tail = _unpack(comm.broadcast_bytes(reply))
        for _ in range(2):  # at most: values asked for, then full plans
            if doc.get("resend") == "values":  # rank-local values changed: send them
                mine = json.dumps(lp.values, allow_nan=True).encode() \
                    if comm.rank in doc["ranks"] else b""
                blobs = comm.gather_bytes(mine)
            elif doc.get("resend"):  # some plan changed (or no cache): full plans
                blobs = comm.gather_bytes(full)
            else:
                break
            reply = coord.plan(blobs, base, storage_options) if coord else None
            doc, tail = _unpack(comm.broadcast_bytes(reply))
        _raise_if_error(doc, f"save to {path}")
        save_id = doc["save_id"]
        nbase = doc.get("base_len", 0)
        if doc.get("cached"):
            mask = rcache.mask
        else:
            mask = gplan.decode_writes(tail[nbase:], comm.rank)
            rcache.structure, rcache.mask = plancache.decode_offer(full).structure, mask
            rcache.plan_id = bytes.fromhex(doc.get("plan_id", ""))

        # 3. write this rank's shard file
        vote: dict[str, Any]
        try:  # the base's parse too: any error here must reach the vote, not hang it
            enc = _encoding(flag[0], base, storage_options, tail[:nbase]) if nbase else \
                Encoding(flag[0])
            vote = write_file(storage, root, data_name(save_id, comm.rank), comm.rank,
                              [p for p, w in zip(pieces, mask) if w], enc)
            _faults.fault("vote", comm.rank)
        except Exception as e:
            vote = {"error": error_payload(e)}
            log.debug("rank %d: write failed", comm.rank, exc_info=True)
        votes = comm.gather_bytes(json.dumps(vote).encode())

        # 4. commit
        outcome = coord.commit([json.loads(v) for v in votes], t0) if coord else None
        result, _ = _unpack(comm.broadcast_bytes(outcome))
    finally:
        if coord is not None:
            coord.finish()  # a collective that broke mid-way: roll back, end the lease
    _raise_if_error(result, f"save to {path}")
    # The path as the user gave it: a URL keeps its scheme (memory://b/x, s3://...).
    shown = path.rstrip("/") if "://" in path else root
    info = CheckpointInfo(path=shown, seconds=result["seconds"], world_size=comm.size,
                          save_id=save_id, bytes_written=result["bytes"], num_files=result["files"],
                          plan_cached=bool(doc.get("cached")))
    if comm.rank == 0:
        log.info("saved %s: %.1f MiB in %d files from %d ranks in %.2f s", shown,
                 info.bytes_written / 2**20, info.num_files, comm.size, info.seconds)
    return info


def _encoding(flag: int, base: str, storage_options: dict | None, data: bytes) -> Encoding:
    """The Encoding of a save with a base whose manifest bytes rank 0 sent. Parsing is
    deterministic, so a bad manifest fails alike on every rank (before any write)."""
    bstorage, broot = make_storage(base, storage_options)
    m = mf.parse(data, bstorage.join(broot, mf.MANIFEST_NAME))
    return Encoding(flag, m, ChunkReader(bstorage, broot, m))


def check_base(storage, root: str, base: str, storage_options: dict | None) -> tuple[Any, str]:
    """(storage, root) of ``base``, which must be another checkpoint directory in the
    same parent as ``root`` on the same storage: a manifest may only reference its
    siblings. No I/O. Raises CheckpointError naming both."""
    bstorage, broot = make_storage(base, storage_options)
    parent, _, name = root.rstrip("/").rpartition("/")
    bparent, _, bname = broot.rstrip("/").rpartition("/")
    if type(bstorage) is not type(storage) or bparent != parent or not bname or bname == name:
        raise CheckpointError(
            f"base {base!r} must be another checkpoint in the same parent directory as "
            f"{root!r} (an incremental checkpoint only references its siblings, as "
            "CheckpointManager lays them out)")
    return bstorage, broot


def local_plan(state_dict: Any, path: str, storage_options: dict | None,
               rank: int, check=None) -> tuple[Any, str, list, bytes, localplan.LocalPlan]:
    """This rank's side of step 1: (storage, root, pieces, encoded plan, plan). Never raises:
    everything up to the first collective (the storage set-up and the plan's encoding
    too) runs inside this try, and an error is encoded in the plan, so it reaches every
    rank through the coordinator instead of leaving the others waiting in the gather.
    No I/O, no collective."""
    storage, root, pieces = None, path, []
    local = localplan.LocalPlan()
    try:
        storage, root = make_storage(path, storage_options)
        if check is not None:
            check()
        flat = flatten(state_dict)
        pieces = [describe(k, t) for k, t in flat.tensors.items()]
        boxes = np.fromiter((x for p in pieces for x in (*p.box.offsets, *p.box.sizes)),
                            np.int64)
        local = localplan.LocalPlan([(p.key, p.dtype, p.shape) for p in pieces], boxes,
                                    flat.values, int_keys=flat.int_keys)
        _faults.fault("plan", rank)
        blob = localplan.encode(local)
    except Exception as e:
        local = localplan.LocalPlan(error=error_payload(e))
        blob = localplan.encode(local)
        log.debug("rank %d: local plan failed", rank, exc_info=True)
    return storage, root, pieces, blob, local


def validate_plans(blobs: list[bytes], where: str,
                   decoded: list | None = None) -> tuple[gplan.GlobalPlan | None, dict]:
    """Rank 0: decode and validate every rank's plan. Returns (plan, {}) or (None,
    {rank: error payload}) for the ranks whose planning failed. Raises
    StateMismatchError (ranks disagree). Pure CPU, no I/O."""
    cache: dict = {}  # byte-identical key tables are decoded once
    plans = [localplan.decode(b, cache) for b in blobs]
    if decoded is not None:
        decoded[:] = plans
    errors = {r: p.error for r, p in enumerate(plans) if p.error}
    if errors:
        return None, errors
    gp = gplan.plan_global(plans)
    if gp.conflicts:
        k, r = next(iter(gp.conflicts.items()))
        log.warning(
            "save to %s: %d value(s) differ between ranks, e.g. %r on rank %d; the "
            "lowest rank's value is saved. Give rank-local values a key per rank.",
            where, len(gp.conflicts), k, r)
    return gp, {}


def data_name(save_id: str, rank: int) -> str:
    """The name of ``rank``'s shard file of save ``save_id``."""
    return f"data-{save_id}-{rank:05d}.safetensors"


class _Coordinator:
    """Rank 0's side of one save: validates plans, then commits or rolls back."""

    def __init__(self, storage, root: str, overwrite: bool, world: int,
                 cache: plancache.CoordCache | None = None) -> None:
        self.storage, self.root, self.overwrite, self.world = storage, root, overwrite, world
        self.cache = cache
        self.awaiting: str | None = None  # the second message plan() expects
        self.save_id = ""
        self.gp: gplan.GlobalPlan | None = None
        self.intent: Intent | None = None
        self.committed = False
        self.base: mf.Manifest | None = None
        self.base_dir = ""

    def plan(self, blobs: list[bytes], base: str | None = None,
             storage_options: dict | None = None) -> bytes:
        """Decode and validate every rank's plan, or reuse the cached plan when every
        rank offered an unchanged one (else reply "resend"); read the base's manifest;
        take the save's lease (intent file); reply with the save id, the base's
        manifest bytes and the write masks (none when cached: ranks keep theirs)."""
        try:
            cached, awaiting, self.awaiting = False, self.awaiting, None
            if self.cache is None:
                self.gp, errors = validate_plans(blobs, self.root)
            elif awaiting == "values":
                self.gp = self.cache.with_values(blobs)
                if self.gp is None:
                    self.awaiting = "full"
                    return _pack({"resend": "full"})
                cached, errors = True, {}
            else:
                offers = [plancache.decode_offer(b) for b in blobs]
                if any(o.cached for o in offers):
                    kind, got = self.cache.reuse(offers)
                    if kind != "plan":
                        self.awaiting = kind
                        return _pack({"resend": kind, "ranks": got or []})
                    self.gp, cached, errors = got, True, {}
                else:
                    self._plans: list = []
                    self.gp, errors = validate_plans([o.blob for o in offers], self.root,
                                                     self._plans)
            if errors:
                return _pack({"errors": errors})
            st = self.storage
            if not self.overwrite and st.exists(st.join(self.root, mf.MANIFEST_NAME)):
                raise self._exists()  # early and cheap; the commit itself is exclusive
            base_bytes = b""
            if base is not None:
                from .restore import read_manifest_bytes

                bstorage, broot = check_base(st, self.root, base, storage_options)
                base_bytes = read_manifest_bytes(bstorage, broot)
                self.base = mf.parse(base_bytes, bstorage.join(broot, mf.MANIFEST_NAME))
                self.base_dir = broot.rstrip("/").rpartition("/")[2]
            self.begin(uuid.uuid4().hex[:16])
            if cached:
                return _pack({"save_id": self.save_id, "base_len": len(base_bytes),
                              "cached": True}, base_bytes)
            doc = {"save_id": self.save_id, "base_len": len(base_bytes)}
            if self.cache is not None:  # every rank accepts this plan with this reply
                doc["plan_id"] = self.cache.store(offers, self._plans, self.gp).hex()
            return _pack(doc, base_bytes + gplan.encode_writes(self.gp))
        except Exception as e:
            return _pack({"errors": {0: error_payload(e)}})

    def begin(self, save_id: str) -> None:
        """Create the directory and take the save's lease (an intent file), before any
        rank writes a data file: gc leaves a save with a live intent alone. I/O."""
        self.storage.makedirs(self.root)
        self.save_id = save_id
        self.intent = Intent(self.storage, self.root, save_id).start()

    def _exists(self) -> AlreadyExistsError:
        return AlreadyExistsError(
            f"{self.root} already holds a committed checkpoint; pass overwrite=True "
            "to replace it (the old one stays intact until the new one commits)")

    def commit(self, votes: list[dict], t0: float) -> bytes:
        """Write the manifest if every rank wrote its file and every file is still
        there; else remove this save's files. After a commit, remove the files of the
        checkpoint it replaced, and nothing else."""
        errors = {r: v["error"] for r, v in enumerate(votes) if v.get("error")}
        if errors:
            return _pack({"errors": errors})
        try:
            meta = {"dckpt_version": _version(), "save_seconds": round(time.perf_counter() - t0, 3)}
            reports = {r: [delta.ChunkReport.from_json(x) for x in v["chunks"]]
                       for r, v in enumerate(votes) if "chunks" in v}
            if self.base is not None:
                meta["base"] = self.base_dir
            m = gplan.to_manifest(self.gp, vote_files(votes), self.save_id, self.world, meta,
                                  missing_ok=bool(reports))
            if reports:
                m = delta.attach(m, reports, self.base, self.base_dir)
        except Exception as e:
            return _pack({"errors": {0: error_payload(e)}})
        return self.commit_manifest(m, t0)

    def commit_manifest(self, m: mf.Manifest, t0: float) -> bytes:
        """Check that every file ``m`` names is there, put ``m`` (THE commit point), then
        remove the files of the checkpoint it replaced. Returns the packed outcome."""
        st, root = self.storage, self.root
        try:
            data = mf.to_json(m)
            _faults.fault("commit", 0)
            _check_files(st, root, list(m.files))
            replaced = _current_files(st, root) if self.overwrite else set()
            if replaced:  # an incremental sibling may still reference them
                replaced -= referenced_by_siblings(st, root)
            try:
                st.put_atomic(st.join(root, mf.MANIFEST_NAME), data,  # THE commit point
                              exclusive=not self.overwrite)
            except FileExistsError:
                raise self._exists() from None
            self.committed = True
            _faults.fault("committed", 0)
            keep = {f.name for f in m.files}
            _remove_files(st, root, lambda n: n in replaced and n not in keep)
            return _pack({"bytes": m.total_bytes, "files": len(m.files),
                          "seconds": time.perf_counter() - t0})
        except Exception as e:
            if not self.committed and self._manifest_is_ours():
                self.committed = True  # e.g. the directory fsync failed after the rename
            return _pack({"errors": {0: error_payload(e)}})

    def finish(self) -> None:
        """Always called on rank 0 at the end of a save, however it ended: removes this
        save's files unless it committed, then ends its lease. Never raises."""
        if self.intent is None:
            return
        try:
            if not self.committed:
                _remove_files(self.storage, self.root,
                              lambda n: n.startswith(f"data-{self.save_id}-"))
        finally:
            self.intent.end()
            self.intent = None

    def _manifest_is_ours(self) -> bool:
        """After a failed commit: did the manifest land anyway (e.g. the directory fsync
        failed after the rename)? Then this save's files must stay."""
        from .restore import read_manifest_bytes

        try:
            data = read_manifest_bytes(self.storage, self.root)  # bounded, regular file only
        except (OSError, CheckpointError):
            return False
        return f'"save_id":"{self.save_id}"'.encode() in data


def vote_files(votes: list[dict]) -> list[mf.FileEntry]:
    """The files the ranks' votes report, in rank order."""
    return [mf.FileEntry(v["file"], v["size"], v["hlen"], v["crc"], r)
            for r, v in enumerate(votes) if v.get("file")]


def _check_files(storage, root: str, files: list) -> None:
    """Every file the manifest will name is there with the size its rank reported (one
    listing). Raises IntegrityError naming the file and rank: something removed or
    rewrote it after it was written (a concurrent gc or save)."""
    listings: dict[str, dict[str, int]] = {}
    for f in files:
        d = file_path(storage, root, f).rpartition("/")[0] if f.dir else root
        if d not in listings:
            try:
                listings[d] = {e.name: e.size for e in storage.listdir(d)}
            except FileNotFoundError:
                listings[d] = {}
        sizes = listings[d]
        if sizes.get(f.name) != f.size:
            whose = f"referenced in {f.dir}" if f.dir else f"rank {f.rank}"
            what = "is missing" if f.name not in sizes else (
                f"holds {sizes[f.name]} bytes, not the {f.size} expected")
            raise IntegrityError(
                f"{file_path(storage, root, f)} ({whose}) {what} at commit time: "
                "another process removed or rewrote it (a concurrent dckpt gc or save?); "
                "nothing was committed")


def _current_files(storage, root: str) -> set[str]:
    """Data files of the checkpoint committed at ``root`` now (empty when there is none
    or its manifest cannot be read: then its files are left for ``dckpt gc``)."""
    from .restore import read_manifest

    try:
        m, _ = read_manifest(storage, root)
    except Exception as e:
        if storage.exists(storage.join(root, mf.MANIFEST_NAME)):
            log.warning("replacing %s, whose manifest cannot be read (%s): its data files "
                        "are left for dckpt gc", root, e)
        return set()
    return {f.name for f in m.files}


def write_file(storage, root: str, name: str, rank: int, pieces: list,
               enc: Encoding | None = None) -> dict:
    """Write ``pieces`` as the shard file ``root/name`` and fsync it. Returns this rank's
    vote ({"file", "size", "hlen", "crc"}, or {"file": None} when there is nothing to
    write). With ``enc``, every piece is hashed in blocks and written plain, encoded or
    not at all (see dckpt.engine.encode), and the vote's "chunks" report each. Blocking
    I/O (with a base, reads of the base's blocks for deltas); raises OSError; a partial
    file is removed."""
    reports = None
    buffers = [as_bytes(p.local) for p in pieces]
    if enc is not None and pieces:
        with ThreadPoolExecutor(2, thread_name_prefix="dckpt-encode") as pool:
            plans = encode.plan_pieces(pieces, buffers, enc, pool)
            keep = [i for i, pl in enumerate(plans) if pl.write]
            entries = [(pieces[i].key, "U8", (plans[i].max_bytes,), plans[i].max_bytes)
                       if plans[i].produce else
                       (pieces[i].key, pieces[i].dtype, pieces[i].box.sizes, len(buffers[i]))
                       for i in keep]
            vote = _write_entries(storage, root, name, rank, entries,
                                  [plans[i].produce or buffers[i] for i in keep])
            # after the writes: the producers fill the block tables
            reports = [pl.report.to_json() for pl in plans]
    else:
        entries = [(p.key, p.dtype, p.box.sizes, len(b)) for p, b in zip(pieces, buffers)]
        vote = _write_entries(storage, root, name, rank, entries, buffers)
    if reports is not None:
        vote["chunks"] = reports
    return vote


def _write_entries(storage, root: str, name: str, rank: int, entries: list,
                   buffers: list) -> dict:
    if not entries:
        return {"file": None}
    order = shards.order_entries(entries)
    # The header (names, shapes, checksums) is a small fraction: 1 MiB of slack covers
    # it for any plausible state and keeps the hint an upper bound.
    hint = sum(e[3] for e in entries) + 64 * len(buffers) + (1 << 20)
    writer = storage.open_write(storage.join(root, name), size_hint=hint)
    try:
        progress = Progress(f"save {root} (rank {rank})", sum(e[3] for e in entries), log)
        writer = CountingWriter(_faults.wrap_writer(writer, rank), progress)
        size, hlen, crc = shards.write_shard(writer, [entries[i] for i in order],
                                             [buffers[i] for i in order], storage.random_write)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"file": name, "size": size, "hlen": hlen, "crc": crc}


def _remove_files(storage, root: str, select) -> int:
    """Remove dckpt data files and temp manifests in ``root`` for which ``select(name)``.
    Failures are logged, never raised: leftovers only cost space (``dckpt gc``)."""
    removed = 0
    try:
        entries = storage.listdir(root)
    except OSError as e:
        log.warning("could not list %s to clean leftovers: %s", root, e)
        return 0
    for e in entries:
        if (DATA_FILE.match(e.name) or TEMP_MANIFEST.match(e.name)) and select(e.name):
            try:
                storage.remove(storage.join(root, e.name))
                removed += 1
            except OSError as err:
                log.warning("could not remove leftover %s: %s", e.name, err)
    return removed


def _version() -> str:
    from .. import __version__
    return __version__


def referenced_by_siblings(storage, root: str) -> set[str]:
    """Names of ``root``'s files that a committed checkpoint in a sibling directory
    references (incremental saves). One listing of the parent and one manifest read per
    sibling. A sibling whose manifest cannot be read may reference anything: then every
    file is reported referenced (kept for ``dckpt gc`` to decide later)."""
    from ..catalog import ALL_FILES, references  # catalog builds on this module

    parent, _, name = root.rstrip("/").rpartition("/")
    try:
        siblings = [storage.join(parent, e.name) for e in storage.listdir(parent)
                    if e.is_dir and not e.is_link and e.name != name] if parent else []
        refs = references(storage, siblings).get(name, set())
        return {e.name for e in storage.listdir(root)} if ALL_FILES in refs else refs
    except OSError as e:
        log.warning("cannot look for references into %s (%s): keeping its files", root, e)
        return {e2.name for e2 in storage.listdir(root)}
