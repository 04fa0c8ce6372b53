"""The reference states a framework job script writes (ROOT/refs/<name>.pt: the model,
optimizer and scheduler state gathered at a save or a resume) and their comparison,
shared by the Accelerate and Trainer tests."""
from __future__ import annotations

import os

import torch


def ref(root, name: str) -> dict:
    """The reference state ``name`` the job wrote under ``root``."""
    return torch.load(os.path.join(root, "refs", f"{name}.pt"), weights_only=True)


def same_state(a: dict, b: dict, keys: tuple[str, ...]) -> bool:
    """Model and optimizer equal bitwise, and ``keys`` (scheduler, step...) equal."""
    for part in ("model", "optim"):
        if a[part].keys() != b[part].keys():
            return False
        for k, v in a[part].items():
            w = b[part][k]
            if not (torch.equal(v, w) if torch.is_tensor(v) else v == w):
                return False
    return all(a[k] == b[k] for k in keys)
