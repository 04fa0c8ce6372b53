"""Resumable synthetic token data for launch/train.py: a position in a global stream.

The data set is ``num_samples`` synthetic sequences; the tokens of sample ``i`` are a pure
function of ``(seed, i)`` (a ``torch.Generator`` seeded from a hash of both), so no
global RNG is involved and any rank can build any sample. Each epoch visits every sample
once, in an order shuffled from ``(seed, epoch)``. Epochs are laid end to end into one
*global stream*: global position ``p`` is sample ``perm(p // num_samples)[p % num_samples]``.

:class:`ResumableSampler` consumes that stream one global batch at a time: at world size
``W`` with ``batch`` samples per rank, a step takes the next ``W * batch`` positions and
rank ``r`` gets the ``r``-th run of ``batch`` of them. Its ``state_dict()`` is the number
of global positions consumed (plus the seed, the data set size and the epoch), identical
on every rank, so it can be saved as one replicated value.

Resume contract. Loading a state that recorded ``consumed = c`` makes the next step take
positions ``c, c+1, ...`` whatever the world size now is:

- same world size: every rank gets exactly the batches it would have got had the job
  never stopped;
- another world size: the job continues with the next unseen global positions; no
  position before ``c`` is seen again and none after it is skipped. What changes is the
  split: a step now takes ``W' * batch`` positions, so steps and ranks map to different
  samples than in the old run from ``c`` on (per-rank batch size is kept; the global
  batch is not);
- positions consumed after the checkpoint and before a failure were consumed by work
  that the failure threw away; the restored job consumes them again, once.
"""
from __future__ import annotations

import hashlib
from typing import Any

import torch

from dckpt import StateMismatchError

STATE_KEYS = ("seed", "num_samples", "epoch", "consumed")


def _seed_of(*parts: int) -> int:
    """A 63-bit generator seed from integers; distinct tuples give unrelated seeds
    (a hash, not arithmetic: seed*K + i would make (seed, i) pairs collide)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_tokens(seed: int, index: int, vocab: int, length: int) -> torch.Tensor:
    """Tokens of sample ``index``: ``length`` int64 values in ``[0, vocab)``, a pure
    function of ``(seed, index, vocab, length)``. O(length); touches no global RNG."""
    g = torch.Generator().manual_seed(_seed_of(0, seed, index))
    return torch.randint(0, vocab, (length,), generator=g)


class ResumableSampler:
    """This rank's sample indices of each global batch, from a resumable global position.

    ``batch`` samples per rank and step, ``rank`` of ``world``. :meth:`next_indices`
    returns this rank's indices and advances the global position by ``world * batch``
    (every rank advances by the same amount, so the state is the same everywhere).
    See the module docstring for what a resume at another world size does.

    Memory: one permutation of ``num_samples`` int64 (the current epoch's), rebuilt in
    O(num_samples) when the stream crosses into another epoch.
    """

    def __init__(self, num_samples: int, batch: int, *, seed: int = 0, rank: int = 0,
                 world: int = 1) -> None:
        if num_samples < 1 or batch < 1 or world < 1 or not 0 <= rank < world:
            raise ValueError(f"bad sampler arguments: num_samples={num_samples} batch={batch} "
                             f"rank={rank} world={world}")
        self.num_samples, self.batch, self.seed = num_samples, batch, seed
        self.rank, self.world = rank, world
        self.consumed = 0  # global positions consumed, over all ranks and epochs
        self._perm: tuple[int, torch.Tensor] | None = None  # (epoch, its order)

    @property
    def epoch(self) -> int:
        return self.consumed // self.num_samples

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(_seed_of(1, self.seed, epoch))
            self._perm = (epoch, torch.randperm(self.num_samples, generator=g))
        return self._perm[1]

    def index_at(self, position: int) -> int:
        """Sample index at global ``position``."""
        epoch, offset = divmod(position, self.num_samples)
        return int(self._order(epoch)[offset])

    def next_indices(self) -> list[int]:
        """This rank's ``batch`` sample indices of the next global batch; advances the
        global position by ``world * batch``."""
        start = self.consumed + self.rank * self.batch
        out = [self.index_at(p) for p in range(start, start + self.batch)]
        self.consumed += self.world * self.batch
        return out

    def next_tokens(self, vocab: int, length: int, device: Any = "cpu") -> torch.Tensor:
        """:meth:`next_indices` as a ``(batch, length)`` int64 token tensor on ``device``."""
        rows = [sample_tokens(self.seed, i, vocab, length) for i in self.next_indices()]
        return torch.stack(rows).to(device)

    def state_dict(self) -> dict[str, int]:
        """Where the stream is: a new dict (dckpt fills it in place on load)."""
        return {"seed": self.seed, "num_samples": self.num_samples, "epoch": self.epoch,
                "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (another world size is fine; rank and world stay
        this sampler's). Raises StateMismatchError (a dckpt.CheckpointError) when the
        keys or types are not :meth:`state_dict`'s, the position is negative or does
        not match its epoch, or the state is of other data (seed or data set size)."""
        if not isinstance(state, dict) or sorted(state) != sorted(STATE_KEYS):
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise StateMismatchError(
                f"sampler state must have keys {sorted(STATE_KEYS)}, got {got}")
        bad = [k for k in STATE_KEYS if type(state[k]) is not int]  # bool is not a position
        if bad:
            raise StateMismatchError("sampler state values must be ints: " + ", ".join(
                f"{k}={state[k]!r} ({type(state[k]).__name__})" for k in bad))
        if state["seed"] != self.seed or state["num_samples"] != self.num_samples:
            raise StateMismatchError(
                f"sampler state is of other data: seed {state['seed']}, {state['num_samples']} "
                f"samples; this sampler has seed {self.seed}, {self.num_samples} samples")
        if state["consumed"] < 0 or state["epoch"] != state["consumed"] // self.num_samples:
            raise StateMismatchError(f"sampler state is inconsistent: consumed {state['consumed']} "
                                     f"in epoch {state['epoch']} of {self.num_samples} samples")
        self.consumed = state["consumed"]
