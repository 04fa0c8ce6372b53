"""An adversarial review of ``dckpt.integrations.deepspeed``: what a DeepSpeed user does
that test_deepspeed.py does not cover. Each test pins one behaviour; the scenarios run
in jobs/deepspeed_review_job.py (DS_ACCELERATOR=cpu, gloo, torchrun), grouped in one
2-rank launch and one 3-rank launch (the resize loads of the 2-rank saves)."""
from __future__ import annotations

import json
import os

import pytest

from .lightning_run import job_env, run_cmd, torchrun

pytest.importorskip("deepspeed")

JOB = os.path.join(os.path.dirname(__file__), "jobs", "deepspeed_review_job.py")
TWO = ["sgd_momentum", "regrouped", "trained_then_frozen", "other_shapes", "zero_size_param",
       "keep_last_other_checkpoints", "keep_last_spares_latest", "hostile_tags",
       "client_per_rank_z3", "trained_engine_no_step_tag", "newer_stock_tag", "backslash_tag",
       "damaged_meta", "rewind_clock_behind", "offload_optimizer", "adagrad",
       "two_groups_resize_save", "zero3_knobs", "model_only_tag"]
THREE = ["two_groups_resize_load", "zero3_knobs_load"]


def _launch(root, n: int, names: list[str]) -> dict[str, list[str]]:
    env = dict(job_env(), DS_ACCELERATOR="cpu")
    _, out = run_cmd(torchrun(JOB, n) + [str(root), *names], 600, env=env)
    got: dict[str, list[str]] = {}
    for ln in out.splitlines():
        if ln.startswith("CASE "):
            got.setdefault(ln.split()[1], []).append(ln)
    got["_out"] = [out[-3000:]]
    got["_n"] = [str(n)]
    return got


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsreview")
    two = _launch(root, 2, TWO)
    three = _launch(root, 3, THREE)
    return {"two": two, "three": three}


def _check(ran, name: str, launch: str = "two") -> None:
    got = ran[launch]
    lines = got.get(name, [])
    n = int(got["_n"][0])
    assert len(lines) == n, f"{name}: {lines}\n{got['_out'][0]}"
    bad = [ln for ln in lines if not ln.rstrip().endswith(" OK")]
    assert not bad, "\n".join(bad)


# -- defects -----------------------------------------------------------------------

def test_sgd_momentum_state_loads_back(ran):
    """A user trains with a client torch SGD(momentum=0.9) at ZeRO-2 or stage 0 and
    saves: the save succeeds, but every load of that tag dies with a RankFailure
    wrapping ``KeyError: 'momentum_buffer'`` (SGD's state has no ``step``, so the load
    drops the state it then fills). The momentum buffers should load back exactly."""
    _check(ran, "sgd_momentum")


def test_a_parameter_frozen_after_training_loads_its_saved_weights(ran):
    """A user saves with every parameter trained, then loads into the same model with a
    layer frozen (fine-tuning): the strict load refuses with "frozen parameter(s) not
    saved (saved with exclude_frozen_parameters=True?)" although the tag holds their
    masters, and load_module_strict=False leaves them at their initial values, silently.
    Stock loads them from the module state dict; the masters should be loaded into the
    frozen parameters (ZeRO-2 and ZeRO-3)."""
    _check(ran, "trained_then_frozen")


def test_same_names_same_numel_other_shape_is_refused(ran):
    """A user loads a tag into a model whose parameter ``w`` (trainable) and ``k``
    (frozen) have the same names and numels but transposed shapes: the load succeeds
    silently with scrambled weights (only numels are compared). Stock's
    load_state_dict refuses the size mismatch; a StateMismatchError naming them is due."""
    _check(ran, "other_shapes")


def test_a_zero_size_parameter_loads_across_stages(ran):
    """A model with a zero-size trainable parameter saved at ZeRO-2 (where DeepSpeed
    leaves it out of the optimizer) and loaded at stage 0 (where it is in the
    optimizer): StateMismatchError "were frozen when saved and are trained here" for a
    parameter with nothing to restore. It should load."""
    _check(ran, "zero_size_param")


def test_keep_last_never_removes_a_checkpoint_that_is_not_this_engines_tag(ran):
    """A user keeps a dckpt checkpoint of their own (``dckpt.save(..., save_dir/best)``)
    in the save_dir and saves with keep_last=2: the rotation deletes ``best`` (it takes
    every committed dckpt checkpoint in the folder as a tag). Lost data: only this
    engine's DeepSpeed tags should be rotated."""
    _check(ran, "keep_last_other_checkpoints")


def test_save_latest_false_snapshots_neither_evict_nor_replace_latest(ran):
    """global_step1 saved (latest names it), then two evaluation snapshots with
    save_latest=False under keep_last=2: the rotation deletes global_step1, the tag
    ``latest`` still names (a dangling latest for stock tools), and
    load_checkpoint(tag=None) resumes the evaluation snapshot instead of what latest
    names. save_latest=False should keep a tag out of the resume choice and the tag
    latest names should survive rotation."""
    _check(ran, "keep_last_spares_latest")


def test_per_rank_client_state_is_not_replaced_by_another_ranks(ran):
    """Each rank passes its own client_state tensor (its data position): after the load
    rank 0 gets rank 1's value, silently, at ZeRO-3 (stock: one model-states file per
    rank, each rank its own) and at ZeRO-2 (stock: rank 0's). Each rank should get its
    own (or at least rank 0's, as stock at stage 1/2), or the save should refuse values
    that differ between ranks."""
    _check(ran, "client_per_rank_z3")


def test_loading_a_tag_without_optimizer_state_relinks_deepspeeds_fragments(ran):
    """A user loads a tag saved before the first step into an engine that has trained
    (ZeRO-2), then trains one step: DeepSpeed's safe_get_full_optimizer_state still
    reads the optimizer-state tensors the load dropped (the lazy-link flag is left set),
    so it reports stale exp_avg/exp_avg_sq. The flag should be reset whenever the load
    replaces or clears the state."""
    _check(ran, "trained_engine_no_step_tag")


def test_tag_none_does_not_skip_a_newer_stock_tag_that_latest_names(ran):
    """dckpt tag global_step1, then a stock save global_step2 (latest names it): the
    load with tag=None resumes the older dckpt tag silently, losing a step of
    training. It should load what latest names (a stock tag at the same size goes to
    DeepSpeed's method) or refuse naming both."""
    _check(ran, "newer_stock_tag")


def test_a_tag_with_a_backslash_is_found_by_tag_none(ran):
    """A tag named ``run\\2`` (legal on POSIX) is saved after global_step1; latest
    names it, but load_checkpoint(tag=None) loads global_step1 (the tag pattern
    excludes backslashes, so the newest tag is invisible to the resume and to
    keep_last). Such a tag should be found, or refused at save."""
    _check(ran, "backslash_tag")


def test_a_tag_with_a_nul_byte_is_refused_clearly(ran):
    """save_checkpoint(tag="a\\x00b"): a RankFailure wrapping ``ValueError: embedded null
    byte``; the 300-character tag gives a clear error. A CheckpointError naming the tag
    as unusable is due (as for "/" or "..")."""
    _check(ran, "hostile_tags")


def test_export_of_a_malformed_deepspeed_record_is_not_a_raw_type_error():
    """``dckpt export`` of a tag whose deepspeed.meta record has a frozen entry or a
    shape that is a number (a hand-made or damaged manifest): names.weights raises a raw
    TypeError, which hf_export does not catch (it catches ValueError). It should
    return None (fall back to keys) or raise ValueError."""
    from dckpt.interop.deepspeed_names import weights

    class E:
        shape = (5,)

    for meta in ({"params": {}, "frozen": {"f": 5}, "buffers": []},
                 {"params": {"w": 5}, "frozen": {}, "buffers": []}):
        try:
            weights({"deepspeed.meta": json.dumps(meta)}, {"master.w": E(), "frozen.f": E()})
        except ValueError:
            pass


# -- what held up (kept: they pin behaviour a refactor could break) -------------------

def test_another_param_grouping_is_refused_not_mixed(ran):
    """Saved with one param group, loaded into two groups (another weight decay): a
    clear StateMismatchError, never the hyper-parameters zipped onto other groups."""
    _check(ran, "regrouped")


def test_a_hand_edited_meta_record_is_a_manifest_error(ran):
    """deepspeed.meta edited and re-sealed (a field missing or of another type): a
    ManifestError naming the field, never a raw KeyError/TypeError."""
    _check(ran, "damaged_meta")


def test_a_rewind_on_a_host_whose_clock_is_behind_resumes_the_new_branch(ran):
    """Load global_step1 of three, train on a host an hour behind, save global_step2
    again: tag=None loads the re-saved global_step2, exactly."""
    _check(ran, "rewind_clock_behind")


def test_cpu_offload_and_adagrad_round_trip(ran):
    """offload_optimizer to the CPU (torch Adam) at ZeRO-2/3, loaded with and without
    offload; a client Adagrad at stages 0-3."""
    _check(ran, "offload_optimizer")
    _check(ran, "adagrad")


def test_two_groups_and_zero3_sub_groups_load_at_three_ranks(ran):
    """Two param groups (weight decay on/off) and ZeRO-3 with several sub-groups per
    group and persistence threshold 0 / 10**6, saved at 2 ranks: loaded at 3 ranks into
    ZeRO-3 (other sub_group_size), ZeRO-2 and ZeRO-1, masters, hyper-parameters and
    per-group steps as saved."""
    _check(ran, "two_groups_resize_save")
    _check(ran, "zero3_knobs")
    _check(ran, "two_groups_resize_load", "three")
    _check(ran, "zero3_knobs_load", "three")


def test_a_weights_only_tag_loads_module_only_and_refuses_a_full_load(ran):
    """The Trainer's save_only_model under DeepSpeed commits the weights only: asked
    for the optimizer's state, the load refuses it by name (never loads the weights
    beside a stale optimizer); module-only, it loads exactly at another stage."""
    _check(ran, "model_only_tag")
