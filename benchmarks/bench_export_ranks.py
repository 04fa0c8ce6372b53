"""A sharded model's Hugging Face folder from many ranks: dckpt's export vs DCP's (issue 52).

    python benchmarks/bench_export_ranks.py --runs 3 --json benchmarks/results/export-ranks-2026-12-06.json

The same Llama-shaped state (``--layers`` decoder layers of ``--hidden`` x ``--inter``
weights, an embedding and an lm_head of ``--vocab`` rows; fp32), sharded over ``--ranks``
CPU ranks (torchrun, gloo) as FSDP2 shards it (DTensor ``Shard(0)``), is saved and then
turned into a model folder (``model-0000i-of-0000N.safetensors`` + the index) by both,
in one run:

- ``dckpt``: ``dckpt.save`` of the sharded state, then every rank's
  ``dckpt.interop.hf_export_ranks.export_share`` (a balanced share of whole tensors by
  range reads of the committed files, checksums verified; rank 0 writes the index once
  every file is in place; no collective): what DckptTrainer runs in the background after
  a commit;
- ``dcp``: ``torch.distributed.checkpoint.save`` with ``HuggingFaceStorageWriter(
  save_distributed=True)`` (torch 2.13's sharded safetensors), then DCP's
  ``consolidate_safetensors_files_on_every_rank`` (each rank the output files of its
  indices, ``num_threads=2``), with one output file per rank as dckpt writes.

Timed on rank 0 between barriers: the save, and the export/consolidation (the folder's
cost). Physical reference, every run: the model's bytes written in 64 MiB blocks and
fsynced, split over ``--ranks`` files written at once (the disk's floor for the folder).
Page cache: left warm (the export reads what the save just wrote, as in the Trainer).
Medians over runs; ratios dckpt / dcp and each / raw.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

p = argparse.ArgumentParser()
p.add_argument("--runs", type=int, default=3)
p.add_argument("--ranks", type=int, default=2)
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--inter", type=int, default=1536)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--vocab", type=int, default=16000)
p.add_argument("--json", default=None)
p.add_argument("--job", action="store_true")
p.add_argument("--root", default=None)
args = p.parse_args()


def shapes() -> dict[str, tuple[int, ...]]:
    h, i = args.hidden, args.inter
    out = {"model.embed_tokens.weight": (args.vocab, h), "lm_head.weight": (args.vocab, h),
           "model.norm.weight": (h,)}
    for layer in range(args.layers):
        pre = f"model.layers.{layer}."
        out |= {pre + "self_attn.q_proj.weight": (h, h), pre + "self_attn.k_proj.weight": (h, h),
                pre + "self_attn.v_proj.weight": (h, h), pre + "self_attn.o_proj.weight": (h, h),
                pre + "mlp.gate_proj.weight": (i, h), pre + "mlp.up_proj.weight": (i, h),
                pre + "mlp.down_proj.weight": (h, i), pre + "input_layernorm.weight": (h,),
                pre + "post_attention_layernorm.weight": (h,)}
    return out


def job() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import (
        consolidate_safetensors_files_on_every_rank)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import dckpt
    from dckpt.interop.hf_export_ranks import export_share

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    state = {k: distribute_tensor(torch.randn(s, generator=g), mesh, [Shard(0)],
                                  src_data_rank=None) for k, s in shapes().items()}
    times: dict[str, float] = {}

    def timed(name: str, fn) -> None:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times[name] = time.perf_counter() - t0

    root = args.root
    ck, out_d = os.path.join(root, "dckpt"), os.path.join(root, "dckpt-folder")
    timed("dckpt_save", lambda: dckpt.save({"models": {"0": state}}, ck))
    timed("dckpt_export", lambda: export_share(ck, out_d, rank, world, prefix="models.0.",
                                               max_shard_size=1 << 40))
    shards, out_c = os.path.join(root, "dcp"), os.path.join(root, "dcp-folder")
    # one output file per rank, as dckpt's export writes (balanced by bytes)
    keys = sorted(shapes(), key=lambda k: -torch.Size(shapes()[k]).numel())
    load = [0] * world
    index = {}
    for k in keys:
        r = min(range(world), key=lambda r: (load[r], r))
        index[k] = r + 1
        load[r] += torch.Size(shapes()[k]).numel()
    timed("dcp_save", lambda: dcp.save(state, storage_writer=HuggingFaceStorageWriter(
        shards, save_distributed=True, fqn_to_index_mapping=index)))
    os.makedirs(out_c, exist_ok=True)
    timed("dcp_consolidate", lambda: consolidate_safetensors_files_on_every_rank(
        shards, out_c, index, num_threads=2))
    if rank == 0:
        with open(os.path.join(root, "times.json"), "w") as f:
            json.dump(times, f)
    dist.barrier()
    dist.destroy_process_group()


def check(root: str) -> int:
    """Both folders hold the same tensors, bitwise; returns the model's bytes."""
    from safetensors import safe_open

    def read(folder: str) -> dict:
        idx = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
        out = {}
        for name in sorted(set(idx["weight_map"].values())):
            with safe_open(os.path.join(folder, name), "pt") as f:
                out |= {k: f.get_tensor(k) for k in f.keys()}
        return out

    a, b = read(os.path.join(root, "dckpt-folder")), read(os.path.join(root, "dcp-folder"))
    assert sorted(a) == sorted(b) == sorted(shapes()), (sorted(a)[:3], sorted(b)[:3])
    assert all(a[k].equal(b[k]) for k in a)
    return sum(t.numel() * t.element_size() for t in a.values())


def raw_write(where: str, nbytes: int, writers: int) -> float:
    """Write ``nbytes`` split over ``writers`` files at once in 64 MiB blocks, fsync;
    the faster of two back-to-back writes."""
    import threading

    block = b"\0" * (64 << 20)

    def one(i: int) -> None:
        left = nbytes // writers
        fd = os.open(os.path.join(where, f"raw-{i}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            while left > 0:
                left -= os.write(fd, block[:min(left, len(block))])
            os.fsync(fd)
        finally:
            os.close(fd)

    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        ts = [threading.Thread(target=one, args=(i,)) for i in range(writers)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        best = min(best, time.perf_counter() - t0)
        for i in range(writers):
            os.remove(os.path.join(where, f"raw-{i}"))
    return best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def driver() -> None:
    base = tempfile.mkdtemp(prefix="bench-export-", dir=os.environ.get("BENCH_DIR"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs: dict[str, list[float]] = {}
    nbytes = 0
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(args.runs):
        root = os.path.join(base, f"run-{r}")
        os.makedirs(root)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(args.ranks), "--master-addr", "127.0.0.1", "--master-port",
               str(free_port()), os.path.abspath(__file__), "--job", "--root", root]
        for k in ("hidden", "inter", "layers", "vocab"):
            cmd += [f"--{k}", str(getattr(args, k))]
        with open(os.path.join(base, f"run-{r}.log"), "w") as log:
            subprocess.run(cmd, check=True, env=env, timeout=1800, stdout=log,
                           stderr=subprocess.STDOUT)
        t = json.load(open(os.path.join(root, "times.json")))
        nbytes = check(root)
        t["raw"] = raw_write(root, nbytes, args.ranks)
        for k, v in t.items():
            runs.setdefault(k, []).append(v)
        print(f"run {r}: " + ", ".join(f"{k} {v:.3f} s" for k, v in t.items())
              + f" ({nbytes / 2**20:.0f} MiB; load avg {os.getloadavg()[0]:.1f})", flush=True)
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    ratio = {"export dckpt/dcp": med["dckpt_export"] / med["dcp_consolidate"],
             "save dckpt/dcp": med["dckpt_save"] / med["dcp_save"],
             "export dckpt/raw": med["dckpt_export"] / med["raw"],
             "consolidate dcp/raw": med["dcp_consolidate"] / med["raw"]}
    print(f"\nmodel {nbytes / 2**20:.0f} MiB at {args.ranks} ranks; medians of {args.runs} runs:")
    for k, v in med.items():
        print(f"  {k:16s} {v:8.3f} s ({nbytes / 2**20 / v:6.0f} MiB/s)")
    for k, v in ratio.items():
        print(f"  {k:20s} {v:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "bytes": nbytes, "runs": runs, "median": med,
                       "ratio": ratio, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    job() if args.job else driver()
