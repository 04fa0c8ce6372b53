"""Byte collectives and error agreement over a process group, or none.

Every payload is raw bytes carried in uint8 CPU tensors (no pickle). When the training
group is not gloo (NCCL), dckpt makes a gloo group over the same ranks once and reuses
it, so checkpoint traffic stays on the CPU.
"""
from __future__ import annotations

import atexit
import json
import logging
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ERROR_TYPES, CheckpointError, CommunicationError, RankFailure

log = logging.getLogger(__name__)
_GLOO_GROUPS: dict[Any, Any] = {}


_LIVE: "weakref.WeakSet[OwnGroup]" = weakref.WeakSet()


@atexit.register
def _shutdown_live_groups() -> None:
    # atexit runs after the interpreter joined its threads (a save still in flight in
    # a ThreadPoolExecutor has ended) and before finalisation destroys objects.
    for g in list(_LIVE):
        g.shutdown()


class OwnGroup:
    """A gloo process group that dckpt owns: made from the default group's store under a
    prefix of its own, and never registered with torch.distributed, so
    ``destroy_process_group()`` cannot tear it down under a save still in flight (an
    async save keeps its group alive until the save ends). Collective to create: every
    rank of ``ranks`` makes its n-th OwnGroup together."""

    _count = 0

    def __init__(self, ranks: list[int], timeout_s: float) -> None:
        import datetime

        from torch.distributed import PrefixStore, ProcessGroupGloo

        OwnGroup._count += 1
        me = dist.get_rank()
        self.ranks = list(ranks)
        self.rank, self.size = self.ranks.index(me), len(self.ranks)
        tag = "-".join(map(str, self.ranks)) if len(self.ranks) <= 8 else str(len(self.ranks))
        # Holding the store keeps it (and on the TCP master, its server) alive as long
        # as this group lives, whatever happens to the default group.
        store = PrefixStore(f"dckpt-own/{OwnGroup._count}/{tag}/",
                            dist.distributed_c10d._get_default_store())
        self.pg = ProcessGroupGloo(store, self.rank, self.size,
                                   datetime.timedelta(seconds=timeout_s))
        _LIVE.add(self)

    def shutdown(self) -> None:
        """Tear the gloo group down now (idempotent; never raises). Called at exit for
        every group still alive: torch destroys only registered groups, and a gloo
        group left to the interpreter's finalisation can abort the process
        ("terminate called without an active exception", pytorch#190489)."""
        pg, self.pg = getattr(self, "pg", None), None
        _LIVE.discard(self)
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as e:  # at exit: nothing left to report it to
                log.debug("shutting down a dckpt gloo group: %s", e)

    @classmethod
    def create(cls, group: Any, timeout_s: float) -> Any:
        """An OwnGroup over ``group``'s ranks, or a registered gloo group where this
        torch cannot build one (then the async save does not survive a destroy)."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        try:
            return cls(ranks, timeout_s)
        except Exception as e:  # private API moved: fall back, and say what it costs
            log.warning("dckpt: could not make a private gloo group (%s); async saves use "
                        "a registered one, which destroy_process_group() also destroys", e)
            return dist.new_group(ranks=ranks, backend="gloo")


class Comm:
    """The ranks taking part in one collective call. With no initialised process group
    it is a single rank and every collective is a no-op. Every collective raises
    CommunicationError (naming what failed) instead of torch's raw errors, so a dead
    peer, a timeout or a destroyed group is a CheckpointError like any other."""

    def __init__(self, group: Any = None) -> None:
        self.own = group if isinstance(group, OwnGroup) else None
        if self.own is not None:
            self.active, self.group = True, None
            self.rank, self.size = self.own.rank, self.own.size
            return
        self.active = dist.is_available() and dist.is_initialized()
        if not self.active:
            self.group, self.rank, self.size = None, 0, 1
            return
        self.group = _cpu_group(group)
        self.rank = dist.get_rank(self.group)
        self.size = dist.get_world_size(self.group)

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    # -- the four operations, on an OwnGroup or a registered group ---------------------
    def _run(self, what: str, fn) -> Any:
        try:
            return fn()
        except CheckpointError:
            raise
        except Exception as e:  # DistBackendError, RuntimeError, ValueError (destroyed)
            raise CommunicationError(
                f"rank {self.rank}: checkpoint collective {what} over {self.size} ranks "
                f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} "
                "(a rank died, hung past the timeout, or the process group was "
                "destroyed)") from e

    def _all_gather(self, out: list, t: torch.Tensor) -> None:
        if self.own is not None:
            self._run("all_gather", lambda: self.own.pg.allgather([out], [t]).wait())
        else:
            self._run("all_gather", lambda: dist.all_gather(out, t, group=self.group))

    def _gather(self, out: list | None, t: torch.Tensor) -> None:
        if self.own is not None:
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self._run("gather", lambda: self.own.pg.gather([out] if out else [], [t], opts).wait())
        else:
            self._run("gather", lambda: dist.gather(t, out, dst=self._global(0), group=self.group))

    def _broadcast(self, t: torch.Tensor) -> None:
        if self.own is not None:
            self._run("broadcast", lambda: self.own.pg.broadcast(t, 0).wait())
        else:
            self._run("broadcast", lambda: dist.broadcast(t, src=self._global(0), group=self.group))

    def _all_reduce_max(self, t: torch.Tensor) -> None:
        if self.own is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self._run("all_reduce", lambda: self.own.pg.allreduce([t], opts).wait())
        else:
            self._run("all_reduce", lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX,
                                                            group=self.group))

    # -- primitives: each is a blocking collective on every rank of the group ----------
    def any_of(self, flags: list[bool]) -> list[bool]:
        """For each flag, whether any rank set it: one all-reduce of ``len(flags)``
        bytes-worth of ints, whatever the number of ranks (cheap enough for every
        training step)."""
        if self.size == 1:
            return list(flags)
        t = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32)
        self._all_reduce_max(t)
        return [bool(x) for x in t.tolist()]

    def _sizes(self, n: int) -> list[int]:
        t = torch.tensor([n], dtype=torch.int64)
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._all_gather(out, t)
        return [int(x.item()) for x in out]

    def _padded(self, data: bytes) -> tuple[list[int], torch.Tensor]:
        """Every rank's payload size, and ``data`` padded to the largest (collective)."""
        sizes = self._sizes(len(data))
        buf = torch.zeros(max(sizes) or 1, dtype=torch.uint8)
        if data:
            buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return sizes, buf

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, on every rank."""
        if self.size == 1:
            return [data]
        sizes, buf = self._padded(data)
        out = [torch.empty(len(buf), dtype=torch.uint8) for _ in range(self.size)]
        self._all_gather(out, buf)
        return [o[:s].numpy().tobytes() for o, s in zip(out, sizes)]

    def gather_bytes(self, data: bytes) -> list[bytes] | None:
        """Every rank's ``data`` on rank 0 (None elsewhere)."""
        if self.size == 1:
            return [data]
        sizes, buf = self._padded(data)
        out = ([torch.empty(len(buf), dtype=torch.uint8) for _ in range(self.size)]
               if self.rank == 0 else None)
        self._gather(out, buf)
        if self.rank != 0:
            return None
        return [o[:s].numpy().tobytes() for o, s in zip(out, sizes)]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank."""
        if self.size == 1:
            return data or b""
        n = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        self._broadcast(n)
        size = int(n.item())
        if size == 0:
            return b""
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(size, dtype=torch.uint8)
        self._broadcast(buf)
        return data if self.rank == 0 else buf.numpy().tobytes()

    def barrier(self) -> None:
        if self.size > 1:
            self.all_gather_bytes(b"")


def _cpu_group(group: Any) -> Any:
    g = group if group is not None else dist.group.WORLD
    if dist.get_backend(g) == "gloo":
        return g
    drop_dead(_GLOO_GROUPS, g)  # destroyed since (destroy_process_group, a new init)
    if g not in _GLOO_GROUPS:  # collective, once per group: every rank reaches it together
        ranks = dist.get_process_group_ranks(g)
        _GLOO_GROUPS[g] = dist.new_group(ranks=ranks, backend="gloo")
    return _GLOO_GROUPS[g]


def group_alive(group: Any) -> bool:
    """Whether ``group`` (None: no group) is still a registered process group. Local."""
    if group is None:
        return not (dist.is_available() and dist.is_initialized())
    try:
        dist.get_process_group_ranks(group)
        return True
    except Exception:  # destroyed, or the default group was torn down
        return False


def drop_dead(by_group: dict, keep: Any) -> list:
    """Remove the entries of ``by_group`` (keyed on process groups) whose group has been
    destroyed, except ``keep``'s; returns their values. Local."""
    dead = [k for k in by_group if k is not keep and not group_alive(k)]
    return [by_group.pop(k) for k in dead]


# ----------------------------------------------------------------------------- errors

def error_payload(exc: BaseException | None) -> dict | None:
    """A JSON-able description of a local failure."""
    if exc is None:
        return None
    if isinstance(exc, CheckpointError):
        return {"type": type(exc).__name__, "message": str(exc)}
    tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return {"type": "RankFailure", "message": tb}


def raise_gathered(errors: dict[int, dict], what: str, local: BaseException | None = None):
    """Raise one error describing every failing rank, typed like the lowest rank's."""
    first = errors[min(errors)]
    cls = ERROR_TYPES.get(first["type"], RankFailure)
    failures = {r: f"{e['type']}: {e['message']}" for r, e in sorted(errors.items())}
    if len(errors) == 1:
        msg = f"{what} failed on rank {min(errors)}: {first['message']}"
    else:
        msg = f"{what} failed on ranks {', '.join(map(str, sorted(errors)))}: " + "; ".join(
            f"rank {r}: {m}" for r, m in failures.items())
    raise cls(msg, failures) from local


def agree(comm: Comm, exc: BaseException | None, what: str) -> None:
    """Collective: every rank says whether it failed; if any did, every rank raises the
    same error (see :func:`raise_gathered`). One all-gather of a few bytes."""
    mine = error_payload(exc)
    if comm.size == 1:
        if exc is not None:
            if isinstance(exc, CheckpointError):
                raise exc
            raise_gathered({0: mine}, what, exc)
        return
    blobs = comm.all_gather_bytes(json.dumps(mine).encode() if mine else b"")
    errors = {r: json.loads(b) for r, b in enumerate(blobs) if b}
    if errors:
        if exc is not None:
            log.debug("rank %d: %s failed", comm.rank, what, exc_info=exc)
        raise_gathered(errors, what, exc)


def rank0_bytes(comm: Comm, fn, what: str) -> bytes:
    """Run ``fn()`` (returning bytes) on rank 0 only and hand its result to every rank;
    if it raises anything, every rank raises the same error (typed like the original
    when it is a CheckpointError, else RankFailure), as "``what`` failed on rank 0".
    An error ``fn`` gathered from other ranks (a CheckpointError with ``failures``, such
    as the votes' errors rank 0 turned into one with :func:`raise_gathered`) reaches
    every rank as it is, naming those ranks: rank 0 only relayed it.
    Collective: one broadcast (two small ones and the payload)."""
    reply = None
    if comm.rank == 0:
        try:
            reply = b"\x00" + fn()
        except Exception as e:
            log.debug("%s failed on rank 0", what, exc_info=True)
            if isinstance(e, CheckpointError) and e.failures:
                reply = b"\x02" + json.dumps({"type": type(e).__name__, "message": str(e),
                                               "failures": e.failures}).encode()
            else:
                reply = b"\x01" + json.dumps(error_payload(e)).encode()
    payload = comm.broadcast_bytes(reply)
    if payload[:1] == b"\x01":
        raise_gathered({0: json.loads(payload[1:])}, what)
    if payload[:1] == b"\x02":
        doc = json.loads(payload[1:])
        cls = ERROR_TYPES.get(doc["type"], RankFailure)
        raise cls(doc["message"], {int(r): str(m) for r, m in doc["failures"].items()})
    return payload[1:]


def on_rank0(comm: Comm, fn, what: str) -> Any:
    """:func:`rank0_bytes` for a JSON-able result."""
    return json.loads(rank0_bytes(comm, lambda: json.dumps(fn()).encode(), what))
