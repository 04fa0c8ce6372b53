"""What :class:`~dckpt.manager.core.CheckpointManager` checks and establishes when it
is made, on every rank together: settings that every rank must share, and the
identity of the durable root its fast tier's steps belong to."""
from __future__ import annotations

import logging
from typing import Any

from ..errors import CheckpointError
from ..format.codec import compression_flag
from ..protocol.collectives import Comm, on_rank0
from ..protocol.settings import agree_settings
from ..tiers import identity

log = logging.getLogger("dckpt.manager.core")  # one logger for the manager's messages


def check_settings(comm: Comm, *, root: str, local_root: str | None, replicas: Any,
                   full_every: Any, compression: Any, **shared: Any) -> None:
    """Collective (one all-gather): each rank validates its own arguments, and a bad
    value on one rank, or ranks that disagree on a setting that shapes the files or
    the collectives (``shared`` and the named ones), raise the same CheckpointError
    everywhere, before any save (never a hang, nor a durable copy that never commits).
    No I/O."""
    bad = None
    try:
        if local_root is None and replicas != 0:
            raise CheckpointError(f"replicas={replicas!r} needs local_root: the replicas "
                                  "are copies of the fast tier's steps on other nodes")
        if isinstance(full_every, bool) or not isinstance(full_every, int) or full_every < 1:
            raise CheckpointError(f"full_every must be an int >= 1, not {full_every!r}")
        compression_flag(compression)  # a bad value or a missing extra: fail now
    except CheckpointError as e:
        bad = str(e)
    agree_settings(comm, {"root": root, **shared, "local_root given": local_root is not None,
                          "full_every": full_every, "compression": compression,
                          "replicas": replicas}, bad, "CheckpointManager settings")


def durable_owner(comm: Comm, storage: Any, root: str, url: str,
                  local_root: str | None) -> str | None:
    """Collective (rank 0 works, every rank gets its answer or its error): create the
    durable root and, with a fast tier, return its identity (``<root URL>#<run id>``,
    see :mod:`dckpt.tiers.identity`). When the durable root cannot be reached, the
    identity cached beside rank 0's ``local_root`` stands in (with a warning: the fast
    tier must still restore and save, the reason it exists). Raises CheckpointError:
    a damaged or unreadable run-id file (never a new run), or the root unreachable
    with no cached identity."""
    def setup() -> str | None:  # rank 0
        try:
            storage.makedirs(root)
            if local_root is None:
                return None
            return identity.root_identity(storage, root, url)
        except identity.RunIdError:
            raise  # damaged: an error, never a new run nor the cache's word
        except Exception as e:
            if local_root is None:
                raise
            cached = identity.cached_identity(local_root, root, url)
            if cached is None:
                raise CheckpointError(
                    f"the durable root {url} cannot be reached ({type(e).__name__}: {e}) "
                    f"and {local_root} holds no cached identity of it (no fast-tier step "
                    "of this root to restore on this node)") from e
            log.warning("the durable root %s cannot be reached (%s): going on with the fast "
                        "tier %s (its identity cached there); durable copies resume when "
                        "the root is back", url, e, local_root)
            return cached

    return on_rank0(comm, setup, f"CheckpointManager: create {url}")
