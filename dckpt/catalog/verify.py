"""Full verification of a committed checkpoint, or of what this node holds of a fast-tier
step: every byte of every file is checked."""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from ..errors import CheckpointError, NotCommittedError
from ..format import shards
from ..format.dtypes import ITEMSIZE
from ..format.checksum import crc32
from ..progress import Progress
from ..engine.openfiles import OpenFiles as _Files
from ..engine.reader import ChunkReader, file_path, stored_name
from ..format.chunknames import bare
from ..format.chunknames import checked_stored
from ..storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)
_READ = 64 << 20  # bytes per read while streaming a tensor; a multiple of any block


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    views: tuple[int, ...] = ()  # a fast-tier step: the ranks whose view this node holds
    note: str = ""  # a fast-tier step: complete on this node, or which ranks are missing

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str, storage_options: dict | None = None) -> VerifyReport:
    """Read every file of the checkpoint at ``path`` and check sizes, header checksums,
    every block checksum, and that each chunk the manifest lists is in its file; files
    an incremental checkpoint references in its siblings are checked the same way (a
    missing or corrupt one is named), and every block of an encoded chunk is decoded
    and checked against its content hash. A fast-tier step (``local_root/step-<N>``,
    rank views ``manifest-<rank>.json``) is checked as this node holds it, see
    :func:`verify_local_step`.

    Single process; blocking I/O of the whole checkpoint; memory bounded by one 64 MiB
    buffer. Never raises for a damaged checkpoint: problems are listed in the report
    (NotCommittedError / ManifestError become a one-line problem too). Raises
    CheckpointError for a wrong path: nothing there ("no such path"), a file, or a root
    of checkpoints rather than one (naming them)."""
    from ..protocol.manifest_read import read_manifest

    storage, root = make_storage(path, storage_options)
    report = VerifyReport(root)
    try:
        m, _ = read_manifest(storage, root)
    except (NotCommittedError, NotADirectoryError) as e:  # a file raises the latter
        from .listing import expect_checkpoint

        if expect_checkpoint(storage, root, path) == "local":  # raises for a wrong path
            return verify_local_step(storage, root, root)
        report.problems.append(str(e))
        return report
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    progress = Progress(f"verify {root}", sum(f.size for f in m.files), log)
    _verify(storage, root, m, range(len(m.files)), report, progress)
    return report


def verify_local_step(storage, where: str, shown: str) -> VerifyReport:
    """Check what this node holds of the fast-tier step ``where``: every rank view here
    is readable, all are of one save and world size, and each rank's own files (its
    data and replica files) pass the same checks as a durable checkpoint's, chunk by
    chunk against that rank's view. Views of ranks on other nodes are not expected
    (``report.note`` says whether the step is complete on this node). Blocking I/O of
    this node's files of the step; never raises for damage (see ``problems``)."""
    from .local import read_local_step

    step = read_local_step(storage, where, shown)
    report = VerifyReport(where, views=tuple(sorted(step.views)), note=step.state())
    report.problems += step.problems  # unreadable views, mixed saves, missing files
    done: set[str] = set()
    todo = []
    for r, view in sorted(step.views.items()):
        # a file missing or of the wrong size is already a problem above
        idx = [i for i in step.held_files(r) if view.files[i].name not in done
               and step.sizes.get(view.files[i].name) == view.files[i].size]
        done |= {view.files[i].name for i in idx}
        todo.append((view, idx))
    progress = Progress(f"verify {where}", sum(v.files[i].size for v, idx in todo for i in idx),
                        log)
    for view, idx in todo:
        _verify(storage, where, view, idx, report, progress)
    return report


def _placed(m, wanted: list[int]) -> dict[str, list[tuple[int, int]]]:
    """{key: [(chunk, file)]}: the chunks stored in the files ``wanted``, by chunk. A
    few files of many (a fast-tier step's node verifying its ranks' files) are looked
    up by rule (``Chunks.in_file``: no tensor's chunks expanded, issue 47); otherwise
    every tensor's file list is scanned, O(chunks)."""
    mine = set(wanted)
    out = {}
    for key, t in m.tensors.items():
        if len(mine) * 8 < len(m.files):
            pairs = sorted((ci, fi) for fi in mine for ci in t.chunks.in_file(fi).tolist())
        else:
            pairs = [(ci, fi) for ci, fi in enumerate(t.chunks.file.tolist()) if fi in mine]
        out[key] = pairs
    return out


def _verify(storage, root: str, m, file_indices, report: VerifyReport,
            progress: Progress) -> None:
    """Check the files ``file_indices`` of manifest ``m`` (header, every block, every
    byte described) and that each chunk the manifest puts in one of them is there."""
    reader = ChunkReader(storage, root, m)
    wanted = list(file_indices)
    # (file index, stored name) -> (the chunk's offsets in its tensor, tensor shape, key);
    # a file holding several chunks of a key names them key@offsets, as the writer's
    # stored_names does (a name never stands for two chunks)
    where = {}
    placed = _placed(m, wanted)
    for key, t in m.tensors.items():
        several = {fi for fi, k in Counter(fi for _, fi in placed[key]).items() if k > 1}
        for ci, fi in placed[key]:
            offs = t.chunks.box(ci)[0]
            named = key if bare(key, 2 if fi in several else 1) else stored_name(key, offs)
            where[(fi, named)] = (offs, t.shape, key)
    for n, fi in enumerate(wanted):
        f = m.files[fi]
        report.files += 1
        try:
            tensors, block = reader.header(fi)
            covered = 8 + f.header_len
            for name, st in sorted(tensors.items(), key=lambda kv: kv[1].start):
                check_tensor(storage, file_path(storage, root, f), st, block,
                             chunk=where.get((fi, name)))
                covered += st.nbytes
                progress.add(st.nbytes)
            if covered != f.size:
                raise CheckpointError(f"shard file {_name(f)}: {f.size - covered} bytes not "
                                      "described by its header")
            report.bytes_checked += f.size
        except (CheckpointError, OSError) as e:
            report.problems.append(str(e))
        log.info("verified %d/%d files", n + 1, len(wanted))
    for key, t in m.tensors.items():
        count = Counter(fi for _, fi in placed[key])  # the key's chunks per file
        for ci, fi in placed[key]:  # a fast-tier view's chunks of other nodes: not here
            if t.encoded(ci) is not None:
                _check_encoded(reader, t, ci, report)
                continue
            try:
                tensors, _ = reader.header(fi)
            except (CheckpointError, OSError):
                continue  # already reported above
            offs, want = t.chunks.box(ci)
            try:  # key@offsets: strided; the offsets the file records must be these
                st = checked_stored(tensors, key, offs, _name(m.files[fi]), count[fi])
            except CheckpointError as e:
                report.problems.append(str(e))
                continue
            if st is None or st.shape != want or st.dtype != t.dtype:
                report.problems.append(f"tensor {key!r} chunk {ci}: not in {m.files[fi].name} "
                                       "as the manifest says")



def _name(f) -> str:
    return f"{f.dir}/{f.name}" if f.dir else f.name


def _check_encoded(reader: ChunkReader, t, ci: int, report: VerifyReport) -> None:
    """Decode every block of encoded chunk ``ci`` (reading its references and anchors);
    the first failure is reported."""
    with _Files(reader.storage) as files:
        for k in range(len(t.encoded(ci))):
            try:
                reader.raw_block(t, ci, k, files)
            except (CheckpointError, OSError) as e:
                report.problems.append(str(e))
                return


def check_tensor(storage, path: str, st: shards.StoredTensor, block: int,
                 read: int = _READ, *, chunk: tuple | None = None) -> None:
    """Read stored tensor ``st`` of file ``path`` ``read`` bytes at a time and check
    every block against its checksum. Blocking I/O of its bytes; memory one read.
    Raises CheckpointError naming the file, the failing byte range in the file (closed:
    first..last byte), and the tensor region those bytes hold. ``chunk``: (offsets,
    tensor shape, key), where the stored chunk sits in its tensor, when the caller knows."""
    step = max(block, read // block * block)
    for pos in range(0, st.nbytes, step):
        n = min(step, st.nbytes - pos)
        data = storage.read(path, st.start + pos, n)
        if len(data) != n:
            raise CheckpointError(
                f"shard file {path}: tensor {st.name!r} is truncated: the file ends within "
                f"bytes {st.start + pos}..{st.start + pos + n - 1} (the tensor is bytes "
                f"{st.start}..{st.start + st.nbytes - 1} of the file)")
        first = pos // block
        got = [crc32(memoryview(data)[i:i + block]) for i in range(0, n, block)]
        want = st.crcs[first:first + len(got)].tolist()
        if got != want:
            bad = first + next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            lo, hi = bad * block, min((bad + 1) * block, st.nbytes) - 1
            raise CheckpointError(
                f"shard file {path}: tensor {st.name!r} fails its checksum in block {bad}: "
                f"bytes {st.start + lo}..{st.start + hi} of the file (closed range) hold "
                f"{region(st, lo, hi, chunk)}")


def region(st: shards.StoredTensor, lo: int, hi: int, chunk: tuple | None = None) -> str:
    """The tensor elements that bytes ``lo..hi`` (closed) of stored tensor ``st`` hold,
    e.g. ``w[64, 0]..w[95, 7] (row-major in its saved chunk w[64:128, 0:8])``: indices
    in the whole tensor when ``chunk`` ((offsets, tensor shape, key): where the stored
    chunk sits) is known, else in the stored chunk. Pure."""
    name = chunk[2] if chunk is not None else st.name
    if not st.shape:
        return f"{name} (a scalar)"
    size = ITEMSIZE.get(st.dtype, 1)
    off, whole = chunk[:2] if chunk is not None and len(chunk[0]) == len(st.shape) else \
        ((0,) * len(st.shape), None)

    def at(flat: int) -> str:
        idx = []
        for dim in reversed(st.shape):
            idx.append(flat % dim)
            flat //= dim
        return f"{name}[{', '.join(str(i + o) for i, o in zip(reversed(idx), off))}]"

    text = f"{at(lo // size)}..{at(hi // size)} (row-major"
    if whole is None:
        return text + ", indices within the stored chunk)"
    if tuple(whole) != tuple(st.shape):
        text += f" in its saved chunk {name}[" + ", ".join(
            f"{o}:{o + d}" for o, d in zip(off, st.shape)) + "]"
    return text + ")"
