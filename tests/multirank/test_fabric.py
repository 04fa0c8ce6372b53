"""Lightning Fabric on dckpt (issue 37): fabric.save at 2 processes, fabric.load at 1
and 3, partial and strict=False loads, against Fabric's stock ModelParallelStrategy;
real processes (Fabric's launcher re-executes tests/multirank/jobs/fabric_job.py once
per extra device) under deadlines."""
from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("lightning_fabric")

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402

from .lightning_run import run_job  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "jobs", "fabric_job.py")
pytestmark = pytest.mark.slow


def run(root: str, strategy: str, devices: int, mode: str, *args: str,
        timeout: float = 240, output: list | None = None) -> dict:
    out = run_job(JOB, root, strategy, devices, mode, *args, timeout=timeout)
    if output is not None:
        output.append(out)
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_dckpt_save_at_2_load_at_1_and_3(tmp_path):
    """fabric.save at 2; fabric.load at 1 and at 3 restores the model and optimizer
    exactly (resharded), the step, and the scheduler through its load_state_dict; the
    remainder is what was not asked for; a partial load (the model alone) returns the
    rest; strict load of a key the checkpoint lacks raises a KeyError
    (dckpt's MissingKeyError), strict=False leaves it as it was; fabric.load_raw loads
    the model; a checkpoint saved with Fabric's ``filter`` (weights without biases,
    refused by the stock strategy) loads with strict=False, biases left as they were.
    The folders verify."""
    root = str(tmp_path)
    assert run(root, "dckpt", 2, "save") == {"saved": True, "filtered": "saved"}
    assert verify_checkpoint(os.path.join(root, "ckpt")).ok
    assert verify_checkpoint(os.path.join(root, "ckpt-filtered")).ok
    for n in (1, 3):
        r = run(root, "dckpt", n, "load")
        assert r == {"equal": True, "step": 3, "sched_restored": True, "sched_type": "StepLR",
                     "remainder": ["note"], "partial_remainder": ["note", "sched", "step"],
                     "partial_model_equal": True, "strict_missing": "MissingKeyError",
                     "nonstrict_missing": 1, "load_raw": True, "filtered_load": True}, n


def test_stock_save_at_2_load_at_3(tmp_path):
    """The same through Fabric's stock strategy (DCP + meta.pt): the model and optimizer
    reshard too, but a requested Stateful (the scheduler) is replaced by its state dict
    in ``state`` instead of being restored (its sharded path assigns
    ``state[key] = metadata.pop(key)``); dckpt's strategy calls load_state_dict."""
    root = str(tmp_path)
    assert run(root, "stock", 2, "save") == {"saved": True, "filtered": "NotImplementedError"}
    r = run(root, "stock", 3, "load")
    assert r["equal"] and r["step"] == 3 and r["remainder"] == ["note"]
    assert r["partial_remainder"] == ["note", "sched", "step"] and r["partial_model_equal"]
    assert r["strict_missing"] == "KeyError" and r["nonstrict_missing"] == 1
    assert not r["sched_restored"] and r["sched_type"] == "dict"
    assert r["load_raw"] == "ValueError"  # load_raw takes only a single-file checkpoint


def test_dckpt_local_root_save_at_2_load_from_the_fast_tier_and_at_3(tmp_path):
    """``local_root``: fabric.save commits node-locally and the copy to the path runs
    behind (the path is whole and verifies once the job ends); every load at 2 (full,
    partial, strict, load_raw) reads the fast tier, and at 3 the durable copy, with the
    same results as without the fast tier."""
    root, local = str(tmp_path / "run"), str(tmp_path / "local")
    os.makedirs(root)
    assert run(root, "dckpt", 2, "save", "--local-root", local) == {"saved": True,
                                                                     "filtered": "saved"}
    assert verify_checkpoint(os.path.join(root, "ckpt")).ok
    assert verify_checkpoint(os.path.join(root, "ckpt-filtered")).ok
    want = {"equal": True, "step": 3, "sched_restored": True, "sched_type": "StepLR",
            "remainder": ["note"], "partial_remainder": ["note", "sched", "step"],
            "partial_model_equal": True, "strict_missing": "MissingKeyError",
            "nonstrict_missing": 1, "load_raw": True, "filtered_load": True}
    for n in (2, 3):
        out: list = []
        assert run(root, "dckpt", n, "load", "--local-root", local, output=out) == want, n
        assert ("from the fast tier" in out[0]) == (n == 2), n


@pytest.mark.parametrize("strategy", ["dckpt", "stock"])
def test_state_keys_with_a_dot_load(tmp_path, strategy):
    """``fabric.save(path, {"model": m, "opt.main": opt})`` then ``fabric.load`` of the
    same keys restores the optimizer too, strict or not (the key is not cut at its
    dot), as the stock strategy does."""
    r = run(str(tmp_path), strategy, 2, "dotted")
    assert r == {"strict=True": True, "strict=False": True}
