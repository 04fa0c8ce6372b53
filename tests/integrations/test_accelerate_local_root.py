"""DckptAccelerator with ``local_root`` (the fast tier), one process (real Accelerate,
CPU): saves commit locally and are copied to their names in the background; retention
(``total_limit``) takes name and slot together; with the durable store down the saves
go on and a load reads the fast tier; a damaged fast-tier commit falls back to the
name's durable copy. The multi-rank kill cases are in
tests/multirank/test_accelerate_local_root.py."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402


def make(project: str, local: str | None, *, total_limit=None, async_save=False,
         options=None, keep_last_local=2, auto=True):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from dckpt.integrations.accelerate import DckptAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = DckptAccelerator(cpu=True, local_root=local, async_save=async_save,
                           storage_options=options, keep_last_local=keep_last_local,
                           project_config=ProjectConfiguration(
                               project_dir=project, automatic_checkpoint_naming=auto,
                               total_limit=total_limit))
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    m, o = acc.prepare(m, o)
    return acc, m, o


def train(acc, m, o, n: int = 1) -> None:
    for _ in range(n):
        acc.backward(m(torch.randn(4, 8)).square().sum())
        o.step()
        o.zero_grad()
        acc.step += 1


def state(m) -> dict:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def names(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


@pytest.mark.parametrize("async_save", [False, True])
def test_saves_are_copied_rotated_and_the_newest_loads(tmp_path, async_save):
    proj, local = str(tmp_path / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local, total_limit=2, async_save=async_save)
    saved = []
    for _ in range(3):
        train(acc, m, o)
        where = acc.save_state()
        saved.append(state(m))
    assert str(where) == os.path.join(proj, "checkpoints", "checkpoint_2")
    acc.end_training()  # waits for the copies
    assert names(tmp_path / "p" / "checkpoints") == ["checkpoint_1", "checkpoint_2"]
    for n in ("checkpoint_1", "checkpoint_2"):
        report = verify_checkpoint(os.path.join(proj, "checkpoints", n))
        assert report.ok, report.problems
    assert len(os.listdir(local)) == 2  # checkpoint_0's slot went with its name
    acc, m, o = make(proj, local, total_limit=2, async_save=async_save)
    acc.load_state()
    assert all(torch.equal(v, saved[2][k]) for k, v in m.state_dict().items())
    assert acc.step == 3 and acc.project_configuration.iteration == 3


def test_store_down_saves_go_on_and_load_reads_the_fast_tier(tmp_path, caplog):
    """The durable store refuses every write (an endpoint where nothing listens): each
    save commits locally, its copy fails (logged), training goes on, and a load in a
    new accelerator takes the newest fast-tier commit."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    pytest.importorskip("s3fs")
    proj, local = "s3://nowhere/proj", str(tmp_path / "local")
    acc, m, o = make(proj, local, total_limit=2, options=opts)
    for _ in range(2):
        train(acc, m, o)
        with caplog.at_level("ERROR"):
            acc.save_state()
    want = state(m)
    acc.end_training()
    assert "durable copy of" in caplog.text
    acc, m, o = make(proj, local, total_limit=2, options=opts)
    acc.load_state()
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
    assert acc.step == 2 and acc.project_configuration.iteration == 2


def test_a_damaged_fast_tier_commit_falls_back_to_its_durable_copy(tmp_path, caplog):
    proj, local = str(tmp_path / "p"), str(tmp_path / "local")
    acc, m, o = make(proj, local)
    train(acc, m, o)
    acc.save_state()
    want = state(m)
    acc.end_training()
    [slot] = os.listdir(local)
    data = [f for f in os.listdir(os.path.join(local, slot)) if f.startswith("data-")]
    with open(os.path.join(local, slot, data[0]), "r+b") as f:  # a flipped byte
        f.seek(-8, 2)
        b = f.read(1)
        f.seek(-8, 2)
        f.write(bytes([b[0] ^ 0xFF]))
    acc, m, o = make(proj, local)
    with caplog.at_level("WARNING"):
        acc.load_state()
    assert "(fast tier) could not be loaded" in caplog.text
    assert all(torch.equal(v, want[k]) for k, v in m.state_dict().items())
