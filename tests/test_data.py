"""launch/data.py: the resumable sampler of launch/train.py, ranks simulated in one process.

Contract under test: the union over ranks of the positions taken in one step is the next
``world * batch`` positions of one global stream, each epoch of which is a permutation of
the data set; a sampler loaded from a ``state_dict`` continues at the recorded position,
at any world size, so the stream is neither repeated nor skipped across a restart.
"""
from __future__ import annotations

import pytest
import torch

import dckpt
from launch.data import ResumableSampler, sample_tokens


def ranks(world: int, n: int = 50, batch: int = 3, seed: int = 7) -> list[ResumableSampler]:
    return [ResumableSampler(n, batch, seed=seed, rank=r, world=world) for r in range(world)]


def step(samplers: list[ResumableSampler]) -> list[list[int]]:
    """One training step: every rank takes its indices."""
    return [s.next_indices() for s in samplers]


def stream(n: int, seed: int, count: int) -> list[int]:
    """The first ``count`` sample indices of the global stream, read by one rank."""
    one = ResumableSampler(n, 1, seed=seed)
    return [one.next_indices()[0] for _ in range(count)]


def test_sample_tokens_are_a_function_of_seed_and_index():
    torch.manual_seed(0)
    a = sample_tokens(3, 11, vocab=257, length=17)
    torch.manual_seed(1)  # the global RNG plays no part, and is left alone
    before = torch.get_rng_state()
    assert torch.equal(a, sample_tokens(3, 11, vocab=257, length=17))
    assert torch.equal(before, torch.get_rng_state())
    assert a.dtype == torch.int64 and a.shape == (17,) and 0 <= a.min() and a.max() < 257
    assert not torch.equal(a, sample_tokens(3, 12, vocab=257, length=17))
    assert not torch.equal(a, sample_tokens(4, 11, vocab=257, length=17))


def test_ranks_split_consecutive_global_positions_and_epochs_are_permutations():
    n, world, batch = 50, 4, 3
    samplers = ranks(world, n, batch)
    taken = []
    for _ in range(9):  # 108 positions: more than two epochs, batches straddle epochs
        taken += [i for per_rank in step(samplers) for i in per_rank]
    assert taken == stream(n, 7, 108)
    assert sorted(taken[:n]) == list(range(n)) and sorted(taken[n:2 * n]) == list(range(n))
    assert taken[:n] != taken[n:2 * n]  # each epoch has its own order
    assert all(s.consumed == 108 and s.epoch == 2 for s in samplers)
    assert len({str(s.state_dict()) for s in samplers}) == 1  # one replicated value


def test_resume_at_the_same_world_size_is_the_exact_continuation():
    a = ranks(3)
    for _ in range(7):
        step(a)
    saved = [s.state_dict() for s in a]
    expected = [step(a) for _ in range(5)]
    b = ranks(3)
    for s, sd in zip(b, saved):
        s.load_state_dict(sd)
    assert [step(b) for _ in range(5)] == expected
    tokens_a = ranks(3)[1]
    tokens_a.load_state_dict(saved[1])
    tokens_b = ranks(3)[1]
    tokens_b.load_state_dict(saved[1])
    assert torch.equal(tokens_a.next_tokens(257, 9), tokens_b.next_tokens(257, 9))


@pytest.mark.parametrize("old,new", [(4, 2), (2, 3), (3, 1), (1, 4)])
def test_world_size_change_continues_with_the_next_unseen_positions(old, new):
    n, batch = 50, 3
    a = ranks(old, n, batch)
    seen = []
    for _ in range(5):
        seen += [i for per_rank in step(a) for i in per_rank]
    saved = a[0].state_dict()
    assert saved["consumed"] == 5 * old * batch
    b = ranks(new, n, batch)
    for s in b:
        s.load_state_dict(dict(saved))
    after = []
    for _ in range(6):
        after += [i for per_rank in step(b) for i in per_rank]
    # Exactly the stream, in order: nothing seen twice, nothing skipped.
    assert seen + after == stream(n, 7, len(seen) + len(after))
    assert all(s.consumed == saved["consumed"] + 6 * new * batch for s in b)


def test_state_survives_a_real_dckpt_round_trip(tmp_path):
    a = ranks(1)[0]
    for _ in range(4):
        a.next_indices()
    dckpt.save({"data": a}, str(tmp_path / "ck"))
    b = ranks(1)[0]
    dckpt.load({"data": b}, str(tmp_path / "ck"))
    assert b.state_dict() == a.state_dict() and b.next_indices() == a.next_indices()


@pytest.mark.parametrize("state,match", [
    ({"seed": 7, "num_samples": 50, "epoch": 0}, "keys"),
    ({"seed": 7, "num_samples": 50, "epoch": 0, "consumed": 3, "extra": 1}, "keys"),
    ([7, 50, 0, 3], "keys"),
    ({"seed": 7, "num_samples": 50, "epoch": 0, "consumed": "3"}, "ints.*consumed='3'"),
    ({"seed": 7, "num_samples": 50, "epoch": 0, "consumed": 3.0}, "ints"),
    ({"seed": 7, "num_samples": 50, "epoch": False, "consumed": 3}, "ints"),
    ({"seed": 8, "num_samples": 50, "epoch": 0, "consumed": 3}, "other data"),
    ({"seed": 7, "num_samples": 60, "epoch": 0, "consumed": 3}, "other data"),
    ({"seed": 7, "num_samples": 50, "epoch": 0, "consumed": -1}, "inconsistent"),
    ({"seed": 7, "num_samples": 50, "epoch": 0, "consumed": 50}, "inconsistent"),
])
def test_bad_state_raises_a_checkpoint_error_and_keeps_the_position(state, match):
    s = ranks(2)[0]
    s.next_indices()
    with pytest.raises(dckpt.CheckpointError, match=match):
        s.load_state_dict(state)
    assert s.consumed == 6


def test_bad_arguments():
    with pytest.raises(ValueError):
        ResumableSampler(10, 2, rank=2, world=2)
    with pytest.raises(ValueError):
        ResumableSampler(0, 2)
