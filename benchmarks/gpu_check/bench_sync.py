"""GPU check part "bench_sync": synchronous save and restore of FSDP2 CUDA DTensors,
dckpt vs DCP, beside raw write+fsync of the same bytes.

One NCCL rank (the lent machine has one GPU: resharding to another world size is
checked for correctness by the "reshard" part; timing it needs 2 GPUs). An FSDP2 MLP
+ Adam (``--layers`` x ``--width``^2 fp32, ~1.5 GiB with the moments) is saved with
``dckpt.save({"train": TrainingState})`` and with
``dcp.save(get_state_dict(...), FileSystemWriter(sync_files=True))``, order
alternating over ``--reps``, each into a fresh directory; then each checkpoint is
loaded into a fresh FSDP2 model on the GPU (``dckpt.load``; ``dcp.load`` +
``set_state_dict``), the first load of each checked for equality. The floor: the
state's bytes, copied to the host, written with ``os.write`` + ``os.fsync``.

    python benchmarks/gpu_check/bench_sync.py [--width 4096] [--layers 8] [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, cpu_mode, device_or_skip, gbps, median, scratch, sync  # noqa: E402

import torch  # noqa: E402


def _model(a: Any, device: str, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The FSDP2 model, one step taken (Adam's moments exist: they are saved too)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    m = torch.nn.Sequential(*[torch.nn.Linear(a.width, a.width) for _ in range(a.layers)])
    m = m.to(device)
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(m.parameters(), lr=1e-4)
    m(torch.randn(8, a.width, device=device)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def _raw(m: torch.nn.Module, opt: torch.optim.Optimizer, path: str) -> float:
    """The floor: every local shard to the host, written and fsynced to one file."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(m, opt)
    tensors = [v for v in msd.values()] + [x for s in osd["state"].values()
                                           for x in s.values() if x.dim()]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for t in tensors:
            local = t.to_local() if hasattr(t, "to_local") else t
            os.write(fd, memoryview(local.detach().cpu().contiguous().view(-1)
                                    .view(torch.uint8).numpy()))
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t0
    os.unlink(path)
    return dt


def main(rep: Report) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    import dckpt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    device = device_or_skip("bench_sync")
    if cpu_mode():
        a.width, a.layers, a.reps = 256, 4, 2
    root = scratch("gpucheck-sync-")
    dist.init_process_group("nccl" if device == "cuda" else "gloo",
                            init_method=f"file://{root}/rdzv", rank=0, world_size=1)
    nbytes = a.layers * (a.width ** 2 + a.width) * 12
    rep.data.update(device=device, width=a.width, layers=a.layers, state_bytes=nbytes)
    t: dict[str, list[float]] = {k: [] for k in ("dckpt save", "dcp save", "dckpt load",
                                                  "dcp load", "raw write+fsync")}
    try:
        mesh = init_device_mesh(device, (1,))
        m, opt = _model(a, device, mesh)
        want = {k: v.full_tensor().cpu() for k, v in m.state_dict().items()}

        def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            m2, o2 = _model(a, device, mesh)
            with torch.no_grad():
                for p in m2.parameters():
                    p.zero_()
            return m2, o2

        def same(m2: torch.nn.Module) -> bool:
            return all(torch.equal(v.full_tensor().cpu(), want[k])
                       for k, v in m2.state_dict().items())

        for r in range(a.reps):
            for lib in (("dckpt", "dcp") if r % 2 == 0 else ("dcp", "dckpt")):
                path = os.path.join(root, f"{lib}-{r}")
                sync(device)
                t0 = time.perf_counter()
                if lib == "dckpt":
                    dckpt.save({"train": dckpt.TrainingState(m, opt)}, path)
                else:
                    msd, osd = get_state_dict(m, opt)
                    dcp.save({"model": msd, "optim": osd},
                             storage_writer=dcp.FileSystemWriter(path, sync_files=True))
                t[f"{lib} save"].append(time.perf_counter() - t0)
                m2, o2 = fresh()
                sync(device)
                t0 = time.perf_counter()
                if lib == "dckpt":
                    dckpt.load({"train": dckpt.TrainingState(m2, o2)}, path)
                else:
                    msd, osd = get_state_dict(m2, o2)
                    sd = {"model": msd, "optim": osd}
                    dcp.load(sd, storage_reader=dcp.FileSystemReader(path))
                    set_state_dict(m2, o2, model_state_dict=sd["model"],
                                   optim_state_dict=sd["optim"])
                sync(device)
                t[f"{lib} load"].append(time.perf_counter() - t0)
                if r == 0:
                    rep.check(f"{lib}: the loaded model equals the saved one", same(m2))
                shutil.rmtree(path, ignore_errors=True)
                del m2, o2
            t["raw write+fsync"].append(_raw(m, opt, os.path.join(root, "raw")))
        for k, v in t.items():
            rep.figures[k] = {"median_s": median(v), "runs_s": v, "GBps": gbps(nbytes, median(v))}
            print(f"{k:<16} {median(v):.3f} s  {gbps(nbytes, median(v)):.2f} GB/s", flush=True)
        for op in ("save", "load"):
            r_ = rep.figures[f"dckpt {op}"]["median_s"] / rep.figures[f"dcp {op}"]["median_s"]
            rep.figures[f"{op} dckpt/dcp"] = r_
            print(f"{op}: dckpt / DCP = {r_:.2f}")
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    Report("bench_sync").run(main)
