"""S3 specifics against a real S3-compatible server (moto's, on loopback, tests/s3server.py):
incomplete multipart uploads and gc, bounded waits on an endpoint that never answers,
errors that name the object, a dropped writer at interpreter exit."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import torch

import dckpt
from dckpt import _faults
from dckpt.catalog import listing as catalog
from dckpt.catalog import gc as catalog_gc
from dckpt.cli.main import main
from dckpt.protocol import intent
from dckpt.storage import fsspec_storage, s3client
from dckpt.storage.fsspec_storage import StorageIOError, make_storage

BIG = 6 << 20  # over the 5 MiB smallest part S3 (and s3fs) allow: one part, then more
PART = {"default_block_size": 5 << 20}
SID = "00000000000000ab"


def _client(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint)


def _key(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    return bucket, key


def _start_upload(server, url: str) -> tuple[str, float]:
    """An incomplete multipart upload of ``url`` with one part; (upload id, the server's
    Initiated time). The client is boto3's, as another tool (or a dead process) would."""
    c = _client(server)
    bucket, key = _key(url)
    uid = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    c.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=1, Body=b"x" * 1000)
    return uid, _initiated(server, url, uid)


def _initiated(server, url: str, uid: str) -> float:
    bucket, key = _key(url)
    ups = _client(server).list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])
    return next(u["Initiated"].timestamp() for u in ups if u["UploadId"] == uid)


def _uploads(server, url: str) -> dict[str, str]:
    """{upload id: key} of the incomplete uploads under ``url``."""
    bucket, key = _key(url)
    ups = _client(server).list_multipart_uploads(Bucket=bucket, Prefix=key + "/")
    return {u["UploadId"]: u["Key"] for u in ups.get("Uploads", [])}


def test_gc_aborts_old_incomplete_uploads_of_dckpt_names_only(s3, monkeypatch, capsys):
    """An upload older than the lease (and --min-age) with a dckpt name, at the root or
    one level down, is aborted; a younger one, a foreign name and one deeper than gc
    looks are left. Ages come from the server's Initiated times: gc's clock is set
    relative to them (moto reports a fixed date)."""
    root = s3.url("mpu")
    dckpt.save({"w": torch.ones(4)}, root + "/step-1", storage_options=s3.options)
    names = {"old": f"{root}/step-2/data-{SID}-00000.safetensors",
             "top": f"{root}/data-{SID}-00001.safetensors",
             "foreign": f"{root}/step-2/notes.bin",
             "deep": f"{root}/a/b/data-{SID}-00000.safetensors"}
    ids = {k: _start_upload(s3, u) for k, u in names.items()}
    t0 = max(t for _, t in ids.values())
    # 10 s after they began: younger than the lease, so even --min-age 0 keeps them
    monkeypatch.setattr(catalog_gc, "_now", lambda: t0 + 10)
    assert catalog_gc.collect_garbage(root, min_age_s=0, storage_options=s3.options) == []
    assert len(_uploads(s3, root)) == 4
    # past the lease but not past --min-age
    monkeypatch.setattr(catalog_gc, "_now", lambda: t0 + intent.LEASE_S + 60)
    assert catalog_gc.collect_garbage(root, storage_options=s3.options) == []
    # past both
    monkeypatch.setattr(catalog_gc, "_now", lambda: t0 + 7200)
    assert main(["--storage-options", '{"endpoint_url": "%s"}' % s3.endpoint,
                 "gc", "--dry-run", root]) == 0
    out = capsys.readouterr().out
    assert names["old"] in out and names["top"] in out and "incomplete upload" in out, out
    assert len(_uploads(s3, root)) == 4  # a dry run
    found = catalog_gc.collect_garbage(root, storage_options=s3.options)
    assert sorted(lo.path for lo in found) == sorted([names["old"], names["top"]])
    assert all(lo.bytes == 1000 and lo.upload_id for lo in found)
    left = _uploads(s3, root)
    assert sorted(left) == sorted([ids["foreign"][0], ids["deep"][0]])
    # aborting never touches the committed checkpoint, and a second gc finds nothing
    assert catalog_gc.collect_garbage(root, storage_options=s3.options) == []
    t = {"w": torch.zeros(4)}
    dckpt.load(t, root + "/step-1", storage_options=s3.options)
    assert torch.equal(t["w"], torch.ones(4))


def test_gc_keeps_the_upload_of_a_save_in_progress(s3, monkeypatch):
    """A real save held mid-upload (one part sent, the rest not): gc with --min-age 0
    and any clock within the lease of its intent leaves its upload alone; the save then
    commits and loads."""
    path = s3.url("live") + "/step-1"
    opts = dict(s3.options, **PART)
    monkeypatch.setenv("DCKPT_FAULT", "write:9:raise")  # arms the write hook, fires never
    arrived, release = threading.Event(), threading.Event()
    real = _faults.fault

    def hold(point: str, rank: int) -> None:
        if point == "write" and threading.current_thread().name == "saver":
            arrived.set()
            assert release.wait(60)
        real(point, rank)

    monkeypatch.setattr(_faults, "fault", hold)
    state = {"w": torch.arange(BIG // 4, dtype=torch.int32), "step": 1}
    out: dict = {}
    t = threading.Thread(name="saver", target=lambda: out.setdefault(
        "info", dckpt.save(state, path, storage_options=opts)))
    t.start()
    try:
        assert arrived.wait(60)
        ups = _uploads(s3, path)
        assert len(ups) == 1, ups  # the shard file is mid-upload
        (uid, key), = ups.items()
        t0 = _initiated(s3, path, uid)
        # Whatever the upload's age says (moto dates every upload 2010), the save's
        # lease, renewed every 10 s, protects it.
        monkeypatch.setattr(catalog_gc, "_now", lambda: max(t0 + 7200, time.time()))
        assert catalog_gc.collect_garbage(path.rsplit("/", 1)[0], min_age_s=0,
                                       storage_options=opts) == []
        assert _uploads(s3, path) == ups
    finally:
        release.set()
        t.join(60)
    assert "info" in out
    assert _uploads(s3, path) == {}
    got = {"w": torch.zeros(BIG // 4, dtype=torch.int32), "step": 0}
    dckpt.load(got, path, storage_options=opts)
    assert torch.equal(got["w"], state["w"]) and got["step"] == 1


def test_an_aborted_write_leaves_no_upload(s3):
    """A write that fails after a part was sent aborts its multipart upload."""
    st, root = make_storage(s3.url("abort"), dict(s3.options, **PART))
    w = st.open_write(root + "/data-00000000000000ab-00000.safetensors")
    w.write(b"x" * BIG)
    assert len(st.incomplete_uploads(root)) == 1
    w.abort()
    assert st.incomplete_uploads(root) == [] and st.listdir(root) == []


DROPPED = r"""
import sys, types
# only the storage layer, without dckpt/__init__ (which imports torch: seconds per process)
pkg = types.ModuleType("dckpt")
pkg.__path__ = [sys.argv[3]]
sys.modules["dckpt"] = pkg
from dckpt.storage.fsspec_storage import make_storage
st, root = make_storage(sys.argv[1], {"endpoint_url": sys.argv[2], "default_block_size": 5 << 20})
w = st.open_write(root + "/data-00000000000000ab-00000.safetensors")
w.write(b"x" * (6 << 20))
print("written", flush=True)
# exits with the writer open: neither committed nor aborted
"""


def test_a_dropped_writer_neither_hangs_exit_nor_completes(s3):
    """The hang that was seen: an s3fs file left open at interpreter exit is closed by
    its finaliser, which completes the upload through fsspec's I/O thread, already gone
    then, so the process waits forever. dckpt's writer drops it without I/O: the
    process exits, nothing becomes visible, and gc can abort the upload."""
    root = s3.url("dropped")
    p = subprocess.run([sys.executable, "-c", DROPPED, root, s3.endpoint,
                        os.path.dirname(dckpt.__file__)], timeout=30, capture_output=True,
                       text=True)
    assert p.returncode == 0 and "written" in p.stdout, p.stderr[-2000:]
    st, base = make_storage(root, s3.options)
    assert st.listdir(base) == []  # not completed
    ups = st.incomplete_uploads(base)
    assert [u.size for u in ups] == [6 << 20]
    catalog_gc._now = lambda: ups[0].initiated + 7200
    try:
        found = catalog_gc.collect_garbage(root, storage_options=s3.options)
    finally:
        catalog_gc._now = time.time
    assert [lo.upload_id for lo in found] == [ups[0].upload_id]
    assert st.incomplete_uploads(base) == []


@pytest.fixture
def silent():
    """An endpoint that accepts TCP connections and never answers (a frozen server)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    conns = []
    stop = threading.Event()

    def accept() -> None:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(s.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    stop.set()
    t.join()
    for c in conns:
        c.close()
    s.close()


def _bounded(fn, limit: float):
    """Run ``fn`` in a thread; its exception, or fail if it is still running after
    ``limit`` seconds (a hang must fail the test, not stall the suite)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    start = time.monotonic()
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"still waiting after {limit:.0f} s: a hang"
    return out.get("error"), time.monotonic() - start


def test_a_silent_endpoint_fails_every_call_in_bounded_time_naming_the_object(silent, monkeypatch):
    """PUTs (botocore sends ``Expect: 100-continue``, which aiohttp waits for with no
    timeout), GETs, listings and multipart uploads all fail after the configured
    timeouts and botocore's retries, as StorageIOError naming the object; a save and a
    load fail as CheckpointError naming it."""
    from s3server import CREDENTIALS

    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(s3client, "S3_MIN_RATE", 64 << 20)  # 6 MiB: ~0.1 s
    opts = {"endpoint_url": silent, "default_block_size": 5 << 20, "config_kwargs": {
        "connect_timeout": 0.5, "read_timeout": 0.5,
        "retries": {"max_attempts": 0, "mode": "standard"}}}
    url = f"s3://silent-{uuid.uuid4().hex[:8]}/run"
    st, root = make_storage(url, opts)
    calls = {"write": lambda: st.put_atomic(root + "/manifest.json", b"{}", exclusive=True),
             "read": lambda: st.read(root + "/data", 0, 10),
             "list": lambda: st.listdir(root),
             "upload to": lambda: st.open_write(root + "/data").write(b"x" * BIG)}
    for op, fn in calls.items():
        err, took = _bounded(fn, 30)
        assert isinstance(err, StorageIOError) and "Timeout" in str(err), (op, repr(err))
        assert f"{url}/" in str(err) or str(err).startswith(f"list {url}"), str(err)
        assert took < 15, (op, took)
    err, _ = _bounded(lambda: dckpt.save({"w": torch.ones(2)}, url, storage_options=opts), 60)
    assert isinstance(err, dckpt.CheckpointError) and url in str(err), repr(err)
    err, _ = _bounded(lambda: dckpt.load({"w": torch.ones(2)}, url, storage_options=opts), 60)
    assert isinstance(err, dckpt.CheckpointError) and f"{url}/manifest.json" in str(err), repr(err)


def test_user_settings_win_over_dckpt_defaults():
    opts = s3client.s3_options({"config_kwargs": {"read_timeout": 300,
                                                        "retries": {"max_attempts": 9}}})
    ck = opts["config_kwargs"]
    assert ck["read_timeout"] == 300 and ck["retries"] == {"max_attempts": 9}
    assert ck["connect_timeout"] == s3client.S3_CONNECT_TIMEOUT_S
    assert s3client.s3_options({})["config_kwargs"]["retries"]["mode"] == "standard"


def test_uploads_that_cannot_be_listed_are_left_and_the_files_still_collected(
        s3, monkeypatch, caplog):
    """A role without s3:ListBucketMultipartUploads: gc warns, leaves the uploads (always
    safe), and still removes the leftover files."""
    import boto3

    root = s3.url("nolist")
    bucket, prefix = _key(root)
    stray = f"{prefix}/step-1/data-{SID}-00000.safetensors"
    boto3.client("s3", endpoint_url=s3.endpoint).put_object(Bucket=bucket, Key=stray, Body=b"x")

    def denied(self, path):
        raise StorageIOError(f"list the incomplete uploads under s3://{path} failed: "
                             "PermissionError: Access Denied")

    monkeypatch.setattr(fsspec_storage.FsspecStorage, "incomplete_uploads", denied)
    monkeypatch.setattr(catalog_gc, "_now", lambda: time.time() + 7200)
    with caplog.at_level("WARNING", logger="dckpt"):
        found = catalog_gc.collect_garbage(root, storage_options=s3.options)
    assert [lo.path for lo in found] == [f"s3://{bucket}/{stray}"]
    assert "incomplete uploads under" in caplog.text and "Access Denied" in caplog.text
