"""The dckpt command line: ls, inspect, verify, gc."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid

import fsspec
import pytest
import torch

import dckpt
from dckpt.cli.main import main
from tests.statekit import flip_byte


def _ckpt(root, name="step-1", n=3):
    path = os.path.join(root, name)
    dckpt.save({"model": {"w": torch.randn(64, 8), "b": torch.zeros(8, dtype=torch.bfloat16)},
                "step": n, "name": "demo"}, path)
    return path


def test_ls_lists_committed_only(tmp_path, capsys):
    _ckpt(tmp_path, "step-1")
    _ckpt(tmp_path, "step-2")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "data-0123456789abcdef-00000.safetensors").write_bytes(b"x")
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-1" in out and "step-2" in out and "half" not in out
    lines = out.strip().splitlines()
    assert lines[0].split() == ["path", "state", "size", "files", "tensors", "ranks", "saved"]
    assert len(lines) == 4 and "committed" in lines[2]


def test_inspect_table_and_json(tmp_path, capsys):
    path = _ckpt(tmp_path)
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert "model.w" in out and "64x8" in out and "F32" in out and "BF16" in out
    assert "step" in out and '"demo"' in out
    assert main(["inspect", "--json", path]) == 0
    assert '"format":"dckpt"' in capsys.readouterr().out


def test_verify_ok_then_corrupt(tmp_path, capsys):
    path = _ckpt(tmp_path)
    assert main(["verify", path]) == 0
    assert capsys.readouterr().out.startswith("OK")
    f = next(os.path.join(path, x) for x in os.listdir(path) if x.endswith(".safetensors"))
    b = bytearray(open(f, "rb").read())
    b[len(b) - 100] ^= 0x40
    open(f, "wb").write(b)
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and os.path.basename(f) in out and "checksum" in out


def test_verify_not_a_checkpoint(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().out


def test_inspect_missing_is_clean_error(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"dckpt inspect: no such path: {tmp_path / 'nope'}\n"


@pytest.mark.parametrize("cmd", ["ls", "du", "inspect", "verify", "export", "gc"])
def test_a_missing_path_is_no_such_path_for_every_command(tmp_path, capsys, cmd):
    """Issue 27 (3): ls/du said "does not exist", inspect/verify/export that the save
    "did not finish". One wording everywhere, exit 2."""
    missing = str(tmp_path / "nope")
    argv = [cmd, missing] + ([str(tmp_path / "out")] if cmd == "export" else [])
    assert main(argv) == 2
    assert capsys.readouterr().err == f"dckpt {cmd}: no such path: {missing}\n"


@pytest.mark.parametrize("cmd", ["inspect", "verify", "export"])
def test_a_root_where_one_checkpoint_is_expected_names_its_checkpoints(tmp_path, capsys, cmd):
    """Issue 27 (3): a root of checkpoints given to inspect/verify/export said its save
    "did not finish"; it says what is there and asks for one of them."""
    root = tmp_path / "run"
    for n in (10, 20, 30, 40):
        dckpt.save({"w": torch.zeros(2), "step": n}, str(root / f"step-{n}"))
    (root / "logs").mkdir()  # not a checkpoint: not named
    argv = [cmd, str(root)] + ([str(tmp_path / "out")] if cmd == "export" else [])
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"dckpt {cmd}: {root} is a root holding step-10 ... "
                                       "step-40 (4 checkpoints): name one of them\n")
    two = tmp_path / "two"
    for n in (10, 20):
        dckpt.save({"w": torch.zeros(2)}, str(two / f"step-{n}"))
    argv[1] = str(two)
    assert main(argv) == 2
    assert capsys.readouterr().err == (f"dckpt {cmd}: {two} is a root holding step-10, step-20 "
                                       "(2 checkpoints): name one of them\n")


@pytest.mark.parametrize("cmd", ["inspect", "verify", "export"])
def test_a_save_that_did_not_finish_keeps_its_message(tmp_path, capsys, cmd):
    half = tmp_path / "step-5"
    half.mkdir()
    (half / "data-0123456789abcdef-00000.safetensors").write_bytes(b"x" * 10)
    argv = [cmd, str(half)] + ([str(tmp_path / "out")] if cmd == "export" else [])
    rc = main(argv)
    cap = capsys.readouterr()
    text = cap.out if cmd == "verify" else cap.err
    assert rc == (1 if cmd == "verify" else 2)
    assert f"{half} holds no committed checkpoint (no manifest.json): the save that wrote it " \
           "did not finish" in text, text


def test_gc_dry_run_then_remove(tmp_path, capsys):
    path = _ckpt(tmp_path)
    stray = os.path.join(path, "data-00000000000000aa-00001.safetensors")
    half = tmp_path / "half"
    half.mkdir()
    orphan = half / "data-00000000000000bb-00000.safetensors"
    for p in (stray, orphan):
        open(p, "wb").write(b"\0" * 10)
    user_file = half / "notes.txt"
    user_file.write_text("mine")
    old = time.time() - 7200
    for p in (stray, orphan, user_file):
        os.utime(p, (old, old))
    young = os.path.join(path, "data-00000000000000cc-00000.safetensors")
    open(young, "wb").write(b"\0")  # a save in progress: too young to touch

    assert main(["gc", "--dry-run", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "would remove 2 leftover" in out and os.path.exists(stray)
    assert main(["gc", str(tmp_path)]) == 0
    assert not os.path.exists(stray) and not orphan.exists()
    assert user_file.exists() and os.path.exists(young)
    assert main(["verify", path]) == 0


def test_console_script_runs(tmp_path):
    _ckpt(tmp_path)
    script = os.path.join(os.path.dirname(sys.executable), "dckpt")  # pip's entry point
    for cmd in ([sys.executable, "-m", "dckpt"], [script]):
        if cmd == [script] and not os.path.exists(script):
            continue  # running from a source tree that was not pip-installed
        r = subprocess.run([*cmd, "ls", str(tmp_path)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "step-1" in r.stdout, (cmd, r.stderr)


def test_gc_never_touches_a_checkpoint_it_cannot_read(tmp_path, capsys):
    """A damaged manifest, or one from a newer dckpt, may still reference every data file
    beside it: gc must leave that directory alone, not treat its files as leftovers."""
    newer, broken = _ckpt(tmp_path, "step-1"), _ckpt(tmp_path, "step-2")
    man = os.path.join(newer, "manifest.json")
    with open(man) as f:
        text = f.read()
    assert '"version":2' in text
    from dckpt.format import manifest as mf
    with open(man, "wb") as f:  # resealed: a valid manifest of a version this dckpt can't read
        f.write(mf.seal(json.loads(text.replace('"version":2', '"version":99', 1))))
    with open(os.path.join(broken, "manifest.json"), "w") as f:
        f.write("{not json")
    before = {d: sorted(os.listdir(d)) for d in (newer, broken)}
    old = time.time() - 7200
    for d in before:
        for name in before[d]:
            os.utime(os.path.join(d, name), (old, old))
    assert main(["gc", "--min-age", "0", str(tmp_path)]) == 0
    assert {d: sorted(os.listdir(d)) for d in before} == before
    assert "would remove" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, cmd, fragment", [
    (["gc", "{missing}"], "gc", "no such path"),
    (["gc", "--dry-run", "{missing}"], "gc", "no such path"),
    (["ls", "{missing}"], "ls", "no such path"),
    (["gc", "{file}"], "gc", "not a directory"),
    (["--storage-options", "{not json", "ls", "{tmp}"], "ls", "--storage-options"),
    (["--storage-options", "[1, 2]", "gc", "{tmp}"], "gc", "--storage-options"),
    (["ls", "nosuchproto://bucket/x"], "ls", "nosuchproto"),
    (["inspect", "nosuchproto://bucket/x"], "inspect", "nosuchproto"),
    (["verify", "nosuchproto://bucket/x"], "verify", "nosuchproto"),
], ids=["gc-missing", "gc-dry-missing", "ls-missing", "gc-file", "bad-json", "json-not-object",
        "ls-protocol", "inspect-protocol", "verify-protocol"])
def test_every_error_is_one_line_and_exit_2(tmp_path, capsys, argv, cmd, fragment):
    (tmp_path / "plain").write_text("x")
    subst = {"{missing}": str(tmp_path / "nope"), "{file}": str(tmp_path / "plain"),
             "{tmp}": str(tmp_path)}
    assert main([subst.get(a, a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dckpt {cmd}: ") and fragment in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_gc_missing_root_prints_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dckpt", "gc", str(tmp_path / "nope")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"dckpt gc: no such path: {tmp_path / 'nope'}"


def test_verbose_keeps_the_traceback(tmp_path, capsys):
    assert main(["-v", "gc", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().endswith(f"dckpt gc: no such path: {tmp_path / 'nope'}")


def test_ls_keeps_the_url_scheme_so_printed_paths_load(capsys):
    name = f"cli-{uuid.uuid4().hex[:8]}"
    try:
        url = f"memory://{name}/run"
        state = {"w": torch.arange(4.0), "step": 3}
        dckpt.save(state, f"{url}/step-3")
        assert main(["ls", url + "/"]) == 0
        rows = capsys.readouterr().out.strip().splitlines()[2:]
        assert [r.split()[0] for r in rows] == [f"{url}/step-3"]
        out = {"w": torch.zeros(4), "step": 0}
        dckpt.load(out, rows[0].split()[0])
        assert out["step"] == 3 and torch.equal(out["w"], state["w"])
        assert main(["ls", f"{url}/step-3"]) == 0  # the root is the checkpoint itself
        assert capsys.readouterr().out.strip().splitlines()[2].split()[0] == f"{url}/step-3"
        assert main(["inspect", f"{url}/step-3"]) == 0
        assert capsys.readouterr().out.startswith(f"checkpoint {url}/step-3\n")
        assert main(["verify", f"{url}/step-3"]) == 0
        assert capsys.readouterr().out.startswith(f"OK {url}/step-3:")
    finally:
        fsspec.filesystem("memory").rm(f"/{name}", recursive=True)


def _dckpt_cli(*argv: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dckpt", *argv], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _done(p: subprocess.Popen) -> tuple[int, str, str]:
    out, err = p.communicate(timeout=120)
    return p.returncode, out, err


def test_s3_urls_with_the_endpoint_from_the_environment(s3):
    """ls, inspect, verify and gc as real processes on s3:// URLs, the endpoint and the
    credentials only in the usual AWS variables (AWS_ENDPOINT_URL is honoured by
    botocore itself): every printed path is the URL as typed, and gc aborts an
    incomplete multipart upload a killed save left beside a stray data file."""
    import boto3

    root = s3.url("cli")
    for step in (100, 200):
        dckpt.save({"w": torch.full((8, 4), float(step)), "step": step},
                   f"{root}/step-{step:08d}", storage_options=s3.options)
    bucket, _, prefix = root[len("s3://"):].partition("/")
    c = boto3.client("s3", endpoint_url=s3.endpoint)
    stray = f"{prefix}/step-00000300/data-00000000000000ab-00000.safetensors"
    c.put_object(Bucket=bucket, Key=stray, Body=b"half a shard")
    upload = f"{prefix}/step-00000300/data-00000000000000ab-00001.safetensors"
    uid = c.create_multipart_upload(Bucket=bucket, Key=upload)["UploadId"]
    c.upload_part(Bucket=bucket, Key=upload, UploadId=uid, PartNumber=1, Body=b"x" * 100)
    env = dict(os.environ, AWS_ENDPOINT_URL=s3.endpoint,
               DCKPT_INTENT_LEASE_S="0")  # whatever time the server dates the upload
    step = f"{root}/step-00000100"
    # four processes at once (each imports torch); gc touches only step-00000300
    ls, inspect, verify, gc = (_dckpt_cli("ls", root, env=env),
                               _dckpt_cli("inspect", step, env=env),
                               _dckpt_cli("verify", step, env=env),
                               _dckpt_cli("gc", "--min-age", "0", root, env=env))
    rc, out, err = _done(ls)
    assert rc == 0, err
    assert [r.split()[0] for r in out.strip().splitlines()[2:]] == [
        f"{root}/step-00000100", f"{root}/step-00000200"], out
    rc, out, err = _done(inspect)
    assert rc == 0 and out.startswith(f"checkpoint {step}\n") and "8x4" in out, (out, err)
    rc, out, err = _done(verify)
    assert rc == 0 and out.startswith(f"OK {step}:"), (out, err)
    rc, out, err = _done(gc)
    assert rc == 0, err
    assert f"removed s3://{bucket}/{stray} (" in out, out
    assert f"removed s3://{bucket}/{upload} (incomplete upload, 100 B," in out, out
    assert "removed 1 leftover file(s) and 1 incomplete upload(s)" in out, out
    assert c.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", []) == []
    t = {"w": torch.zeros(8, 4), "step": 0}
    dckpt.load(t, step, storage_options=s3.options)
    assert t["step"] == 100


def test_s3_verify_names_the_damaged_object_as_typed(s3, capsys):
    import boto3

    step = s3.url("cli-bad") + "/step-1"
    dckpt.save({"w": torch.arange(64.0)}, step, storage_options=s3.options)
    bucket, _, prefix = step[len("s3://"):].partition("/")
    c = boto3.client("s3", endpoint_url=s3.endpoint)
    key = next(o["Key"] for o in c.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
               if o["Key"].endswith(".safetensors"))
    body = bytearray(c.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[-8] ^= 0x01
    c.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    opts = json.dumps(s3.options)
    assert main(["--storage-options", opts, "verify", step]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"FAILED {step}:") and f"s3://{bucket}/{key}" in out, out
    assert "checksum" in out


def test_s3_unreachable_endpoint_is_one_line_naming_the_object_and_exit_2(monkeypatch, capsys):
    """A persistent failure (an endpoint, from AWS_ENDPOINT_URL, that accepts connections
    and answers nothing) ends in bounded time with one line naming the object; the
    user's client settings merge with dckpt's defaults."""
    from s3server import CREDENTIALS

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)  # the kernel accepts; nobody answers
    try:
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s.getsockname()[1]}")
        opts = '{"config_kwargs": {"connect_timeout": 0.5, "read_timeout": 0.5, ' \
               '"retries": {"max_attempts": 0, "mode": "standard"}}}'
        t0 = time.monotonic()
        assert main(["--storage-options", opts, "inspect", "s3://nobucket/run/step-1"]) == 2
        assert time.monotonic() - t0 < 30
        err = capsys.readouterr().err
        assert err.startswith("dckpt inspect: ") and len(err.strip().splitlines()) == 1, err
        assert "s3://nobucket/run/step-1/manifest.json" in err and "Timeout" in err, err
    finally:
        s.close()


def _run_piped_into_head(argv: list[str], pythonpath: str | None = None) -> tuple[int, str, str]:
    """``python -m dckpt ARGV | head -1`` with real processes and a real pipe: (dckpt's
    exit status, head's output, dckpt's stderr)."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    # cwd: not a directory that holds a dckpt package (``-m`` puts the cwd first)
    p = subprocess.Popen([sys.executable, "-m", "dckpt", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=os.path.dirname(argv[-1]))
    head = subprocess.Popen(["head", "-1"], stdin=p.stdout, stdout=subprocess.PIPE)
    p.stdout.close()  # only head holds the read end: when it exits, the pipe is closed
    first = head.communicate(timeout=120)[0].decode()
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    return p.returncode, first, err


def test_inspect_into_head_ends_quietly_on_the_closed_pipe(tmp_path):
    """Issue 27 (4): ``dckpt inspect ... | head -1`` printed ``[Errno 32] Broken pipe``.
    The table is far bigger than a pipe's buffer, so dckpt is still writing when head
    exits: it must end quietly with the SIGPIPE status, as Unix tools do."""
    path = str(tmp_path / "step-1")
    dckpt.save({f"layer{i:05d}.weight": torch.zeros(1) for i in range(3000)}, path)
    for argv in (["inspect", path], ["inspect", "--json", path]):
        rc, first, err = _run_piped_into_head(argv)
        assert first.startswith("checkpoint " if "--json" not in argv else "{"), first
        assert err == "", err
        assert rc in (0, 141), (rc, err)


def test_verify_names_the_closed_byte_range_and_the_tensor_region(tmp_path, capsys):
    """Issue 27 (5): "fails its checksum in block 0 (bytes 0..)" was open-ended and did
    not say whether it counted file or tensor bytes. Now: the file, the failing block's
    bytes in the file (first..last, closed) and the elements they hold."""
    from dckpt.format import shards

    path = str(tmp_path / "step-1")
    dckpt.save({"a": torch.zeros(10), "w": torch.arange(1024 * 300, dtype=torch.float32)
                .reshape(1024, 300)}, path)
    f = next(os.path.join(path, x) for x in os.listdir(path) if x.endswith(".safetensors"))
    size = os.path.getsize(f)
    with open(f, "rb") as fh:
        raw = fh.read()
    head = raw[:8 + int.from_bytes(raw[:8], "little")]
    tensors, block = shards.parse_header(head, f, size)
    w = tensors["w"]
    at = w.start + 2 * block + 5  # a byte in w's third checksum block
    flip_byte(f, at)
    assert main(["verify", path]) == 1
    out = capsys.readouterr().out
    lo, hi = w.start + 2 * block, w.start + 3 * block - 1
    first, last = (2 * block) // 4, (3 * block - 1) // 4  # float32 elements of the block
    want = (f"shard file {f}: tensor 'w' fails its checksum in block 2: bytes {lo}..{hi} of "
            f"the file (closed range) hold w[{first // 300}, {first % 300}].."
            f"w[{last // 300}, {last % 300}] (row-major)")
    assert want in out, out
    assert lo <= at <= hi


def test_a_load_error_names_the_checkpoint_directory(tmp_path):
    """Issue 27 (5): a checksum failure during load named only the shard file
    (``shard file data-...safetensors``): which checkpoint was it?"""
    path = str(tmp_path / "run" / "step-7")
    dckpt.save({"w": torch.arange(300000.0)}, path)
    f = next(x for x in os.listdir(path) if x.endswith(".safetensors"))
    flip_byte(os.path.join(path, f), os.path.getsize(os.path.join(path, f)) - 100)
    with pytest.raises(dckpt.IntegrityError) as e:
        dckpt.load({"w": torch.zeros(300000)}, path)
    msg = str(e.value)
    assert path in msg and f in msg and "checksum" in msg, msg


@pytest.mark.parametrize("cmd", ["ls", "inspect", "du", "history", "ls-fast-tier",
                                 "inspect-fast-tier", "ls-missing", "inspect-root"])
def test_json_only_commands_never_import_torch(tmp_path, cmd):
    """Issue 27 (9): every command paid ~2 s importing torch (``import dckpt`` pulled the
    whole API). ls, inspect, du and history read JSON only: run each in a fresh
    interpreter and check torch was never imported."""
    root, shm = str(tmp_path / "run"), str(tmp_path / "shm")
    mgr = dckpt.CheckpointManager(root, local_root=shm, every_steps=1, capture_rng=False)
    assert mgr.save(1, {"w": torch.arange(4.0), "step": 1})
    mgr.close()
    step = os.path.join(root, "step-00000001")
    argv = {"ls": ["ls", root], "inspect": ["inspect", step], "du": ["du", root],
            "history": ["history", root], "ls-fast-tier": ["ls", shm],
            "inspect-fast-tier": ["inspect", os.path.join(shm, "step-00000001")],
            "ls-missing": ["ls", str(tmp_path / "nope")], "inspect-root": ["inspect", root]}[cmd]
    code = ("import sys; from dckpt.cli.main import main; rc = main(%r); "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]; "
            "print('rc', rc)" % (argv,))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("rc 2" if cmd in ("ls-missing", "inspect-root") else "rc 0"), \
        (r.stdout, r.stderr)


def test_region_names_the_key_of_a_chunk_stored_as_key_at_offsets():
    """A file holding several chunks of one tensor names them ``key@offsets``: the
    region is given in the tensor's own indices and name."""
    import numpy as np

    from dckpt.format.shards import StoredTensor
    from dckpt.catalog.verify import region

    st = StoredTensor("w@32,0", "F32", (32, 8), 4096, 32 * 8 * 4, np.zeros(1, np.uint32))
    assert region(st, 0, 32 * 8 * 4 - 1, ((32, 0), (64, 8), "w")) == \
        "w[32, 0]..w[63, 7] (row-major in its saved chunk w[32:64, 0:8])"
    assert region(st, 40, 71, ((32, 0), (64, 8), "w")) == \
        "w[33, 2]..w[34, 1] (row-major in its saved chunk w[32:64, 0:8])"
    assert region(st, 0, 3) == "w@32,0[0, 0]..w@32,0[0, 0] (row-major, indices within the " \
        "stored chunk)"
    scalar = StoredTensor("step", "I64", (), 4096, 8, np.zeros(1, np.uint32))
    assert region(scalar, 0, 7, ((), (), "step")) == "step (a scalar)"
