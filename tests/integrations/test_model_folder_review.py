"""Adversarial review of the model folder (side files, the Trainer's checkpoint-N as a
model folder, the many-process export). Each test pins a behaviour the review
found wrong, failing before its fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import dckpt  # noqa: E402

from .hf_helpers import fresh_accelerate_state, tiny_llama, training_args  # noqa: E402,F401

INDEX = "model.safetensors.index.json"


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dckpt", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def _ckpt(path, scale: float) -> dict:
    """A checkpoint with 4 model tensors (2 KiB each) in side files, values ``scale``."""
    st = {f"models.0.l{i}.weight": torch.full((16, 32), scale * (i + 1)) for i in range(4)}
    st["optim.x"] = torch.zeros(3)
    dckpt.save(st, str(path), side=dckpt.SideFile("models.0."))
    return {k[len("models.0."):]: v for k, v in st.items() if k.startswith("models.0.")}


def _folder(out) -> dict:
    """What a reader of the model folder ``out`` gets: every tensor its index names."""
    from safetensors.torch import load_file

    idx = json.loads((out / INDEX).read_text())["weight_map"]
    got = {}
    for f in set(idx.values()):
        got.update(load_file(str(out / f)))
    return {k: got[k] for k in idx}


def test_share_export_never_indexes_another_checkpoints_files(tmp_path):
    """An out dir holding an earlier export of step A (same shapes, the same plan):
    rank 0 of a new export of step B must not write an index while rank 1's file is
    still A's (rank 1 died, or has not written yet): no index, or B's weights."""
    from dckpt.errors import CheckpointError
    from dckpt.interop.hf_export_ranks import export_share

    _ckpt(tmp_path / "A", 1.0)
    want = _ckpt(tmp_path / "B", 2.0)
    out = tmp_path / "out"
    for r in (1, 0):  # a complete export of A (rank 1 first: rank 0 waits)
        export_share(str(tmp_path / "A"), str(out), r, 2, prefix="models.0.",
                     max_shard_size="3KB")
    (out / INDEX).unlink()  # as --overwrite / a fresh target would have it
    try:
        export_share(str(tmp_path / "B"), str(out), 0, 2, prefix="models.0.",
                     max_shard_size="3KB", wait_s=2)  # rank 1 never comes
    except CheckpointError:
        pass  # refusing is fine
    if (out / INDEX).exists():
        got = _folder(out)
        assert all(torch.equal(got[k], v) for k, v in want.items()), \
            "the index publishes A's weights as B's"


def test_ranks_export_overwrite_removes_an_earlier_exports_shards(tmp_path):
    _ckpt(tmp_path / "A", 1.0)
    out = tmp_path / "out"
    for size in ("3KB", "5KB"):  # 4 files, then 2
        r = _cli("export", str(tmp_path / "A"), str(out), "--prefix", "models.0.", "--ranks",
                 "2", "--max-shard-size", size, "--overwrite")
        assert r.returncode == 0, r.stderr
    idx = json.loads((out / INDEX).read_text())["weight_map"]
    weights = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert weights == sorted(set(idx.values())), weights


def test_torchrun_export_refuses_a_non_empty_out_dir_without_overwrite(tmp_path):
    _ckpt(tmp_path / "A", 1.0)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    env = dict(os.environ, TORCHELASTIC_RUN_ID="review", RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0")
    r = _cli("export", str(tmp_path / "A"), str(out), "--prefix", "models.0.", env=env)
    assert r.returncode != 0 and "not empty" in r.stderr, (r.returncode, os.listdir(out))


def _trainer(out, model, data, **kw):
    from dckpt.integrations.transformers import DckptTrainer

    dk = {k: kw.pop(k) for k in ("model_folder", "async_save", "compression") if k in kw}
    return DckptTrainer(model=model, args=training_args(out, **kw), train_dataset=data, **dk)


def test_resaved_checkpoint_has_no_index_naming_missing_files(tmp_path):
    """checkpoint-4 saved with the model folder, then the run rewound to checkpoint-2
    and trained to step 4 again with model_folder=False: the new checkpoint-4 must not
    carry an index of files that are gone (from_pretrained: 'no weights', not a
    dangling index; the docs' switch writes config and tokenizer only)."""
    from dckpt.integrations.common.modelfolder import check_loadable

    model, data = tiny_llama()
    _trainer(tmp_path, model, data, max_steps=4).train()
    model, data = tiny_llama()
    _trainer(tmp_path, model, data, max_steps=4, model_folder=False).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    ck = tmp_path / "checkpoint-4"
    problems = check_loadable(str(ck))
    assert not any("missing" in p for p in problems), (problems, sorted(os.listdir(ck)))


def test_moe_checkpoint_folder_has_the_names_stock_writes(tmp_path):
    from safetensors import safe_open
    from transformers import MixtralConfig, MixtralForCausalLM, Trainer

    cfg = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                        max_position_embeddings=32, num_local_experts=2,
                        num_experts_per_tok=1)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": i, "labels": i} for i in torch.randint(0, 64, (8, 8), generator=g)]
    torch.manual_seed(0)
    Trainer(model=MixtralForCausalLM(cfg), args=training_args(tmp_path / "stock", max_steps=2),
            train_dataset=data).train()
    with safe_open(str(tmp_path / "stock" / "checkpoint-2" / "model.safetensors"), "pt") as f:
        stock = sorted(f.keys())
    torch.manual_seed(0)
    _trainer(tmp_path / "dckpt", MixtralForCausalLM(cfg), data, max_steps=2).train()
    ck = tmp_path / "dckpt" / "checkpoint-2"
    if (ck / INDEX).exists():
        names = sorted(json.loads((ck / INDEX).read_text())["weight_map"])
    else:  # a model with weight conversions: stock's plain copy (documented)
        with safe_open(str(ck / "model.safetensors"), "pt") as f:
            names = sorted(f.keys())
    assert names == stock


def test_ranks_export_fails_promptly_when_a_worker_fails(tmp_path):
    import struct

    _ckpt(tmp_path / "A", 1.0)
    ck = tmp_path / "A"
    side = next(n for n in os.listdir(ck) if n.startswith("model-"))
    raw = bytearray((ck / side).read_bytes())
    (hlen,) = struct.unpack_from("<Q", raw, 0)
    head = json.loads(raw[8:8 + hlen])
    start = 8 + hlen + head["l1.weight"]["data_offsets"][0]  # worker 1's share (l1, l3)
    raw[start + 5] ^= 0xFF
    (ck / side).write_bytes(bytes(raw))
    out = tmp_path / "out"
    import signal

    env = dict(os.environ)
    env.pop("DCKPT_EXPORT_WAIT_S", None)
    proc = subprocess.Popen([sys.executable, "-m", "dckpt", "export", str(ck), str(out),
                             "--prefix", "models.0.", "--ranks", "2", "--max-shard-size",
                             "3KB"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        text = None
    finally:  # the command and its pool's workers
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.communicate()
    assert text is not None, "dckpt export --ranks 2 still running 60 s after worker 1 failed"
    assert proc.returncode != 0 and "checksum mismatch" in text, text[-2000:]
