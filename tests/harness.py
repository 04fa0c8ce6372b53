"""Multi-process test harness: N real processes in a gloo process group.

A :class:`RankPool` spawns its ranks once and runs many test functions on them, so a
test module pays the process start-up (torch import, rendezvous) once. A function runs
on every rank as ``fn(*args)``; its return values come back as a list indexed by rank.
If any rank raises, the test fails with every failing rank's traceback. A rank that
hangs past the timeout fails the test and the pool is rebuilt for the next one.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
import time
import traceback
from typing import Any, Callable


def _worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    import torch.distributed as dist

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, env = task
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report everything, keep the rank alive
            results.put((rank, False, traceback.format_exc()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    dist.destroy_process_group()


class RankFailed(AssertionError):
    pass


class RankPool:
    """``world`` spawned ranks sharing one gloo process group."""

    def __init__(self, world: int, timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.timeout = world, timeout
        self.dir = tempfile.mkdtemp(prefix="dckpt-pool-")
        init = os.path.join(self.dir, "rendezvous")
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_worker, args=(r, world, init, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn: Callable, *args: Any, env: dict[str, str] | None = None,
            timeout: float | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank (``env`` set around the call); return the
        per-rank results or raise RankFailed with each failing rank's traceback."""
        for q in self.tasks:
            q.put((fn, args, dict(env or {})))
        got: dict[int, tuple[bool, Any]] = {}
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        while len(got) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=0.25)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            missing = sorted(set(range(self.world)) - set(got))
            # A dead rank never answers: fail as soon as every live rank has, instead of
            # waiting out the deadline.
            if time.monotonic() > deadline or (dead and set(missing) <= set(dead)):
                self.broken = True
                self.close()
                raise RankFailed(f"ranks {missing} did not finish {fn.__name__} within "
                                 f"{limit:.0f} s (dead: {dead}); finished: "
                                 + "; ".join(f"rank {r}: {'ok' if o else v}" for r, (o, v) in got.items()))
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            raise RankFailed("\n".join(f"----- rank {r} -----\n{tb}" for r, tb in sorted(failed.items())))
        return [got[r][1] for r in range(self.world)]

    def close(self) -> None:
        for p, q in zip(self.procs, self.tasks):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:
                    pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
