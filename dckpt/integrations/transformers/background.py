"""The model folder of a sharded model's checkpoint (FSDP1/FSDP2, TP), written by the
ranks together in the background after the commit.

Each rank's shards hold a slice of every tensor, so the committed files cannot be the
model folder's: after the placement every rank starts a thread that assembles a
balanced share of whole tensors by range reads from the committed files and writes it
into ``checkpoint-N`` (:func:`dckpt.interop.hf_export_ranks.export_share`: no
collective, memory about the read budget); rank 0 writes the index last, once every
file is in place, so the folder loads only when complete. Training is not blocked; the
next save, a resume and the end of ``train()`` wait for the thread. A crash in it leaves
a committed checkpoint that resumes and a folder ``from_pretrained`` refuses (no
index); a resume from that checkpoint writes the folder again (:meth:`FolderExport.
resume`). An export error is logged, never raised into training: the checkpoint itself
is complete.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ... import _faults
from ...protocol.collectives import Comm
from ..common import modelfolder as folder

log = logging.getLogger(__name__)


class FolderExport:
    """One background export per process at a time. ``start`` and ``join`` are called
    by the training thread and, with the fast tier, by its copy thread (an export
    starts once a durable copy landed): both are thread-safe. The export runs in a
    daemon thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _thread
        self._starting = threading.Lock()  # one start at a time
        self.error: BaseException | None = None
        # what the folder is exported from: model 0's keys, or a DeepSpeed engine's tag
        # nested in the checkpoint (its fp32 masters, written in the model's dtype)
        self.prefix: str = folder.PREFIX
        self.dtype: Any = None

    def start(self, final: str, save_id: str | None) -> None:
        """Begin writing ``final``'s model folder (every rank, after the commit of save
        ``save_id``: the thread first waits until ``final`` holds that commit, placed by
        rank 0; None: ``final`` is committed already). Waits for the export before.
        No collective; returns once the thread runs."""
        with self._starting:
            self.join()
            comm = Comm()
            rank, world = comm.rank, comm.size
            self.error = None
            t = threading.Thread(target=self._run, args=(final, save_id, rank, world),
                                 name="dckpt-model-folder", daemon=True)
            t.start()  # started before it is published: a join never sees it unstarted
            with self._lock:
                self._thread = t

    def _run(self, final: str, save_id: str | None, rank: int, world: int) -> None:
        from ...interop.hf_export_ranks import WAIT_S, export_share

        try:
            if save_id is not None:
                _await_commit(final, save_id, WAIT_S)
            _faults.fault("export-start", rank)
            # overwrite: the checkpoint's own files stay; an earlier export's go
            export_share(final, final, rank, world, prefix=self.prefix, dtype=self.dtype,
                         overwrite=True,
                         before_index=lambda: _faults.fault("export", rank))
        except BaseException as e:  # logged: the checkpoint itself is complete
            self.error = e
            log.error("the model folder of %s was not written (rank %d): %s; the checkpoint "
                      "resumes; a resume from it writes the folder again", final, rank, e)

    def join(self) -> None:
        """Wait for the export in flight, if any. Blocking; never raises."""
        with self._lock:
            t, self._thread = self._thread, None
        if t is not None:
            t.join()

    def resume(self, path: str) -> None:
        """After a resume from ``path``: when its model folder is incomplete (a crash
        during its export), write it again in the background. Every rank (each reads
        the folder listing: the answer is the same once nothing writes there). No
        collective."""
        problems = folder.check_loadable(path)
        if problems:
            log.warning("%s: its model folder is incomplete (%s): writing it again in the "
                        "background", path, problems[0])
            self.start(path, None)


def _await_commit(final: str, save_id: str, wait_s: float) -> None:
    """Wait until ``final``'s manifest is that of save ``save_id`` (rank 0 places the
    folder after the commit every rank saw). Polls; local I/O. Raises TimeoutError."""
    from ..common.place import read_manifest

    deadline = time.monotonic() + wait_s
    delay = 0.02
    while True:
        try:
            if os.path.exists(os.path.join(final, "manifest.json")) and \
                    read_manifest(final).save_id == save_id:
                return
        except Exception:  # noqa: BLE001 - not placed yet, or being replaced
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{final} does not hold save {save_id} after {wait_s:.0f} s")
        time.sleep(delay)
        delay = min(0.5, delay * 1.5)
