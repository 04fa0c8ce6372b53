"""Full verification of a committed checkpoint: every byte of every file is checked."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .errors import CheckpointError
from .format import shards
from .format.checksum import crc32
from .progress import Progress
from .reader import ChunkReader, _Files, file_path
from .storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)
_READ = 64 << 20  # bytes per read while streaming a tensor; a multiple of any block


@dataclass
class VerifyReport:
    path: str
    files: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(path: str, storage_options: dict | None = None) -> VerifyReport:
    """Read every file of the checkpoint at ``path`` and check sizes, header checksums,
    every block checksum, and that each chunk the manifest lists is in its file; files
    an incremental checkpoint references in its siblings are checked the same way (a
    missing or corrupt one is named), and every block of an encoded chunk is decoded
    and checked against its content hash.

    Single process; blocking I/O of the whole checkpoint; memory bounded by one 64 MiB
    buffer. Never raises for a damaged checkpoint: problems are listed in the report
    (NotCommittedError / ManifestError become a one-line problem too)."""
    from .protocol.restore import read_manifest

    storage, root = make_storage(path, storage_options)
    report = VerifyReport(root)
    try:
        m, _ = read_manifest(storage, root)
    except CheckpointError as e:
        report.problems.append(str(e))
        return report
    reader = ChunkReader(storage, root, m)
    progress = Progress(f"verify {root}", sum(f.size for f in m.files), log)
    for fi, f in enumerate(m.files):
        report.files += 1
        try:
            tensors, block = reader.header(fi)
            covered = 8 + f.header_len
            for name, st in sorted(tensors.items(), key=lambda kv: kv[1].start):
                check_tensor(storage, file_path(storage, root, f), st, block)
                covered += st.nbytes
                progress.add(st.nbytes)
            if covered != f.size:
                raise CheckpointError(f"shard file {_name(f)}: {f.size - covered} bytes not "
                                      "described by its header")
            report.bytes_checked += f.size
        except (CheckpointError, OSError) as e:
            report.problems.append(str(e))
        log.info("verified %d/%d files", fi + 1, len(m.files))
    for key, t in m.tensors.items():
        for ci, fi in enumerate(t.chunks.file.tolist()):
            if t.encoded(ci) is not None:
                _check_encoded(reader, t, ci, report)
                continue
            try:
                tensors, _ = reader.header(fi)
            except (CheckpointError, OSError):
                continue  # already reported above
            st = tensors.get(key)
            want = tuple(int(x) for x in t.chunks.sizes[ci])
            if st is None or st.shape != want or st.dtype != t.dtype:
                report.problems.append(f"tensor {key!r} chunk {ci}: not in {m.files[fi].name} "
                                       "as the manifest says")
    return report


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
                 read: int = _READ) -> None:
    """Read stored tensor ``st`` of file ``path`` ``read`` bytes at a time and check
    every block against its checksum. Blocking I/O of its bytes; memory one read.
    Raises CheckpointError naming the file, tensor and block."""
    step = max(block, read // block * block)
    for pos in range(0, st.nbytes, step):
        n = min(step, st.nbytes - pos)
        data = storage.read(path, st.start + pos, n)
        if len(data) != n:
            raise CheckpointError(f"shard file {path}: tensor {st.name!r} is truncated")
        first = pos // block
        got = [crc32(memoryview(data)[i:i + block]) for i in range(0, n, block)]
        want = st.crcs[first:first + len(got)].tolist()
        if got != want:
            bad = first + next(i for i, (g, w) in enumerate(zip(got, want)) if g != w)
            raise CheckpointError(f"shard file {path}: tensor {st.name!r} fails its checksum "
                                  f"in block {bad} (bytes {bad * block}..)")
