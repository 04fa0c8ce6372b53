"""A committed checkpoint verified by every rank together before a framework commits to
resuming it: rank r checks files r, r+N, ... (every byte of each, as ``dckpt verify``),
so the whole checkpoint is read once, spread over the ranks. An adapter whose framework
reads the chosen checkpoint's metadata before any tensor (the transformers Trainer
reads ``trainer_state.json`` first) calls it to fall back *before* that choice is made."""
from __future__ import annotations

import logging

from ...catalog.verify import VerifyReport, _verify
from ...errors import CheckpointError, IntegrityError
from ...progress import Progress
from ...protocol.collectives import Comm, agree
from ...protocol.manifest_read import read_manifest
from ...storage.fsspec_storage import make_storage

log = logging.getLogger(__name__)


def verify_shared(path: str, storage_options: dict | None = None) -> None:
    """Check every file of the committed checkpoint at ``path`` (sizes, header and
    block checksums, each chunk where the manifest puts it), the files split over the
    ranks. Collective (one small all-gather); blocking I/O: each rank reads about
    1/N of the checkpoint, and every rank reads the manifest. Raises on every rank
    alike: IntegrityError naming each problem found, or the manifest's
    CheckpointError (nothing committed, invalid)."""
    comm = Comm()
    err: BaseException | None = None
    try:
        storage, root = make_storage(path, storage_options)
        m, _ = read_manifest(storage, root)
        report = VerifyReport(root)
        mine = range(comm.rank, len(m.files), comm.size)
        _verify(storage, root, m, mine, report,
                Progress(f"verify {root}", sum(m.files[i].size for i in mine), log))
        if report.problems:
            raise IntegrityError(f"{path}: " + "; ".join(report.problems[:5])
                                 + (f" (+{len(report.problems) - 5} more)"
                                    if len(report.problems) > 5 else ""))
    except CheckpointError as e:
        err = e
    agree(comm, err, f"verify {path}")
