"""Progress lines on long saves, loads and verification."""
from __future__ import annotations

import logging

import torch

import dckpt
from dckpt.progress import Progress
from dckpt.catalog.verify import verify_checkpoint


def test_line_reports_fraction_rate_and_time_left():
    p = Progress("load x (rank 0)", 4 << 30, logging.getLogger("t"), every=10)
    assert p.line(1 << 30, 2.0) == ("load x (rank 0): 1.0/4.0 GiB (25%), 0.54 GB/s, "
                                    "about 6 s left")
    assert p.line(0, 0.0) == "load x (rank 0): 0.0/4.0 GiB (0%), 0.00 GB/s"
    assert Progress("v", 0, logging.getLogger("t")).line(0, 1.0) == "v: 0.0/0.0 MiB, 0.00 GB/s"
    small = Progress("s", 3 << 20, logging.getLogger("t"))
    assert small.line(4 << 20, 1.0) == "s: 4.0/3.0 MiB (100%), 0.00 GB/s"


def test_logs_at_most_once_per_period(caplog):
    caplog.set_level(logging.INFO, logger="t")
    p = Progress("op", 100, logging.getLogger("t"), every=3600)
    for _ in range(10):
        p.add(10)
    assert p.done == 100 and not caplog.records  # an operation shorter than the period
    p = Progress("op", 100, logging.getLogger("t"), every=0)
    p.add(60)
    assert [r.getMessage() for r in caplog.records][-1].startswith("op: 0.0/0.0 MiB (60%)")


def test_save_load_and_verify_report_progress(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DCKPT_PROGRESS_SECONDS", "0")  # a line for every step
    caplog.set_level(logging.INFO, logger="dckpt")
    sd = {"w": torch.randn(512, 512), "b": torch.randn(3)}
    path = str(tmp_path / "c")
    dckpt.save(sd, path)
    dckpt.load({"w": torch.zeros(512, 512), "b": torch.zeros(3)}, path)
    assert verify_checkpoint(path).ok
    lines = [r.getMessage() for r in caplog.records]
    for what in (f"save {path} (rank 0): ", f"load {path} (rank 0): ", f"verify {path}: "):
        mine = [x for x in lines if x.startswith(what)]
        assert mine, (what, lines)
        assert "(100%)" in mine[-1], mine
