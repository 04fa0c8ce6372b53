"""Stock DeepSpeed ZeRO-1/2/3 tags (saved by DeepSpeed itself at 2 ranks, CPU, gloo)
imported into dckpt DeepSpeed tags by ``dckpt.integrations.deepspeed.stock.import_tag``
(and ``dckpt import``), then loaded through the adapter at 3 ranks and at 1. The job:
jobs/deepspeed_import_job.py (engines from jobs/deepspeed_job.py)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import dckpt
from dckpt.errors import CheckpointError, UnsupportedValueError

from .lightning_run import job_env, run_cmd, torchrun

pytest.importorskip("deepspeed")

from dckpt.integrations.deepspeed.stock import import_tag  # noqa: E402

JOB = os.path.join(os.path.dirname(__file__), "jobs", "deepspeed_import_job.py")
LOADED = ["z3-fp32-frozen", "z2-bf16", "z1-fp32"]
CASES = LOADED + ["z2-fp32-frozen-tied", "z1-bf16acc"]  # these two: compared in-process only
TAG = "global_step3"


def launch(mode: str, root, n: int, *specs: str) -> dict[str, list[str]]:
    """Run the job; returns spec -> its CASE lines (one per rank)."""
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    _, out = run_cmd(torchrun(JOB, n) + [mode, str(root), *specs], 300, env=env)
    lines: dict[str, list[str]] = {}
    for ln in out.splitlines():
        if ln.startswith("CASE "):
            lines.setdefault(ln.split()[1], []).append(ln)
    for s in specs:
        assert len(lines.get(s, [])) == n, f"{s}: {lines.get(s)}\n{out[-4000:]}"
    return lines


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Every case trained 3 steps at 2 ranks, saved by dckpt's adapter (ROOT/CASE/dckpt)
    and by DeepSpeed (ROOT/CASE/stock), the stock tag imported into ROOT/CASE/imported:
    z1-fp32 through the CLI's auto-detection, z2-bf16 through the CLI's --format
    deepspeed, the others through import_tag."""
    root = tmp_path_factory.mktemp("dsi")
    got = launch("save", root, 2, *CASES)
    for c in CASES:
        assert all(" OK " in ln for ln in got[c]), got[c]
    for c in CASES:
        src, dst = root / c / "stock" / TAG, root / c / "imported" / TAG
        if c == "z1-fp32":
            p = subprocess.run([sys.executable, "-m", "dckpt", "import", str(src), str(dst)],
                               capture_output=True, text=True, timeout=120, env=job_env())
            assert p.returncode == 0 and "imported" in p.stdout, p.stdout + p.stderr
        elif c == "z2-bf16":
            p = subprocess.run([sys.executable, "-m", "dckpt", "import", str(src), str(dst),
                                "--format", "deepspeed"],
                               capture_output=True, text=True, timeout=120, env=job_env())
            assert p.returncode == 0 and "imported" in p.stdout, p.stdout + p.stderr
        else:
            info = import_tag(str(src), str(dst))
            assert info.world_size == 1 and info.path.endswith(TAG)
    return root


def _manifest(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("case", CASES)
def test_the_import_writes_what_the_adapter_writes_for_the_same_engine(imported, case):
    """ZeRO-1/2/3, fp32/bf16, BF16_Optimizer, frozen and tied parameters: the imported
    tag has exactly the keys of the adapter's own save of the same engine at the same
    step (but its per-rank RNG states, which stock tags do not hold), the same
    ``deepspeed.meta`` record (shapes, groups, steps, counters, loss scaler, aliases,
    stored frozen parameters...), the same hyper-parameter, scheduler and client_state
    entries, and every tensor (full fp32 masters, exp_avg, exp_avg_sq, frozen
    parameters, buffers) bitwise equal."""
    mine, theirs = imported / case / "imported" / TAG, imported / case / "dckpt" / TAG
    a, b = _manifest(mine), _manifest(theirs)
    # but the RNG, and the client_state of ranks > 0 (a stock ZeRO-1/2 tag holds rank
    # 0's only: the import stores that one, which every rank loads, as stock)
    keys_b = {k for k in [*b["tensors"], *b["values"]] if not k.startswith("rng.")
              and not (k.startswith("client.rank") and not k.startswith("client.rank0."))}
    assert {*a["tensors"], *a["values"]} == keys_b
    assert json.loads(a["values"]["deepspeed.meta"]) == json.loads(b["values"]["deepspeed.meta"])
    for k in ("hyper.doc", "scheduler.doc", "client.rank0.doc"):
        assert a["values"][k] == b["values"][k], k
    ca, cb = dckpt.open(str(mine)), dckpt.open(str(theirs))
    for k in a["tensors"]:
        x, y = ca[k], cb[k]
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k


def _ok(lines: list[str], losses: bool) -> None:
    for ln in lines:
        assert " OK " in ln, ln
        if losses:
            assert "losses_equal=True" in ln, ln


def test_imported_stock_tags_load_at_three_ranks_and_across_stages(imported):
    """Saved by stock DeepSpeed at 2 ranks, imported, loaded by the adapter at 3 ranks
    (stock refuses that resize): every full fp32 master, exp_avg and exp_avg_sq
    bitwise the saved ones, the step counts, counters (global_steps, global_samples,
    skipped_steps), scheduler and client_state too; ZeRO-3 -> ZeRO-2 with the import
    run inside the 3-rank job by rank 0 (its process group up: a private one-rank
    group). fp32 continues with the uninterrupted run's losses."""
    specs = ["z3-fp32-frozen:z3-fp32-frozen", "z2-bf16:z2-bf16", "z1-fp32:z1-fp32",
             "z3-fp32-frozen:z2-fp32-frozen@job"]
    for spec, lines in launch("load", imported, 3, *specs).items():
        _ok(lines, losses="fp32" in spec)


def test_imported_stock_tags_load_at_one_rank_across_stages(imported):
    """The same at one process: ZeRO-3 -> ZeRO-1, bf16 ZeRO-2 -> ZeRO-2, ZeRO-1 ->
    ZeRO-3; the next three losses bit for bit the uninterrupted run's."""
    specs = ["z3-fp32-frozen:z1-fp32-frozen", "z2-bf16:z2-bf16", "z1-fp32:z3-fp32"]
    for spec, lines in launch("load", imported, 1, *specs).items():
        _ok(lines, losses=True)


def _copy(imported, case, tmp_path):
    src = tmp_path / case
    shutil.copytree(imported / case / "stock" / TAG, src)
    return src


def test_a_pickle_referencing_another_global_is_refused_and_runs_nothing(imported, tmp_path):
    """A rank file replaced by a hand-made pickle that calls ``os.system`` when
    unpickled: CheckpointError naming the file and the global; the command never ran,
    nothing was committed. Same for the model-states file."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for case, name in (("z1-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                       ("z3-fp32-frozen", "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        src = _copy(imported, case, tmp_path)
        torch.save({"optimizer_state_dict": Evil(), "module": Evil()}, src / name)
        with pytest.raises(CheckpointError) as e:
            import_tag(str(src), str(tmp_path / "out" / case))
        assert str(src / name) in str(e.value) and "system" in str(e.value), e.value
        assert not marker.exists()
        assert not (tmp_path / "out" / case / "manifest.json").exists()


@pytest.mark.parametrize("case,name", [
    ("z1-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z2-bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("z3-fp32-frozen", "zero_pp_rank_1_mp_rank_00_model_states.pt")])
def test_a_missing_rank_file_is_named(imported, tmp_path, case, name):
    src = _copy(imported, case, tmp_path)
    os.remove(src / name)
    with pytest.raises(CheckpointError, match="missing") as e:
        import_tag(str(src), str(tmp_path / "out"))
    assert str(src / name) in str(e.value), e.value


def _edit_model_states(src, edit) -> None:
    path = src / "mp_rank_00_model_states.pt"
    d = torch.load(path, weights_only=True)  # ZeRO-1/2 model states hold no DeepSpeed class
    edit(d)
    torch.save(d, path)


@pytest.mark.parametrize("edit,err,words", [
    (lambda d: d.update(bad={1, 2}), UnsupportedValueError, ["client_state['bad']", "set"]),
    (lambda d: d["ds_config"]["zero_optimization"].update(round_robin_gradients=True),
     CheckpointError, ["round_robin_gradients"]),
    (lambda d: d.update(mp_world_size=2), CheckpointError, ["model parallelism"]),
    (lambda d: d.update(dp_world_size=3), CheckpointError,
     ["zero_pp_rank_2_mp_rank_00_optim_states.pt", "missing"]),
], ids=["client-value", "round-robin", "model-parallel", "more-ranks"])
def test_what_cannot_be_mapped_exactly_is_refused_naming_it(imported, tmp_path, edit, err, words):
    """A client_state value dckpt cannot store (the key named), round-robin gradients,
    model parallelism, a tag whose files do not cover its world size: refused, nothing
    committed."""
    src = _copy(imported, "z1-fp32", tmp_path)
    _edit_model_states(src, edit)
    with pytest.raises(err) as e:
        import_tag(str(src), str(tmp_path / "out"))
    for w in words:
        assert w in str(e.value), e.value
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_files_over_the_size_bound_and_model_parallel_files_are_refused(imported, tmp_path):
    src = _copy(imported, "z2-bf16", tmp_path)
    with pytest.raises(CheckpointError, match="bound") as e:
        import_tag(str(src), str(tmp_path / "out"), max_file_size=1000)
    assert "mp_rank_00_model_states.pt" in str(e.value)
    shutil.copy(src / "mp_rank_00_model_states.pt", src / "mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointError, match="model-parallel") as e:
        import_tag(str(src), str(tmp_path / "out"))
    assert "mp_rank_01_model_states.pt" in str(e.value)


def test_import_checkpoint_points_a_deepspeed_tag_to_its_importer(imported, tmp_path):
    """``dckpt.import_checkpoint`` (the core's importer, below the adapters) does not read
    DeepSpeed's pickles: a stock tag gets a CheckpointError naming the tag and the way
    (``dckpt import`` or import_tag), nothing is written."""
    src = imported / "z1-fp32" / "stock" / TAG
    with pytest.raises(CheckpointError, match="DeepSpeed tag.*dckpt import"):
        dckpt.import_checkpoint(str(src), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()
