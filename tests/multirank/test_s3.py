"""Multi-rank saves and loads on S3, against a real S3-compatible server (moto's, on
loopback): resharding 2 -> 3 ranks, torchrun jobs SIGKILLed mid-upload and mid-overwrite,
damaged and missing objects. The ranks find the endpoint and credentials in the usual AWS
environment variables only, as a real job would."""
from __future__ import annotations

import importlib.util
import json
import os
import time

import pytest
import torch

import dckpt
from dckpt.catalog import listing as catalog
from dckpt.catalog import gc as catalog_gc
from dckpt.protocol import intent
from dckpt.catalog.verify import verify_checkpoint

from .test_crash import Job as TorchrunJob
from .test_reshard import _load, _save

JOB = os.path.join(os.path.dirname(__file__), "jobs", "s3_job.py")
_spec = importlib.util.spec_from_file_location("s3_job", JOB)
s3_job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s3_job)
PART = {"default_block_size": 5 << 20}  # S3's smallest part: each shard file is multipart


def _env(server) -> dict[str, str]:
    from s3server import CREDENTIALS

    return dict(CREDENTIALS, AWS_ENDPOINT_URL=server.endpoint)


def _client(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint)


def _split(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def _objects(server, url: str) -> list[str]:
    bucket, prefix = _split(url)
    resp = _client(server).list_objects_v2(Bucket=bucket, Prefix=prefix + "/")
    return sorted(o["Key"][len(prefix) + 1:] for o in resp.get("Contents", []))


def _uploads(server, url: str) -> list[str]:
    bucket, prefix = _split(url)
    resp = _client(server).list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/")
    return sorted(u["Key"][len(prefix) + 1:] for u in resp.get("Uploads", []))


# ------------------------------------------------------------------ (a) resharding


def test_save_at_2_ranks_load_at_3(ranks, s3):
    """The reshard test's state (Shard on every dim, Replicate, uneven and empty
    shards) saved by 2 ranks to S3 and loaded by 3 into other placements, with a small
    read budget so regions are read in several ranged GETs."""
    url = s3.url("reshard") + "/step-1"
    env = _env(s3)
    ranks(2).run(_save, url, env=env, timeout=90)
    assert ranks(3).run(_load, url, 1 << 20, env=env, timeout=90) == [2, 2, 2]
    assert verify_checkpoint(url, s3.options).ok


# ------------------------------------------------------------- (d) damaged objects


def _load_error(path: str) -> str:
    """Load ``path`` (the reshard layout); the error every rank must raise, as text."""
    try:
        _load(path, 1 << 20)
    except dckpt.CheckpointError as e:
        return f"{type(e).__name__}: {e}"
    return "loaded"


def test_damaged_or_missing_object_is_named_by_load_and_verify(ranks, s3):
    """One shard object's bytes flipped (rewritten with boto3), another checkpoint's
    shard object deleted: a load at 3 ranks raises the same IntegrityError on every rank
    naming the object, and verify lists it. (3 ranks save too: one pool for the test.)"""
    env = _env(s3)
    base = s3.url("damaged")
    c = _client(s3)
    for damage in ("flipped", "missing"):
        url = f"{base}/{damage}"
        ranks(3).run(_save, url, env=env, timeout=90)
        bucket, prefix = _split(url)
        name = next(n for n in _objects(s3, url) if n.endswith("-00001.safetensors"))
        key = f"{prefix}/{name}"
        if damage == "flipped":
            body = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
            body[len(body) // 2] ^= 0x10  # in the data, past the header
            c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
        else:
            c.delete_object(Bucket=bucket, Key=key)
        errors = ranks(3).run(_load_error, url, env=env, timeout=90)
        assert len(set(errors)) == 1, errors  # every rank raises the same error
        assert errors[0].startswith("IntegrityError") and key in errors[0], errors[0]
        assert ("checksum" if damage == "flipped" else "missing") in errors[0], errors[0]
        report = verify_checkpoint(url, s3.options)
        assert not report.ok and any(key in p for p in report.problems), report.problems


# ------------------------------------------------------------- (b), (c) torchrun kills


def Job(server, url: str, rundir: str, *args: str):
    """``torchrun --nproc-per-node=2 s3_job.py``, endpoint and credentials in its env
    (test_crash's Job: output, kills and the end of every worker handled there)."""
    return TorchrunJob(url, rundir, "--storage-options", json.dumps(PART), *args,
                       script=JOB, env=_env(server))


def _generation(server, url: str, rows: int = s3_job.ROWS) -> int:
    """Load ``url`` into plain tensors in this process; it must be exactly one
    generation and verify."""
    want0 = s3_job.full(0, 2, rows)
    t = {"w": torch.zeros_like(want0["w"]), "r": torch.zeros_like(want0["r"]), "gen": -1}
    dckpt.load(t, url, storage_options=server.options)
    want = s3_job.full(t["gen"], 2, rows)
    for k in ("w", "r"):
        assert torch.equal(t[k], want[k]), f"{k} is not generation {t['gen']}: a mix"
    report = verify_checkpoint(url, server.options)
    assert report.ok, report.problems
    return t["gen"]


def _manifest_files(server, url: str) -> list[str]:
    from dckpt.protocol.restore import read_manifest
    from dckpt.storage.fsspec_storage import make_storage

    return sorted(f.name for f in read_manifest(*make_storage(url, server.options))[0].files)


def _gc_after_lease(server, root: str, monkeypatch) -> list:
    """gc as it runs once the killed save's lease has run out (gc's clock moved on:
    an object's time cannot be set back on S3)."""
    later = time.time() + intent.LEASE_S + 60
    monkeypatch.setattr(catalog_gc, "_now", lambda: later)
    return catalog_gc.collect_garbage(root, min_age_s=0, storage_options=server.options)


@pytest.mark.slow
def test_sigkill_mid_upload_keeps_the_previous_checkpoint_and_gc_cleans_up(
        s3, tmp_path, monkeypatch):
    """Generation 2's shard files are mid-upload (rank 1's multipart upload has parts,
    is not complete) when the whole job is SIGKILLed: generation 1 still loads and
    verifies, generation 2 is invisible (no manifest names it), and gc removes what
    the dead save left, aborting its incomplete uploads."""
    root = s3.url("kill-upload")
    url = root + "/ckpt"
    job = Job(s3, url, str(tmp_path), "--gens", "2", "--fault-gen", "2",
              "--fault", "write:1:sleep=60")  # rank 1 stalls after its first part
    job.wait_for("saved 1")
    end = time.time() + 90
    while not any(u.endswith("-00001.safetensors") for u in _uploads(s3, url)):
        assert time.time() < end and job.proc.poll() is None, "".join(job.output)[-3000:]
        time.sleep(0.05)
    job.kill_all()
    assert job.finish() != 0
    assert job.last_saved() == 1
    assert _generation(s3, url) == 1
    gen1 = _manifest_files(s3, url)
    assert [u for u in _uploads(s3, url) if u.endswith("-00001.safetensors")]
    found = _gc_after_lease(s3, root, monkeypatch)
    assert any(lo.upload_id for lo in found), found
    assert _uploads(s3, url) == []
    assert [o for o in _objects(s3, url) if o != "manifest.json"] == gen1
    assert _generation(s3, url) == 1


@pytest.mark.slow
def test_sigkill_after_the_overwrite_commits_gives_exactly_the_new_generation(
        s3, tmp_path, monkeypatch):
    """Killed between the new manifest's PUT and the removal of the old files: the
    checkpoint is exactly generation 2 (never a mix with 1's files beside it), and gc
    then removes generation 1's files."""
    root = s3.url("kill-commit")
    url = root + "/ckpt"
    job = Job(s3, url, str(tmp_path), "--gens", "2", "--fault-gen", "2",
              "--fault", "committed:0:kill", "--rows", "8")  # small: no multipart needed
    assert job.finish() != 0, "".join(job.output)
    assert job.last_saved() == 1
    assert _generation(s3, url, 8) == 2
    gen2 = _manifest_files(s3, url)
    assert len([o for o in _objects(s3, url) if o.endswith(".safetensors")]) == 4
    _gc_after_lease(s3, root, monkeypatch)
    assert [o for o in _objects(s3, url) if o != "manifest.json"] == gen2
    assert _uploads(s3, url) == []
    assert _generation(s3, url, 8) == 2
