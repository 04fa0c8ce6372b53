"""An adversarial review of DckptAccelerator (issue 51's fixes), one process, CPU, real
Accelerate, next to the stock ``accelerate.Accelerator`` where stock has the behaviour.
Each test pins a defect found by running the adapter as users' scripts do; marked
fixed with its test (a stock parametrisation runs and passes beside it)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from .hf_helpers import accelerator as _accelerator, params  # noqa: E402
from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)

import dckpt  # noqa: E402


def accelerator(kind: str, project_dir=None, **kw):
    """:func:`.hf_helpers.accelerator`, with automatic naming under a project_dir."""
    return _accelerator(kind, project_dir, auto=project_dir is not None, **kw)


def kinds(reason: str) -> list:
    """stock (the behaviour a drop-in must keep) and dckpt; ``reason``: the defect
    the dckpt run pinned before its fix."""
    return ["stock", "dckpt"]


# ----------------------------------------------- a parameter that never had a gradient
class WithUnusedHead(nn.Module):
    """A model with a parameter the loss never reaches (BERT's pooler under MLM, an
    unused head or expert): Adam keeps no state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(3, 2)
        self.pooler = nn.Linear(3, 2)

    def forward(self, x):
        return self.body(x)


@pytest.mark.parametrize("kind", kinds(
    "an optimizer holding a parameter that never received a gradient (no state for it) "
    "is saved without its entries and the load refuses it: StateMismatchError 'the "
    "checkpoint lacks 6 key(s)'; stock resumes it"))
def test_an_optimizer_with_a_parameter_that_never_had_a_gradient_resumes(tmp_path, kind):
    def make():
        acc = accelerator(kind)
        torch.manual_seed(0)
        m = WithUnusedHead()
        o = torch.optim.AdamW(m.parameters(), lr=0.1)
        return (acc, *acc.prepare(m, o))

    def train(acc, m, o, n, seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            acc.backward(m(torch.randn(4, 3, generator=g)).pow(2).mean())
            o.step()
            o.zero_grad()
    acc, m, o = make()
    train(acc, m, o, 2, 0)
    acc.save_state(str(tmp_path / "ck"))
    train(acc, m, o, 2, 1)
    want = params(m)
    acc, m, o = make()
    acc.load_state(str(tmp_path / "ck"))
    train(acc, m, o, 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(want, params(m)))


# ------------------------------------------------ a user's file named like dckpt's own
@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("kind", kinds(
    "a user's manifest.json in the checkpoint folder (written before the save) is "
    "silently replaced by dckpt's manifest: a file dckpt did not write is deleted "
    "without an error; stock keeps it"))
def test_a_users_file_named_like_dckpts_manifest_is_never_silently_deleted(
        tmp_path, kind, async_save):
    if kind == "stock" and async_save:
        pytest.skip("stock has no async_save")
    out = tmp_path / "ck"
    out.mkdir()
    mine = b'{"dataset": "train-00001.jsonl", "rows": 1024}'
    (out / "manifest.json").write_bytes(mine)
    acc = accelerator(kind, async_save=async_save)
    acc.prepare(nn.Linear(2, 2))
    try:
        acc.save_state(str(out))
        acc.end_training()
    except dckpt.CheckpointError:
        # refusing loudly is fine: then the user's file must be untouched
        assert (out / "manifest.json").read_bytes() == mine
        return
    kept = [p for p in out.rglob("*") if p.is_file() and p.read_bytes() == mine]
    assert kept, f"the user's manifest.json is gone: {sorted(os.listdir(out))}"


# ------------------------------------------- async: the returned folder, written into
@pytest.mark.parametrize("kind", kinds(
    "with async_save and automatic naming, save_state returns a path that does not "
    "exist until the background placement: writing a file into it (as into stock's "
    "returned folder) raises FileNotFoundError, depending on timing"))
def test_a_file_written_into_the_folder_save_state_returned_lands_in_the_checkpoint(
        tmp_path, kind, monkeypatch):
    # a slow commit (a real store): the placement comes a moment after save_state returns
    monkeypatch.setenv("DCKPT_FAULT", "place:0:sleep=1")
    acc = accelerator(kind, tmp_path / "p", async_save=True)
    m = nn.Linear(2, 2)
    m, o = acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    path = pathlib.Path(acc.save_state())
    (path / "meta.json").write_text('{"epoch": 3}')
    acc.end_training()
    assert (tmp_path / "p" / "checkpoints" / "checkpoint_0" / "meta.json").read_text() == \
        '{"epoch": 3}'


# ------------------------------------------------------------------------ a rewind
def test_a_rewind_to_an_older_checkpoint_then_save_state_saves_and_resumes_it(tmp_path):
    def make():
        acc = accelerator("dckpt", tmp_path / "p")
        m = nn.Linear(2, 2)
        return (acc, *acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    acc, m, o = make()
    for i in range(3):
        with torch.no_grad():
            m.weight.fill_(i)
        acc.save_state()
    acc, m, o = make()
    acc.load_state(str(tmp_path / "p" / "checkpoints" / "checkpoint_0"))  # rewind
    assert float(m.weight.detach()[0, 0]) == 0.0
    with torch.no_grad():
        m.weight.fill_(7)
    acc.save_state()  # raised ValueError: checkpoint_1 exists
    acc, m, o = make()
    acc.load_state()
    assert float(m.weight.detach()[0, 0]) == 7.0  # the run's newest, not the abandoned branch


def test_a_rewind_on_a_host_whose_clock_is_behind_resumes_and_keeps_the_new_saves(
        tmp_path, monkeypatch):
    def make():
        acc = accelerator("dckpt", tmp_path / "p", total_limit=3)
        m = nn.Linear(2, 2)
        return (acc, *acc.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1)))
    acc, m, o = make()
    for i in range(4):  # checkpoint_1.._3 remain
        with torch.no_grad():
            m.weight.fill_(i)
        acc.save_state()
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() - 86400.0)
    acc, m, o = make()
    acc.load_state(str(tmp_path / "p" / "checkpoints" / "checkpoint_2"))  # rewind
    acc.project_configuration.iteration = 4  # as stock's message says to
    for v in (10, 11, 12):  # checkpoint_4, _5, _6
        with torch.no_grad():
            m.weight.fill_(v)
        acc.save_state()
    monkeypatch.setattr(time, "time", real)
    names = sorted(os.listdir(tmp_path / "p" / "checkpoints"))
    assert names == ["checkpoint_4", "checkpoint_5", "checkpoint_6"], names
    acc, m, o = make()
    acc.load_state()
    assert float(m.weight.detach()[0, 0]) == 12.0


# ------------------------------------------------------------ kills in the placement
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from torch import nn
    from dckpt.integrations.accelerate import DckptAccelerator
    out = sys.argv[1]
    if os.environ.get("KILL_IN_ADOPTION"):
        # killed right after the committed folder was exchanged with what stood at the
        # name, before the files found there are moved into it
        import dckpt.integrations.common.place as pl
        pl.adopt_entries = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    acc = DckptAccelerator(cpu=True)
    acc.prepare(nn.Linear(2, 2))
    acc.save_state(out)
""")


def _killed_save(tmp_path, env: dict) -> pathlib.Path:
    """A subprocess saves into ``root/ck``, which holds the user's tokenizer.json, and
    is SIGKILLed in the placement. Returns ``root/ck``."""
    out = tmp_path / "root" / "ck"
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text("mine")
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    e = dict(os.environ)
    e.pop("DCKPT_FAULT", None)
    e.update(env)
    r = subprocess.run([sys.executable, str(child), str(out)], env=e, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == -9, r.stdout[-2000:] + r.stderr[-2000:]
    return out


def test_a_kill_in_the_placement_never_loses_the_users_files_at_the_name(tmp_path):
    out = _killed_save(tmp_path, {"KILL_IN_ADOPTION": "1"})
    acc = accelerator("dckpt")
    acc.prepare(nn.Linear(2, 2))
    acc.save_state(str(out.parent / "next"))  # any later save in the same folder
    assert (out / "tokenizer.json").exists(), sorted(out.parent.rglob("tokenizer.json"))


def test_a_load_of_a_name_whose_save_was_killed_before_placement_raises_checkpointerror(
        tmp_path):
    out = _killed_save(tmp_path, {"DCKPT_FAULT": "place:0:kill"})
    acc = accelerator("dckpt")
    acc.prepare(nn.Linear(2, 2))
    with pytest.raises(dckpt.CheckpointError):
        acc.load_state(str(out))
