"""Issue 34, defect 1.8: settings every rank must share are agreed when the manager is
made. Ranks that disagree (or one rank with a bad value) raise the same
CheckpointError on every rank, naming the setting, the values and the ranks, within
the deadline: before, ranks that disagreed on ``compression`` never committed a
durable copy and blamed "a concurrent dckpt gc or save?", and a bad ``full_every`` on
one rank left the others waiting in the construction's broadcast."""
from __future__ import annotations

import os

import torch.distributed as dist

from dckpt.protocol.settings import disagreements

DEADLINE = 60


def _make(base: str, kw_by_rank: dict) -> str:
    import dckpt

    kw = kw_by_rank.get(dist.get_rank(), kw_by_rank.get("*", {}))
    try:
        mgr = dckpt.CheckpointManager(os.path.join(base, "durable"), capture_rng=False,
                                      every_steps=1, local_root=os.path.join(base, "shm"),
                                      **kw)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    mgr.close()
    return "no error"


def test_ranks_disagreeing_on_compression_fail_alike(ranks, tmp_path):
    out = ranks(2).run(_make, str(tmp_path), {0: {"compression": "zstd"},
                                              1: {"compression": None}}, timeout=DEADLINE)
    assert len(set(out)) == 1, out
    assert out[0].startswith("CheckpointError") and \
        "compression='zstd' on rank 0; compression=None on rank 1" in out[0], out[0]
    assert not os.path.exists(tmp_path / "durable" / ".dckpt-run-id")  # nothing made


def test_ranks_disagreeing_on_files_and_policy_settings_name_each(ranks, tmp_path):
    out = ranks(2).run(_make, str(tmp_path), {
        0: {"incremental": True, "full_every": 5, "durable_every_steps": 10},
        1: {"incremental": False, "full_every": 5, "durable_every_steps": 20}},
        timeout=DEADLINE)
    assert len(set(out)) == 1, out
    assert "incremental=True on rank 0; incremental=False on rank 1" in out[0]
    assert "durable_every_steps=10 on rank 0; durable_every_steps=20 on rank 1" in out[0]


def test_a_bad_value_on_one_rank_fails_every_rank_without_a_hang(ranks, tmp_path):
    out = ranks(2).run(_make, str(tmp_path), {0: {}, 1: {"full_every": 0}}, timeout=DEADLINE)
    assert len(set(out)) == 1, out
    assert "rank 1: full_every must be an int >= 1, not 0" in out[0], out[0]


def test_disagreements_is_pure_and_names_every_group():
    docs = [{"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}]
    assert disagreements(docs) == ["a=1 on ranks 0, 1; a=2 on rank 2",
                                   "b='x' on ranks 0, 2; b='y' on rank 1"]
    assert disagreements([{"a": 1}] * 3) == []
