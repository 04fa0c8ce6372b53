"""DckptAccelerator with ``project_dir`` on S3 (a real S3-compatible server: moto's, on
loopback): automatic naming, ``total_limit`` in commit order, a resume in a new process
state, a damaged newest checkpoint passed over, and the store down at start-up. One
process (real Accelerate, CPU)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from .hf_helpers import fresh_accelerate_state  # noqa: E402,F401 (autouse)

from dckpt.catalog.verify import verify_checkpoint  # noqa: E402
from dckpt.errors import CheckpointError  # noqa: E402


def make(url: str, options: dict, total_limit=None):
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    from dckpt.integrations.accelerate import DckptAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = DckptAccelerator(cpu=True, storage_options=options, project_config=ProjectConfiguration(
        project_dir=url, automatic_checkpoint_naming=True, total_limit=total_limit))
    torch.manual_seed(0)
    m = nn.Linear(8, 8)
    o = torch.optim.AdamW(m.parameters(), lr=0.1)
    s = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
    m, o, s = acc.prepare(m, o, s)
    return acc, m, o, s


def step(acc, m, o, s) -> None:
    acc.backward(m(torch.randn(4, 8)).square().sum())
    o.step()
    s.step()
    o.zero_grad()


def names(url: str, options: dict) -> list[str]:
    import boto3

    bucket, _, prefix = url[len("s3://"):].partition("/")
    resp = boto3.client("s3", endpoint_url=options["endpoint_url"]).list_objects_v2(
        Bucket=bucket, Prefix=prefix + "/checkpoints/")
    return sorted({o["Key"][len(prefix) + len("/checkpoints/"):].split("/")[0]
                   for o in resp.get("Contents", [])})


def test_s3_project_dir_rotates_in_commit_order_and_resumes_the_newest(s3, caplog):
    url, opts = s3.url("acc"), s3.options
    acc, m, o, s = make(url, opts, total_limit=2)
    saved = []
    for _ in range(3):
        step(acc, m, o, s)
        where = acc.save_state()
        saved.append(({k: v.clone() for k, v in m.state_dict().items()},
                       s.state_dict()["last_epoch"], where))
    assert names(url, opts) == ["checkpoint_1", "checkpoint_2"]
    assert saved[-1][2] == f"{url}/checkpoints/checkpoint_2"
    for n in ("checkpoint_1", "checkpoint_2"):
        report = verify_checkpoint(f"{url}/checkpoints/{n}", opts)
        assert report.ok, report.problems
    acc, m, o, s = make(url, opts, total_limit=2)
    acc.load_state()
    assert all(torch.equal(v, saved[2][0][k]) for k, v in m.state_dict().items())
    assert s.state_dict()["last_epoch"] == saved[2][1]
    assert acc.project_configuration.iteration == 3
    # a damaged newest (a data file lost): skipped with a warning, the one before loads
    from fsspec.core import url_to_fs

    fs, p = url_to_fs(f"{url}/checkpoints/checkpoint_2", **opts)
    data = [f for f in fs.ls(p, detail=False) if f.endswith(".safetensors")]
    fs.rm(data[0])
    acc, m, o, s = make(url, opts, total_limit=2)
    with caplog.at_level("WARNING"):
        acc.load_state()
    assert "checkpoint_2 could not be loaded" in caplog.text
    assert all(torch.equal(v, saved[1][0][k]) for k, v in m.state_dict().items())
    assert acc.project_configuration.iteration == 3  # past every name present


def test_store_down_at_start_up_is_a_checkpoint_error(s3):
    """The endpoint refuses connections (the store is down): load_state raises a
    CheckpointError naming the folder, not botocore's exception."""
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    opts = {"endpoint_url": f"http://127.0.0.1:{port}",
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1}}
    acc, m, o, s = make(s3.url("down"), opts)
    with pytest.raises(CheckpointError, match="checkpoints"):
        acc.load_state()
