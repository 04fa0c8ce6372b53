"""Side files at real gloo ranks: a save with ``side=SideFile("models.0.")`` stores the
model's tensors in files holding nothing else, under their names without the prefix
(what a Hugging Face model folder's index points at), listed and checksummed by the
manifest; everything reads back (load at another world size, open, verify); ranks that
disagree about ``side`` fail alike with nothing left behind; a rank that fails after
writing its side file leaves no file either."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

PREFIX = "models.0."


def _model() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(6, 4, generator=g) for i in range(5)} | {
        "embed.weight": torch.randn(9, 4, generator=g), "count": torch.arange(3)}


def _state(rank: int) -> dict:
    # the model replicated (DDP), the optimizer's state and the rng per rank
    return {"models": {"0": _model()}, "optimizers": {"0": {"m": torch.full((4,), float(rank))}},
            "rng": {f"rank{rank}": torch.tensor([rank])}, "step": 7}


def _save(root: str, side_on: bool | str, fault: str = "") -> tuple[str, str]:
    import dckpt

    rank = dist.get_rank()
    side = None
    if side_on is True or (side_on == "rank0" and rank == 0):
        side = dckpt.SideFile(PREFIX)
    elif side_on == "other-prefix":
        side = dckpt.SideFile(PREFIX if rank == 0 else "models.")
    if fault:
        os.environ["DCKPT_FAULT"] = fault
    try:
        dckpt.save(_state(rank), root, side=side)
        return "ok", ""
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        os.environ.pop("DCKPT_FAULT", None)


def _load(root: str) -> bool:
    import dckpt

    got = {"models": {"0": {k: torch.zeros_like(v) for k, v in _model().items()}}}
    dckpt.load(got, root, strict=False)
    return all(torch.equal(got["models"]["0"][k], v) for k, v in _model().items())


def test_model_tensors_go_to_side_files_under_their_names(ranks, tmp_path):
    import dckpt
    from dckpt.catalog.verify import verify_checkpoint
    from dckpt.format import manifest as mf

    root = str(tmp_path / "ck")
    assert ranks(2).run(_save, root, True) == [("ok", "")] * 2
    names = sorted(os.listdir(root))
    side = [n for n in names if n.startswith("model-")]
    assert side and all(n.endswith(".safetensors") for n in side)
    seen: dict[str, torch.Tensor] = {}
    for n in side:  # plain safetensors holding the model's tensors only, named bare
        with safe_open(os.path.join(root, n), "pt") as f:
            assert f.metadata()["format"] == "pt"
            for k in f.keys():
                assert k not in seen
                seen[k] = f.get_tensor(k)
    want = _model()
    assert sorted(seen) == sorted(want)
    assert all(torch.equal(seen[k], want[k]) for k in want)
    for n in names:
        if n.startswith("data-"):
            with safe_open(os.path.join(root, n), "pt") as f:
                assert not any(k.startswith(PREFIX) or k in want for k in f.keys())
    m = mf.parse(open(os.path.join(root, mf.MANIFEST_NAME), "rb").read(), root)
    assert set(side) <= {f.name for f in m.files}
    assert m.meta["side_prefix"] == PREFIX
    # every reader: a load at 1 and 2 ranks, open, verify
    assert _load(root)
    assert ranks(2).run(_load, root) == [True, True]
    ck = dckpt.open(root)
    assert torch.equal(ck[PREFIX + "embed.weight"], want["embed.weight"])
    assert verify_checkpoint(root).ok


@pytest.mark.parametrize("how", ["rank0", "other-prefix"])
def test_side_settings_that_differ_between_ranks_fail_alike(ranks, tmp_path, how):
    root = str(tmp_path / "ck")
    out = ranks(2).run(_save, root, how)
    assert out[0] == out[1] and out[0][0] == "CheckpointError", out
    assert "side differs between ranks" in out[0][1] and "rank 1" in out[0][1]
    assert not os.path.exists(os.path.join(root, "manifest.json"))
    assert not [n for n in os.listdir(root) if n.endswith(".safetensors")]


def test_failed_save_leaves_no_side_file(ranks, tmp_path):
    root = str(tmp_path / "ck")
    out = ranks(2).run(_save, root, True, "vote:1:raise")
    assert out[0] == out[1] and out[0][0] != "ok", out
    assert not os.path.exists(os.path.join(root, "manifest.json"))
    assert not [n for n in os.listdir(root) if n.endswith(".safetensors")], os.listdir(root)


def test_side_file_is_refused_with_encoding(tmp_path):
    import dckpt
    from dckpt.errors import CheckpointError

    with pytest.raises(CheckpointError, match="side files are plain"):
        dckpt.save(_state(0), str(tmp_path / "ck"), side=dckpt.SideFile(PREFIX),
                   block_hashes=True)
    with pytest.raises(CheckpointError, match="prefix"):
        dckpt.SideFile("")
    assert not os.path.exists(os.path.join(tmp_path, "ck", "manifest.json"))


def test_async_save_writes_side_files(tmp_path):
    import dckpt

    root = str(tmp_path / "ck")
    dckpt.async_save(_state(0), root, side=dckpt.SideFile(PREFIX)).result(60)
    assert [n for n in os.listdir(root) if n.startswith("model-")]
    assert _load(root)
