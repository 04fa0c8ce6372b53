"""Issue 36 review, one process (or one real subprocess): DckptCheckpointManager at
interpreter exit, dckpt.load_hf under a transient I/O error, bytes values against
hostile manifests. The multi-rank cases are in tests/multirank/test_torchtitan_edges.py."""
from __future__ import annotations

import base64
import errno
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dckpt

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EXIT_JOB = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import torch.distributed as dist
    base = sys.argv[1]
    dist.init_process_group("gloo", init_method=f"file://{{base}}/rdv", rank=0, world_size=1)
    from titankit import Parts
    from dckpt.integrations.torchtitan import DckptCheckpointManager
    parts = Parts(seed=0)
    ck = DckptCheckpointManager.Config(
        enable=True, interval=2, async_mode="async", keep_latest_k=2,
        last_save_model_only=False).build(**parts.build_kwargs(base))
    parts.train(ck, 20, until=8)
    print("trained", flush=True)
    # no close(): the interpreter exits with the last async save in flight
""")


def test_exit_without_close_flushes_and_keeps_k(tmp_path):
    """A script that never calls close() (torchtitan's DCP manager relies on __del__):
    at exit the last async save commits and keep_latest_k still holds (the flush must
    run before the interpreter tears its modules down, not in a late __del__)."""
    pytest.importorskip("torchtitan")
    script = tmp_path / "job.py"
    script.write_text(EXIT_JOB.format(tests=TESTS))
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    dirs = sorted(d for d in os.listdir(tmp_path / "checkpoint") if d.startswith("step-"))
    assert [int(d[5:]) for d in dirs] == [6, 8], (dirs, out.stderr[-2000:])
    assert "skipped" not in out.stderr, out.stderr[-2000:]
    for d in dirs:
        assert (tmp_path / "checkpoint" / d / "manifest.json").exists()


# ------------------------------------------------------------------ load_hf under EIO

def _hf_dir(tmp_path) -> tuple[str, dict]:
    from safetensors.torch import save_file

    ref = {"a": torch.arange(4096, dtype=torch.float32).reshape(64, 64),
           "b": torch.ones(16, dtype=torch.bfloat16)}
    save_file(ref, str(tmp_path / "model.safetensors"))
    return str(tmp_path), ref


def test_load_hf_transient_eio_is_a_checkpoint_error_then_retry_works(tmp_path, monkeypatch):
    """An EIO in the middle of load_hf's reads is a CheckpointError naming the file (no
    raw OSError, no thread left behind, no file left open); the same call then loads."""
    from dckpt.storage import local

    path, ref = _hf_dir(tmp_path)
    calls = {"n": 0}
    real = local.LocalStorage.open_read

    def flaky(self, p):
        f = real(self, p)
        orig = f.readv

        def readv(off, bufs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise OSError(errno.EIO, "Input/output error")
            return orig(off, bufs)

        f.readv = readv
        return f

    monkeypatch.setattr(local.LocalStorage, "open_read", flaky)
    fds = len(os.listdir("/proc/self/fd"))
    state = {"a": torch.zeros(64, 64), "b": torch.zeros(16, dtype=torch.bfloat16)}
    with pytest.raises(dckpt.CheckpointError, match="model.safetensors"):
        dckpt.load_hf(state, path, read_workers=1)
    assert len(os.listdir("/proc/self/fd")) <= fds
    dckpt.load_hf(state, path, read_workers=1)
    for k in ref:
        assert torch.equal(state[k], ref[k]), k


# ------------------------------------------------------------------ hostile bytes tags

def _forge(path: str, key: str, tag) -> None:
    """Rewrite the manifest's value ``key`` to ``tag`` and reseal it."""
    from dckpt.format import sealed

    mpath = os.path.join(path, "manifest.json")
    doc = json.loads(open(mpath, "rb").read())
    doc["values"][key] = tag
    open(mpath, "wb").write(sealed.seal(doc))


@pytest.mark.parametrize("tag", [
    {"$bytes": "A" * (8 << 20)},                        # huge
    {"$bytes": "eHl7"[:-1] + "="},                      # non-canonical padding bits
    {"$bytes": "eHl6", "x": 1},                         # two keys
    {"$bytes": {"$bytes": "eHl6"}},                     # nested
    {"$bytes": ["eHl6"]},
    {"$bytes": "eH l6"},                                # not base64
    {"$bytes": "\u00e9\u00e9\u00e9\u00e9"},             # non-ASCII
])
def test_hostile_bytes_tag_is_a_manifest_error(tmp_path, tag):
    path = str(tmp_path / "c")
    dckpt.save({"v": b"xyz", "t": torch.zeros(2)}, path)
    try:
        key = next(k for k in json.loads(open(os.path.join(path, "manifest.json"), "rb").read())
                   ["values"] if k.endswith("v"))
    except StopIteration:
        pytest.skip("values not stored under 'values'")
    _forge(path, key, tag)
    state = {"v": b"", "t": torch.ones(2)}
    with pytest.raises(dckpt.CheckpointError):
        dckpt.load(state, path)
    with pytest.raises(dckpt.CheckpointError):
        with dckpt.open(path) as ck:
            ck.info("v")


def test_bytes_key_colliding_with_a_tensor_key_is_refused(tmp_path):
    with pytest.raises(dckpt.UnsupportedValueError):
        dckpt.save({"a.b": b"x", "a": {"b": torch.zeros(1)}}, str(tmp_path / "c"))


def test_bytes_value_round_trips_exactly(tmp_path):
    raw = bytes(range(256)) * 5
    path = str(tmp_path / "c")
    dckpt.save({"v": raw, "e": b"", "t": torch.zeros(1)}, path)
    state = {"v": b"", "e": b"?", "t": torch.ones(1)}
    dckpt.load(state, path)
    assert state["v"] == raw and state["e"] == b"" and type(state["v"]) is bytes
    assert base64.b64encode(raw)  # the tag's alphabet is the standard one
