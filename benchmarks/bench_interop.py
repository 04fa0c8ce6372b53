"""Export to Hugging Face safetensors and import from safetensors / torch.save / DCP: peak
memory (RSS) of the exporting or importing process against the largest output file, and
wall time.

Sources (made once, not measured): a dckpt checkpoint saved by 2 gloo ranks (subprocesses,
``file://`` rendezvous), DTensors Shard(0), 13 fp32 tensors of 16/32/64 MiB (rows of 4096
floats) plus a few small ones, 512 MiB in all; the same state saved by ``dcp.save`` at 2
ranks; and as one ``torch.save`` file written by one process. Each measured operation runs
in a fresh subprocess (``python bench_interop.py --child OP ...``) that reports its own
``VmHWM`` (peak RSS) from /proc/self/status, its RSS just before the operation (torch,
dckpt and the op's modules imported) and the operation's wall time. The baseline is a
process that only imports torch, dckpt and torch.distributed.checkpoint. The page cache
is warm (the sources were just written); ``sync`` runs before each operation, whose time
includes writing and fsyncing its output. Target: peak RSS - baseline <= 1.5 x the
largest output file.

    python benchmarks/bench_interop.py [--dir D] [--max-shard-size 128MB] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
COLS = 4096  # fp32 per row: 16 KiB rows
SIZES_MIB = [64, 32, 16] * 4 + [64]  # 512 MiB


def specs() -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor: the big fp32 ones, then small ones (a bias, a 0-d)."""
    out = [(f"layers.{i}.weight", (s * MIB // (4 * COLS), COLS)) for i, s in enumerate(SIZES_MIB)]
    return out + [("norm.weight", (COLS,)), ("scale", ())]


def full(i: int, shape):
    """Tensor number ``i``: uniform floats from its own seed (any process remakes it)."""
    import torch

    g = torch.Generator().manual_seed(i)
    return torch.rand(shape, generator=g)


def vm(field: str) -> int:
    """A /proc/self/status field in bytes (VmHWM, VmRSS)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- children

def _save_rank(rank: int, world: int, init: str, ckpt: str, dcp_dir: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dckpt

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    # DTensors Shard(0), one chunk per rank; the 0-d tensor stays a plain (replicated) one
    state = {"model": {n: distribute_tensor(full(i, s), mesh, [Shard(0)]) if s else full(i, s)
                       for i, (n, s) in enumerate(specs())}}
    dckpt.save(state, ckpt)
    dcp.save(state, checkpoint_id=dcp_dir)
    dist.destroy_process_group()


def _child(op: str, args: list[str]) -> dict:
    t_import = time.perf_counter()
    import torch
    import torch.distributed.checkpoint  # noqa: F401  (every child, so the baseline is one)

    import dckpt

    rss0 = vm("VmRSS")
    t0 = time.perf_counter()
    if op == "export":
        src, out, size, dtype = args
        dckpt.export(src, out, prefix="model.", max_shard_size=size,
                     dtype=None if dtype == "-" else dtype)
    elif op.endswith("import"):
        src, dst, size = args
        dckpt.import_checkpoint(src, dst, prefix="model." if op == "st-import" else None,
                                max_shard_size=size)
    elif op == "torch-save":
        torch.save({"model": {n: full(i, s) for i, (n, s) in enumerate(specs())}}, args[0])
    seconds = time.perf_counter() - t0
    return {"op": op, "seconds": seconds, "hwm": vm("VmHWM"), "rss0": rss0,
            "import_s": t0 - t_import}


def run_child(op: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", op, *args],
                         check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def largest(path: str, pattern=lambda n: n.endswith(".safetensors")) -> int:
    return max(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path) if pattern(n))


def check_export(out: str, dtype) -> None:
    """The exported files hold exactly the source tensors (converted if asked)."""
    import torch
    from safetensors import safe_open

    want = dict(specs())
    seen = set()
    for n in sorted(os.listdir(out)):
        if not n.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(out, n), "pt") as f:
            for k in f.keys():
                i = [s[0] for s in specs()].index(k)
                t = full(i, want[k])
                assert torch.equal(f.get_tensor(k), t if dtype is None else t.to(dtype)), k
                seen.add(k)
    assert seen == set(want), set(want) ^ seen


def check_import(dst: str, key_prefix: str) -> None:
    import torch

    import dckpt

    target = {n: torch.empty(s) for n, s in specs()}
    state = {"model": target} if key_prefix else target
    dckpt.load(state, dst)
    for i, (n, s) in enumerate(specs()):
        assert torch.equal(target[n], full(i, s)), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir in /tmp)")
    ap.add_argument("--max-shard-size", default="128MB")
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        if a.child[0] == "save-rank":
            r, w, init, ck, dd = a.child[1:]
            _save_rank(int(r), int(w), init, ck, dd)
            print("{}")
            return
        print(json.dumps(_child(a.child[0], a.child[1:])))
        return

    import torch

    work = tempfile.mkdtemp(prefix="bench-interop-", dir=a.dir)
    try:
        ck, dcp_dir, pt = (os.path.join(work, n) for n in ("ckpt", "dcp", "state.pt"))
        init = os.path.join(work, "rendezvous")
        t = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                   "save-rank", str(r), "2", init, ck, dcp_dir],
                                  stdout=subprocess.DEVNULL,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
                 for r in range(2)]
        assert all(p.wait() == 0 for p in procs), "the 2-rank save failed"
        run_child("torch-save", pt)
        total = sum(int(torch.Size(s).numel()) * 4 for _, s in specs())
        print(f"sources: {total / MIB:.0f} MiB state, dckpt + DCP saved by 2 ranks, torch.save "
              f"file ({time.perf_counter() - t:.0f} s to make)\n")
        base = run_child("baseline")
        rows = []

        def measure(name: str, op: str, out: str, *args: str, files=None) -> None:
            os.sync()  # the previous step's writeback must not slow this one's writes
            r = run_child(op, *args)
            big = largest(out, files or (lambda n: n.endswith(".safetensors")))
            extra = r["hwm"] - base["hwm"]
            rows.append({"name": name, **r, "largest": big, "extra": extra,
                         "ratio": extra / big, "gbps": total / r["seconds"] / 1e9})

        size = a.max_shard_size
        hf, hf16 = os.path.join(work, "hf"), os.path.join(work, "hf-bf16")
        measure("export (fp32)", "export", hf, ck, hf, size, "-")
        check_export(hf, None)
        measure("export --dtype bf16", "export", hf16, ck, hf16, size, "bf16")
        check_export(hf16, torch.bfloat16)
        data = lambda n: n.startswith("data-")  # noqa: E731
        for name, op, src, pre in (("import safetensors dir", "st-import", hf, True),
                                   ("import torch.save file", "torch-import", pt, True),
                                   ("import DCP (2 ranks)", "dcp-import", dcp_dir, True)):
            dst = os.path.join(work, op)
            measure(name, op, dst, src, dst, size, files=data)
            check_import(dst, pre)

        print(f"baseline (python + torch + dckpt + DCP imported): VmHWM "
              f"{base['hwm'] / MIB:.0f} MiB")
        print(f"max shard size {size}; extra = VmHWM - baseline; target extra <= 1.5 x "
              "largest file\n")
        head = f"{'operation':<24} {'time s':>7} {'GB/s':>6} {'VmHWM MiB':>10} " \
               f"{'RSS before':>10} " \
               f"{'extra MiB':>9} {'largest file MiB':>16} {'extra/largest':>13}"
        print(head)
        print("-" * len(head))
        for r in rows:
            ok = "ok" if r["ratio"] <= 1.5 else "OVER"
            print(f"{r['name']:<24} {r['seconds']:>7.2f} {r['gbps']:>6.2f} {r['hwm'] / MIB:>10.0f} "
                  f"{r['rss0'] / MIB:>10.0f} {r['extra'] / MIB:>9.0f} {r['largest'] / MIB:>16.1f} "
                  f"{r['ratio']:>10.2f} {ok}")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"total_bytes": total, "max_shard_size": size, "baseline": base,
                           "rows": rows}, f, indent=1)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
