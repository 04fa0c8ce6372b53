"""The Trainer's background model-folder export (``transformers/background.py``) is
started by the fast tier's copy thread while the training thread joins it at the next
save: the two never race into a raw RuntimeError ("cannot join thread before it is
started") and no started export goes unjoined."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("transformers")


def test_start_from_one_thread_and_join_from_another_never_raises(monkeypatch):
    from dckpt.integrations.transformers.background import FolderExport

    ran = []
    monkeypatch.setattr(FolderExport, "_run",
                        lambda self, final, sid, rank, world: ran.append(final))
    ex = FolderExport()
    errors: list[BaseException] = []
    stop = threading.Event()

    def starter() -> None:  # the copy thread: an export per landed copy
        try:
            for i in range(400):
                ex.start(f"ck-{i}", None)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=starter)
    t.start()
    try:
        while not stop.is_set():  # the training thread: the next save joins the export
            ex.join()
            time.sleep(0)  # let the starter run
    except BaseException as e:  # noqa: BLE001
        errors.append(e)
    t.join()
    ex.join()
    assert not errors, repr(errors[0])
    assert len(ran) == 400  # every export ran, none lost
