"""Random number generator states (Python, NumPy, torch CPU, every CUDA device) as a
dckpt state: tensors and JSON values only.

Restoring RNG state never fails a restore: a generator whose saved state is missing or
unusable (a job moved from CPU to GPU, or to more visible GPUs) is seeded
deterministically from what was saved instead, with a warning.
"""
from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


def capture() -> dict[str, Any]:
    """This process's RNG states. Cheap (a few KiB of copies)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    return out


def _indexed(obj: Any) -> list:
    """A saved list as a list, whether it comes back as a list or as {"0": ..., "1": ...}."""
    if isinstance(obj, dict):
        return [obj[k] for k in sorted(obj, key=int)]
    return list(obj or [])


def restore(sd: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture`'s layout, as far as they go.
    Each generator is restored on its own; one that cannot be (absent, or a CUDA state
    for a device this process does not see) is left alone or, for CUDA devices beyond
    the saved ones, seeded from the restored torch generator. Never raises."""
    def attempt(what: str, fn) -> None:
        try:
            fn()
        except Exception as e:
            log.warning("RNG state %s not restored (%s: %s); it keeps its current seed",
                        what, type(e).__name__, e)

    def py() -> None:
        p = sd["python"]
        random.setstate((int(p["version"]), tuple(int(x) for x in p["state"].tolist()),
                         p["gauss"]))

    def npy() -> None:
        n = sd["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), int(n["pos"]),
                             int(n["has_gauss"]), float(n["cached"])))

    if "python" in sd:
        attempt("python", py)
    if "numpy" in sd:
        attempt("numpy", npy)
    if "torch" in sd:
        attempt("torch", lambda: torch.set_rng_state(sd["torch"]))
    if torch.cuda.is_available():
        attempt("cuda", lambda: _restore_cuda(_indexed(sd.get("cuda"))))
    elif sd.get("cuda"):
        log.info("the checkpoint holds CUDA RNG states but no CUDA device is visible: "
                 "they are not used")


def _restore_cuda(saved: list) -> None:
    n = torch.cuda.device_count()
    for i in range(min(n, len(saved))):
        torch.cuda.set_rng_state(saved[i], i)
    if n > len(saved):
        # More devices than were saved: distinct, reproducible seeds for the new ones.
        base = int(torch.randint(0, 2**62, (1,)).item())
        for i in range(len(saved), n):
            with torch.cuda.device(i):
                torch.cuda.manual_seed(base + i)
        log.info("CUDA RNG: %d device(s) restored, %d new one(s) seeded", len(saved),
                 n - len(saved))


def reseed(rank: int, base: dict[str, Any]) -> None:
    """Give a rank that has no saved state of its own (the job grew) a distinct,
    deterministic one: restore ``base`` (another rank's saved state) then reseed every
    generator from a number drawn from it, mixed with ``rank``. Never raises."""
    restore(base)
    seed = (int(torch.randint(0, 2**62, (1,)).item()) ^ (rank * 0x9E3779B97F4A7C15)) % 2**63
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def saved_target(manifest, src: int) -> dict[str, Any]:
    """A target to load rank ``src``'s saved RNG state into, shaped after what the
    checkpoint holds (not after this process: it may see other devices). Pure besides
    allocating the few KiB of tensors. Keys are the manifest's ``rng.rank<src>.*``."""
    from ..format.dtypes import to_torch

    prefix = f"rng.rank{src}."
    out: dict[str, Any] = {}

    def put(key: str, leaf: Any) -> None:
        node = out
        *parents, last = key[len(prefix):].split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                return  # a malformed layout: that part is simply not restored
        node[last] = leaf

    for key, t in manifest.tensors.items():
        if key.startswith(prefix):
            put(key, torch.empty(t.shape, dtype=to_torch(t.dtype)))
    for key, v in manifest.values.items():
        if key.startswith(prefix):
            put(key, v)
    return out
