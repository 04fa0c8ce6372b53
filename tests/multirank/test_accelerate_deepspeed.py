"""DckptAccelerator under DeepSpeed ZeRO (Accelerate's DeepSpeedPlugin, CPU, gloo,
torchrun), next to stock's Accelerator: ``save_state`` is one dckpt commit holding each
engine's state nested (no pickle), ``load_state`` resumes exactly at the same size and
at another size and ZeRO stage, where stock refuses. The job: jobs/accelerate_ds_job.py."""
from __future__ import annotations

import os
import re

import pytest

from .lightning_run import job_env, run_cmd, torchrun

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "accelerate_ds_job.py")


def run(impl: str, root, n: int, stage: int, mode: str) -> str:
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    rc, text = run_cmd(torchrun(JOB, n) + [impl, str(root), str(stage), mode], 300, env=env)
    assert rc == 0, text[-4000:]
    return text


def lines(text: str, head: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.match(rf"^{head} \d", ln)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("accds")
    stock = run("stock", base / "stock", 2, 2, "save")
    dck = run("dckpt", base / "dckpt", 2, 2, "save")
    return base, lines(stock, "DONE"), lines(dck, "DONE")


def test_save_state_under_deepspeed_is_one_commit_with_stocks_losses(saved):
    base, stock, dck = saved
    assert dck and sorted(dck) == sorted(stock)
    ck = base / "dckpt" / "checkpoints" / "checkpoint_0"
    held = os.listdir(ck)
    assert "manifest.json" in held and not any(n.endswith((".pt", ".pkl", ".bin"))
                                               for n in held), held


def test_load_state_resumes_exactly_at_the_same_size(saved):
    base, _, dck = saved
    text = run("dckpt", base / "dckpt", 2, 2, "load")
    got = lines(text, "LOADED")
    assert len(got) == 2 and all(" ok " in ln for ln in got), text[-3000:]
    # the three steps after the load: the uninterrupted run's last three losses
    want = dck[0].split(" ", 2)[2]
    assert all(ln.split(" ok ")[1] == "[" + ", ".join(want.strip("[]").split(", ")[3:]) + "]"
               for ln in got), (got, want)


def test_load_state_at_three_ranks_under_zero3_where_stock_refuses(saved):
    base, _, _ = saved
    text = run("stock", base / "stock", 3, 2, "load")
    assert all("RAISED" in ln for ln in lines(text, "LOADED")), text[-3000:]
    text = run("dckpt", base / "dckpt", 3, 3, "load")
    got = lines(text, "LOADED")
    assert len(got) == 3 and all(" ok " in ln for ln in got), text[-3000:]
