"""Shared helpers of the GPU check's parts (benchmarks/gpu_check.sh).

Every part is a script that exits 0 (pass), 77 (skipped) or anything else (fail),
prints what it did, and writes one JSON of its figures and checks. Why a convention and
not pytest: the driver runs each part under its own ``timeout`` and keeps going when
one fails, and the JSON is what comes back from a lent machine (its $OUT).

``GPU_CHECK_CPU=1`` runs the CUDA parts on CPU tensors at small sizes instead of
skipping them: the parts' logic (spawning, resharding, the byte checks, the JSON) is
then exercised on a machine without a GPU. Figures from such a run mean nothing.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # the parts import dckpt from this checkout, installed or not
    sys.path.insert(0, ROOT)

SKIP = 77  # automake's "skipped" exit code: the driver maps it to "skip"


def cpu_mode() -> bool:
    """Whether CUDA parts run on CPU (GPU_CHECK_CPU=1): a logic dry run."""
    return os.environ.get("GPU_CHECK_CPU") == "1"


def device_or_skip(part: str) -> str:
    """"cuda" when a GPU is present, "cpu" under GPU_CHECK_CPU=1, else print the skip
    line the driver and a reader look for and exit with SKIP."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if cpu_mode():
        print(f"{part}: no CUDA, running on CPU (GPU_CHECK_CPU=1; figures are meaningless)")
        return "cpu"
    print(f"skipped: no CUDA ({part})", flush=True)
    sys.exit(SKIP)


def sync(device: str) -> None:
    """Wait for the device's queued work (no-op on CPU): timings end on completion."""
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> float:
    """Seconds ``fn`` takes, the device synchronised before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median(xs: list[float]) -> float | None:
    """The median, None for no values (a part that failed early)."""
    return statistics.median(xs) if xs else None


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Bandwidth in GB/s (1e9 bytes), None when not measured."""
    return None if not seconds else nbytes / seconds / 1e9


def json_path(part: str) -> str:
    """Where a part writes its JSON: $GPU_CHECK_PARTS (the driver sets it) or cwd."""
    d = os.environ.get("GPU_CHECK_PARTS", ".")
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"{part}.json")


def scratch(prefix: str, shm: bool = False) -> str:
    """A fresh scratch directory: in /dev/shm for the fast tier (tmpfs, as a node's
    local tier would be in tests), else under $GPU_CHECK_SCRATCH or the temp dir."""
    if shm and os.path.isdir("/dev/shm"):
        return tempfile.mkdtemp(prefix=prefix, dir="/dev/shm")
    return tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("GPU_CHECK_SCRATCH"))


class Report:
    """A part's checks and figures, written as JSON on every exit path, so that a part
    that dies half-way still leaves what it measured."""

    def __init__(self, part: str) -> None:
        self.part, self.checks, self.figures = part, [], {}
        self.data: dict[str, Any] = {"part": part, "checks": self.checks,
                                     "figures": self.figures, "cpu_mode": cpu_mode()}

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        """Record one check; printed at once so the log shows the order of events."""
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        print(f"[{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def write(self) -> None:
        """Write the JSON now (called again at the end: the last write wins)."""
        self.data["ok"] = all(c["ok"] for c in self.checks)
        with open(json_path(self.part), "w") as f:
            json.dump(self.data, f, indent=1, default=str)

    def run(self, body: Callable[["Report"], None]) -> None:
        """Run ``body(self)``, record an exception as a failed check, write the JSON
        and exit 0 if every check passed (and there was at least one), else 1."""
        try:
            body(self)
        except SystemExit:
            raise
        except BaseException as e:  # noqa: BLE001 - any error is a result here
            traceback.print_exc()
            self.check("no exception", False, f"{type(e).__name__}: {e}")
        finally:
            self.write()
        sys.exit(0 if self.checks and self.data["ok"] else 1)
