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
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .. import _faults
from ..errors import CheckpointError
from ..format import manifest as mf
from ..format import codec, shards
from ..layout import localplan, plan as gplan
from ..engine.reader import ChunkReader, stored_names
from ..engine import devstream, encode
from ..engine.encode import Encoding
from ..progress import CountingWriter, Progress
from ..state.flatten import flatten
from ..state.tensors import as_bytes, describe_all
from ..storage.fsspec_storage import make_storage
from .collectives import Comm, error_payload, raise_gathered
from . import plancache, rulesig
from .votes import encode as vote_bytes
from .coordinator import _Coordinator, _unpack
from ..format.filenames import data_name, side_name

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class SideFile:
    """Ask a save to store the tensors whose key starts with ``prefix`` in a file of
    their own per rank (``model-<save_id>-<rank>.safetensors``), each under its key
    without the prefix: with ``prefix="models.0."`` a Hugging Face model's tensors are
    stored under the names ``from_pretrained`` looks up, in files holding nothing else,
    so an index beside them (``model.safetensors.index.json``) makes the checkpoint a
    model folder without writing any byte twice. The files are the save's own: listed
    and checksummed by the manifest, removed with a failed save. Plain saves only (no
    ``compression``, ``base`` or ``block_hashes``); every rank passes the same one."""

    prefix: str

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix or len(self.prefix) > 1024:
            raise CheckpointError(f"SideFile prefix {self.prefix!r:.80}: a non-empty key "
                                  "prefix of at most 1024 characters")


def _raise_if_error(doc: dict, what: str) -> None:
    if doc.get("errors"):
        raise_gathered({int(r): e for r, e in doc["errors"].items()}, what)


def save(state_dict: Any, path: str, *, process_group: Any = None,
         storage_options: dict | None = None, overwrite: bool = False,
         base: str | None = None, compression: str | None = None,
         block_hashes: bool = False, side: SideFile | None = None) -> CheckpointInfo:
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
    ``block_hashes``: record a content hash per 1 MiB block of every chunk in the
    manifest (16 bytes per MiB), so that a later save with this one as its ``base``
    compares hashes instead of reading this save's bytes back. Incremental and
    compressed saves always record them; a plain save does not by default: at scale
    they would make the manifest, and what every rank sends rank 0, grow with the data
    (at 131,072 ranks x 500 tensors, over 1 GiB; issue 38). A base saved without them
    still serves: each rank reads and hashes the base's chunks it compares with.
    ``side``: a :class:`SideFile` (a model folder's files inside the checkpoint).

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

    def check() -> None:
        flag[0] = codec.compression_flag(compression)
        if side is not None and (flag[0] or base is not None or block_hashes):
            raise CheckpointError("side files are plain: a save with side= takes no "
                                  "compression, base or block_hashes")

    storage, root, pieces, blob, lp = local_plan(state_dict, path, storage_options,
                                                 comm.rank, check=check)
    rcache, ccache = plancache.caches(id(comm.own or comm.group), comm.own or comm.group)
    offer, full = rcache.offer(blob, lp, comm.rank,
                               lambda: rulesig.offer(lp.tensors, lp.int_keys, pieces, comm))
    blobs = comm.gather_bytes(offer)

    coord = _Coordinator(storage, root, overwrite, comm.size, ccache) if comm.rank == 0 else None
    if coord is not None and side is not None:
        coord.side_prefix = side.prefix
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
            rcache.accept(mask, bytes.fromhex(doc.get("plan_id", "")))

        # 3. write this rank's shard file
        vote: dict[str, Any]
        try:  # the base's parse too: any error here must reach the vote, not hang it
            bstore = None if base is None else make_storage(base, storage_options)
            _check_base(base, bstore, doc.get("base"))
            enc = _encoding(flag[0], bstore, tail[:nbase]) if nbase else \
                Encoding(flag[0]) if flag[0] or block_hashes else None
            mine = [p for p, w in zip(pieces, mask) if w]
            if side is None:
                vote = write_file(storage, root, data_name(save_id, comm.rank), comm.rank,
                                  mine, enc)
            else:
                vote = _write_with_side(storage, root, save_id, comm.rank, mine, side)
            _faults.fault("vote", comm.rank)
        except Exception as e:
            vote = {"error": error_payload(e)}
            log.debug("rank %d: write failed", comm.rank, exc_info=True)
        # a 20-byte record in the common case (dckpt.protocol.votes), else JSON
        votes = comm.gather_bytes(vote_bytes(vote, save_id, comm.rank))

        # 4. commit (a malformed vote is its rank's error: inside commit, broadcast)
        outcome = coord.commit(votes, t0) if coord else None
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


def _write_with_side(storage, root: str, save_id: str, rank: int, mine: list,
                     side: SideFile) -> dict:
    """Write this rank's data file (``mine`` outside ``side.prefix``) and side file (the
    rest, stored without the prefix); the vote names both ({"side": {"prefix", and the
    file's record when one was written}}). Blocking I/O; raises OSError (a file
    already written is removed by the coordinator's clean-up of a failed save)."""
    n = len(side.prefix)
    into = [len(p.key) > n and p.key.startswith(side.prefix) for p in mine]
    inside = [p for p, x in zip(mine, into) if x]
    vote = write_file(storage, root, data_name(save_id, rank), rank,
                      [p for p, x in zip(mine, into) if not x])
    sv = write_file(storage, root, side_name(save_id, rank), rank, inside,
                    prefix=side.prefix) if inside else {}
    vote["side"] = {"prefix": side.prefix, **({} if sv.get("file") is None else sv)}
    return vote


def _check_base(base: str | None, bstore: tuple | None, used: str | None) -> None:
    """Raise CheckpointError unless this rank's ``base`` (``bstore``: its storage and
    normalised root, from make_storage) is the checkpoint rank 0 read as the base
    (``used``: its normalised root; None: rank 0 passed none). Only rank 0's base is
    read, so another rank's would be silently ignored (the save committed in full) or
    its files read through rank 0's manifest: ranks that disagree on ``base`` fail the
    save alike instead, as for ``compression`` or ``block_hashes``. No I/O."""
    mine = None if bstore is None else bstore[1].rstrip("/")
    if mine != used:
        raise CheckpointError(
            f"base={base!r} on this rank, but rank 0 "
            + (f"saved on the base {used!r}" if used is not None else "passed no base")
            + " (base differs between ranks): pass the same base on every rank")


def _encoding(flag: int, bstore: tuple, data: bytes) -> Encoding:
    """The Encoding of a save with a base (``bstore``: its storage and root) whose
    manifest bytes rank 0 sent. Parsing is deterministic, so a bad manifest fails alike
    on every rank (before any write)."""
    bstorage, broot = bstore
    m = mf.parse(data, bstorage.join(broot, mf.MANIFEST_NAME))
    return Encoding(flag, m, ChunkReader(bstorage, broot, m))


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
        flat = flatten(state_dict, blobs=True)  # large bytes values: data-file entries
        # one piece per box: a strided DTensor's local tensor is several
        pieces = [p for k, t in flat.tensors.items() for p in describe_all(k, t)]
        boxes = np.fromiter((x for p in pieces for x in (*p.box.offsets, *p.box.sizes)),
                            np.int64)
        local = localplan.LocalPlan([(p.key, p.dtype, p.shape) for p in pieces], boxes,
                                    flat.values, int_keys=flat.int_keys,
                                    bytes_keys=flat.bytes_keys, tensors=flat.tensors)
        _faults.fault("plan", rank)
        blob = localplan.encode(local)
    except Exception as e:
        local = localplan.LocalPlan(error=error_payload(e))
        blob = localplan.encode(local)
        log.debug("rank %d: local plan failed", rank, exc_info=True)
    return storage, root, pieces, blob, local


def write_file(storage, root: str, name: str, rank: int, pieces: list,
               enc: Encoding | None = None, after: dict | None = None,
               prefix: str = "") -> dict:
    """Write ``pieces`` as the shard file ``root/name`` and fsync it. Returns this rank's
    vote ({"file", "size", "hlen", "crc"}, or {"file": None} when there is nothing to
    write). With ``enc``, every piece is hashed in blocks and written plain, encoded or
    not at all (see dckpt.engine.encode), and the vote's "chunks" report each. Unless
    ``enc`` compresses or has a base, CUDA tensors are written through a bounded pinned
    bounce buffer, after the events ``after`` ({device: CUDA event}, see
    dckpt.engine.devstream), never copied to the host whole. ``prefix``: every piece's
    key starts with it, and is stored without it (a side file, see :class:`SideFile`;
    plain only). Blocking I/O (with a
    base, reads of the base's blocks for deltas); raises OSError; a partial file is
    removed."""
    reports = None
    plain = enc is None or not enc.active  # nothing to encode: a GPU tensor can stream
    if plain and after is None:  # now, in the caller's thread: one event per GPU
        after = devstream.mark({p.local.device for p in pieces})
    buffers: list = [devstream.DeviceSource(p.local, (after or {}).get(p.local.device), p.key)
                     if plain and devstream.streams(p.local) else as_bytes(p.local)
                     for p in pieces]
    names = stored_names(pieces)  # a key's several boxes in one file: distinct names
    if prefix:  # a side file: the reader adds the prefix its header records
        names = [n[len(prefix):] for n in names]
    # each chunk's global offsets, recorded in the header: a reader checks them
    at = {n: tuple(int(x) for x in p.box.offsets) for n, p in zip(names, pieces)}
    if enc is not None and pieces:
        with ThreadPoolExecutor(2, thread_name_prefix="dckpt-encode") as pool:
            plans = encode.plan_pieces(pieces, buffers, enc, pool)
            buffers = [encode.hashing(b, pl.report) for b, pl in zip(buffers, plans)]
            keep = [i for i, pl in enumerate(plans) if pl.write]
            entries = [(names[i], "U8", (plans[i].max_bytes,), plans[i].max_bytes)
                       if plans[i].produce else
                       (names[i], pieces[i].dtype, pieces[i].box.sizes, len(buffers[i]))
                       for i in keep]
            vote = _write_entries(storage, root, name, rank, entries,
                                  [plans[i].produce or buffers[i] for i in keep], at)
            # after the writes: the producers fill the block tables
            reports = [pl.report.to_json() for pl in plans]
    else:
        entries = [(n, p.dtype, p.box.sizes, len(b)) for n, p, b in zip(names, pieces, buffers)]
        vote = _write_entries(storage, root, name, rank, entries, buffers, at, prefix)
    if reports is not None:
        vote["chunks"] = reports
    return vote


def _write_entries(storage, root: str, name: str, rank: int, entries: list,
                   buffers: list, at: dict[str, tuple[int, ...]], prefix: str = "") -> dict:
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
                                             [buffers[i] for i in order], storage.random_write,
                                             at=at, prefix=prefix)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return {"file": name, "size": size, "hlen": hlen, "crc": crc}

