"""Random number generator states (Python, NumPy, torch CPU, every CUDA device) as a
dckpt state: tensors and JSON values only."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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


def restore(sd: dict[str, Any]) -> None:
    """Set this process's RNG states from :func:`capture`'s layout."""
    py = sd["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = sd["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), int(n["pos"]),
                         int(n["has_gauss"]), float(n["cached"])))
    torch.set_rng_state(sd["torch"])
    if "cuda" in sd and torch.cuda.is_available():
        states = sd["cuda"][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


def reseed(rank: int, base: dict[str, Any]) -> None:
    """Give a rank that has no saved state of its own (the job grew) a distinct,
    deterministic one: restore ``base`` (another rank's saved state) then reseed every
    generator from a number drawn from it, mixed with ``rank``."""
    restore(base)
    seed = (int(torch.randint(0, 2**62, (1,)).item()) ^ (rank * 0x9E3779B97F4A7C15)) % 2**63
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
