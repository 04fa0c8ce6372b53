"""Which forwards of a fenced model can write a saved tensor, and so must wait.

No list of classes: a module is a *writer* when

- **structurally**, it has persistent buffers of its own (``recurse=False``; a
  non-persistent buffer is not saved): BatchNorm's running stats, the old spectral
  norm's ``weight_u``/``weight_v``, a parametrization's ``_u``/``_v``, any custom
  buffer: a buffer exists to be changed by something other than the optimizer;
- **learned**, it was seen writing one of its own saved tensors (parameters, persistent
  buffers) during its forward: their version counters are read in a forward pre-hook
  and again in a forward post-hook (``Embedding(max_norm=)`` renormalising rows is
  learned so). A write inside the forward of a submodule that owns the tensor is that
  submodule's, not its parent's;
- **the outermost call**, when a saved tensor of its subtree changed during it without
  being written inside the forward of a module that owns it (a parent writing a
  child's parameter): that module (the root, usually) waits as a whole from then on.

A compiled module's inside is not hooked (:func:`eager_modules`): its saved tensors
are its whole subtree's. What is learned is kept per module (weakly: the entry goes
with the module) and carries across saves. Learning runs while a fence is armed: every
eager module of a fenced root gets the two hooks (the pre-hook waits only for a
writer) until its first call that ends once the snapshot is taken (removed when the
outermost call returns), so a writer is learned at the first save. Until one whole
forward of the root has run under them, every module waits: the first fenced save of
a model, or one armed before any forward ran. A write that escapes (a module that
writes only on some forwards) fails that save through the version check of
:class:`dckpt.engine.fence.Versions`, and the same hooks learn the module then: the
next save fences it.

Cost: O(modules + tensors) to arm, in the caller's thread, no per-element work, no I/O;
for a model of 4,500 modules on a CPU (benchmarks/bench_fence.py), about 40 ms to arm
(a wait-only hook per module: about 20 ms) and about 40 ms more for each forward
under the hooks (about 9 us a module call, against 3 for a wait-only hook), paid by
the forwards that overlap the snapshot and the first one that ends after it; none
after that.
Each thread's calls are matched by themselves.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

class _ModuleSet:
    """A set of modules held weakly, by identity (a module may define ``__eq__`` and so
    not be hashable): an entry goes with its module."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, m: torch.nn.Module) -> bool:
        r = self._refs.get(id(m))
        return r is not None and r() is m

    def add(self, m: torch.nn.Module) -> None:
        # the callback runs as the module is freed, before its id can be reused
        self._refs[id(m)] = weakref.ref(m, lambda _r, k=id(m): self._refs.pop(k, None))


_LEARNED = _ModuleSet()  # seen writing their own saved tensors during their forward
_OBSERVED = _ModuleSet()  # roots: one whole forward of each ran under the hooks


def _compiled(m: torch.nn.Module) -> bool:
    return (type(m).__name__ == "OptimizedModule"
            or getattr(m, "_compiled_call_impl", None) is not None)


def eager_modules(root: torch.nn.Module) -> list[torch.nn.Module]:
    """``root`` and its submodules whose forward pre-hooks run as Python code: not the
    inside of a compiled module (``torch.compile``'s wrapper, or ``module.compile()``),
    whose hooks would be traced into its graph; the compiled module itself is hooked,
    so its call waits. Pure; O(modules)."""
    out, stack, seen = [], [root], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        out.append(m)
        if not _compiled(m):
            stack.extend(m.children())
    return out


def _own(m: torch.nn.Module) -> tuple[list[torch.Tensor], bool]:
    """``m``'s own saved tensors (parameters, persistent buffers; for a compiled module,
    those of its whole subtree, whose modules are not hooked) and whether any of them
    is a buffer."""
    tensors: list[torch.Tensor] = []
    has_buffer = False
    for x in (m.modules() if _compiled(m) else (m,)):
        tensors.extend(p for p in x._parameters.values() if p is not None)
        skip = x._non_persistent_buffers_set
        for name, b in x._buffers.items():
            if b is not None and name not in skip:
                tensors.append(b)
                has_buffer = True
    return tensors, has_buffer


def _union(lists: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    ids: set[int] = set()
    for tensors in lists:
        for t in tensors:
            if id(t) not in ids:
                ids.add(id(t))
                out.append(t)
    return out


class ModuleHooks:
    """The forward hooks one fenced save puts on the modules of its roots. ``wait``
    blocks until the snapshot is taken, ``done`` is set then; every handle is
    appended to ``handles`` (removed by the fence's disarm)."""

    def __init__(self, wait: Callable[[], None], done: threading.Event,
                 handles: list) -> None:
        self._wait, self._done, self._handles = wait, done, handles
        # tensor id -> writes seen inside the forward of a module that owns it
        self._credit: dict[int, int] = {}
        self._seen: set[int] = set()
        self._roots: set[int] = set()
        # thread id -> one frame per hooked call in progress, outermost first
        self._calls: dict[int, list] = {}
        # module id -> the saved tensors of its subtree (for a call that is outermost)
        self._subtrees: dict[int, list[torch.Tensor]] = {}
        self._spent: list = []  # handles to remove once the outermost call returns

    def arm(self, root: torch.nn.Module) -> int:
        """Hook every eager module of ``root`` (once per module across roots); return
        how many will wait. O(modules + tensors), no wait. The garbage collector is
        paused meanwhile: the hooks' few objects per module would otherwise set off
        full collections that walk the whole heap, several times (~8x slower)."""
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._arm(root)
        finally:
            if paused:
                gc.enable()

    def _arm(self, root: torch.nn.Module) -> int:
        first = root not in _OBSERVED
        mods = eager_modules(root)
        owns = {id(m): _own(m) for m in mods}
        self._subtrees[id(root)] = _union(owns[id(m)][0] for m in mods)
        self._roots.add(id(root))
        waiting = 0
        for m in mods:
            if id(m) in self._seen:
                continue
            self._seen.add(id(m))
            tensors, has_buffer = owns[id(m)]
            waits = first or has_buffer or m in _LEARNED
            waiting += waits
            self._hook(m, tensors, waits)
        return waiting

    def _subtree(self, m: torch.nn.Module) -> list[torch.Tensor]:
        got = self._subtrees.get(id(m))
        if got is None:  # a submodule called by itself: O(its subtree), once a save
            got = self._subtrees[id(m)] = _union(_own(x)[0] for x in eager_modules(m))
        return got

    def _hook(self, m: torch.nn.Module, own: list[torch.Tensor], waits: bool) -> None:
        credit, handles = self._credit, []

        def pre(*_args: Any) -> None:
            if waits:
                self._wait()
            calls = self._calls.setdefault(threading.get_ident(), [])
            sub = None
            if not calls:  # outermost: a write its modules' forwards do not explain?
                tensors = self._subtree(m)
                sub = (tensors, [t._version for t in tensors],
                       [credit.get(id(t), 0) for t in tensors])
            calls.append((m, [t._version for t in own],
                          [credit.get(id(t), 0) for t in own], sub))

        def post(*_args: Any) -> None:
            calls = self._calls.get(threading.get_ident(), [])
            i = len(calls) - 1
            while i >= 0 and calls[i][0] is not m:  # above it: calls that raised
                i -= 1
            if i < 0:  # its pre-hook ran before the fence was armed
                return
            _, versions, credits, sub = calls[i]
            del calls[i:]
            wrote = False
            for t, v, c in zip(own, versions, credits):
                # writes in this call less those inside nested owners' forwards
                mine = (t._version - v) - (credit.get(id(t), 0) - c)
                if mine > 0:
                    credit[id(t)] = credit.get(id(t), 0) + mine
                    wrote = True
            if wrote:
                _learn(m, "writes saved tensors of its own in its forward")
            if sub is not None:
                if any(t._version - v > credit.get(id(t), 0) - c for t, v, c in zip(*sub)):
                    _learn(m, "writes saved tensors of its submodules outside their "
                              "forwards: its whole forward")
                if id(m) in self._roots and sys.exc_info()[1] is None:
                    _OBSERVED.add(m)  # a whole forward of it ran (did not raise)
            if self._done.is_set():  # nothing left to hold back or to learn
                self._spent.extend(handles)
            if not calls:  # outermost: a module called again inside it stays hooked
                spent, self._spent = self._spent, []
                for h in spent:
                    remove(h)

        # First in line: a pre-hook registered earlier may write saved tensors (the
        # old spectral norm updates weight_u/v in one); last out, for post-hooks, and
        # called also when the forward raises (the frames stay matched).
        handles.append(m.register_forward_pre_hook(pre, prepend=True))
        handles.append(m.register_forward_hook(post, always_call=True))
        self._handles.extend(handles)


def _learn(m: torch.nn.Module, what: str) -> None:
    if m not in _LEARNED:
        _LEARNED.add(m)
        log.info("fence: %s %s: it waits for the snapshot from the next fenced save on",
                 type(m).__name__, what)


def remove(handle: Any) -> None:
    """Remove a hook handle; one removed already (by another thread) is fine."""
    try:
        handle.remove()
    except KeyError:
        pass
