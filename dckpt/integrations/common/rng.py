"""Each rank's RNG states in a checkpoint, and their restore at any world size by the
manager's rule: rank r gets rank r's saved states; when the world grew, rank r >= N
(N saved ranks) gets a stream derived from rank r mod N's states and r. Reuses
:mod:`dckpt.state.rng` (what :class:`dckpt.CheckpointManager` saves under ``rng.``)."""
from __future__ import annotations

from typing import Any

from ...state import rng

ROOT = "rng"


def entry(rank: int) -> dict[str, Any]:
    """``{"rank<r>": this process's RNG states}`` for the tree's ``rng`` key. Cheap
    (a few KiB of copies); no I/O."""
    return {f"rank{rank}": rng.capture()}


def target(manifest: Any, rank: int) -> tuple[dict[str, Any], Any]:
    """(the load target for the states this rank restores, a token for :func:`apply`),
    shaped after the manifest; ({}, None) when it holds no RNG states. No I/O."""
    if not any(k.startswith(ROOT + ".") for k in (*manifest.tensors, *manifest.values)):
        return {}, None
    src = rank % manifest.world_size
    sd = rng.saved_target(manifest, src)
    return {f"rank{src}": sd}, (rank, manifest.world_size, sd)


def apply(token: Any) -> None:
    """Set this process's generators from the loaded states (:func:`target`'s token):
    its own rank's, or for a rank beyond the saved world a derived stream. Never
    raises (as :func:`dckpt.state.rng.restore`)."""
    if token is None:
        return
    rank, world, sd = token
    if rank < world:
        rng.restore(sd)
    else:
        rng.reseed(rank, sd)
