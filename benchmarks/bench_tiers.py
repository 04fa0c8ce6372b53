"""The fast tier: restart-restore time and save blocking time, against DCP, in one run.

Spawns ``--world`` gloo ranks holding the state of bench_save_load.py (fp32 weights and
two Adam moments of a small transformer as DTensors Shard(0); 660 MiB in all with the
defaults). Each rep, in rotating order:

1. **Restart from the fast tier.** A CheckpointManager with ``local_root`` on /dev/shm
   (each rank its own directory) and a durable root on disk saves the state; then a
   *new* manager (as a restarted job builds) restores it into zeroed tensors. Timed:
   ``restore()`` (listing, the ranks' agreement, the reads, the checks); the new
   manager's construction (its background groups) is reported apart. Against: DCP
   saves the same state to disk and loads it right back (its data still in the page
   cache: the best case of a crash-and-restart on the same machine). Baselines, each
   rank at once on its own bytes (the same tensors the restore fills): ``memcpy``,
   torch ``copy_`` of them into preallocated, already-touched buffers (one thread per
   rank, as the restore reads with one thread per core share); ``read_floor``, what a
   verified read out of tmpfs cannot go below: the same bytes preadv'd from one file on
   --shm into those buffers plus CRC32 of every 256 KiB.
2. **Blocking time of a save.** ``mgr.save`` of a manager with ``async_save=True`` and
   the /dev/shm fast tier (snapshot, then local commit and staging in the background),
   the first call (after ``restore``, as a job starts) and later ones; beside it
   ``dckpt.async_save`` and DCP's ``async_save`` with a reused stager (its best CPU
   configuration), first and later calls. Each save is waited for before the next.

Per call: max over ranks; tables: medians over reps.

    python benchmarks/bench_tiers.py [--reps 5] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_save_load import (_max_over_ranks, add_state_args, locals_of, make_state, memcpy_floor,  # noqa: E402
                             model_specs, save_results, timed)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.device_mesh import init_device_mesh

    import dckpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    specs = model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"])
    src = make_state(specs, mesh, rank, world, zero=False)
    locs = locals_of(src)
    nbytes = sum(t.numel() * t.element_size() for t in locs)
    dcp_pg = dist.new_group(backend="gloo")
    stager = DefaultStager(StagingOptions(False, False, False, False))
    bufs, memcpy = memcpy_floor(locs)

    # The floor of a verified read out of tmpfs: the same bytes read from one file on
    # --shm with preadv into the same buffers, then CRC32 of every 256 KiB (zlib-ng, the
    # library's checksum), both ranks at once. No planning, no manifest, no collective.
    from dckpt.format.shards import block_crcs
    from dckpt.storage.local import LocalReader
    floor_path = os.path.join(a["shm"], f"floor-{rank}.bin")
    with open(floor_path, "wb") as fh:
        for x in locs:
            fh.write(memoryview(x.contiguous().view(torch.uint8).numpy()))
    views = [memoryview(b.view(torch.uint8).numpy()).cast("B") for b in bufs]

    def read_floor() -> None:  # per tensor, as a restore reads: the read, then its CRCs
        with LocalReader(floor_path) as f:
            pos = 0
            for v in views:
                if f.readv(pos, [v]) != len(v):
                    raise OSError(f"{floor_path}: short read")
                block_crcs(v, 256 << 10)
                pos += len(v)

    def check(dst: dict) -> bool:
        ok = all(torch.equal(x, y) for x, y in zip(locals_of(dst), locs)) and dst["step"] == src["step"]
        return _max_over_ranks(0.0 if ok else 1.0) == 0.0

    def manager(i: int, **kw):
        return dckpt.CheckpointManager(os.path.join(a["dir"], f"durable-{i}"), every_steps=1,
                                       capture_rng=False, keep_last=1,
                                       local_root=os.path.join(a["shm"], f"r{i}-node{rank}"), **kw)

    def restart(i: int) -> dict[str, float]:
        m = manager(i)
        m.save(1, src)
        m.close()
        dst = make_state(specs, mesh, rank, world, zero=True)
        box: dict[str, Any] = {}

        def build() -> None:
            box["m"] = manager(i)

        def go() -> None:
            box["step"], box["tier"] = box["m"].restore(dst), box["m"].restored_from
        t_new = timed(build)  # the restarted job's manager: its groups, its local_root
        t = timed(go)
        box["m"].close()
        assert box["tier"] == "local" and check(dst), box
        dist.barrier()
        if rank == 0:
            shutil.rmtree(os.path.join(a["dir"], f"durable-{i}"), ignore_errors=True)
        shutil.rmtree(os.path.join(a["shm"], f"r{i}-node{rank}"), ignore_errors=True)
        return {"tier_restore": t, "tier_manager_new": t_new}

    def dcp_reload(i: int) -> dict[str, float]:
        path = os.path.join(a["dir"], f"dcp-{i}")
        dcp.save(src, storage_writer=dcp.FileSystemWriter(path, sync_files=True), process_group=dcp_pg)
        dst = make_state(specs, mesh, rank, world, zero=True)
        t = timed(lambda: dcp.load(dst, checkpoint_id=path, process_group=dcp_pg))
        assert check(dst)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        return {"dcp_load_warm": t}

    def blocking(i: int) -> dict[str, float]:
        out: dict[str, float] = {}
        # The manager as a job uses it: restore (nothing there yet) prepares, then saves.
        m = manager(100 + i, async_save=True)
        m.restore(make_state(specs, mesh, rank, world, zero=True))
        for k in range(a["calls"]):
            dist.barrier()
            t0 = time.perf_counter()
            m.save(k + 1, src)
            b = _max_over_ranks(time.perf_counter() - t0)
            m.wait()
            out["tier_first" if k == 0 else f"tier_{k}"] = b
        m.close()
        if rank == 0:
            shutil.rmtree(os.path.join(a["dir"], f"durable-{100 + i}"), ignore_errors=True)
        shutil.rmtree(os.path.join(a["shm"], f"r{100 + i}-node{rank}"), ignore_errors=True)
        for lib in ("dckpt", "dcp"):
            for k in range(a["calls"]):
                path = os.path.join(a["dir"], f"{lib}-async-{i}-{k}")
                dist.barrier()
                t0 = time.perf_counter()
                if lib == "dckpt":
                    h = dckpt.async_save(src, path)
                    wait = h.result
                else:
                    r = dcp.async_save(src, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
                                       process_group=dcp_pg, async_stager=stager)
                    wait = getattr(r, "upload_completion", r).result
                b = _max_over_ranks(time.perf_counter() - t0)
                wait()
                out[f"{lib}_first" if k == 0 else f"{lib}_{k}"] = b
                dist.barrier()
                if rank == 0:
                    shutil.rmtree(path, ignore_errors=True)
        return out

    rows = []
    parts = [restart, dcp_reload]
    for i in range(a["reps"]):
        row: dict[str, Any] = {"rep": i, "memcpy": timed(memcpy), "read_floor": timed(read_floor)}
        for fn in (parts[i % 2:] + parts[:i % 2]):
            row.update(fn(i))
        if i < a["block_reps"]:
            row.update(blocking(i))
        rows.append(row)
        if rank == 0:
            print(f"  rep {i}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()
                                              if isinstance(v, float)), flush=True)
    os.unlink(floor_path)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"rows": rows, "bytes_per_rank": nbytes, "world": world}, fh)
    dist.barrier()
    dist.destroy_process_group()


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows if key in r)


def _later(rows: list[dict], lib: str) -> float:
    return statistics.median(v for r in rows for k, v in r.items()
                             if k.startswith(lib + "_") and k[len(lib) + 1:].isdigit())


def report(res: dict) -> dict:
    rows = res["rows"]
    mib = res["bytes_per_rank"] * res["world"] / 2**20
    s = {"state_mib": mib, "memcpy": _med(rows, "memcpy"), "read_floor": _med(rows, "read_floor"),
         "tier_restore": _med(rows, "tier_restore"), "dcp_load_warm": _med(rows, "dcp_load_warm"),
         "tier_manager_new": _med(rows, "tier_manager_new")}
    for lib in ("tier", "dckpt", "dcp"):
        s[f"{lib}_first"] = _med(rows, f"{lib}_first")
        s[f"{lib}_later"] = _later(rows, lib)
    print(f"\nstate {mib:.0f} MiB over {res['world']} ranks; medians over {len(rows)} reps")
    print(f"restart from the fast tier   {s['tier_restore']:.3f} s   DCP load (warm) "
          f"{s['dcp_load_warm']:.3f} s   ratio {s['tier_restore'] / s['dcp_load_warm']:.2f}x "
          f"(target <= 0.5)   vs memcpy {s['memcpy']:.3f} s: {s['tier_restore'] / s['memcpy']:.2f}x "
          f"(target <= 2); the new manager itself (groups, local_root) {s['tier_manager_new']:.3f} s")
    print(f"  floor of a verified read from tmpfs (preadv + CRC32, no dckpt) {s['read_floor']:.3f} s "
          f"= {s['read_floor'] / s['memcpy']:.2f}x memcpy; restore / that floor "
          f"{s['tier_restore'] / s['read_floor']:.2f}x")
    print("save blocking (s)      first    later   first/later")
    for lib, name in (("tier", "manager + /dev/shm"), ("dckpt", "dckpt.async_save"),
                      ("dcp", "DCP async (reused stager)")):
        f, l = s[f"{lib}_first"], s[f"{lib}_later"]
        print(f"  {name:26s} {f:.3f}   {l:.3f}   {f / l:.2f}x")
    print(f"manager later / DCP later: {s['tier_later'] / s['dcp_later']:.2f}x (target <= 0.4); "
          f"manager first / later: {s['tier_first'] / s['tier_later']:.2f}x (target <= 2); "
          f"later / memcpy {s['tier_later'] / s['memcpy']:.2f}x")
    return s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="restore reps")
    p.add_argument("--block-reps", type=int, default=2, help="reps that also time save blocking")
    p.add_argument("--calls", type=int, default=4, help="saves per blocking run")
    add_state_args(p)
    p.add_argument("--dir", default=None, help="durable/DCP parent dir (None: system temp)")
    p.add_argument("--shm", default="/dev/shm", help="parent of the fast tier")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.multiprocessing as tmp

    scratch = tempfile.mkdtemp(prefix="dckpt-bench-tiers-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="dckpt-bench-tiers-", dir=args.shm)
    a = {**vars(args), "dir": scratch, "shm": shm}
    res_path = os.path.join(scratch, "result.json")
    try:
        tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                  nprocs=args.world, join=True)
        with open(res_path) as fh:
            res = json.load(fh)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["summary"] = report(res)
    res["args"] = vars(args)
    save_results(res, args.json)
    return res


if __name__ == "__main__":
    main()
