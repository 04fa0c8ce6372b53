"""GPU check part "reshard": FSDP2 CUDA DTensors saved and restored at another world
size, every byte checked.

The lent machines have one GPU, so the training backend a GPU user has (NCCL) runs
one rank; resharding needs two, which share the GPU over gloo with CUDA tensors (gloo
moves nothing here: dckpt's own collectives run on gloo groups it makes, and the
states are built from local shards, so no CUDA collective is needed). Three phases,
each in fresh processes:

1. world 1, NCCL: an FSDP2 model + Adam trains 3 steps; ``{"train": TrainingState}``
   and a dict of raw DTensors (uneven rows, fp32/bf16/fp16/int64) are saved; the full
   values are kept as the reference (host copies, torch.save).
2. world 2, gloo, both ranks on cuda:0: fresh FSDP2 model and DTensors load both
   checkpoints; every local shard must equal its slice of the reference byte for
   byte and still be on the GPU; then both are saved again from world 2.
3. world 1, NCCL: loads world 2's checkpoints and checks every byte again.

    python benchmarks/gpu_check/reshard.py
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Report, device_or_skip, scratch  # noqa: E402

import torch  # noqa: E402

WIDTH, VOCAB, LAYERS = 256, 1001, 3  # odd vocabulary: FSDP2's Shard(0) is uneven at 2


def _model(device: str, mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same small FSDP2 model at any world size (weights from a fixed seed)."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    torch.manual_seed(0)
    layers = [torch.nn.Embedding(VOCAB, WIDTH)]
    layers += [torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    m = torch.nn.Sequential(*layers).to(device)
    for layer in m[1:]:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _raw_globals() -> dict[str, torch.Tensor]:
    """Global values of the raw DTensors: odd row counts, several dtypes."""
    g = torch.Generator().manual_seed(1)
    return {"f32": torch.randn(1001, 33, generator=g),
            "bf16": torch.randn(7, 5, generator=g).bfloat16(),
            "f16": torch.randn(3, 64, 5, generator=g).half(),
            "i64": torch.randint(-2**40, 2**40, (4097,), generator=g)}


def _raw_state(mesh: Any, device: str, zero: bool) -> dict[str, Any]:
    """The raw DTensors Shard(0) over ``mesh``, built from local chunks (no collective)."""
    from torch.distributed.tensor import DTensor, Shard

    rank, world = mesh.get_local_rank(), mesh.size()
    out = {}
    for k, t in _raw_globals().items():
        local = t.chunk(world, dim=0)[rank].clone() if rank < len(t.chunk(world, 0)) else t[:0]
        local = torch.zeros_like(local) if zero else local
        out[k] = DTensor.from_local(local.to(device), mesh, [Shard(0)], run_check=False,
                                    shape=t.shape, stride=t.stride())
    return out


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts/lists to {"a/b/0": leaf}."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(_leaves(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def _full(v: Any) -> Any:
    """A leaf's full value on the host (at world 1 full_tensor() needs no collective)."""
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        return v.full_tensor().cpu()
    return v.detach().cpu() if isinstance(v, torch.Tensor) else v


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte equality (not value equality: -0.0 vs 0.0 and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _compare(got: dict[str, Any], ref: dict[str, Any], device: str) -> list[str]:
    """Each leaf of ``got`` against ``ref``: a DTensor's local shard against its slice
    of the reference, on the right device. Returns the mismatches (empty: all equal)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    bad = [f"{k}: missing" for k in ref if k not in got]
    bad += [f"{k}: unexpected" for k in got if k not in ref]
    for k, v in got.items():
        if k not in ref:
            continue
        want = ref[k]
        if isinstance(v, DTensor):
            shape, off = compute_local_shape_and_global_offset(v.shape, v.device_mesh,
                                                               v.placements)
            want = want[tuple(slice(o, o + n) for o, n in zip(off, shape))]
            local = v.to_local()
            if local.device.type != device:
                bad.append(f"{k}: on {local.device}, not {device}")
            if not _same_bytes(local.cpu(), want):
                bad.append(f"{k}: bytes differ")
        elif isinstance(v, torch.Tensor):
            if not _same_bytes(v.cpu(), want):
                bad.append(f"{k}: bytes differ")
        elif v != want:
            bad.append(f"{k}: {v!r} != {want!r}")
    return bad


def _phase(rank: int, world: int, backend: str, device: str, phase: int, work: str) -> None:
    """One rank of one phase; writes rank<r>.json with its checks (or its error)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dckpt

    res: dict[str, Any] = {"rank": rank, "checks": {}}
    try:
        if device == "cuda":
            torch.cuda.set_device(0)  # one GPU: every rank shares it
        dist.init_process_group(backend, init_method=f"file://{work}/rdzv{phase}",
                                rank=rank, world_size=world)
        mesh = init_device_mesh(device, (world,))
        m, opt = _model(device, mesh)
        ts = dckpt.TrainingState(m, opt)
        if phase == 1:
            for _ in range(3):
                opt.zero_grad()
                x = torch.randint(0, VOCAB, (8, 16), device=device)
                m(x).square().mean().backward()
                opt.step()
            raw = _raw_state(mesh, device, zero=False)
            dckpt.save({"train": ts}, f"{work}/fsdp_w1")
            dckpt.save(raw, f"{work}/raw_w1")
            ref = {"train": {k: _full(v) for k, v in _leaves(ts.state_dict()).items()},
                   "raw": {k: v.clone() for k, v in _raw_globals().items()}}
            torch.save(ref, f"{work}/ref.pt")
            res["checks"]["saved at world 1"] = []
        else:
            src = "w1" if phase == 2 else "w2"
            ref = torch.load(f"{work}/ref.pt", weights_only=False)
            if phase == 3:  # an optimizer has state to load into only after a step
                opt.zero_grad()
                m(torch.zeros(1, 1, dtype=torch.long, device=device)).sum().backward()
                opt.step()
            dckpt.load({"train": ts}, f"{work}/fsdp_{src}")
            raw = _raw_state(mesh, device, zero=True)
            dckpt.load(raw, f"{work}/raw_{src}")
            res["checks"][f"fsdp2 {src} -> world {world}"] = _compare(
                _leaves(ts.state_dict()), ref["train"], device)
            res["checks"][f"raw DTensors {src} -> world {world}"] = _compare(
                raw, ref["raw"], device)
            if phase == 2:
                dckpt.save({"train": ts}, f"{work}/fsdp_w2")
                dckpt.save(raw, f"{work}/raw_w2")
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    with open(f"{work}/p{phase}_rank{rank}.json", "w") as f:
        json.dump(res, f)


def main(rep: Report) -> None:
    import torch.multiprocessing as mp

    device = device_or_skip("reshard")
    one = "nccl" if device == "cuda" else "gloo"
    work = scratch("gpucheck-reshard-")
    rep.data.update(device=device, work=work)
    for phase, world, backend in ((1, 1, one), (2, 2, "gloo"), (3, 1, one)):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.start_processes(_phase, args=(world, backend, device, phase, work), nprocs=world,
                           join=True, start_method="spawn")
        for r in range(world):
            with open(f"{work}/p{phase}_rank{r}.json") as f:
                res = json.load(f)
            if "error" in res:
                rep.check(f"phase {phase} ({backend}, world {world}) rank {r} ran", False,
                          res["error"])
                return  # the next phase reads this one's checkpoints
            for name, bad in res["checks"].items():
                rep.check(f"{name} (rank {r})", not bad, "; ".join(bad[:8]))


if __name__ == "__main__":
    Report("reshard").run(main)
