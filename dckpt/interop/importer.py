"""Import: make a dckpt checkpoint out of a DCP directory, Hugging Face safetensors or
a ``torch.save`` file, in one process, holding one output data file at a time.

The checkpoint is written with dckpt's own primitives, as a save by one process would
write it: data files through :func:`dckpt.protocol.commit.write_file` (plain
safetensors with per-block CRCs and content hashes, optionally compressed), then the
manifest through the save coordinator's commit (a lease against gc while files are
written, the files checked, the manifest put last, exclusive unless ``overwrite``, the
replaced checkpoint's files removed after, this import's files removed on failure).
Unlike a save, the data are cut into several files of at most ``max_shard_size``
bytes, and a tensor larger than that into slabs of rows, one per file: that is what
bounds the memory, since a data file is written from buffers that are all in memory.
A bytes value over 64 KiB (a DCP or torch.save checkpoint's pickled dataloader state)
is a bytes entry of one data file, whole, as ``dckpt.save`` writes it (manifest
version 5); a smaller one is a ``{"$bytes"}`` value in the manifest.
"""
from __future__ import annotations

import math
import os
import time
import uuid
from typing import Any

import numpy as np

from ..errors import (ERROR_TYPES, CheckpointError, StateMismatchError, UnsupportedValueError,
                      preview)
from ..engine.encode import Encoding
from ..format import codec
from ..format import manifest as mf
from ..format.dtypes import to_code
from ..layout import delta
from ..format import tiling
from ..layout.chunks import Box
from ..progress import Progress
from ..protocol.commit import CheckpointInfo, write_file
from ..protocol.coordinator import _Coordinator, _unpack, dckpt_version
from ..format.filenames import data_name
from ..state.flatten import check_utf8
from ..state.tensors import LocalPiece
from ..storage.fsspec_storage import make_storage
from .common import log, norm_prefix, parse_size, slab_rows, trim_heap
from .sources import SafetensorsSource, Source, SourceTensor, TorchSaveSource, detect

FORMATS = ("auto", "dcp", "safetensors", "torch", "deepspeed")
Chunk = tuple[SourceTensor, int, int]  # a tensor and the rows [r0, r1) of one chunk


def import_checkpoint(src: str, dst: str, *, format: str = "auto", prefix: str | None = None,
                      aliases: dict[str, str] | None = None, overwrite: bool = False,
                      max_shard_size: int | str = "1GB", compression: str | None = None,
                      storage_options: dict | None = None) -> CheckpointInfo:
    """Write the checkpoint at local path ``src`` as a dckpt checkpoint at ``dst`` (a
    local path or fsspec URL; ``storage_options`` are its options), which ``dckpt.load``
    then restores into any layout and world size.

    ``format``: "dcp" (a torch.distributed.checkpoint directory: its ``.metadata`` is a
    pickle, read by a restricted unpickler, but the import trusts its source), "safetensors"
    (a file, or a directory with or without ``model.safetensors.index.json``), "torch"
    (a ``torch.save`` zip file, read with ``weights_only=True, mmap=True``), "deepspeed"
    (a stock DeepSpeed ZeRO-1/2/3 tag folder ``global_step<N>``, written as a dckpt
    DeepSpeed tag by :func:`dckpt.integrations.deepspeed.stock.import_tag`, which ignores
    ``max_shard_size``), or "auto" (from what ``src`` holds: a folder with
    ``*_model_states.pt`` files is a DeepSpeed tag). ``prefix`` is put before every key
    (``"train.model."``
    lets ``TrainingState`` under key "train" load a model's weights; a missing final "."
    is added). ``aliases`` maps extra names to source names whose tensor they copy, e.g.
    ``{"lm_head.weight": "model.embed_tokens.weight"}`` for a model with tied embeddings
    whose safetensors hold the embedding once (the prefix applies to both).
    ``compression``: None, "zstd" or "lz4", as ``dckpt.save``.

    Cost: reads every source byte once (a DCP tensor whole, through ``dcp.load``) and
    writes it once with fsync (plus hashing, and compressing if asked). Memory: one
    output data file of at most ``max_shard_size`` bytes (default 1 GB), plus for DCP
    its read temporaries of one saved chunk; a DCP tensor larger than the limit is held
    whole, and a single row over it is one chunk; so is a bytes value over it (each is
    in memory whole anyway, up to 4 GiB). Returns the CheckpointInfo of the
    commit (``world_size`` 1).

    Raises CheckpointError naming the file or key: an unknown or unreadable source, a
    damaged safetensors header or index, a dtype or object dckpt cannot store, a bytes
    value over 4 GiB (UnsupportedValueError), a key that is both a tensor and a value, an alias of a
    missing name; AlreadyExistsError when ``dst`` holds a checkpoint and not
    ``overwrite``. On any error nothing is committed: ``dst`` keeps what it had."""
    t0 = time.perf_counter()
    if format not in FORMATS:
        raise CheckpointError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    if format == "deepspeed" or (format == "auto" and deepspeed_tag(src)):
        # its reader lives with the DeepSpeed adapter (which this layer does not import)
        raise CheckpointError(
            f"{src} is a DeepSpeed tag: import it with `dckpt import` or "
            "dckpt.integrations.deepspeed.stock.import_tag")
    limit = parse_size(max_shard_size)
    flag = codec.compression_flag(compression)
    kind = detect(src) if format == "auto" else format
    pre = norm_prefix(prefix)
    storage, root = make_storage(dst, storage_options)
    coord = _Coordinator(storage, root, overwrite, 1)
    if not overwrite and storage.exists(storage.join(root, mf.MANIFEST_NAME)):
        raise coord._exists()
    source = _open(kind, src, pre)
    try:
        tensors = source.tensors + _aliases(source, aliases or {}, pre, src)
        _check_keys(tensors, source.values, src)
        files = _plan(tensors, limit)
        coord.begin(uuid.uuid4().hex[:16])
        try:
            m = _write(source, files, tensors, storage, root, coord.save_id, flag, kind, src, t0)
            _loadable(m, dst)
            doc, _ = _unpack(coord.commit_manifest(m, t0))
        finally:
            coord.finish()  # removes this import's files unless it committed
    finally:
        source.close()
    if doc.get("errors"):
        e = next(iter(doc["errors"].values()))  # the coordinator's own (rank 0) error
        cls = ERROR_TYPES.get(e["type"], CheckpointError)
        raise cls(f"import into {dst} failed: {e['message']}")
    shown = dst.rstrip("/") if "://" in dst else root
    info = CheckpointInfo(path=shown, bytes_written=doc["bytes"], num_files=doc["files"],
                          seconds=time.perf_counter() - t0, world_size=1, save_id=coord.save_id)
    log.info("imported %s (%s, %d tensors, %d values) into %s: %.1f MiB in %d files in %.2f s",
             src, kind, len(tensors), len(source.values), shown, info.bytes_written / 2**20,
             info.num_files, info.seconds)
    return info


def deepspeed_tag(src: str) -> bool:
    """Whether ``src`` is a stock DeepSpeed tag folder (``*_model_states.pt`` files).
    Lists one folder."""
    try:
        return os.path.isdir(src) and any(n.endswith("_model_states.pt") for n in os.listdir(src))
    except OSError:
        return False


def _open(kind: str, src: str, prefix: str) -> Source:
    if kind == "dcp":
        from .dcp_source import DCPSource

        return DCPSource(src, prefix)
    if kind == "safetensors":
        return SafetensorsSource(src, prefix)
    return TorchSaveSource(src, prefix)


def _aliases(source: Source, aliases: dict[str, str], prefix: str, src: str) -> list[SourceTensor]:
    """The extra tensors ``aliases`` asks for (new name -> source name). Pure. Raises
    CheckpointError naming an alias whose source name does not exist."""
    by_name = {t.name: t for t in source.tensors}
    out = []
    for new, old in aliases.items():
        t = by_name.get(old)
        if t is None:
            raise CheckpointError(f"alias {new!r} -> {old!r}: {src} has no tensor {old!r}")
        out.append(SourceTensor(prefix + new, old, t.dtype, t.shape, t.bytes_value))
    return out


def _check_keys(tensors: list[SourceTensor], values: dict[str, Any], src: str) -> None:
    """Refuse, before anything is written, what a save refuses and a load could not
    read back, with save's own checks: a key that is not valid UTF-8 (flatten's check;
    a prefix or a source name can bring one), a shape save's tiling refuses (over 64
    dims), twice the same key, a key both a tensor and a value, safetensors' reserved
    ``__metadata__``. Pure, O(keys + dims)."""
    seen: set[str] = set()
    dup = []
    for t in tensors:
        check_utf8(t.key)
        # save's tiling check, on one chunk that is the whole tensor (none when empty)
        whole = np.array([t.shape] if math.prod(t.shape) else [], np.int64)
        whole = whole.reshape(len(whole), len(t.shape))
        err = tiling.analyse(t.shape, np.zeros_like(whole), whole).error
        if err:
            raise UnsupportedValueError(f"importing {src}: tensor {t.key!r}: {err}")
        (dup.append if t.key in seen else seen.add)(t.key)
    for k in values:
        check_utf8(k)
    if dup:
        raise StateMismatchError(f"importing {src}: key(s) {preview(dup)} appear twice "
                                 "(an alias that names an existing tensor?)")
    both = sorted(seen & set(values))
    if both:
        raise StateMismatchError(f"importing {src}: key(s) {preview(both)} are both a tensor "
                                 "and a value")
    if "__metadata__" in seen:
        raise UnsupportedValueError(f"importing {src}: a tensor cannot have the key "
                                    "'__metadata__' (safetensors reserves it); use prefix=")


def _loadable(m: mf.Manifest, dst: str) -> None:
    """Parse ``m`` back as a load parses a manifest, before it is committed: whatever a
    source got past :func:`_check_keys`, an import never commits a checkpoint that
    load refuses. Pure, O(manifest size). Raises CheckpointError naming ``dst`` and the
    field."""
    try:
        mf.parse(mf.to_json(m))
    except (CheckpointError, ValueError, TypeError) as e:
        raise CheckpointError(f"import into {dst}: the checkpoint would not load ({e}); "
                              "nothing was committed") from None


def _plan(tensors: list[SourceTensor], limit: int) -> list[list[Chunk]]:
    """Pack the tensors, in order, into data files of at most ``limit`` bytes. A tensor
    over the limit is cut into slabs of rows, each in a file of its own (a file holds
    one chunk of a tensor at most); the last slab's file takes the next tensors if they
    fit. A bytes value is never cut (its entry is one chunk, as a save writes it).
    Tensors with no elements go in no file. Pure."""
    files: list[list[Chunk]] = []
    cur: list[Chunk] = []
    size = 0
    for t in tensors:
        n = t.nbytes
        if n == 0:
            continue
        rows = t.shape[0] if t.shape else 1
        if n <= limit or not t.shape or t.bytes_value:
            if cur and size + n > limit:
                files.append(cur)
                cur, size = [], 0
            cur.append((t, 0, rows))
            size += n
            continue
        step = slab_rows(t.shape, t.dtype.itemsize, limit)
        for r in range(0, rows, step):
            if cur:
                files.append(cur)
            stop = min(rows, r + step)
            cur, size = [(t, r, stop)], n // rows * (stop - r)
    if cur:
        files.append(cur)
    return files


def _write(source: Source, files: list[list[Chunk]], tensors: list[SourceTensor], storage,
           root: str, save_id: str, flag: int, kind: str, src: str, t0: float) -> mf.Manifest:
    """Write every data file, each from buffers read just before it and released just
    after, and return the manifest that describes them (not yet committed). Blocking
    I/O. Raises CheckpointError naming the source or the data file."""
    last = {}
    for i, chunks in enumerate(files):
        for t, _, _ in chunks:
            last[t.name] = i
    placed: dict[str, list[tuple[int, int]]] = {}  # key -> [(file, row start)]
    entries, reports = [], {}
    progress = Progress(f"import {src} -> {root}", sum(t.nbytes for t in tensors), log)
    enc = Encoding(flag)
    for i, chunks in enumerate(files):
        name = data_name(save_id, i)
        try:
            source.prepare([t.name for t, _, _ in chunks])
            pieces = [_piece(source, t, r0, r1) for t, r0, r1 in chunks]
        except OSError as e:
            raise CheckpointError(f"reading {src} failed: {e}") from None
        try:
            vote = write_file(storage, root, name, i, pieces, enc)
        except OSError as e:
            raise CheckpointError(f"writing {storage.join(root, name)} failed: {e}") from None
        del pieces
        entries.append(mf.FileEntry(vote["file"], vote["size"], vote["hlen"], vote["crc"], i))
        reports[i] = [delta.ChunkReport.from_json(x) for x in vote["chunks"]]
        for t, r0, _ in chunks:
            placed.setdefault(t.key, []).append((i, r0))
            if last[t.name] == i:
                source.done(t.name)
        trim_heap()
        nbytes = sum(t.nbytes // (t.shape[0] if t.shape else 1) * (r1 - r0) for t, r0, r1 in chunks)
        progress.add(nbytes)
        log.info("import: wrote %s (%d chunks, %.1f MiB), file %d of %d", name, len(chunks),
                 nbytes / 2**20, i + 1, len(files))
    meta: dict[str, Any] = {"dckpt_version": dckpt_version(), "save_seconds":
                            round(time.perf_counter() - t0, 3),
                            "imported_from": {"format": kind, "source": src}}
    if source.int_keys:
        meta["int_keys"] = sorted(set(source.int_keys))
    m = mf.Manifest(save_id, 1, time.time(), tuple(entries),
                    {t.key: _entry(t, placed.get(t.key, [])) for t in tensors},
                    dict(source.values), meta)
    return delta.attach(m, reports, None, "")


def _piece(source: Source, t: SourceTensor, r0: int, r1: int) -> LocalPiece:
    """Rows ``[r0, r1)`` of ``t`` read from the source, as the LocalPiece a shard file
    is written from. Raises CheckpointError when the source gives another shape."""
    local = source.read(t.name, r0, r1)
    box = Box((r0,) + (0,) * (len(t.shape) - 1), (r1 - r0, *t.shape[1:])) if t.shape else \
        Box((), ())
    if tuple(local.shape) != box.sizes or local.dtype != t.dtype:
        raise CheckpointError(f"tensor {t.name!r}: the source gave {local.dtype} "
                              f"{list(local.shape)} where its metadata says {t.dtype} "
                              f"{list(box.sizes)}")
    return LocalPiece(t.key, to_code(t.dtype, t.key), t.shape, box, local)


def _entry(t: SourceTensor, placed: list[tuple[int, int]]) -> mf.TensorEntry:
    """The manifest entry of ``t`` from the files holding its slabs, in row order: a
    grid cut along dim 0 (the list form with no chunks for an empty tensor), marked as
    bytes for a bytes value. Pure."""
    nd = len(t.shape)
    if math.prod(t.shape) == 0:
        z = np.zeros((0, nd), np.int64)
        chunks = mf.Chunks(z, z.copy(), np.zeros(0, np.int64), None)
    else:
        grid = tuple((0, *[r for _, r in placed[1:]], t.shape[0]) if d == 0 else (0, t.shape[d])
                     for d in range(nd))
        offsets, sizes = mf.grid_cells(grid)
        chunks = mf.Chunks(offsets, sizes, np.array([f for f, _ in placed], np.int64), grid)
    return mf.TensorEntry(t.key, to_code(t.dtype, t.key), t.shape, chunks,
                          bytes_value=t.bytes_value)


