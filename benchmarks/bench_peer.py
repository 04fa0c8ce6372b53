"""The replicated fast tier (issue 28): peer restore vs the other tiers, replication's cost
to a training loop, and the memory both take, in one run.

**1. Restore after losing one of 2 nodes, same world size.** Spawns ``--world`` gloo
ranks (torch.multiprocessing, file:// rendezvous, OMP_NUM_THREADS=1) on ``--nodes``
simulated nodes (node = rank // (world / nodes), one ``local_root`` per node on --shm,
shared by its ranks), holding the state of bench_save_load.py (fp32 weights and two Adam
moments of a small transformer as DTensors Shard(0)). Once: a manager with
``replicas=1`` saves step 10 (forced durable: a local directory) and another the same
step with S3 on moto (loopback) as its durable tier. Then each rep, in rotating order,
a *new* manager (as a restarted job builds) restores into zeroed tensors:

- ``local``: nothing lost (``restored_from == "local"``);
- ``peer``: node 1's ``local_root`` wiped first (``"peer"``: node 0 sends node 1's parts
  back, and node 1 re-creates the replicas it held for node 0);
- ``durable``: both nodes' ``local_root`` empty, durable tier a local directory, the
  page cache dropped first (a replacement node reads it cold; bench_save_load's
  drop_caches, which also touches and frees 2 GiB so the load gets resident pages);
- ``durable_warm``: the same, its files still in the page cache (the best case);
- ``s3``: the same with S3 on moto.

Timed: ``restore()`` alone, max over ranks (the new manager's construction apart).
Beside them, the limits on the same bytes, each rank at once: ``memcpy`` (copy_ of its
shards into touched buffers), ``read_floor`` (preadv of its bytes from one file on --shm
+ CRC32 of every 256 KiB), ``gloo_p2p`` (node 0's ranks send a rank's share to node 1's
ranks over gloo in 64 MiB pieces: the wire a peer restore uses). Each rep also times one
replication: a manager saves (synchronously) and ``wait()`` returns once the step is on
the next node; the same with ``replicas=0`` beside it.

**3. Memory.** Around each restore and each save+wait, a thread samples the rank's
``/proc/self/status`` every 5 ms (after ``malloc_trim``); the figure is the peak minus
the value just before, max over ranks: ``RssAnon`` (what the process itself allocated)
and ``VmRSS`` (also mapped file pages: tmpfs pages written with write() are not in it,
mapped ones are, as RssShmem).

**2. Replication's cost to the training loop.** launch/train.py (FSDP2 TinyLM, AdamW,
async saves every --every steps to a /dev/shm fast tier, durable only at the end) under
two torchrun agents on loopback (c10d rendezvous, --nnodes=2, one rank each): each agent
one node (--node-id n0/n1, its own --local-root), ``--replicas 1`` vs ``0`` alternating.
Figure: the job's mean step time at its last step (rank 0's log), medians over reps.

    python benchmarks/bench_peer.py [--reps 3] [--loop-reps 3] [--json OUT]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # s3server
from bench_save_load import (_max_over_ranks, add_state_args, drop_caches, locals_of,  # noqa: E402
                             make_state, model_specs, save_results, timed)

CASES = ("local", "peer", "durable", "durable_warm", "s3")
FIELDS = ("VmRSS", "RssAnon", "RssShmem")


def status_kib() -> dict[str, int]:
    """VmRSS, RssAnon, RssShmem of this process, KiB, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            k = line.split(":", 1)[0]
            if k in FIELDS:
                out[k] = int(line.split()[1])
    return out


class PeakRss:
    """Samples status_kib every ``period`` s in a thread between enter and exit;
    ``extra`` is {field: peak - value at enter, MiB}. malloc_trim first, so memory an
    earlier operation freed but glibc kept is not in the baseline for this one to reuse
    unseen."""

    def __init__(self, period: float = 0.005) -> None:
        self.period, self.extra = period, {}
        self._stop = threading.Event()

    def __enter__(self) -> "PeakRss":
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.base = status_kib()
        self.peak = dict(self.base)
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def _sample(self) -> None:
        for k, v in status_kib().items():
            self.peak[k] = max(self.peak[k], v)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self._sample()
        self.extra = {k: (self.peak[k] - self.base[k]) / 1024 for k in FIELDS}


def worker(rank: int, world: int, init: str, a: dict, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import dckpt
    from dckpt.format.shards import block_crcs
    from dckpt.storage.local import LocalReader

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    per_node = world // a["nodes"]
    node = rank // per_node
    lowest = rank % per_node == 0  # the rank of its node that wipes the node's local_root
    specs = model_specs(a["layers"], a["hidden"], a["vocab"], a["ffn_mult"])
    src = make_state(specs, mesh, rank, world, zero=False)
    locs = locals_of(src)
    nbytes = sum(t.numel() * t.element_size() for t in locs)
    s3opt = {"endpoint_url": a["endpoint"]}

    def lroot(tag: str, n: int = node) -> str:
        return os.path.join(a["shm"], f"{tag}-node{n}")

    def manager(tag: str, root: str, replicas: int = 1):
        return dckpt.CheckpointManager(
            root, every_steps=1, keep_last=1, capture_rng=False, local_root=lroot(tag),
            node=node, replicas=replicas, durable_every_steps=10 ** 6,
            storage_options=s3opt if root.startswith("s3://") else None)

    def wipe(tag: str, nodes=None) -> None:
        dist.barrier()
        if lowest and (nodes is None or node in nodes):
            shutil.rmtree(lroot(tag), ignore_errors=True)
        dist.barrier()

    def check(dst: dict) -> bool:
        ok = all(torch.equal(x, y) for x, y in zip(locals_of(dst), locs)) and dst["step"] == src["step"]
        return _max_over_ranks(0.0 if ok else 1.0) == 0.0

    def max_extra(p: PeakRss) -> dict[str, float]:
        return {k: _max_over_ranks(v) for k, v in p.extra.items()}

    # -- the limits on the same bytes
    bufs = [torch.empty_like(x) for x in locs]
    for b, x in zip(bufs, locs):
        b.copy_(x)
    views = [memoryview(b.view(torch.uint8).numpy()).cast("B") for b in bufs]
    floor_path = os.path.join(a["shm"], f"floor-{rank}.bin")
    with open(floor_path, "wb") as fh:
        for x in locs:
            fh.write(memoryview(x.contiguous().view(torch.uint8).numpy()))
    wire_n = int(_max_over_ranks(float(nbytes)))  # shards are uneven: one size both sides know
    wire = torch.empty(wire_n, dtype=torch.uint8)
    piece = 64 << 20

    def memcpy() -> None:
        for b, x in zip(bufs, locs):
            b.copy_(x)

    def read_floor() -> None:
        with LocalReader(floor_path) as f:
            pos = 0
            for v in views:
                if f.readv(pos, [v]) != len(v):
                    raise OSError(f"{floor_path}: short read")
                block_crcs(v, 256 << 10)
                pos += len(v)

    def gloo_p2p() -> None:  # node 0's rank k -> node 1's rank k, one share each
        if node > 1:
            return
        peer = rank + per_node if node == 0 else rank - per_node
        for off in range(0, wire_n, piece):
            chunk = wire[off:off + piece]
            (dist.send if node == 0 else dist.recv)(chunk, peer)

    # -- once: step 10 in the fast tier, replicated, and durable (local dir, then S3)
    setup: dict[str, float] = {}
    for tag, root in (("A", os.path.join(a["dir"], "durable")), ("S", a["s3_url"])):
        m = manager(tag, root)
        setup[f"save_{tag}"] = timed(lambda: m.save(10, src, force=True))
        setup[f"close_{tag}"] = timed(m.close)  # replication and staging waited for
    assert os.path.isdir(os.path.join(lroot("A"), "peers", "step-00000010")), "no replica"
    wipe("S")

    dropped = [True]

    def restore(i: int, case: str) -> dict[str, Any]:
        tag, root, want = {"local": ("A", os.path.join(a["dir"], "durable"), "local"),
                           "peer": ("A", os.path.join(a["dir"], "durable"), "peer"),
                           "durable": (f"E{i}", os.path.join(a["dir"], "durable"), "durable"),
                           "durable_warm": (f"W{i}", os.path.join(a["dir"], "durable"),
                                            "durable"),
                           "s3": (f"E{i}s", a["s3_url"], "durable")}[case]
        if case == "peer":
            wipe("A", nodes={1})  # node 1 lost; its replacement starts empty
        dst = make_state(specs, mesh, rank, world, zero=True)
        box: dict[str, Any] = {}
        t_new = timed(lambda: box.setdefault("m", manager(tag, root)))
        m = box["m"]
        if case == "durable":
            dropped[0] = drop_caches(rank) and dropped[0]
        with PeakRss() as p:
            t = timed(lambda: box.setdefault("step", m.restore(dst)))
        got = m.restored_from
        m.close()
        assert box["step"] == 10 and got == want and check(dst), (case, box.get("step"), got)
        if case in ("durable", "durable_warm", "s3"):
            wipe(tag)
        return {case: t, f"{case}_new": t_new, **{f"{case}_{k}": v for k, v in max_extra(p).items()}}

    def replicate(i: int) -> dict[str, Any]:
        row: dict[str, Any] = {}
        for r in (1, 0):
            tag = f"R{i}r{r}"
            m = manager(tag, os.path.join(a["dir"], f"rep-{i}-{r}"), replicas=r)
            dist.barrier()
            with PeakRss() as p:
                c0 = time.process_time()  # every thread of the process: the save's and the copy's
                row[f"save_r{r}"] = timed(lambda: m.save(20, src))
                row[f"wait_r{r}"] = timed(m.wait)  # r=1: until the step is on the next node
                row[f"cpu_r{r}"] = _max_over_ranks(time.process_time() - c0)
            row.update({f"save_r{r}_{k}": v for k, v in max_extra(p).items()})
            m.close()
            wipe(tag)
        return row

    rows = []
    for i in range(a["reps"]):
        row: dict[str, Any] = {"rep": i, "load1": os.getloadavg()[0], "memcpy": timed(memcpy),
                               "read_floor": timed(read_floor), "gloo_p2p": timed(gloo_p2p)}
        order = CASES[i % len(CASES):] + CASES[:i % len(CASES)]
        row["order"] = list(order)
        for case in order:
            row.update(restore(i, case))
        row.update(replicate(i))
        rows.append(row)
        if rank == 0:
            print(f"  rep {i} [load {row['load1']:.1f}]: " + "  ".join(
                f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float) and k != "load1"
                and not k.endswith(FIELDS)), flush=True)
    os.unlink(floor_path)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"rows": rows, "setup": setup, "bytes_per_rank": nbytes, "world": world,
                       "nodes": a["nodes"], "dropped": dropped[0]}, fh)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------- 2. the training loop
STEP_RE = re.compile(r"step (\d+) loss \S+ lr \S+ \(([0-9.]+) s/step\)")
REPL_RE = re.compile(r"step (\d+) replicated to \d+ peer node\(s\) in ([0-9.]+) s")


def loop_job(a, replicas: int, work: str) -> dict:
    """One launch/train.py job on two torchrun agents (one node and one rank each)."""
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "launch"))
    from elastic_demo import Agent, free_port, rdzv_args

    port, run_id = free_port(), f"peer{replicas}-{os.getpid()}-{time.monotonic_ns()}"
    ckpt = os.path.join(work, "ckpt")
    shutil.rmtree(ckpt, ignore_errors=True)
    agents = []
    try:
        for n in range(2):
            local = os.path.join(a.shm, f"loop-node{n}")
            shutil.rmtree(local, ignore_errors=True)
            train = ["--steps", str(a.steps), "--ckpt-root", ckpt, "--every", str(a.every),
                     "--async-save", "--local-root", local, "--durable-every", str(10 ** 6),
                     "--replicas", str(replicas), "--node-id", f"n{n}", "--keep-last", "2",
                     "--log-every", str(a.steps), "--width", str(a.width), "--depth",
                     str(a.depth), "--batch", str(a.batch), "--seq", str(a.seq),
                     "--vocab", str(a.loop_vocab)]
            agents.append(Agent(f"n{n}", rdzv_args(port, run_id, 1, 0, host=n == 0,
                                                    nnodes="2"), train))
        codes = [ag.finish(timeout=900) for ag in agents]
        text = "".join(ag.text for ag in agents)
    finally:
        for ag in agents:
            ag.close()
        for n in range(2):
            shutil.rmtree(os.path.join(a.shm, f"loop-node{n}"), ignore_errors=True)
    if any(codes):
        raise SystemExit(f"loop job (replicas={replicas}) failed {codes}:\n{text[-4000:]}")
    steps = [(int(s), float(t)) for s, t in STEP_RE.findall(text)]
    if not steps or steps[-1][0] != a.steps:
        raise SystemExit(f"no final step line in the job's log:\n{text[-3000:]}")
    repl = [float(t) for _, t in REPL_RE.findall(text)]
    if replicas and len(repl) < a.steps // a.every - 1:
        raise SystemExit(f"only {len(repl)} replications logged:\n{text[-3000:]}")
    return {"step_s": steps[-1][1], "replications": len(repl),
            "replication_s": statistics.median(repl) if repl else None}


def run_loop(a, work: str) -> list[dict]:
    runs = []
    for i in range(a.loop_reps):
        for r in ((1, 0) if i % 2 else (0, 1)):
            res = {"rep": i, "replicas": r, "load1": os.getloadavg()[0], **loop_job(a, r, work)}
            runs.append(res)
            print(f"  loop rep {i} replicas={r}: {res['step_s'] * 1000:.1f} ms/step, "
                  f"{res['replications']} replications (median {res['replication_s']} s) "
                  f"[load {res['load1']:.1f}]", flush=True)
    return runs


# ---------------------------------------------------------------- report
def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def report(res: dict) -> dict:
    s: dict[str, Any] = {}
    if "rows" in res:
        rows, mib = res["rows"], res["bytes_per_rank"] * res["world"] / 2 ** 20
        for k in ("memcpy", "read_floor", "gloo_p2p", *CASES, *(f"{c}_new" for c in CASES),
                  "save_r1", "wait_r1", "save_r0", "wait_r0", "cpu_r1", "cpu_r0"):
            s[k] = _med(rows, k)
        for k in (*CASES, "save_r1", "save_r0"):
            for f in FIELDS:
                s[f"{k}_{f}"] = max(r[f"{k}_{f}"] for r in rows)  # the worst rep
        share = res["bytes_per_rank"] / 2 ** 20
        print(f"\nstate {mib:.0f} MiB over {res['world']} ranks on {res['nodes']} nodes "
              f"({share:.0f} MiB a rank); medians of {len(rows)} reps, max over ranks")
        print(f"{'restore (s)':34}{'median':>8}{'/local':>8}{'/durable':>9}"
              f"{'RssAnon+':>10}{'VmRSS+':>8}  (MiB, worst rep, max over ranks)")
        for c in CASES:
            print(f"  {c:32}{s[c]:8.3f}{s[c] / s['local']:8.2f}{s[c] / s['durable']:9.2f}"
                  f"{s[f'{c}_RssAnon']:10.1f}{s[f'{c}_VmRSS']:8.1f}")
        print(f"peer / local {s['peer'] / s['local']:.2f}x (goal <= 1.5); peer / durable "
              f"(local dir, {'cache dropped' if res['dropped'] else 'cache NOT dropped'}) "
              f"{s['peer'] / s['durable']:.2f}x, / durable warm {s['peer'] / s['durable_warm']:.2f}x"
              f", / durable (S3 moto) {s['peer'] / s['s3']:.2f}x (goal <= 0.3)")
        print(f"limits, each rank its {share:.0f} MiB at once: memcpy {s['memcpy']:.3f} s, "
              f"tmpfs preadv + CRC32 {s['read_floor']:.3f} s, gloo send one share "
              f"{s['gloo_p2p']:.3f} s ({share / s['gloo_p2p']:.0f} MiB/s a pair)")
        print(f"replication: save {s['save_r1']:.3f} s then wait {s['wait_r1']:.3f} s "
              f"(replicas=0: save {s['save_r0']:.3f}, wait {s['wait_r0']:.3f}); extra "
              f"RssAnon during save+wait {s['save_r1_RssAnon']:.1f} MiB (replicas=0: "
              f"{s['save_r0_RssAnon']:.1f}), VmRSS {s['save_r1_VmRSS']:.1f} MiB "
              f"(goal <= 128 MiB a rank)")
        s["repl_cpu_s_per_mib"] = (s["cpu_r1"] - s["cpu_r0"]) / share
        print(f"replication's CPU: {s['cpu_r1']:.3f} s a rank for save+wait vs {s['cpu_r0']:.3f} s "
              f"with replicas=0: {1000 * s['repl_cpu_s_per_mib']:.2f} ms of CPU per MiB of a "
              f"rank's share (send one, receive one)")
    if res.get("loop"):
        runs = res["loop"]
        for r in (0, 1):
            s[f"loop_r{r}"] = statistics.median(x["step_s"] for x in runs if x["replicas"] == r)
        s["loop_ratio"] = s["loop_r1"] / s["loop_r0"]
        pair = [a["step_s"] / b["step_s"] for a in runs if a["replicas"] == 1
                for b in runs if b["replicas"] == 0 and b["rep"] == a["rep"]]
        s["loop_pair_ratios"] = pair
        s["loop_pair_median"] = statistics.median(pair)
        rep = [x["replication_s"] for x in runs if x["replicas"] == 1]
        print(f"\ntraining loop (2 agents x 1 rank, save every {res['args']['every']}): "
              f"replicas=1 {s['loop_r1'] * 1000:.1f} ms/step, replicas=0 "
              f"{s['loop_r0'] * 1000:.1f} ms/step: {100 * (s['loop_ratio'] - 1):+.1f}% "
              f"(goal <= +2%); per rep: " + ", ".join(f"{100 * (p - 1):+.1f}%" for p in pair)
              + f" (median of the pairs {100 * (s['loop_pair_median'] - 1):+.1f}%); replication "
              f"of one step {statistics.median(rep):.2f} s (median)")
    return s


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="restore reps (0: skip)")
    add_state_args(p)
    p.set_defaults(layers=4)
    p.add_argument("--loop-reps", type=int, default=3, help="training-loop reps (0: skip)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--loop-vocab", type=int, default=2048)
    p.add_argument("--dir", default=None, help="durable parent dir (None: system temp)")
    p.add_argument("--shm", default="/dev/shm", help="parent of the fast tiers")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    import torch.multiprocessing as tmp

    if args.world % args.nodes or args.nodes != 2:
        raise SystemExit("the restore part wants 2 nodes of equal size")
    scratch = tempfile.mkdtemp(prefix="dckpt-bench-peer-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="dckpt-bench-peer-", dir=args.shm)
    args.shm = shm
    res: dict[str, Any] = {}
    server = None
    try:
        if args.reps:
            from s3server import S3Server
            server = S3Server().start()
            a = {**vars(args), "dir": scratch, "endpoint": server.endpoint,
                 "s3_url": server.url("peer")}
            res_path = os.path.join(scratch, "result.json")
            tmp.spawn(worker, args=(args.world, os.path.join(scratch, "rdv"), a, res_path),
                      nprocs=args.world, join=True)
            with open(res_path) as fh:
                res = json.load(fh)
            server.stop()
            server = None
        if args.loop_reps:
            res["loop"] = run_loop(args, scratch)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    res["args"] = vars(args)
    res["summary"] = report(res)
    save_results(res, args.json)
    return res


if __name__ == "__main__":
    main()
