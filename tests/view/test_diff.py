"""dckpt.diff and `dckpt diff` in one process (plus CLI subprocesses): slab bounds, exact
numbers of a changed tensor against torch in float64, tolerances, NaN/inf, integer and
bool exactness, 0-d and empty tensors, added/removed/shape/dtype and JSON values, key
prefixes, memory:// and S3 against a local checkpoint, a damaged chunk (exit 2 naming
the key), exit codes and --json, the progress line, and peak RSS of `python -m dckpt
diff` on a 512 MiB pair. Saves by 2 and 3 ranks: tests/multirank/test_diff.py."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import dckpt
from dckpt import CheckpointError, IntegrityError
from dckpt.cli.main import main
from dckpt.view.diff import Accumulator, DiffResult, KeyDiff, slabs, values_equal
from dckpt.protocol.manifest_read import read_manifest
from dckpt.engine.reader import ChunkReader, find_stored
from dckpt.storage.fsspec_storage import make_storage
from statekit import flip_byte
from tests.view.test_open import _counting

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return env


def _cli(*argv: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dckpt", *argv], capture_output=True,
                          text=True, env=_env(**env), timeout=300)


def _expected(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, int]:
    """max |a-b|, ||a-b|| / ||b|| and the count of a != b, by torch in float64."""
    d = (a.double() - b.double()).abs()
    return float(d.max()), float(d.norm() / b.double().norm()), int((a != b).sum())


def _by_key(r: DiffResult) -> dict[str, KeyDiff]:
    return {k.key: k for k in r.keys}


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("shape", [(10, 6), (7,), (3, 5, 4), (2, 1, 9, 3), (1,), (5, 0), ()])
@pytest.mark.parametrize("limit", [1, 4, 12, 24, 40, 100, 10_000])
def test_slabs_cover_every_element_once_within_the_limit(shape, limit):
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    pieces = [t[i].reshape(-1) for i in slabs(shape, 4, limit)]
    flat = torch.cat(pieces) if pieces else torch.zeros(0)
    assert torch.equal(flat, t.reshape(-1))  # row-major order, each element once
    assert all(p.numel() * 4 <= max(limit, 4) for p in pieces)
    if t.numel() and limit >= t.numel() * 4:
        assert len(pieces) == 1


def test_values_equal_is_equality_but_a_bool_is_not_an_int():
    assert values_equal(1, 1.0) and values_equal("a", "a") and values_equal(None, None)
    assert values_equal(float("nan"), float("nan"))
    assert not values_equal(True, 1) and not values_equal(0, False) and not values_equal(1, 2)


def test_nan_inf_and_tolerance_rules_element_by_element():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, nan, nan, inf, inf, 2.0, 0.0, -0.0, 10.0])
    b = torch.tensor([1.0, nan, 3.0, inf, -inf, 2.5, 0.0, 0.0, 11.0])
    acc = Accumulator(torch.float32, 0.0, 0.0)
    acc.update(a, b)
    # differ: NaN vs 3, inf vs -inf, 2 vs 2.5, 10 vs 11; -0.0 == 0.0
    assert acc.n_diff == 4 and acc.max_abs == inf and acc.rel_l2() == inf
    acc = Accumulator(torch.float32, 0.5, 0.0)  # |2-2.5| <= 0.5: close; |10-11| is not
    acc.update(a, b)
    assert acc.n_diff == 3
    acc = Accumulator(torch.float32, 0.5, 0.1)  # 1 <= 0.5 + 0.1*11: close too
    acc.update(a, b)
    assert acc.n_diff == 2  # NaN vs number and inf vs -inf never close
    # ||b|| == 0: rel_l2 is 0 when a == b, inf when not
    z = Accumulator(torch.float32, 0, 0)
    z.update(torch.zeros(3), torch.zeros(3))
    assert (z.n_diff, z.max_abs, z.rel_l2()) == (0, 0.0, 0.0)
    z.update(torch.ones(1), torch.zeros(1))
    assert (z.n_diff, z.max_abs, z.rel_l2()) == (1, 1.0, inf)


def test_complex_nan_equals_nan_only_part_by_part():
    """Review: a complex NaN compared equal to any other complex NaN, e.g. nan+1j to
    nan+2j, so two different checkpoints were called equal."""
    nan = float("nan")
    a = torch.tensor([complex(nan, 1), complex(nan, 0), complex(nan, 2), complex(1, nan)],
                     dtype=torch.complex64)
    b = torch.tensor([complex(nan, 2), complex(0, nan), complex(nan, 2), complex(1, nan)],
                     dtype=torch.complex64)
    acc = Accumulator(torch.complex64, 0.0, 0.0)
    acc.update(a, b)
    assert acc.n_diff == 2 and acc.max_abs == float("inf")
    acc = Accumulator(torch.complex64, 10.0, 1.0)  # a NaN part against a number: never close
    acc.update(a, b)
    assert acc.n_diff == 2


def test_rel_l2_of_large_float64_values_does_not_overflow():
    """Review: ||b|| of float64 values past ~1e154 overflowed to inf in the squares, so
    rel_l2 read inf (or 0) for a finite ratio."""
    a = torch.tensor([1e200, 1e200], dtype=torch.float64)
    b = torch.tensor([1e200, 2e200], dtype=torch.float64)
    acc = Accumulator(torch.float64, 0.0, 0.0)
    acc.update(a, b)
    assert acc.n_diff == 1 and acc.max_abs == 1e200
    assert acc.rel_l2() == pytest.approx(1 / math.sqrt(5), rel=1e-12)


# ------------------------------------------------------------------ numbers
def test_one_changed_tensor_reports_exact_numbers_through_many_slabs(tmp_path):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 70, generator=g)
    w2 = w.clone()
    w2[17, 3] += 0.75
    w2[250:260, 10:20] -= 0.125  # 100 elements in other slabs
    w2[299, 69] = 5.5
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"w": w, "u": torch.ones(3), "step": 1}, a)
    dckpt.save({"w": w2, "u": torch.ones(3), "step": 1}, b)
    mx, rel, n = _expected(w, w2)
    for slab in (7, 280, 4096, 64 << 20):  # below a row, one row, rows, everything
        r = dckpt.diff(a, b, slab_bytes=slab)
        k = _by_key(r)["w"]
        assert (k.status, k.n_diff, k.numel) == ("changed", n, 300 * 70) and n == 102
        assert k.max_abs_diff == mx and k.rel_l2 == pytest.approx(rel, rel=1e-12)
        assert not r.equal and r.counts() == {"equal": 2, "changed": 1}
    # and in the other direction: rel_l2 divides by the new side's norm
    k = _by_key(dckpt.diff(b, a))["w"]
    assert k.rel_l2 == pytest.approx(_expected(w2, w)[1], rel=1e-12)


def test_tolerances_turn_changed_into_equal(tmp_path):
    base = torch.linspace(1, 100, 1000, dtype=torch.float64)
    new = base * (1 + 1e-6)  # |a-b| = 1e-6 * |a|: up to 1e-4
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"x": base}, a)
    dckpt.save({"x": new}, b)
    assert _by_key(dckpt.diff(a, b))["x"].n_diff == 1000
    assert dckpt.diff(a, b, atol=1.01e-4).equal
    partial = _by_key(dckpt.diff(a, b, atol=5e-5))["x"]  # only the large values differ
    assert partial.status == "changed"
    assert partial.n_diff == int(((base - new).abs() > 5e-5).sum())
    assert dckpt.diff(a, b, rtol=1.01e-6).equal  # rtol is relative to |b|
    assert not dckpt.diff(a, b, rtol=0.5e-6).equal
    eq = _by_key(dckpt.diff(a, b, rtol=1e-5))["x"]  # equal, and says by how much
    assert eq.status == "equal" and eq.n_diff == 0 and eq.max_abs_diff > 0
    with pytest.raises(CheckpointError, match="atol must be a finite number >= 0"):
        dckpt.diff(a, b, atol=-1)


def test_integers_and_bools_compare_exactly_whatever_the_tolerance(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    big = torch.tensor([2**62, 5, -7], dtype=torch.int64)
    dckpt.save({"i": big, "m": torch.tensor([True, False, True]),
                "u": torch.arange(6, dtype=torch.uint8)}, a)
    dckpt.save({"i": big + torch.tensor([1, 0, 2]), "m": torch.tensor([True, True, True]),
                "u": torch.arange(6, dtype=torch.uint8)}, b)
    k = _by_key(dckpt.diff(a, b, atol=10, rtol=1))
    assert (k["i"].status, k["i"].n_diff) == ("changed", 2)  # 2**62 + 1 != 2**62 counts
    assert (k["m"].status, k["m"].n_diff, k["m"].max_abs_diff) == ("changed", 1, 1.0)
    assert k["u"].status == "equal"


def test_scalars_empty_complex_and_low_precision_tensors(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    c = torch.tensor([1 + 1j, 2 - 1j], dtype=torch.complex64)
    dckpt.save({"s": torch.tensor(2.5), "e": torch.zeros(0, 4), "c": c,
                "h": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
                "f8": torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)}, a)
    dckpt.save({"s": torch.tensor(3.0), "e": torch.zeros(0, 4), "c": c + torch.tensor([0, 3j]),
                "h": torch.tensor([1.0, 2.0], dtype=torch.bfloat16),
                "f8": torch.tensor([1.0, 4.0]).to(torch.float8_e4m3fn)}, b)
    k = _by_key(dckpt.diff(a, b))
    assert (k["s"].status, k["s"].max_abs_diff, k["s"].n_diff) == ("changed", 0.5, 1)
    assert (k["e"].status, k["e"].n_diff, k["e"].numel) == ("equal", 0, 0)
    assert (k["c"].status, k["c"].max_abs_diff) == ("changed", 3.0)  # |3j|
    assert k["h"].status == "equal"
    assert (k["f8"].status, k["f8"].max_abs_diff) == ("changed", 2.0)


def test_added_removed_shape_dtype_and_json_values(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"keep": torch.ones(2), "old": torch.ones(2), "sh": torch.ones(2, 2),
                "dt": torch.ones(3), "kind": torch.ones(1),
                "step": 10, "name": "run", "lr": 0.5, "flag": 1, "same": [1, "x", None]}, a)
    dckpt.save({"keep": torch.ones(2), "new": torch.zeros(4), "sh": torch.ones(2, 3),
                "dt": torch.ones(3, dtype=torch.bfloat16), "kind": 3,
                "step": 11, "name": "run", "lr": 0.25, "flag": True, "same": [1, "x", None],
                "added_value": "hello"}, b)
    r = dckpt.diff(a, b)
    got = {k.key: (k.status, k.max_abs_diff, k.rel_l2, k.n_diff) for k in r.keys}
    na = (None, None, None)
    assert got == {"keep": ("equal", 0.0, 0.0, 0), "old": ("removed", *na),
                   "sh": ("shape", *na), "dt": ("dtype", *na), "kind": ("dtype", *na),
                   "step": ("changed", *na), "name": ("equal", *na), "lr": ("changed", *na),
                   "flag": ("changed", *na), "same.0": ("equal", *na),
                   "same.1": ("equal", *na), "same.2": ("equal", *na),
                   "new": ("added", *na), "added_value": ("added", *na)}
    # A's keys in A's order, then B's new ones
    assert [k.key for k in r.keys][-2:] == ["new", "added_value"]
    assert _by_key(r)["sh"].detail == "[2, 2] -> [2, 3]"
    assert _by_key(r)["dt"].detail == "float32 -> bfloat16"
    assert _by_key(r)["lr"].detail == "0.5 -> 0.25"
    assert r.summary() == ("14 keys: 5 equal, 3 changed, 2 added, 1 removed, 1 shape, "
                           "2 dtype")
    with pytest.raises(TypeError, match="result.equal"):
        bool(r)


def test_keys_prefix_selects_a_dotted_subtree(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"model": {"l1": {"w": torch.ones(2)}, "l10": {"w": torch.ones(2)}},
                "opt": {"m": torch.ones(2)}}, a)
    dckpt.save({"model": {"l1": {"w": torch.ones(2)}, "l10": {"w": torch.zeros(2)}},
                "opt": {"m": torch.zeros(2)}}, b)
    assert [k.key for k in dckpt.diff(a, b, keys="model.l1").keys] == ["model.l1.w"]
    assert dckpt.diff(a, b, keys="model.l1.").equal  # a trailing dot is accepted
    r = dckpt.diff(a, b, keys=["model.l10", "opt"])
    assert [k.key for k in r.keys] == ["model.l10.w", "opt.m"] and not r.equal
    with pytest.raises(CheckpointError, match="no key under 'mod'"):
        dckpt.diff(a, b, keys="mod")


def test_each_side_is_read_once_in_slabs_through_open_views(tmp_path):
    """Open views can be passed in (and stay open); every byte of a tensor is read once
    per side (plus headers and checksum-block widening), whatever the slab."""
    t = torch.randn(512, 1024)  # 2 MiB
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"t": t}, a)
    dckpt.save({"t": t}, b)
    ck_a, ca = _counting(a)
    ck_b, cb = _counting(b)
    r = dckpt.diff(ck_a, ck_b, slab_bytes=256 << 10)
    assert r.equal and not ck_a.closed and not ck_b.closed
    for c in (ca, cb):
        assert t.nbytes <= c.bytes < t.nbytes + (64 << 10), c.bytes


# ------------------------------------------------------------------ storages
def test_local_against_memory_storage(tmp_path):
    t = torch.randn(64, 33)
    a = str(tmp_path / "a")
    b = f"memory://diff-{os.getpid()}-{time.monotonic_ns()}/b"
    dckpt.save({"t": t, "step": 3}, a)
    dckpt.save({"t": t, "step": 3}, b)
    assert dckpt.diff(a, b).equal
    t2 = t.clone()
    t2[5, 5] = 100.0
    b2 = b + "2"
    dckpt.save({"t": t2, "step": 3}, b2)
    k = _by_key(dckpt.diff(a, b2))["t"]
    assert (k.max_abs_diff, k.n_diff) == (abs(100.0 - float(t[5, 5])), 1)


def test_local_against_s3_through_the_cli(s3, tmp_path):
    t = torch.randn(128, 40)
    a = str(tmp_path / "a")
    b = s3.url("diff")
    dckpt.save({"t": t, "step": 3}, a)
    dckpt.save({"t": t + 0.25, "step": 3}, b, storage_options=s3.options)
    r = dckpt.diff(a, b, storage_options=(None, s3.options))
    assert _by_key(r)["t"].max_abs_diff == pytest.approx(0.25, abs=1e-6)
    opts = json.dumps(s3.options)
    p = _cli("diff", a, b, "--json", "--storage-options-b", opts)
    assert p.returncode == 1, p.stderr
    got = json.loads(p.stdout)
    assert got["equal"] is False and got["keys"][0]["n_diff"] == 128 * 40
    p = _cli("--storage-options", opts, "diff", a, b, "--atol", "0.26")  # float32 rounding
    assert p.returncode == 0, (p.stdout, p.stderr)


# ------------------------------------------------------------------ CLI
def _pair(tmp_path) -> tuple[str, str, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 8, generator=g)
    w2 = w.clone()
    w2[3] += 2.0
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    dckpt.save({"w": w, "v": torch.ones(4), "bias": torch.zeros(8), "old": torch.ones(1),
                "step": 1}, a)
    v2 = torch.ones(4)
    v2[0] = 1.5
    dckpt.save({"w": w2, "v": v2, "bias": torch.zeros(8), "new": torch.ones(1),
                "step": 2}, b)
    return a, b, w, w2


def test_cli_exit_codes_table_order_and_json(tmp_path, capsys):
    a, b, w, w2 = _pair(tmp_path)
    assert main(["diff", a, a]) == 0
    out = capsys.readouterr().out
    assert out.strip().endswith("5 keys: 5 equal (exact): equal") and "bias" not in out
    assert main(["diff", a, b]) == 1
    out = capsys.readouterr().out
    rows = [line.split()[:2] for line in out.splitlines()[5:] if line.strip()][:-1]
    # largest difference first, then the JSON value, then structural statuses
    assert rows == [["w", "changed"], ["v", "changed"], ["step", "changed"],
                    ["new", "added"], ["old", "removed"]], out
    assert "8/320" in out and "1 -> 2" in out
    assert out.strip().endswith("6 keys: 1 equal, 3 changed, 1 added, 1 removed (exact): "
                                "different")
    assert main(["diff", a, b, "--all"]) == 1
    assert "bias" in capsys.readouterr().out
    assert main(["diff", a, b, "--json"]) == 1
    got = json.loads(capsys.readouterr().out)  # exactly one object
    assert set(got) == {"equal", "keys"} and got["equal"] is False
    assert [k["key"] for k in got["keys"]] == ["w", "v", "bias", "old", "step", "new"]
    assert all(set(k) == {"key", "status", "max_abs_diff", "rel_l2", "n_diff"}
               for k in got["keys"])
    kw = got["keys"][0]
    mx, rel, n = _expected(w, w2)
    assert (kw["max_abs_diff"], kw["n_diff"]) == (mx, n)
    assert kw["rel_l2"] == pytest.approx(rel, rel=1e-12)
    assert got["keys"][3] == {"key": "old", "status": "removed", "max_abs_diff": None,
                              "rel_l2": None, "n_diff": None}
    assert main(["diff", a, b, "--keys", "bias", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["equal"] is True
    assert main(["diff", a, b, "--keys", "w", "--keys", "v", "--atol", "2.01"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("argv, fragment", [
    (["--atol", "-1"], "atol must be a finite number >= 0"),
    (["--keys", "zzz"], "no key under 'zzz'"),
    (["--slab-mib", "0"], "--slab-mib must be at least 1"),
    (["--storage-options-b", "[1]"], "--storage-options-b must be a JSON object"),
])
def test_cli_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, argv, fragment):
    a, b, *_ = _pair(tmp_path)
    assert main(["diff", a, b, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dckpt diff: ") and fragment in err and err.count("\n") == 1, err


def test_cli_missing_checkpoint_exits_2(tmp_path, capsys):
    a, *_ = _pair(tmp_path)
    assert main(["diff", a, str(tmp_path / "nope")]) == 2
    assert "nope" in capsys.readouterr().err


def test_a_damaged_chunk_exits_2_naming_the_key(tmp_path):
    a, b, *_ = _pair(tmp_path)
    storage, root = make_storage(b)
    m, _ = read_manifest(storage, root)
    e = m.tensors["w"]
    tensors, _ = ChunkReader(storage, root, m).header(int(e.chunks.file[0]))
    st = find_stored(tensors, "w", e.chunks.offsets[0])
    flip_byte(os.path.join(b, m.files[int(e.chunks.file[0])].name), st.start + 100)
    p = _cli("diff", a, b)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert p.stderr.startswith("dckpt diff: ") and "key 'w'" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    with pytest.raises(IntegrityError, match="key 'w'"):
        dckpt.diff(a, b)
    assert dckpt.diff(a, b, keys="bias").equal  # other keys still compare


def test_progress_line_on_stderr(tmp_path):
    a, b, *_ = _pair(tmp_path)
    p = _cli("diff", a, b, DCKPT_PROGRESS_SECONDS="0")
    assert p.returncode == 1, p.stderr
    assert f"dckpt.view.diff: diff {a} {b}: " in p.stderr and "GB/s" in p.stderr, p.stderr
    p = _cli("diff", a, b)  # a short diff: no progress line
    assert p.returncode == 1 and p.stderr == "", p.stderr


# ------------------------------------------------------------------ memory
def _peak_rss(argv: list[str]) -> tuple[int, subprocess.CompletedProcess]:
    """Run `python -m dckpt diff ...`, sampling its RSS every 5 ms from outside:
    (peak bytes, the finished process)."""
    proc = subprocess.Popen([sys.executable, "-m", "dckpt", "diff", *argv], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    peak = 0
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            peak = max(peak, int(line.split()[1]) * 1024)
            except (FileNotFoundError, ProcessLookupError):
                return
            time.sleep(0.005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = proc.communicate(timeout=300)
    stop.set()
    th.join()
    return peak, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_peak_memory_stays_bounded_whatever_the_checkpoint_size(tmp_path):
    """Two checkpoints of 256 MiB each (a 192 MiB and a 64 MiB tensor), 8 MiB slabs:
    the diff's peak RSS exceeds that of the same command on a tiny pair (imports,
    manifests) by far less than one checkpoint, let alone two whole tensors and their
    float64 copies (what a non-streaming diff would hold: over 1 GiB)."""
    g = torch.Generator().manual_seed(5)
    big = torch.randn(4096, 12288, generator=g)  # 192 MiB
    other = torch.randn(2048, 8192, generator=g)  # 64 MiB
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    big[4000, :7] = 0.5
    dckpt.save({"big": big, "other": other}, a)
    big[4000, :7] = 1.5
    dckpt.save({"big": big, "other": other}, b)
    del big, other
    ta, tb = str(tmp_path / "ta"), str(tmp_path / "tb")
    dckpt.save({"big": torch.ones(4, 4), "other": torch.ones(2)}, ta)
    dckpt.save({"big": torch.zeros(4, 4), "other": torch.ones(2)}, tb)
    base, p = _peak_rss([ta, tb, "--json"])
    assert p.returncode == 1, p.stderr
    peak, p = _peak_rss([a, b, "--json", "--slab-mib", "8"])
    assert p.returncode == 1, p.stderr
    k = {x["key"]: x for x in json.loads(p.stdout)["keys"]}
    assert (k["big"]["n_diff"], k["big"]["max_abs_diff"], k["other"]["status"]) == (
        7, 1.0, "equal"), k
    growth = peak - base
    assert growth < 96 << 20, f"peak RSS grew by {growth >> 20} MiB (base {base >> 20} MiB)"


def test_dckpt_diff_is_the_function_even_after_importing_its_module():
    import dckpt.view.diff

    assert dckpt.diff is dckpt.view.diff.diff and callable(dckpt.diff)
    assert dckpt.DiffResult is DiffResult and dckpt.KeyDiff is KeyDiff
