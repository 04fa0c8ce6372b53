"""Peak host memory per rank of each save/restore mode, dckpt and DCP side by side.

For each mode, fresh processes (``--world`` gloo ranks, torch.multiprocessing) build an
FSDP2 MLP (bias-free 2048x2048 Linears, fp32) and its AdamW state, sized so that each
rank holds ``--mib`` MiB (weights and two Adam moments), saved as one
``dckpt.TrainingState`` (DCP saves the same object: it is Stateful). Each mode runs
twice (the second run is the steady state: reused buffers), with no training step in
between, so that only the checkpoint's memory is measured (a fenced save's hook is
then spent by the next save). glibc's mmap threshold is pinned (MALLOC_MMAP_THRESHOLD_)
so that freed tensors go back to the OS and later allocations cannot hide in memory
the training step freed. Reported per rank, max over ranks, as growth over the moment
the state was built:

* peak RSS (VmHWM: the process's own memory, staging buffers included);
* /dev/shm held after the run (the fast tier's files: tmpfs pages are host memory;
  shared by the node's ranks, so divided by the rank count);
* peak host memory: RSS plus that rank's share of /dev/shm, sampled every 2 ms during
  the run (the transient while a new fast-tier step is written beside the kept one).

Modes "manager ... tier" save into a /dev/shm fast tier (a durable root on disk);
"fenced" passes the TrainingState (the manager fences its optimizer and writes the tier
straight from the live tensors), "unfenced" passes the same tensors as a plain dict
(nothing to fence on: a snapshot into staging buffers first).

    python benchmarks/bench_memory.py [--world 2] [--mib 256] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("dckpt sync save", "dckpt async save", "dckpt manager async + tier, fenced",
         "dckpt manager async + tier, unfenced", "dckpt restore", "DCP save",
         "DCP async save", "DCP load")


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _shm_mib() -> float:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize / 2**20


class _Sampler(threading.Thread):
    """Samples RSS + this rank's share of /dev/shm every 2 ms; keeps the maximum."""

    def __init__(self, world: int) -> None:
        super().__init__(daemon=True)
        self.world, self.peak, self.stop = world, 0.0, threading.Event()
        self.page = os.sysconf("SC_PAGE_SIZE") / 2**20

    def run(self) -> None:
        with open("/proc/self/statm") as f:
            while not self.stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * self.page
                self.peak = max(self.peak, rss + _shm_mib() / self.world)
                time.sleep(0.002)


def worker(rank: int, world: int, init: str, mode: str, mib: int, scratch: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    d = 2048
    layers = max(1, round(mib * 2**20 * world / 12 / (d * d)))  # 3 fp32 copies, sharded
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    model(torch.ones(2, d)).sum().backward()
    opt.step()  # the Adam moments exist
    opt.zero_grad()
    ts = dckpt.TrainingState(model, opt)
    state_mib = sum(p.to_local().numel() * 4 * 3 for p in model.parameters()) / 2**20
    path = os.path.join(scratch, "ckpt")
    if mode in ("dckpt restore", "DCP load"):  # the checkpoint to restore, made first
        dckpt.save({"train": ts}, path + "-d") if mode == "dckpt restore" else \
            dcp.save({"train": ts}, checkpoint_id=path + "-d")
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the peak from here on is the checkpoint's
    base_rss, base_shm = _status("VmRSS"), _shm_mib()
    sampler = _Sampler(world)
    sampler.start()
    mgr = None
    for i in range(2):
        p = f"{path}-{i}"
        if mode == "dckpt sync save":
            dckpt.save({"train": ts}, p)
        elif mode == "dckpt async save":
            dckpt.async_save({"train": ts}, p, fence=opt).result()
        elif mode.startswith("dckpt manager"):
            if mgr is None:
                mgr = dckpt.CheckpointManager(
                    os.path.join(scratch, "root"), async_save=True, capture_rng=False,
                    local_root=os.path.join("/dev/shm", os.path.basename(scratch), f"r{rank}"))
                mgr.restore({"train": ts})  # nothing to restore: prepares what saves need
            fenced = mode.endswith(", fenced")
            mgr.save(i + 1, {"train": ts} if fenced else {"train": ts.state_dict()}, force=True)
        elif mode == "dckpt restore":
            dckpt.load({"train": ts}, path + "-d")
        elif mode == "DCP save":
            dcp.save({"train": ts}, checkpoint_id=p)
        elif mode == "DCP async save":
            dcp.async_save({"train": ts}, checkpoint_id=p).result()
        elif mode == "DCP load":
            dcp.load({"train": ts}, checkpoint_id=path + "-d")
        if mgr is not None:
            mgr.wait()
        dist.barrier()
    sampler.stop.set()
    sampler.join()
    peak = _status("VmHWM") - base_rss
    shm = _shm_mib() - base_shm
    transient = sampler.peak - base_rss - base_shm / world
    if mgr is not None:
        mgr.close()
    res = torch.tensor([peak, shm, state_mib, transient], dtype=torch.float64)
    gathered = [torch.zeros(4, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, res)
    if rank == 0:
        with open(out, "w") as f:
            json.dump([g.tolist() for g in gathered], f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--mib", type=int, default=256, help="state per rank")
    p.add_argument("--json", default=None)
    p.add_argument("--modes", nargs="*", default=None, help="substrings: run only these modes")
    a = p.parse_args(argv)
    import torch.multiprocessing as tmp

    # Inherited by the spawned ranks (glibc reads it at start): every large block is
    # its own mapping, returned to the OS when freed, so RSS is what is live.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))

    results = {}
    print(f"{a.world} ranks, {a.mib} MiB of state per rank; growth over the RSS with the "
          "state built, max over ranks; /dev/shm per rank")
    print(f"{'mode':40}{'RSS MiB':>9}{'shm MiB':>9}{'held':>7}{'peak MiB':>10}{'peak':>7}")
    for mode in MODES:
        if a.modes and not any(m in mode for m in a.modes):
            continue
        scratch = tempfile.mkdtemp(prefix="dckpt-bench-mem-")
        out = os.path.join(scratch, "out.json")
        try:
            tmp.spawn(worker, args=(a.world, os.path.join(scratch, "rdv"), mode, a.mib, scratch, out),
                      nprocs=a.world, join=True)
            rows = json.load(open(out))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(os.path.join("/dev/shm", os.path.basename(scratch)), ignore_errors=True)
        state = rows[0][2]
        rss = max(r[0] for r in rows)
        shm = max(r[1] for r in rows) / a.world if "tier" in mode else 0.0  # shm is shared: per rank
        # RSS + shm sampled together; without a tier the sampler only sees the RSS,
        # whose exact peak VmHWM has (the 2 ms sampling may miss a short one)
        transient = max(max(r[3] for r in rows), rss) if "tier" in mode else rss
        held = rss + shm
        results[mode] = {"rss_mib": rss, "shm_mib_per_rank": shm, "held_mib": held,
                         "peak_mib": transient, "state_mib": state,
                         "x_state_held": held / state, "x_state_peak": transient / state}
        print(f"{mode:40}{rss:9.0f}{shm:9.0f}{held / state:7.2f}{transient:10.0f}"
              f"{transient / state:7.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()
