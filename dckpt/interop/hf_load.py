"""``dckpt.load_hf``: fill a state's tensors and DTensors in place from a Hugging Face
safetensors directory, each rank reading only the byte ranges of its own boxes.

Call order (collective when a process group is initialised): rank 0 lists the
directory, reads the index and every file's header, checks them (sizes, offsets,
dtypes, the index's file names; :mod:`dckpt.interop.sources`) and broadcasts what they
hold, so a hostile or damaged file is the same error on every rank; every rank matches
its state against it (keys through ``rename``, shapes, dtypes) and all ranks agree on
the outcome before any tensor is touched; every rank then reads the runs of its boxes
(:mod:`dckpt.interop.hf_read`) straight into its tensors, and all ranks agree again.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, StateMismatchError, UnsupportedValueError, preview
from ..format.dtypes import ITEMSIZE, to_code
from ..protocol.collectives import Comm, error_payload, raise_gathered, rank0_bytes
from ..protocol.rename import Rename, map_keys, resolve
from ..state.flatten import fill, flatten
from ..state.tensors import describe_all
from ..storage.fsspec_storage import make_storage
from .hf_read import read_all
from .sources import INDEX_NAME, check_weight_map, read_safetensors_header, safetensors_files

log = logging.getLogger(__name__)

DEFAULT_READ_BUDGET = 256 << 20
_FLOATS = {"F64", "F32", "F16", "BF16"}
_FP8 = {"F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True)
class HFLoadInfo:
    """What :func:`load_hf` did. ``files``: the safetensors files of ``path`` it used;
    ``keys``: the state's keys this rank filled; ``missing``: state keys the files
    lack, left as they were (``allow_missing``), over all ranks; ``bytes_read`` and
    ``bytes_needed``: per rank, the tensor data bytes it read and the bytes of its own
    boxes in the files' dtypes (headers and index, read by rank 0, not counted);
    ``seconds``: the whole call on this rank."""

    path: str
    files: tuple[str, ...]
    keys: tuple[str, ...]
    missing: tuple[str, ...]
    bytes_read: tuple[int, ...]
    bytes_needed: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class _Tensor:
    file: int
    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


def load_hf(state: dict, path: str, *, rename: Rename = None, allow_missing: bool = False,
            strict: bool = False, cast: bool = True, process_group: Any = None,
            storage_options: dict | None = None, read_workers: int = 4,
            read_budget: int = DEFAULT_READ_BUDGET) -> HFLoadInfo:
    """Fill ``state``'s tensors and DTensors in place from the Hugging Face safetensors
    at ``path`` and return an :class:`HFLoadInfo`. Collective when torch.distributed is
    initialised (call it on every rank of ``process_group``, default the world); works
    in a single process without it.

    Why a function of its own, not ``dckpt.load(state, hf_dir)``: ``dckpt.load`` only
    loads a committed dckpt checkpoint, whose manifest is the commit point and whose
    every byte is covered by a checksum it verifies. A Hugging Face directory has
    neither: nothing says it was written completely, and nothing can verify its bytes.
    A path that is not a dckpt checkpoint must stay an error for ``dckpt.load``
    (NotCommittedError), never a silent unverified load; loading unverified bytes is a
    choice the caller makes by calling this function. What is checked: the headers and
    the index (below), never the data.

    ``path``: a directory holding ``model.safetensors.index.json`` and the files it
    names, or ``*.safetensors`` files (usually one ``model.safetensors``), or a single
    ``.safetensors`` file; a local path or any fsspec URL (``storage_options`` as for
    ``dckpt.load``). ``state``: nested dicts (lists, tuples) of tensors, DTensors (any
    placements: Shard, Replicate, FSDP2 over TP's ``_StridedShard``, uneven shards, any
    mesh), FSDP1 ShardedTensors, and Stateful objects (their ``state_dict()`` is filled,
    then handed to their ``load_state_dict``), on any device; its dotted keys name the
    files' tensors. Non-tensor leaves are left as they are (safetensors holds tensors
    only). ``rename``: as for ``dckpt.load``, maps each state key to the file key it is
    read from (a callable, or ``{state prefix: file prefix}``, longest prefix first).

    Each rank reads only the bytes of its own boxes: a row-sharded box is one read
    straight into place, a column slice one read per row segment, except that
    consecutive segments are joined into one scatter read (the gaps into a scratch
    buffer) while the gaps joined for the box total at most 64 KiB. The bound: a rank
    reads at most its boxes' bytes plus 64 KiB per box (one box per tensor; several for
    a ``_StridedShard`` DTensor whose local tensor interleaves boxes), exactly its
    boxes' bytes when they are row blocks. On object stores gaps under 1 MiB are read through (a
    request costs a round trip). Rank 0 also reads the index and every file's header.
    Reads run on ``read_workers`` threads; a read that needs a temporary (a cast, a
    device tensor, a non-contiguous destination) is at most about ``read_budget /
    read_workers`` bytes. Long loads log progress (see dckpt.progress).

    ``cast`` (default True, unlike ``dckpt.load``): a floating-point tensor stored in
    another floating dtype (fp64/fp32/fp16/bf16; HF weights are usually bf16, training
    weights fp32) is converted while loading, as ``Tensor.copy_`` does; with
    ``cast=False`` a dtype difference is an error, as in ``dckpt.load``. FP8 tensors
    load only into a tensor of the same FP8 dtype (their values mean something only
    with the scales stored beside them), and integer/bool dtypes only into their own.

    Keys in the files that no state key reads are fine (an HF directory holds more:
    a tied ``lm_head.weight``, buffers) unless ``strict=True``. State keys the files
    lack are a StateMismatchError listing them, unless ``allow_missing=True`` (left as
    they were; rank 0 logs them).

    Raises, the same error on every rank: CheckpointError naming the file (and key) for
    a missing path, a bad index (not JSON, over 100 MiB, naming a file outside the
    directory or missing from it, or a tensor not in the file it names), a damaged or
    hostile header (length prefix over 100 MiB or past the end, not a JSON object,
    offsets outside the file, overlapping or not matching shape x itemsize, a dtype
    dckpt does not know, such as F8_E8M0 or F4), a short read; StateMismatchError for
    missing keys, a shape difference (naming key, file and both shapes) or a dtype
    that cannot be loaded; UnsupportedValueError for a target dckpt cannot fill (a
    Partial DTensor, a meta tensor). A failed load may have written part of the
    files into the state's tensors: treat them as undefined."""
    t0 = time.perf_counter()
    comm = Comm(process_group)
    what = f"load_hf from {path}"
    storage, root, setup_err = None, path, None
    try:
        storage, root = make_storage(path, storage_options)
    except Exception as e:  # reported through the collectives, so no rank waits
        setup_err = e

    def describe() -> bytes:
        if setup_err is not None:
            raise setup_err
        return _describe(storage, root)

    doc = json.loads(rank0_bytes(comm, describe, what))
    files = doc["files"]
    tensors = {k: _Tensor(v[0], v[1], tuple(v[2]), v[3], v[4]) for k, v in doc["tensors"].items()}

    # Phase 1: match the state against the files before touching any tensor.
    err, matched = None, None
    try:
        if setup_err is not None:
            raise setup_err
        matched = _match(state, tensors, files, rename, cast, allow_missing)
    except Exception as e:
        err = e
    mine = {"error": error_payload(err), "missing": matched.missing if matched else [],
            "unread": matched.unread if matched and strict else []}
    views = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    errors = {r: v["error"] for r, v in enumerate(views) if v["error"]}
    if errors:
        raise_gathered(errors, what, err)
    missing = tuple(dict.fromkeys(k for v in views for k in v["missing"]))
    if strict:
        unread = sorted(set.intersection(*(set(v["unread"]) for v in views)))
        if unread:
            raise StateMismatchError(
                f"{what}: the files hold {len(unread)} tensor(s) the state lacks: "
                f"{preview(unread, 8)} (strict=True)")
    if missing and comm.rank == 0:
        log.warning("%s: the files lack %d key(s) of the state, left as they were "
                    "(allow_missing=True): %s", path, len(missing), preview(list(missing), 8))

    # Phase 2: read into place.
    nread = 0
    try:
        nread = read_all(storage, files, matched.pieces, max(1, read_workers), read_budget,
                         f"load_hf {root} (rank {comm.rank})")
        fill(state, lambda k, old: old, matched.flat.stateful)
    except Exception as e:
        err = e
    mine = {"error": error_payload(err), "read": nread, "needed": matched.needed}
    views = [json.loads(b) for b in comm.all_gather_bytes(json.dumps(mine).encode())]
    errors = {r: v["error"] for r, v in enumerate(views) if v["error"]}
    if errors:
        raise_gathered(errors, what, err)
    dt = time.perf_counter() - t0
    if comm.rank == 0:
        log.info("loaded Hugging Face safetensors %s: %d tensor(s), %.1f MiB on rank 0 in "
                 "%.2f s", root, len(matched.keys), nread / 2**20, dt)
    return HFLoadInfo(root, tuple(os.path.basename(f) for f in files), tuple(matched.keys),
                      missing, tuple(v["read"] for v in views),
                      tuple(v["needed"] for v in views), dt)


def _describe(storage, root: str) -> bytes:
    """Rank 0: the files of ``root`` and every tensor they hold, checked, as JSON
    ({"files": [path], "tensors": {name: [file, dtype, shape, start, nbytes]}}).
    Blocking I/O: a listing, the index, each file's header. Raises CheckpointError."""
    paths, wm = safetensors_files(root, storage)
    stored: dict = {}
    for path in paths:
        for name, st in read_safetensors_header(path, storage).items():
            if name in stored:
                raise CheckpointError(f"tensor {name!r} is in both {stored[name].path} "
                                      f"and {path}")
            stored[name] = st
    if wm is not None:
        check_weight_map(storage.join(root, INDEX_NAME), wm, stored)
    index = {p: i for i, p in enumerate(paths)}
    out = {name: [index[st.path], to_code(st.dtype, name), list(st.shape), st.start, st.nbytes]
           for name, st in stored.items()}
    return json.dumps({"files": paths, "tensors": out}).encode()


@dataclass
class _Matched:
    flat: Any
    pieces: list  # [(LocalPiece, _Tensor, target key)]
    keys: list[str]
    missing: list[str]
    unread: list[str]
    needed: int


def _dtype_problem(key: str, where: str, want: str, have: str, cast: bool) -> str | None:
    if want == have or (cast and want in _FLOATS and have in _FLOATS):
        return None
    if want in _FP8 or have in _FP8:
        return (f"tensor {key!r} ({where}) is {have} in the file and {want} in the state: "
                "FP8 values load only into their own dtype (they mean something only with "
                "the scales stored beside them)")
    hint = "; pass cast=True to convert floating-point tensors" if (
        want in _FLOATS and have in _FLOATS) else ""
    return f"tensor {key!r} ({where}) is {have} in the file and {want} in the state{hint}"


def _match(state: dict, tensors: dict, files: list, rename: Rename, cast: bool,
           allow_missing: bool) -> _Matched:
    """Pair every tensor of ``state`` with the file tensor its (renamed) key names; all
    problems listed at once. No I/O, no collective. Raises StateMismatchError,
    UnsupportedValueError."""
    flat = flatten(state)
    names = map_keys(flat.tensors, resolve(rename))
    pieces, keys, missing, problems, needed = [], [], [], [], 0
    for key, t in flat.tensors.items():
        ck = names[key]
        st = tensors.get(ck)
        if st is None:
            missing.append(key if ck == key else f"{key} (file key {ck})")
            continue
        shown = key if ck == key else f"{key} (file key {ck})"
        several = describe_all(key, t)
        where = files[st.file]
        if several[0].shape != st.shape:
            problems.append(f"tensor {shown!r} has shape {list(several[0].shape)} in the "
                            f"state and {list(st.shape)} in {where}")
            continue
        bad = _dtype_problem(shown, where, several[0].dtype, st.dtype, cast)
        if bad:
            problems.append(bad)
            continue
        if any(p.local is not None and any(s == 0 and n > 1 for s, n in
                                           zip(p.local.stride(), p.local.shape)) for p in several):
            raise UnsupportedValueError(
                f"tensor {shown!r} is an expanded view (several elements share one memory "
                "location): load into a tensor that owns its elements, e.g. .clone()")
        keys.append(key)
        for p in several:
            if p.local is not None and p.box.numel:
                pieces.append((p, st, key))
                needed += p.box.numel * ITEMSIZE[st.dtype]
    if problems:
        raise StateMismatchError(f"{len(problems)} tensor(s) of the state do not match the "
                                 f"files: " + "; ".join(problems[:8])
                                 + ("; ..." if len(problems) > 8 else ""))
    if missing and not allow_missing:
        raise StateMismatchError(f"the files lack {len(missing)} key(s) of the state: "
                                 f"{preview(missing, 8)} (pass allow_missing=True to leave "
                                 "them as they are)")
    wanted = set(names.values())
    unread = [k for k in tensors if k not in wanted]
    return _Matched(flat, pieces, keys, missing, unread, needed)
