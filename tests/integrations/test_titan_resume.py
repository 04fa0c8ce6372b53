"""The rule that picks what a torchtitan job resumes from a folder holding dckpt's and
DCP's steps (dckpt.integrations.torchtitan.resume), pure, in one process."""
from __future__ import annotations

import pytest

from dckpt.errors import CheckpointError, IntegrityError, StateMismatchError
from dckpt.integrations.torchtitan.resume import (DCKPT, DCP, Choice, dcp_candidates, order,
                                             resume)
from dckpt.tiers.chooser import Candidate


def _dcp(*steps_times):
    """DCP's steps as load.dcp_steps lists them, kind "dcp"."""
    return [(s, "dcp", t) for s, t in steps_times]


def _plan(mine, theirs):
    kinds = {s: k for s, k, _ in theirs}
    return order(mine, dcp_candidates(theirs), kinds)


def test_newest_commit_wins_over_a_higher_dcp_step_of_an_abandoned_timeline():
    # DCP saved 2..8; a rewind to 2 saved dckpt's 4 after them
    theirs = _dcp((2, 10.0), (4, 20.0), (6, 30.0), (8, 40.0))
    mine = [Candidate(4, "durable", 50.0, "a")]
    choices, abandoned = _plan(mine, theirs)
    assert choices == [Choice(DCKPT, 4), Choice(DCP, 2, "dcp")]
    assert sorted((c.step, c.tier) for c in abandoned) == [(4, DCP), (6, DCP), (8, DCP)]


def test_a_damaged_dckpt_step_falls_back_to_the_dcp_step_committed_before_it():
    theirs = _dcp((2, 20.0), (4, 30.0))
    mine = [Candidate(2, "durable", 10.0, "a"), Candidate(6, "durable", 40.0, "b")]
    choices, abandoned = _plan(mine, theirs)
    assert choices == [Choice(DCKPT, 6), Choice(DCP, 4, "dcp"), Choice(DCP, 2, "dcp")]
    assert [(c.step, c.tier) for c in abandoned] == [(2, "durable")]  # DCP's 2 is newer


def test_dcp_steps_order_by_step_number_among_themselves():
    # a copy that lost the modification times: step-8 copied before step-2
    theirs = _dcp((2, 40.0), (4, 10.0), (6, 20.0), (8, 30.0))
    choices, abandoned = _plan([], theirs)
    assert [c.step for c in choices] == [8, 6, 4, 2] and abandoned == []
    assert [c.created for c in dcp_candidates(theirs)] == [40.0, 40.0, 40.0, 40.0]


def test_a_tie_goes_to_dckpt_and_unknown_times_take_their_step_turn():
    theirs = [(4, "dcp", 30.0), (6, "hf", None)]
    mine = [Candidate(4, "durable", 30.0, "a"), Candidate(4, "local", 30.0, "a")]
    choices, abandoned = _plan(mine, theirs)
    assert choices == [Choice(DCP, 6, "hf"), Choice(DCKPT, 4), Choice(DCP, 4, "dcp")]
    assert abandoned == []


def test_resume_skips_damage_only():
    tried = []

    def load(c: Choice) -> None:
        tried.append(c)
        if c.step == 6:
            raise IntegrityError("checksum mismatch in data-00000.safetensors")

    choices = [Choice(DCKPT, 6), Choice(DCP, 4, "dcp"), Choice(DCP, 2, "dcp")]
    assert resume(choices, load, "/f", 0) == Choice(DCP, 4, "dcp")
    assert tried == choices[:2]

    def mismatch(c: Choice) -> None:
        raise StateMismatchError("missing key optimizer.state")

    with pytest.raises(StateMismatchError):  # never an older step in its place
        resume(choices, mismatch, "/f", 0)

    def damaged(c: Choice) -> None:
        raise CheckpointError(f"{c} is damaged")

    with pytest.raises(CheckpointError, match="3 tried") as e:
        resume(choices, damaged, "/f", 0)
    assert "DCP's step-2" in str(e.value) and "dckpt's step 6" in str(e.value)
