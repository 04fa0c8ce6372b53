"""The load protocol: manifest -> match -> read + verify -> fill, all ranks agreeing.

Call order (collective): rank 0 reads and validates manifest.json and broadcasts it;
every rank matches its state_dict against it (keys, dtypes, shapes) and all ranks agree
on the outcome before any tensor is touched; every rank then reads only the chunks that
overlap what it holds, verifies their checksums, copies them in place, and all ranks
agree again. A failure anywhere raises the same error on every rank.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, Callable

import torch

from .. import _faults
from ..errors import (CheckpointError, preview, IntegrityError, ManifestError, NotCommittedError,
                      StateMismatchError, UnsupportedValueError)
from ..format import manifest as mf
from ..format.dtypes import to_torch
from ..format.sealed import user_value
from ..state.flatten import fill, flatten, grow, tensor_bytes
from ..state.tensors import describe_all
from ..storage.fsspec_storage import make_storage
from ..engine.reader import DEFAULT_READ_BUDGET, ChunkReader, plan_reads
from .collectives import Comm, agree, error_payload, raise_gathered, rank0_bytes
from .rename import Rename, map_keys, resolve
# torch-free (the CLI reads manifests without importing torch); re-exported from here
from .manifest_read import MAX_MANIFEST, read_manifest, read_manifest_bytes  # noqa: F401

log = logging.getLogger(__name__)


def load(state_dict: dict, path: str, *, process_group: Any = None,
         storage_options: dict | None = None, strict: bool = True,
         read_budget: int = DEFAULT_READ_BUDGET, ignore_prefixes: tuple[str, ...] = (),
         extra: Callable[[mf.Manifest], dict] | None = None,
         manifest_name: str | None = None, read_workers: int = 4, cast: bool = False,
         allow_missing: bool = False, rename: Rename = None) -> dict:
    """Fill ``state_dict`` in place from the checkpoint at ``path`` and return it.
    Collective: call on every rank.

    Tensors (plain or DTensor) are copied into in place; JSON leaves are replaced in their
    containers (tuples are rebuilt). ``strict`` also reports checkpoint keys that no rank
    asked for. Cost: each rank reads only the byte ranges of the saved chunks that overlap
    what it holds (widened to 256 KiB checksum blocks), plus one header per file it
    touches; three small collectives. Extra memory stays under about ``read_budget``
    bytes (default 256 MiB) whatever the checkpoint or tensor size: a region that is
    contiguous on both sides is read straight into its destination. Checkpoint keys that
    start with one of ``ignore_prefixes`` are never reported as unexpected. Raises on every rank alike:
    NotCommittedError, ManifestError / IntegrityError (naming the file), StateMismatchError
    (missing/unexpected keys, dtype or shape differences). ``extra(manifest)``, if
    given, returns entries added to ``state_dict`` before matching: targets shaped after
    what the checkpoint holds (the manager's RNG states).

    A failed load may leave the destination tensors partly overwritten: bytes are read
    straight into them and verified in place, so a checksum failure is detected after
    some of them changed. Treat the state as undefined after an error: load another
    checkpoint into it (CheckpointManager.restore does) or rebuild it.

    ``manifest_name`` (the fast tier, :mod:`dckpt.tiers.local`): every rank reads its own
    manifest of that name under ``path`` instead of rank 0's ``manifest.json``; the ranks
    agree on any error reading or parsing it (one more small collective).
    ``read_workers``: threads reading for this rank.

    ``cast=True``: a floating-point tensor saved in another floating dtype (an fp32
    checkpoint into a bf16 model for evaluation) is read in its saved dtype and
    converted into the target, a group of tensors of at most ``read_budget`` bytes at a
    time (extra memory stays about ``read_budget``). Without it, a dtype difference
    is a StateMismatchError. Other dtype differences (int to float) are refused either
    way.

    ``rename`` (see :mod:`dckpt.protocol.rename`): maps each key of ``state_dict`` (the
    dotted key) to the checkpoint key it is read from: a callable ``str -> str``, or a
    dict ``{target prefix: checkpoint prefix}`` where the longest matching prefix wins
    (``{"module.": ""}``: the target's "module.fc.weight" reads "fc.weight"). Every
    rank must pass the same one. Two target keys mapped to one checkpoint key raise
    StateMismatchError naming both; ``strict``'s unexpected keys are the checkpoint
    keys no renamed target key reads.

    ``allow_missing=True``: target keys the checkpoint lacks are left as they are
    (tensors keep their values, JSON leaves theirs, a Stateful object gets them back in
    its ``load_state_dict``) instead of raising StateMismatchError; rank 0 logs one
    warning naming them (the count and the first few, over all ranks). A key that is
    a tensor on one side and a value on the other is still an error."""
    t0 = time.perf_counter()
    comm = Comm(process_group)
    # A storage set-up error (an fsspec protocol missing on one node) is reported through
    # the collectives below like any other, so no rank is left waiting for the others.
    storage, root, setup_err = None, path, None
    try:
        storage, root = make_storage(path, storage_options)
    except Exception as e:
        setup_err = e
    name = manifest_name or mf.MANIFEST_NAME
    where = storage.join(root, name) if storage else f"{path}/{name}"

    def manifest_bytes() -> bytes:
        if setup_err is not None:
            raise setup_err
        return read_manifest_bytes(storage, root, name)

    if manifest_name is None:
        # Rank 0 reads the bytes; every rank parses them at once (parsing is
        # deterministic, so a bad manifest fails identically everywhere without
        # another collective).
        payload = rank0_bytes(comm, manifest_bytes, f"load from {path}")
        try:
            manifest = mf.parse(payload, where)
        except CheckpointError as e:
            raise type(e)(f"load from {path} failed: {e}") from None
    else:
        manifest, read_err = None, None
        try:
            manifest = mf.parse(manifest_bytes(), where)
        except Exception as e:
            read_err = e
        agree(comm, read_err, f"load from {path}")

    t_manifest = time.perf_counter()
    # Phase 1: match the target against the manifest before touching any tensor.
    err: BaseException | None = None
    matched = None
    try:
        if setup_err is not None:
            raise setup_err
        matched = match_target(state_dict, manifest, extra, cast, rename=rename,
                               allow_missing=allow_missing)
    except Exception as e:
        err = e
    # One all-gather carries each rank's error, unexpected and (allow_missing) missing
    # keys: a checkpoint key is unexpected only if no rank wants it (pipeline stages each
    # hold part of the state); rank 0 warns once about the keys any rank lacks.
    mine = {"error": error_payload(err),
            "unexpected": matched.unexpected if strict and matched else [],
            "missing": matched.missing if matched else []}
    # Each distinct view decoded once: at 131,072 ranks they are nearly all the same
    # few bytes, and decoding every rank's on every rank was O(ranks) JSON (issue 47).
    blobs = comm.all_gather_bytes(json.dumps(mine).encode())
    distinct: dict[bytes, dict] = {}
    for b in blobs:
        if b not in distinct:
            distinct[b] = json.loads(b)
    views = [distinct[b] for b in blobs]
    errors = {r: v["error"] for r, v in enumerate(views) if v["error"]}
    if errors:
        raise_gathered(errors, f"load from {path}", err)
    flat, pieces, names = matched.flat, matched.pieces, matched.names
    unexpected = sorted(k for k in set.intersection(*(set(v["unexpected"])
                                                      for v in distinct.values()))
                        if not k.startswith(ignore_prefixes) and k not in mf.TIMELINE_VALUES)
    if unexpected:
        raise StateMismatchError(
            f"checkpoint {root} has {len(unexpected)} key(s) the state_dict lacks: "
            f"{preview(unexpected, 8)} (pass strict=False to ignore them)")
    if comm.rank == 0:
        missing = list(dict.fromkeys(k for v in distinct.values() for k in v["missing"]))
        if missing:
            log.warning("checkpoint %s lacks %d key(s) of the state_dict, left as they were "
                        "(allow_missing=True): %s", root, len(missing), preview(missing, 8))

    t_match = time.perf_counter()
    # Phase 2: read, verify, copy.
    nbytes = 0
    try:
        _faults.fault("load", comm.rank)
        reader = ChunkReader(storage, root, manifest)
        what = f"load {root} (rank {comm.rank})"
        same = [(p, e) for p, e in pieces if p.dtype == e.dtype]
        nbytes = reader.fill_all(same, workers=read_workers, budget=read_budget, what=what)
        nbytes += _fill_cast([(p, e) for p, e in pieces if p.dtype != e.dtype], reader,
                             read_workers, read_budget, what)
        values, blobs = manifest.values, matched.blobs

        def value(k: str, old: Any) -> Any:
            # whatever the target held there (bytes, str...), as JSON leaves always were;
            # a {"$bytes"} tag, or a bytes entry read above, becomes the user's bytes here
            if k in blobs:
                return tensor_bytes(blobs.pop(k))  # one copy; the buffer goes at once
            ck = names.get(k, k)
            return user_value(values[ck]) if ck in values else old

        fill(state_dict, value, flat.stateful)
    except IntegrityError as e:  # the reader names the shard file; say whose it is too
        err = e if root in str(e) else type(e)(f"checkpoint {root}: {e}")
    except Exception as e:
        err = e
    t_read = time.perf_counter()
    agree(comm, err, f"load from {path}")
    t_end = time.perf_counter()
    log.debug("rank %d load phases: manifest %.3f s, match %.3f s, read %.3f s, agree %.3f s",
              comm.rank, t_manifest - t0, t_match - t_manifest, t_read - t_match, t_end - t_read)
    if comm.rank == 0:
        log.info("loaded %s: %.1f MiB on rank 0 in %.2f s", root, nbytes / 2**20, t_end - t0)
    return state_dict


@dataclasses.dataclass
class Matched:
    """What a load reads: the flattened target, ``pieces`` ([(piece, manifest entry)],
    each piece named by its checkpoint key), ``unexpected`` (checkpoint keys no target
    key reads), ``missing`` (target keys the checkpoint lacks, allow_missing=True),
    ``names`` ({target key: checkpoint key}, tensors and values) and ``blobs`` ({target
    key: the uint8 buffer a bytes value stored in a data file is read into}: among the
    pieces; the load hands the target ``bytes`` of it)."""

    flat: Any
    pieces: list
    unexpected: list[str]
    missing: list[str]
    names: dict[str, str]
    blobs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def match_target(state_dict: dict, manifest: mf.Manifest,
                 extra: Callable[[mf.Manifest], dict] | None = None, cast: bool = False, *,
                 rename: Rename = None, allow_missing: bool = False) -> Matched:
    """What a load of ``manifest`` into ``state_dict`` reads, as :func:`load` plans it
    (with its ``rename`` and ``allow_missing``). Adds ``extra``'s targets and grows a
    fresh optimizer's empty state first (as the load does; both are idempotent; only
    from what the checkpoint holds, so nothing is made for keys it lacks). No I/O, no
    collective. Raises StateMismatchError and UnsupportedValueError as :func:`load`
    does."""
    fn = resolve(rename)
    if extra is not None:
        state_dict.update(extra(manifest))
    if manifest.meta.get("int_keys"):  # a fresh optimizer's empty state: rebuild it
        grow(state_dict, manifest.tensors, manifest.values, manifest.meta["int_keys"],
             rename=fn)
    flat = flatten(state_dict, target=True)  # a target's bytes leaves: not encoded
    names = map_keys((*flat.tensors, *flat.values), fn)
    blobs: dict[str, torch.Tensor] = {}
    pieces, unexpected, missing = _match(manifest, flat.tensors, flat.values, cast, names,
                                         allow_missing, blobs)
    return Matched(flat, pieces, unexpected, missing, names, blobs)


def needed_chunks(state_dict: dict, manifest: mf.Manifest,
                  extra: Callable[[mf.Manifest], dict] | None = None,
                  cast: bool = False, *, rename: Rename = None,
                  allow_missing: bool = False) -> dict[int, set[tuple[str, tuple[int, ...]]]]:
    """{file index: {(checkpoint key, chunk offsets)}}: the saved chunks a load of
    ``manifest`` into ``state_dict`` on this rank reads (its headers aside), with the
    load's ``rename`` and ``allow_missing``. Pure planning, as :func:`match_target`;
    raises what it raises."""
    pieces = match_target(state_dict, manifest, extra, cast, rename=rename,
                          allow_missing=allow_missing).pieces
    out: dict[int, set] = {}
    for p, e in pieces:
        for item in plan_reads(p, e):
            out.setdefault(item.file, set()).add(
                (p.key, e.chunks.box(item.chunk)[0]))
    return out


def _fill_cast(pieces: list, reader: ChunkReader, workers: int, budget: int, what: str) -> int:
    """``load(cast=True)``: fill pieces whose dtype differs from the saved one through
    temporaries of the saved dtype, at most about ``budget`` bytes of them at a time,
    each converted into its target right after its group is read. Blocking I/O."""
    nbytes, group, size = 0, [], 0

    def flush() -> int:
        n = reader.fill_all([(tmp, e) for _, tmp, e in group], workers=workers,
                            budget=budget, what=what)
        for p, tmp, _ in group:
            p.local.copy_(tmp.local)  # the conversion
        group.clear()
        return n

    for p, e in pieces:
        if p.local is None:
            continue
        t = torch.empty(p.local.shape, dtype=to_torch(e.dtype))
        tmp = dataclasses.replace(p, dtype=e.dtype, local=t)
        if group and size + t.nbytes > budget:
            nbytes += flush()
            size = 0
        group.append((p, tmp, e))
        size += t.nbytes
    if group:
        nbytes += flush()
    return nbytes


_FLOAT_CODES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


def _shown(key: str, ck: str) -> str:
    """A target key for an error message, with its checkpoint key when renamed (built
    only for an error: _match runs per tensor)."""
    return repr(key) if ck == key else f"{key!r} (checkpoint key {ck!r})"


def _match(m: mf.Manifest, tensors: dict, values: dict, cast: bool, names: dict[str, str],
           allow_missing: bool = False, blobs: dict | None = None):
    """Pair every target tensor with the manifest entry of its checkpoint key
    (``names``); list problems all at once. With ``cast``, a floating dtype may differ
    from the saved floating dtype. A target value whose checkpoint key is a bytes entry
    (stored in a data file) gets a uint8 buffer of its saved length in ``blobs`` and a
    piece that reads it whole (allocated here: at most sealed.MAX_BYTES_VALUE, which
    the manifest's parse checked). Returns (pieces, unexpected, missing); ``missing``
    is empty unless ``allow_missing`` (else missing keys raise)."""
    missing, wrong = [], []
    pieces = []
    for key, t in tensors.items():
        ck = names[key]
        entry = m.tensors.get(ck)
        if entry is None or entry.bytes_value:  # a bytes value is a value, not a tensor
            (wrong if ck in m.values or entry is not None else missing).append(key)
            continue
        several = describe_all(ck, t)  # a strided DTensor's local tensor: several boxes
        piece = several[0]
        if any(p.local is not None and any(s == 0 and n > 1 for s, n in
                                           zip(p.local.stride(), p.local.shape)) for p in several):
            raise UnsupportedValueError(
                f"tensor {_shown(key, ck)} is an expanded view (several elements share one "
                "memory location): load into a tensor that owns its elements, e.g. .clone()")
        castable = cast and piece.dtype in _FLOAT_CODES and entry.dtype in _FLOAT_CODES
        if (piece.dtype != entry.dtype and not castable) or piece.shape != entry.shape:
            hint = ("" if piece.shape != entry.shape or cast else
                    "; pass cast=True to convert floating-point tensors while loading")
            raise StateMismatchError(
                f"tensor {_shown(key, ck)}: the state_dict has dtype {piece.dtype} shape "
                f"{list(piece.shape)}, the checkpoint has dtype {entry.dtype} shape "
                f"{list(entry.shape)}{hint}")
        pieces += [(p, entry) for p in several]
    for key in values:
        ck = names[key]
        entry = m.tensors.get(ck)
        if entry is not None and entry.bytes_value and blobs is not None:
            blobs[key] = buf = torch.empty(entry.shape, dtype=torch.uint8)
            pieces += [(p, entry) for p in describe_all(ck, buf)]
        elif ck not in m.values:
            (wrong if ck in m.tensors else missing).append(key)
    if wrong:
        raise StateMismatchError(f"key(s) {preview(wrong, 8)} are tensors on one side and plain "
                                 "values on the other")
    if missing and not allow_missing:
        raise StateMismatchError(f"the checkpoint lacks {len(missing)} key(s) of the "
                                 f"state_dict: {preview(missing, 8)} (pass allow_missing=True "
                                 "to leave them as they are)")
    wanted = set(names.values())
    unexpected = [k for k in (*m.tensors, *m.values) if k not in wanted]
    return pieces, unexpected, missing
