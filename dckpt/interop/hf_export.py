"""Export a dckpt checkpoint as a Hugging Face safetensors directory.

What ``from_pretrained`` reads: one ``model.safetensors``, or shards
``model-00001-of-0000N.safetensors`` plus ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``). Each file is plain
safetensors (``__metadata__`` is ``{"format": "pt"}``, which transformers checks).

How: one process, no process group. The manifest is read once; every output tensor is
reassembled from the checkpoint's chunks by :class:`dckpt.engine.reader.ChunkReader` (the
resharding reader ``dckpt.load`` uses: any world size and placement, incremental
references followed, compressed blocks decoded, every block's checksum verified), a
slab of rows at a time, and streamed into the output file right after its header. So
memory stays about ``read_budget`` bytes whatever the checkpoint, tensor or shard size.

Atomicity: each file is written under a temporary name and renamed into place once
complete and synced (object stores: one upload that becomes visible at its end), and
the file that makes the directory loadable goes last: the index for a sharded export,
``model.safetensors`` itself otherwise. A crash leaves a directory ``from_pretrained``
refuses, never one that loads part of the weights.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import CheckpointError, IntegrityError, preview
from ..format import manifest as mf
from ..format import shards
from ..format.dtypes import ITEMSIZE, to_code, to_torch
from ..layout.chunks import Box
from ..progress import Progress
from ..protocol.restore import read_manifest
from ..engine.reader import ChunkReader
from ..state.tensors import LocalPiece, as_bytes
from ..storage.fsspec_storage import FsspecStorage, make_storage
from ..storage.rename import replace_file
from .common import (CONVERTIBLE, log, norm_prefix, parse_dtype, parse_size, slab_rows,
                     trim_heap)

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_TEMP = re.compile(r"^\.model[\w.-]*\.safetensors\.tmp-[0-9a-f]{12}$")
DEFAULT_BUDGET = 64 << 20  # bytes read per batch: large enough to keep reads efficient


@dataclass(frozen=True)
class ExportInfo:
    """What an export wrote: the output directory as given, its weight files in order,
    the number of tensors, their bytes (the index's ``total_size``) and the time."""

    out_dir: str
    files: tuple[str, ...]
    tensors: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class _Out:
    """One output tensor: its checkpoint entry, its name in the export, its dtype."""

    entry: mf.TensorEntry
    name: str
    dtype: torch.dtype
    # the output shape when it differs from the stored one (same elements, row-major:
    # a DeepSpeed master stored 1-D); None: the entry's
    shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes // ITEMSIZE[self.entry.dtype] * self.dtype.itemsize


def export(ckpt: str, out_dir: str, prefix: str | None = None, dtype=None,
           max_shard_size: int | str = "5GB", *, storage_options: dict | None = None,
           out_storage_options: dict | None = None, overwrite: bool = False,
           read_budget: int = DEFAULT_BUDGET, read_workers: int = 4) -> ExportInfo:
    """Write the tensors of checkpoint ``ckpt`` whose key starts with ``prefix`` (e.g.
    ``"train.model."``; a missing final "." is added; None: every tensor) to ``out_dir``
    as Hugging Face safetensors, named by their key without the prefix. Runs in the
    calling process only (no collective; any world size and layout saved it).

    ``dtype`` ("bf16", "fp16", "fp32" or a torch dtype) converts floating-point tensors
    (fp64/fp32/fp16/bf16; FP8 and integer tensors are written as saved). Files are cut
    at ``max_shard_size`` (int bytes or "5GB"/"500MiB"): one ``model.safetensors``
    when everything fits, else ``model-0000i-of-0000N.safetensors`` and the index; a
    tensor larger than the limit gets a file of its own, as transformers does.
    ``out_dir`` must be empty or absent unless ``overwrite``, which replaces the weight
    files there and keeps every other file (config.json, tokenizer...).
    ``storage_options`` are the checkpoint's fsspec options; ``out_storage_options``
    the output's (default: the same when both are URLs of one protocol).

    Cost: reads each exported byte of the checkpoint once (verifying every checksum
    block), writes it once. Memory: about ``read_budget`` bytes (default 64 MiB, capped
    at ``max_shard_size``) plus, for a dtype conversion, the converted copy of one
    batch; on an object store one output file is buffered for its upload.

    Raises CheckpointError: no tensor matches ``prefix`` (naming the prefixes that
    exist), a bad ``dtype`` or ``max_shard_size``, ``out_dir`` not empty; and as
    ``dckpt.load``: NotCommittedError, ManifestError, IntegrityError naming the file
    and tensor. OSError from the output storage propagates, naming the file."""
    t0 = time.perf_counter()
    out_dtype = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    budget = max(1, min(int(read_budget), limit))
    storage, root = make_storage(ckpt, storage_options)
    manifest, _ = read_manifest(storage, root)
    outs = _select(manifest, norm_prefix(prefix), out_dtype, ckpt)
    groups = _shards(outs, limit)
    names = [SINGLE] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    if out_storage_options is None and "://" in out_dir and "://" in ckpt and \
            out_dir.split("://")[0] == ckpt.split("://")[0]:
        out_storage_options = storage_options
    ostore, oroot = make_storage(out_dir, out_storage_options)
    old = _prepare_dir(ostore, oroot, out_dir, overwrite)

    reader = ChunkReader(storage, root, manifest)
    total = sum(o.nbytes for g in groups for o in g)
    progress = Progress(f"export {ckpt} -> {out_dir}", total, log)
    for name, group in zip(names, groups):
        _write_file(ostore, oroot, name, group, reader, budget, read_workers, progress)
        log.info("export: wrote %s (%d tensors, %.1f MiB)", name, len(group),
                 sum(o.nbytes for o in group) / 2**20)
    if len(groups) > 1:  # the index goes last: it is what makes the directory loadable
        index = {"metadata": {"total_size": total},
                 "weight_map": {o.name: n for n, g in zip(names, groups) for o in g}}
        ostore.put_atomic(ostore.join(oroot, INDEX), json.dumps(index, indent=2).encode())
    for stale in sorted(old - set(names)):  # an earlier export's shards
        _remove(ostore, ostore.join(oroot, stale))
    seconds = time.perf_counter() - t0
    log.info("exported %d tensors (%.1f MiB) of %s to %s in %d file(s) in %.2f s",
             len(outs), total / 2**20, ckpt, out_dir, len(names), seconds)
    return ExportInfo(out_dir, tuple(names), len(outs), total, seconds)


def _select(m: mf.Manifest, prefix: str, out_dtype: torch.dtype | None,
            ckpt: str) -> list[_Out]:
    """The tensors to export, in the checkpoint's order, with their output names and
    dtypes. Pure. Raises CheckpointError when none matches or a name would be empty."""
    outs = []
    if (prefix + "deepspeed.meta") in m.values:  # a DeepSpeed tag: its module's names
        from .deepspeed_names import weights

        try:
            named = weights(m.values, m.tensors, prefix)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {ckpt}: its DeepSpeed record: {e}") from None
        if named:
            for key, name, shape in named:
                e = m.tensors[key]
                src = to_torch(e.dtype)
                dt = out_dtype if out_dtype is not None and src in CONVERTIBLE else src
                outs.append(_Out(e, name, dt, shape))
            return outs
    for key, e in m.tensors.items():
        if not key.startswith(prefix) or e.bytes_value:  # a bytes value is no weight
            continue
        name = key[len(prefix):]
        if not name:
            raise CheckpointError(f"tensor {key!r} of checkpoint {ckpt} would have an "
                                  f"empty name once {prefix!r} is stripped")
        src = to_torch(e.dtype)
        dt = out_dtype if out_dtype is not None and src in CONVERTIBLE else src
        outs.append(_Out(e, name, dt))
    if not outs:
        raise CheckpointError(f"no tensor of checkpoint {ckpt} has a key starting with "
                              f"{prefix!r}{_prefix_hint(list(m.tensors), prefix)}")
    return outs


def _prefix_hint(keys: list[str], prefix: str) -> str:
    """What the keys start with (their first two parts as a prefix; a key of one or two
    parts up to its last dot, a one-part key as itself), and the full prefix when
    ``prefix`` matches at a part boundary inside keys (a manager's keys start with
    ``state.``). Pure."""
    if not keys:
        return " (it holds no tensors)"
    tops = sorted({k if "." not in k else ".".join(k.split(".")[:min(2, k.count("."))]) + "."
                   for k in keys})
    hint = f"; its tensor keys start with {preview(tops)}"
    found = sorted({k[:i + len(prefix)] for k in keys
                    for i in [k.find("." + prefix) + 1] if prefix and i > 0})
    if found:
        hint += f"; did you mean {preview(found, 3)}?"
    return hint


def _shards(outs: list[_Out], limit: int) -> list[list[_Out]]:
    """Cut ``outs`` into files of at most ``limit`` bytes, in order, as transformers
    does: a tensor that does not fit in the current file starts the next one, and a
    tensor over the limit is alone in its file. Pure."""
    groups: list[list[_Out]] = [[]]
    size = 0
    for o in outs:
        if groups[-1] and size + o.nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(o)
        size += o.nbytes
    return groups


def _weight_file(name: str) -> bool:
    return name in (SINGLE, INDEX) or (name.startswith("model-") and
                                       name.endswith(".safetensors") and "-of-" in name)


def _prepare_dir(storage, root: str, shown: str, overwrite: bool) -> set[str]:
    """Make ``root`` ready for an export; returns the names of an earlier export's
    shard files there (removed once the new export is in place). Without
    ``overwrite`` the directory must be empty or absent. With it, the earlier export's
    index and single file are removed first, so that from now until the new export
    completes the directory does not load as a model. I/O: a listing, removals."""
    try:
        entries = storage.listdir(root) if storage.is_dir(root) else None
    except FileNotFoundError:
        entries = None
    if entries is None:
        if storage.exists(root):
            raise CheckpointError(f"export target {shown} exists and is not a directory")
        storage.makedirs(root)
        return set()
    names = sorted(e.name for e in entries)
    if names and not overwrite:
        raise CheckpointError(
            f"export target {shown} is not empty (it holds {preview(names)}); pass "
            "overwrite=True (--overwrite) to replace the weights there (other files are "
            "kept)")
    for n in names:  # the old markers first; and temporary files of a killed export
        if n in (INDEX, SINGLE) or _TEMP.match(n):
            _remove(storage, storage.join(root, n))
    return {n for n in names if _weight_file(n) and n not in (INDEX, SINGLE)}


def _remove(storage, path: str) -> None:
    try:
        storage.remove(path)
    except FileNotFoundError:
        pass


def _header(group: list[_Out], meta: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """The safetensors header of one output file (length prefix included, padded with
    spaces so the data starts 8-aligned) and the file order of ``group``: larger items
    first, so every tensor starts at a multiple of its item size. ``meta``: more
    ``__metadata__`` entries (strings). Pure."""
    entries = [(o.name, to_code(o.dtype, o.name), o.entry.shape if o.shape is None else o.shape,
                o.nbytes) for o in group]
    order = shards.order_entries(entries)
    # plain: no dckpt checksums
    raw = shards.header_json([entries[i] for i in order], meta=meta)
    return len(raw).to_bytes(8, "little") + raw, order


def _write_file(storage, root: str, name: str, group: list[_Out], reader: ChunkReader,
                budget: int, workers: int, progress: Progress,
                meta: dict[str, str] | None = None) -> None:
    """Write one output file: header, then the tensors' bytes in file order, read in
    batches of slabs of at most ``budget`` bytes; under a temporary name renamed into
    place at the end (a direct upload on object stores). Blocking I/O. Raises
    CheckpointError/IntegrityError from the reads; a partial file is removed."""
    head, order = _header(group, meta)
    size = len(head) + sum(o.nbytes for o in group)
    final = storage.join(root, name)
    direct = isinstance(storage, FsspecStorage) and storage.one_put
    tmp = final if direct else storage.join(root, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    writer = storage.open_write(tmp, size_hint=size)
    # the next batch is read while this one is written (a thread): each batch gets
    # half the budget, so the two in flight stay within it
    half = max(1, budget // 2)
    pool = ThreadPoolExecutor(1, thread_name_prefix="dckpt-export-read")
    pending = None
    try:
        writer.write(head)
        batches = _batches([group[i] for i in order], half)
        nxt = next(batches, None)
        pending = pool.submit(_read_batch, nxt, reader, half, workers) if nxt else None
        while pending is not None:
            bufs = pending.result()
            nxt = next(batches, None)
            pending = pool.submit(_read_batch, nxt, reader, half, workers) if nxt else None
            for buf in bufs:
                writer.write(buf)
                progress.add(len(buf))
            bufs = buf = None
            trim_heap()  # this batch's pages, before the next batch allocates
        writer.commit()
    except BaseException:
        if pending is not None:
            pending.cancel()
        writer.abort()
        raise
    finally:
        pool.shutdown(wait=True)
    if tmp != final:
        replace_file(storage, tmp, final)


def _batches(outs: list[_Out], budget: int):
    """Yield lists of (out, row_start, row_stop): slabs of rows of the tensors in order,
    each slab and each list at most ``budget`` bytes of the checkpoint's dtype (a single
    row over the budget goes alone). Pure."""
    batch, size = [], 0
    for o in outs:
        shape, isz = o.entry.shape, ITEMSIZE[o.entry.dtype]
        rows = shape[0] if shape else 1
        step = slab_rows(shape, isz, budget)
        per_row = o.entry.nbytes // rows if rows else 0
        for r in range(0, max(rows, 1), step):
            stop = min(rows, r + step) if shape else 1
            n = (stop - r) * per_row if shape else o.entry.nbytes
            if batch and size + n > budget:
                yield batch
                batch, size = [], 0
            batch.append((o, r, stop))
            size += n
    if batch:
        yield batch


def _read_batch(batch, reader: ChunkReader, budget: int, workers: int) -> list[memoryview]:
    """Read the slabs of ``batch`` out of the checkpoint (verified) and return their
    bytes in the output dtype, in order. Memory: the slabs, plus converted copies."""
    pairs, temps = [], []
    for o, r0, r1 in batch:
        e = o.entry
        shape = (r1 - r0, *e.shape[1:]) if e.shape else ()
        t = torch.empty(shape, dtype=to_torch(e.dtype))
        offsets = (r0,) + (0,) * (len(e.shape) - 1) if e.shape else ()
        pairs.append((LocalPiece(e.key, e.dtype, e.shape, Box(offsets, shape), t), e))
        temps.append(t)
    try:
        reader.fill_all(pairs, workers=workers, budget=budget, what=f"export {reader.root}")
    except IntegrityError as e:
        raise IntegrityError(f"export of checkpoint {reader.root}: {e}") from None
    return [as_bytes(t if t.dtype == o.dtype else t.to(o.dtype))
            for (o, _, _), t in zip(batch, temps)]
