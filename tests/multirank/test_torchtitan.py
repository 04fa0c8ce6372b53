"""Issue 36: torchtitan's trainer contract on dckpt's DckptCheckpointManager, each case
run with torchtitan's own DCP CheckpointManager in the same test where it supports it.

Real gloo ranks drive torchtitan's real components (ModelWrapper over an FSDP2 model,
OptimizersContainer with AdamW, LRSchedulersContainer with warmup, the
ParallelAwareDataloader, a Stateful train state) as torchtitan's Trainer does
(tests/titankit.py)."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from titankit import Parts, assert_same  # noqa: E402

DEADLINE = 240
WHICH = ("dckpt", "dcp")


def config(which: str, **kw):
    """The manager's Config: dckpt's or torchtitan's DCP one, same fields."""
    if which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    kw.setdefault("enable", True)
    return cls.Config(**kw)


def _train(base: str, which: str, steps: int, kw: dict, until: int | None = None) -> dict:
    parts = Parts(seed=0)
    ck = config(which, **kw).build(**parts.build_kwargs(base))
    parts.train(ck, steps, until=until)
    ck.close()
    return parts.snapshot(data=False) | {"drawn": parts.drawn}


def _resume(base: str, which: str, kw: dict, step: int = -1, data: bool = True) -> dict:
    parts = Parts(seed=1)
    ck = config(which, **kw).build(**parts.build_kwargs(base))
    loaded = ck.load(step=step)
    ck.close()
    return parts.snapshot(data=data) | {"loaded": loaded}


def _strip(s: dict) -> dict:
    return {k: v for k, v in s.items() if k not in ("drawn", "loaded", "next_batch")}


@pytest.mark.parametrize("which", WHICH)
def test_save_at_2_resume_at_2_3_1(ranks, tmp_path, which):
    """Everything saved comes back at 2 ranks (the dataloader: the next batch it yields
    is the one the saved run drew next); at 3 and 1 ranks too, the dataloader excluded
    (torchtitan's dataloader refuses another dp degree: it asserts the saved
    world_size)."""
    base = str(tmp_path)
    kw = dict(interval=2, last_save_model_only=False)
    full = ranks(2).run(_train, base + "/full", which, 6, kw, timeout=DEADLINE)
    back = ranks(2).run(_resume, base + "/full", which, kw, timeout=DEADLINE)
    for r in range(2):
        assert back[r]["loaded"] is True
        assert_same(_strip(full[r]), _strip(back[r]), f"{which} rank {r}")
        assert back[r]["train_state"] == {"step": 6, "ntokens_seen": 6 * 2 * 9}
    # the next batch after a resume is the one the first run would have drawn next
    cont = ranks(2).run(_train, base + "/cont", which, 8, kw, timeout=DEADLINE)
    nxt = ranks(2).run(_resume_batch, base + "/cont", which, kw, 6, timeout=DEADLINE)
    for r in range(2):
        assert torch.equal(nxt[r], cont[r]["drawn"][6]), f"{which} rank {r}"
    resharded = dict(kw, exclude_from_loading=["dataloader"])
    for n in (3, 1):
        got = ranks(n).run(_resume, base + "/full", which, resharded, -1, False,
                           timeout=DEADLINE)
        for r in range(n):
            assert_same(_strip(full[0]), _strip(got[r]), f"{which} at {n} ranks, rank {r}")


def _resume_batch(base: str, which: str, kw: dict, step: int) -> torch.Tensor:
    parts = Parts(seed=1)
    ck = config(which, **kw).build(**parts.build_kwargs(base))
    assert ck.load(step=step)
    ck.close()
    return parts.batch()


def _dirs(folder: str) -> list[str]:
    return sorted(d for d in os.listdir(folder) if d.startswith("step-"))


def test_keep_latest_k(ranks, tmp_path):
    """keep_latest_k=2 leaves two step directories with dckpt; torchtitan's DCP
    manager leaves three (it skips the purge after the last save)."""
    kw = dict(interval=2, keep_latest_k=2, last_save_model_only=False)
    for which in WHICH:
        ranks(2).run(_train, str(tmp_path / which), which, 8, kw, timeout=DEADLINE)
    ours = _dirs(str(tmp_path / "dckpt" / "checkpoint"))
    theirs = _dirs(str(tmp_path / "dcp" / "checkpoint"))
    assert len(ours) == 2 and [int(d[5:]) for d in ours] == [6, 8], ours
    assert sorted(int(d[5:]) for d in theirs) == [4, 6, 8], theirs


def test_last_save_model_only_bf16(ranks, tmp_path):
    """The last step holds only the model, in bf16, with both managers."""
    kw = dict(interval=3, export_dtype="bfloat16")  # last_save_model_only defaults to True
    for which in WHICH:
        ranks(2).run(_train, str(tmp_path / which), which, 4, kw, timeout=DEADLINE)
    import dckpt
    from torch.distributed.checkpoint import FileSystemReader

    step = [d for d in _dirs(str(tmp_path / "dckpt" / "checkpoint")) if int(d[5:]) == 4][0]
    with dckpt.open(str(tmp_path / "dckpt" / "checkpoint" / step)) as ck:
        keys = [k for k in ck.keys() if not k.startswith("manager.")]  # its timeline
        assert keys and all(k.startswith("state.model.") for k in keys), keys[:5]
        assert {ck.info(k).dtype for k in keys} == {torch.bfloat16}
    md = FileSystemReader(str(tmp_path / "dcp" / "checkpoint" / "step-4")).read_metadata()
    dtypes = {m.properties.dtype for m in md.state_dict_metadata.values()
              if hasattr(m, "properties")}
    assert dtypes == {torch.bfloat16}


def test_exclude_from_loading(ranks, tmp_path):
    kw = dict(interval=2, last_save_model_only=False)
    for which in WHICH:
        base = str(tmp_path / which)
        full = ranks(2).run(_train, base, which, 4, kw, timeout=DEADLINE)
        back = ranks(2).run(_resume, base, which, dict(kw, exclude_from_loading=["lr_scheduler"]),
                            timeout=DEADLINE)
        for r in range(2):
            assert back[r]["lr_scheduler"] != full[r]["lr_scheduler"], which
            assert back[r]["lr_scheduler"]["last_epoch"] == 0, which
            assert_same(full[r]["model"], back[r]["model"], which)
            assert back[r]["train_state"] == full[r]["train_state"]


def _initial(base: str, which: str, path: str) -> dict:
    return _resume(base, which, dict(interval=2, initial_load_path=path,
                                     initial_load_model_only=True), data=False)


def test_initial_load_model_only(ranks, tmp_path):
    """initial_load_path, model only: the model comes from the other run's step, the
    rest stays fresh; dckpt also starts from a DCP checkpoint (a run moving to dckpt)."""
    kw = dict(interval=2, last_save_model_only=False)
    src = {}
    for which in WHICH:
        src[which] = ranks(2).run(_train, str(tmp_path / which), which, 4, kw, timeout=DEADLINE)
    ours = [d for d in _dirs(str(tmp_path / "dckpt" / "checkpoint")) if int(d[5:]) == 4][0]
    cases = [("dckpt", str(tmp_path / "dckpt" / "checkpoint" / ours), "dckpt"),
             ("dcp", str(tmp_path / "dcp" / "checkpoint" / "step-4"), "dcp"),
             ("dckpt", str(tmp_path / "dcp" / "checkpoint" / "step-4"), "dcp")]
    for i, (which, path, origin) in enumerate(cases):
        got = ranks(2).run(_initial, str(tmp_path / f"new{i}"), which, path, timeout=DEADLINE)
        for r in range(2):
            assert got[r]["loaded"] is True
            assert_same(src[origin][r]["model"], got[r]["model"], f"{which} from {origin}")
            assert got[r]["train_state"] == {"step": 0, "ntokens_seen": 0}
            assert got[r]["lr_scheduler"]["last_epoch"] == 0


def test_fresh_start_and_missing_step(ranks, tmp_path):
    """load() on an empty folder is False; load(step=N) for a step that is not there
    raises FileNotFoundError (folder missing, or the step missing), with both."""
    ranks(2).run(_fresh, str(tmp_path), timeout=DEADLINE)


def _fresh(base: str) -> None:
    for which in WHICH:
        kw = dict(interval=2, last_save_model_only=False)
        parts = Parts()
        ck = config(which, **kw).build(**parts.build_kwargs(f"{base}/{which}"))
        assert ck.load() is False
        with pytest.raises(FileNotFoundError):
            ck.load(step=3)
        parts.train(ck, 2)
        with pytest.raises(FileNotFoundError):
            ck.load(step=3)
        ck.close()


def _async(base: str, which: str) -> dict:
    """Save step 4 asynchronously and keep training: record the state at the save
    call, then load step 4 into fresh components."""
    parts = Parts(seed=0)
    kw = dict(interval=4, async_mode="async", last_save_model_only=False)
    ck = config(which, **kw).build(**parts.build_kwargs(base))
    at_call: dict = {}

    def before_save(step: int) -> None:
        if step == 4:
            at_call.update(_strip(parts.snapshot(data=False)))

    parts.train(ck, 7, before_save=before_save, until=6)
    ck.maybe_wait_for_saving()
    ck.close()
    dist.barrier()
    back = Parts(seed=1)
    ck2 = config(which, **kw).build(**back.build_kwargs(base))
    assert ck2.load(step=4)
    ck2.close()
    return {"at_call": at_call, "loaded": _strip(back.snapshot(data=False)),
            "next": back.batch(), "drawn": parts.drawn}


@pytest.mark.parametrize("which", WHICH)
def test_async_holds_the_values_at_the_save_call(ranks, tmp_path, which):
    got = ranks(2).run(_async, str(tmp_path), which, timeout=DEADLINE)
    for r in range(2):
        assert_same(got[r]["at_call"], got[r]["loaded"], f"{which} rank {r}")
        assert torch.equal(got[r]["next"], got[r]["drawn"][4])


@pytest.mark.slow
def test_sigkill_mid_save_resumes_from_the_previous_step(tmp_path):
    """Rank 1 is SIGKILLed in the middle of step 4's save (torchrun, real signal); the
    restart resumes from step 2 and trains to the end, with both managers. dckpt's
    step-4 folder has no manifest and is never listed; DCP's has no .metadata (rank 0
    writes it after every rank's files), and torchtitan skips it too."""
    from dckpt.catalog.verify import verify_checkpoint

    from .test_crash import Job

    script = os.path.join(os.path.dirname(__file__), "jobs", "titan_job.py")
    for which in WHICH:
        base, run = str(tmp_path / which), str(tmp_path / f"run-{which}")
        os.makedirs(run)
        job = Job(base, run, "--which", which, "--steps", "6", "--kill-at", "4", script=script)
        job.wait_for("saved 2")
        assert job.finish(timeout=DEADLINE) != 0
        assert "saved 4" not in "".join(job.output)
        job = Job(base, run, "--which", which, "--steps", "6", script=script)
        job.wait_for("resumed 2")
        job.wait_for("done 6")
        assert job.finish(timeout=DEADLINE) == 0, "".join(job.output)[-3000:]
    folder = tmp_path / "dckpt" / "checkpoint"
    for step in sorted(os.listdir(folder)):
        if step.startswith("step-"):
            verify_checkpoint(str(folder / step))


class RenamingAdapter:
    """A state dict adapter as torchtitan's models have: native FQNs <-> HF names
    ("model." prefix), DCP's HF reader for quantized checkpoints."""

    fqn_to_index_mapping = None

    def __init__(self, hf_assets_path: str | None = None) -> None:
        self.hf_assets_path = hf_assets_path

    def to_hf(self, sd: dict) -> dict:
        return {f"model.{k}": v for k, v in sd.items()}

    def from_hf(self, hf: dict) -> dict:
        return {k[len("model."):]: v for k, v in hf.items()}

    def get_hf_storage_reader(self, path: str, from_quantized: bool = False):
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        return HuggingFaceStorageReader(path)


def _hf_initial(base: str, which: str, hf_dir: str) -> dict:
    parts = Parts(seed=1)
    kw = parts.build_kwargs(base) | {"sd_adapter": RenamingAdapter()}
    ck = config(which, interval=2, initial_load_path=hf_dir, initial_load_in_hf=True,
                initial_load_model_only=True).build(**kw)
    loaded = ck.load()
    ck.close()
    return parts.snapshot(data=False) | {"loaded": loaded}


def test_initial_load_from_hf_through_the_adapter(ranks, tmp_path):
    """initial_load_in_hf: the HF safetensors (one file, then an indexed set of two)
    load straight into the FSDP2 model through the adapter, as with DCP's HF reader."""
    from safetensors.torch import save_file

    from titankit import TinyLlama

    torch.manual_seed(5)
    ref = {k: v.detach().clone() for k, v in TinyLlama().state_dict().items()}
    one, two = tmp_path / "hf-one", tmp_path / "hf-two"
    one.mkdir(), two.mkdir()
    save_file({f"model.{k}": v for k, v in ref.items()}, str(one / "model.safetensors"))
    keys = sorted(ref)
    halves = {"model-00001-of-00002.safetensors": keys[::2],
              "model-00002-of-00002.safetensors": keys[1::2]}
    for name, ks in halves.items():
        save_file({f"model.{k}": ref[k] for k in ks}, str(two / name))
    import json

    (two / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {f"model.{k}": n for n, ks in halves.items()
                                        for k in ks}}))
    for which in WHICH:
        for src in (one, two):
            got = ranks(2).run(_hf_initial, str(tmp_path / f"{which}-{src.name}"), which,
                               str(src), timeout=DEADLINE)
            for r in range(2):
                assert got[r]["loaded"] is True
                assert_same(ref, got[r]["model"], f"{which} from {src.name}")


def _hf_last(base: str, which: str) -> dict:
    parts = Parts(seed=0)
    kw = parts.build_kwargs(base) | {"sd_adapter": RenamingAdapter()}
    ck = config(which, interval=3, last_save_in_hf=True, export_dtype="bfloat16").build(**kw)
    parts.train(ck, 4)
    ck.close()
    return parts.snapshot(data=False)


def test_last_save_in_hf(ranks, tmp_path):
    """last_save_in_hf: the final model in bf16 as HF safetensors, named by the
    adapter: dckpt's export (step-N-hf beside the model-only step-N) holds exactly
    what DCP's HF writer does."""
    from safetensors.torch import load_file

    for which in WHICH:
        got = ranks(2).run(_hf_last, str(tmp_path / which), which, timeout=DEADLINE)
    final = got[0]["model"]
    folder = tmp_path / "dckpt" / "checkpoint"
    hf_dirs = [d for d in os.listdir(folder) if d.endswith("-hf")]
    assert len(hf_dirs) == 1 and hf_dirs[0].startswith("step-") and int(hf_dirs[0][5:-3]) == 4
    ours = load_file(str(folder / hf_dirs[0] / "model.safetensors"))
    dcp_dir = tmp_path / "dcp" / "checkpoint" / "step-4"
    theirs = {}
    for f in sorted(os.listdir(dcp_dir)):
        if f.endswith(".safetensors"):
            theirs.update(load_file(str(dcp_dir / f)))
    assert set(ours) == set(theirs) == {f"model.{k}" for k in final}
    for k, v in ours.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, theirs[k]), k
        assert torch.equal(v, final[k[len("model."):]].to(torch.bfloat16)), k


def _seed(base: str, which: str) -> dict:
    """torchtitan's create_seed_checkpoint: one rank, save(curr_step=0, last_step=True)."""
    parts = Parts(seed=3)
    ck = config(which, interval=2).build(**parts.build_kwargs(base))
    ck.save(curr_step=0, last_step=True)
    ck.close()
    return parts.snapshot(data=False)


def test_seed_checkpoint_loads_model_only_at_2(ranks, tmp_path):
    """A seed checkpoint (step 0, written by one rank) loads model-only into the
    2-rank run, whose optimizer, scheduler and train state stay fresh."""
    for which in WHICH:
        base = str(tmp_path / which)
        seed = ranks(1).run(_seed, base, which, timeout=DEADLINE)[0]
        got = ranks(2).run(_resume, base, which, dict(interval=2), -1, False,
                           timeout=DEADLINE)
        for r in range(2):
            assert got[r]["loaded"] is True
            assert_same(seed["model"], got[r]["model"], which)
            assert got[r]["train_state"] == {"step": 0, "ntokens_seen": 0}
