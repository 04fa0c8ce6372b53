"""Peak host memory per rank of each save/restore mode, dckpt and DCP side by side.

For each mode, fresh processes (``--world`` gloo ranks, torch.multiprocessing) build a
state of fp32 DTensors Shard(0) (``--mib`` MiB per rank: weights and two Adam moments),
record their resident memory (VmRSS) once the state exists, run the mode twice (the
second run is the steady state: reused buffers), and report the growth of their peak
(VmHWM - RSS before) plus the growth of /dev/shm (the fast tier's files live there, and
tmpfs pages are host memory too). Reported per mode: the max over ranks, in MiB and as
a multiple of the rank's state.

    python benchmarks/bench_memory.py [--world 2] [--mib 256] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("dckpt sync save", "dckpt async save", "dckpt manager async + /dev/shm tier",
         "dckpt restore", "DCP save", "DCP async save", "DCP load")


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _shm_mib() -> float:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20


def worker(rank: int, world: int, init: str, mode: str, mib: int, scratch: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = mib * 2**20 // (3 * 8 * 1024 * 4)
    state = {g: {f"w{i}": DTensor.from_local(torch.rand(rows, 1024), mesh, [Shard(0)], run_check=False)
                 for i in range(8)} for g in ("weights", "exp_avg", "exp_avg_sq")}
    state["step"] = 1
    state_mib = sum(t.to_local().numel() * 4 for g in ("weights", "exp_avg", "exp_avg_sq")
                    for t in state[g].values()) / 2**20
    path = os.path.join(scratch, "ckpt")
    if mode in ("dckpt restore", "DCP load"):  # the checkpoint to restore, made first
        dckpt.save(state, path + "-d") if mode == "dckpt restore" else dcp.save(state, checkpoint_id=path + "-d")
    dist.barrier()
    base_rss, base_shm = _status("VmRSS"), _shm_mib()
    # VmHWM cannot be reset without privileges here: the peak is read relative to the
    # RSS with the state built, which is also the peak so far (nothing larger ran).
    mgr = None
    for i in range(2):
        p = f"{path}-{i}"
        if mode == "dckpt sync save":
            dckpt.save(state, p)
        elif mode == "dckpt async save":
            dckpt.async_save(state, p).result()
        elif mode == "dckpt manager async + /dev/shm tier":
            if mgr is None:
                mgr = dckpt.CheckpointManager(os.path.join(scratch, "root"), async_save=True,
                                              local_root=os.path.join("/dev/shm", os.path.basename(scratch), f"r{rank}"),
                                              capture_rng=False)
            mgr.save(i + 1, state, force=True)
            mgr.wait()
        elif mode == "dckpt restore":
            dckpt.load(state, path + "-d")
        elif mode == "DCP save":
            dcp.save(state, checkpoint_id=p)
        elif mode == "DCP async save":
            dcp.async_save(state, checkpoint_id=p).result()
        elif mode == "DCP load":
            dcp.load(state, checkpoint_id=path + "-d")
        dist.barrier()
    peak = _status("VmHWM") - base_rss
    shm = _shm_mib() - base_shm
    if mgr is not None:
        mgr.close()
    res = [torch.tensor([peak, shm, state_mib], dtype=torch.float64)]
    gathered = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, res[0])
    if rank == 0:
        with open(out, "w") as f:
            json.dump([g.tolist() for g in gathered], f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="state per rank")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch.multiprocessing as tmp

    results = {}
    print(f"{a.world} ranks, {a.mib} MiB of state per rank; growth of peak RSS and of /dev/shm "
          "over the RSS with the state built, max over ranks")
    print(f"{'mode':40}{'RSS MiB':>9}{'shm MiB':>9}{'total MiB':>10}{'x state':>8}")
    for mode in MODES:
        scratch = tempfile.mkdtemp(prefix="dckpt-bench-mem-")
        out = os.path.join(scratch, "out.json")
        try:
            tmp.spawn(worker, args=(a.world, os.path.join(scratch, "rdv"), mode, a.mib, scratch, out),
                      nprocs=a.world, join=True)
            rows = json.load(open(out))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(os.path.join("/dev/shm", os.path.basename(scratch)), ignore_errors=True)
        rss = max(r[0] for r in rows)
        shm = max(r[1] for r in rows) / a.world if "tier" in mode else 0.0  # shm is shared: per rank
        total = rss + shm
        results[mode] = {"rss_mib": rss, "shm_mib_per_rank": shm, "total_mib": total,
                         "state_mib": rows[0][2], "x_state": total / rows[0][2]}
        print(f"{mode:40}{rss:9.0f}{shm:9.0f}{total:10.0f}{total / rows[0][2]:8.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
