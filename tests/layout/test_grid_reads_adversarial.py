"""Adversarial review of issue 47 (plans by rule): consumers of a parsed manifest that
still expanded a run-form grid tensor on a path claimed compact (proved on 6db8c43,
fixed since). Pure (no I/O)."""
from __future__ import annotations

import numpy as np

from dckpt.format import manifest as mf
from dckpt.format.runs import Runs
from dckpt.layout.chunks import Box
from dckpt.state.tensors import LocalPiece


def _fsdp_manifest(world: int, tensors: int, rows_per_rank: int = 2) -> mf.Manifest:
    """A parsed FSDP manifest of ``world`` ranks: each tensor's grid and file list
    are kept as runs by the parse (as at 131,072 ranks)."""
    n = world * rows_per_rank
    grid = (tuple(range(0, n + 1, rows_per_rank)), (0, 4))
    ft = [mf.FileEntry(f"data-0123456789abcdef-{r:05d}.safetensors", 4096, 64, 1, r)
          for r in range(world)]
    ts = {}
    for k in range(tensors):
        o, s = mf.grid_cells(grid)
        ts[f"w{k}"] = mf.TensorEntry(f"w{k}", "F32", (n, 4),
                                     mf.Chunks(o, s, np.arange(world, dtype=np.int64), grid))
    m = mf.parse(mf.to_json(mf.Manifest("0123456789abcdef", world, 0.0, ft, ts, {})))
    for t in m.tensors.values():
        assert isinstance(t.chunks.file_ids, Runs) and isinstance(t.chunks.grid[0], Runs)
    return m


def test_fast_tier_local_view_keeps_run_form_file_lists_compact(monkeypatch):
    """A fast-tier save: every rank parses the global manifest and builds its view
    (local_view) pointing its replicas at its replica file. The replica chunk is found
    by rule (Chunks.find), but the view then copies the whole file list
    (``c.file.copy()``), expanding the Runs of every replicated tensor: measured with
    benchmarks/bench_restore_scale.py's manifest builder at 16,384 ranks x 500 tensors,
    one rank's local_view took 0.37 s and kept 134 MB (500/500 file lists expanded),
    linear in the world size (~1 GB per rank at 131,072), the cost issue 47 removed
    from restore. Its view's file list differs from the global one in one entry: it
    can stay runs (the global runs with that entry spliced out)."""
    from dckpt.tiers.local import local_view

    world, tensors, rank = 4096, 8, 5
    m = _fsdp_manifest(world, tensors)
    expanded = []
    real = Runs.__array__

    def counting(self, *a, **k):
        expanded.append(len(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Runs, "__array__", counting)
    partner = 13  # the rank whose chunks this rank holds as replicas
    replicas = [LocalPiece(k, "F32", t.shape, Box((2 * partner, 0), (2, 4)),
                           np.zeros((2, 4), np.float32))
                for k, t in m.tensors.items()]
    vote = {"file": "replica-0123456789abcdef-00005.safetensors", "size": 4096, "hlen": 64,
            "crc": 1}
    view = local_view(m, rank, vote, replicas)
    # the view is right: the replica chunk points at the new file, the rest unchanged
    for t in view.tensors.values():
        assert int(t.chunks.file_of(np.array([partner]))[0]) == world
        assert int(t.chunks.file_of(np.array([partner + 1]))[0]) == partner + 1
    # ... and built without expanding any tensor's chunks
    assert expanded == [], f"{len(expanded)} run-form arrays of {max(expanded)} values expanded"
