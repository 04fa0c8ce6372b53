"""DeepSpeed ZeRO engines (CPU, gloo, torchrun) saving and loading through
``dckpt.integrations.deepspeed``, next to DeepSpeed's own methods in the same jobs: the
same-size round trip of every stage, loads at another world size and ZeRO stage (stock
refuses them), kills at every phase of a save. The job: jobs/deepspeed_job.py."""
from __future__ import annotations

import os

import pytest

from .lightning_run import job_env, run_cmd, torchrun

pytest.importorskip("deepspeed")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "deepspeed_job.py")
CASES = ["z0-fp32", "z1-fp32", "z2-fp32-frozen-tied", "z3-fp32-frozen", "z2-bf16",
         "z3-bf16-tied", "z1-bf16acc"]


def launch(mode: str, root, n: int, *specs: str, complete: bool = True,
           timeout: float = 300) -> dict[str, list[str]]:
    """Run the job; returns spec -> its CASE lines (one per rank when ``complete``)."""
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    _, out = run_cmd(torchrun(JOB, n) + [mode, str(root), *specs], timeout, env=env)
    lines: dict[str, list[str]] = {}
    for ln in out.splitlines():
        if ln.startswith("CASE "):
            lines.setdefault(ln.split()[1], []).append(ln)
    for s in specs if complete else ():
        assert len(lines.get(s, [])) == n, f"{s}: {lines.get(s)}\n{out[-4000:]}"
    return lines


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Every case trained 3 steps at 2 ranks and saved by dckpt and by DeepSpeed."""
    root = tmp_path_factory.mktemp("ds")
    got = launch("save", root, 2, *CASES)
    for c in CASES:
        assert all(" OK " in ln for ln in got[c]), got[c]
    return root


def _ok(lines: list[str], losses: bool) -> None:
    for ln in lines:
        assert " OK " in ln, ln
        if losses:
            assert "losses_equal=True" in ln, ln


def test_every_zero_stage_resumes_exactly_at_the_same_size_as_stock_does(saved):
    """Stages 0-3, fp32 and bf16, BF16_Optimizer, frozen and tied parameters: after the
    load every parameter's full fp32 master, exp_avg and exp_avg_sq are bitwise those
    saved, the step counts, counters, scheduler, client_state and RNG too, and the next
    three losses are bit for bit the uninterrupted run's; DeepSpeed's own save/load of
    the same engine resumes the same losses (the reference)."""
    specs = [f"{c}:{c}" for c in CASES]
    for spec, lines in launch("load", saved, 2, *specs).items():
        _ok(lines, losses=True)
    for spec, lines in launch("stock", saved, 2, "z2-bf16:z2-bf16", "z3-fp32-frozen:z3-fp32-frozen").items():
        _ok(lines, losses=True)


def test_a_checkpoint_loads_at_three_ranks_and_another_stage_where_stock_refuses(saved):
    """Saved at 2 ranks, loaded at 3: the same stage and across stages (2 -> 3, 3 -> 2,
    0 -> 2, 1 -> 2, bf16 ZeRO-2 -> ZeRO-3, BF16_Optimizer), every full value bitwise equal; the
    premise: DeepSpeed's own load refuses the resize."""
    got = launch("stock", saved, 3, "z2-bf16:z2-bf16")
    assert all("ZeRORuntimeException" in ln and "DP world size of 2" in ln
               for ln in got["z2-bf16:z2-bf16"]), got
    specs = ["z1-fp32:z1-fp32", "z2-bf16:z3-bf16", "z2-fp32-frozen-tied:z3-fp32-frozen-tied",
             "z3-fp32-frozen:z2-fp32-frozen", "z0-fp32:z2-fp32", "z1-bf16acc:z1-bf16acc",
             "z1-fp32:z2-fp32"]
    for spec, lines in launch("load", saved, 3, *specs).items():
        _ok(lines, losses=False)


def test_a_checkpoint_loads_at_one_rank_across_stages(saved):
    """Saved at 2 ranks, loaded by one process: ZeRO-3 -> ZeRO-1, ZeRO-3 bf16 -> ZeRO-2,
    ZeRO-1 -> stage 0 (the torch optimizer itself)."""
    specs = ["z3-fp32-frozen:z1-fp32-frozen", "z3-bf16-tied:z2-bf16-tied", "z1-fp32:z0-fp32"]
    for spec, lines in launch("load", saved, 1, *specs).items():
        _ok(lines, losses=True)


@pytest.mark.parametrize("fault,want", [
    ("write:1:kill", 3), ("vote:0:kill", 3), ("commit:0:kill", 3), ("committed:0:kill", 3),
    ("place:0:kill", 3), ("latest:0:kill", 5), ("write:0:kill@async", 3),
    ("place:0:kill@async", 3), ("latest:0:kill@async", 5)])
def test_a_save_killed_at_any_phase_resumes_the_newest_complete_tag(tmp_path, fault, want):
    """global_step3 saved, global_step5's save SIGKILLed at a phase (sync and async):
    ``load_checkpoint(tag=None)`` loads global_step5 only once it was placed (a kill
    before ``latest`` is written: ``latest`` still names global_step3, the newest
    committed tag wins), else global_step3, each exactly; never a partial tag."""
    got = launch("crash", tmp_path, 2, fault, complete=False)
    assert not any(" OK survived" in ln for ln in got.get(fault, [])), got  # the kill happened
    res = launch("resume", tmp_path, 2, "resume")["resume"]
    for ln in res:
        assert " OK " in ln and f"at={want}" in ln and f"path=global_step{want}" in ln, ln


MISC = os.path.join(os.path.dirname(__file__), "jobs", "deepspeed_misc_job.py")
SCENARIOS = {
    "async_values": "an asynchronous save stores the values at the call (training goes on; "
                    "engine.destroy() waits for it)",
    "keep_last": "keep_last=2 keeps the two newest tags, latest names the newest",
    "damaged": "tag=None skips a damaged newest tag (the one before loads exactly); the "
               "damaged tag named raises IntegrityError",
    "other_model": "another model's checkpoint: StateMismatchError naming the parameter",
    "excluded": "exclude_frozen_parameters=True: a strict load names the frozen parameters "
                "and the fix, load_module_strict=False loads",
    "client_value": "a client_state value dckpt cannot store: CheckpointError naming the "
                    "key on every rank, no tag placed",
    "refusals": "custom_load_fn, a tag that differs between ranks, a second attach",
    "round_robin": "round_robin_gradients refused at attach",
    "module_only": "load_module_only / load_optimizer_states=False as DeepSpeed's",
    "stock_tag": "a stock DeepSpeed tag at its own size loads through DeepSpeed's method",
    "none_saved": "nothing saved: (None, None) as stock",
    "fast_tier": "local_root: committed on the fast tier, copied behind (latest once "
                 "copied, keep_last over both); loads from the fast tier, from the durable "
                 "copy when the fast tier is lost, from the fast tier when the copy is",
    "export_llama": "a ZeRO-3 tiny Llama's tag exported by dckpt.export loads with "
                    "from_pretrained, every weight equal, tied weights tied",
}


def test_options_and_bad_inputs_behave_as_documented(tmp_path):
    """Each scenario of jobs/deepspeed_misc_job.py (one launch, 2 ranks): see SCENARIOS."""
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    _, out = run_cmd(torchrun(MISC, 2) + [str(tmp_path), *SCENARIOS], 300, env=env)
    for name, what in SCENARIOS.items():
        lines = [ln for ln in out.splitlines() if ln.startswith(f"CASE {name} ")]
        assert len(lines) == 2 and all(ln.endswith(" OK") for ln in lines), \
            f"{name} ({what}): {lines}\n{out[-3000:]}"
