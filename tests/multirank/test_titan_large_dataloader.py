"""torchtitan's dataloader state over 1 MiB through DckptCheckpointManager, at 2 real
gloo ranks, beside torchtitan's own DCP CheckpointManager on the same scenario.

torchtitan's ``HuggingFaceTextDataset`` keeps the tokens of a document it has not
yielded yet in its buffers (inputs, labels, positions), and
``ParallelAwareDataloader.state_dict`` returns ``{"dp_rank_<r>": pickle.dumps(...),
"world_size": N}``: a long document makes that pickle megabytes, which dckpt refused
(1 MiB) and killed the job at its first checkpoint. Here the real dataset (over an
in-memory ``datasets.Dataset`` of one long document per rank, registered as a torchtitan
dataset, with a character tokenizer) is drawn once, so ~1.6 MB of pickled buffers are
in the state, then saved with the model, optimizer, schedulers and train state of
tests/titankit.py, restored into fresh components, and compared: the next batch the
restored dataloader yields must be the one the saved run would have drawn next."""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchtitan")
pytest.importorskip("datasets")

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
from titankit import Parts, assert_same  # noqa: E402

DEADLINE = 240
WHICH = ("dckpt", "dcp")
DATASET = "dckpt_long_document"
DOC_CHARS = 200_000  # per rank: its pickled buffers come to about 1.7 MB
VOCAB = 64  # titankit's TinyLlama vocabulary


def _tokenizer():
    from torchtitan.components.tokenizer import BaseTokenizer

    class Chars(BaseTokenizer):
        """One token per character, in the model's vocabulary."""

        def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]:
            ids = [ord(c) % (VOCAB - 2) + 2 for c in text]
            return [0] * add_bos + ids + [1] * add_eos

        def decode(self, ids: list[int]) -> str:
            return "".join(chr(i) for i in ids)

        def get_vocab_size(self) -> int:
            return VOCAB

    return Chars()


def _register() -> None:
    """One long document per dp rank, as a map-style ``datasets.Dataset`` (row r goes to
    dp rank r), registered the way torchtitan's docs/datasets.md says."""
    from datasets import Dataset
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def docs(_path: str) -> Dataset:
        return Dataset.from_dict({"text": [
            "".join(chr(97 + (7 * i + r) % 26) for i in range(DOC_CHARS)) for r in range(2)]})

    DATASETS[DATASET] = DatasetConfig(path="in-memory", loader=docs,
                                      sample_processor=lambda s: s["text"])


def _loader():
    """torchtitan's real text dataloader for this rank."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    _register()
    r, world = dist.get_rank(), dist.get_world_size()
    ds = HuggingFaceTextDataset(DATASET, None, _tokenizer(), seq_len=8, dp_rank=r,
                                dp_world_size=world, infinite=True)
    return ParallelAwareDataloader(ds, dp_rank=r, dp_world_size=world, batch_size=2)


def _manager(which: str, parts: Parts, loader, base: str):
    if which == "dckpt":
        from dckpt.integrations.torchtitan import DckptCheckpointManager as cls
    else:
        from torchtitan.components.checkpointer import CheckpointManager as cls
    kw = parts.build_kwargs(base) | {"dataloader": loader}
    return cls.Config(enable=True, interval=1, last_save_model_only=False).build(**kw)


def _batch(it) -> list[torch.Tensor]:
    inputs, labels = next(it)
    return [inputs["input"], inputs["positions"], labels]


def _train(base: str, which: str) -> dict:
    """One training step, the dataloader drawn once (its buffers hold most of the
    document), a save; then the batch the run draws next."""
    import pickle

    parts = Parts(seed=0)
    loader = _loader()
    ck = _manager(which, parts, loader, base)
    ck.load()
    it = iter(loader)
    _batch(it)
    parts.train_state.step = 1
    parts.train_step(ck)
    state = loader.state_dict()[f"dp_rank_{dist.get_rank()}"]
    buffered = len(pickle.loads(state)["dataset_state"]["inputs_buffer"])
    ck.save(1, last_step=True)
    ck.close()
    nxt = _batch(it)
    return parts.snapshot(data=False) | {"next": nxt, "pickled": len(state),
                                          "buffered": buffered, "head": _head(loader)}


def _head(loader) -> list[int]:
    """The first tokens the dataset holds, not yielded yet."""
    return list(loader.dataset._inputs_buffer[:4096])


def _resume(base: str, which: str) -> dict:
    parts = Parts(seed=1)
    loader = _loader()
    ck = _manager(which, parts, loader, base)
    loaded = ck.load()
    ck.close()
    nxt = _batch(iter(loader))
    return parts.snapshot(data=False) | {"next": nxt, "loaded": loaded, "head": _head(loader)}


@pytest.mark.parametrize("which", WHICH)
def test_a_megabyte_token_buffer_saves_and_restores(ranks, tmp_path, which):
    base = str(tmp_path / which)
    saved = ranks(2).run(_train, base, which, timeout=DEADLINE)
    back = ranks(2).run(_resume, base, which, timeout=DEADLINE)
    for r in range(2):
        assert saved[r]["pickled"] > 1.5e6, saved[r]["pickled"]  # over the old 1 MiB bound
        assert saved[r]["buffered"] > DOC_CHARS - 100  # most of the document
        assert back[r]["loaded"] is True
        # the same next batch, and the same tokens after it (a restored dataset reads
        # its next document before it yields: the buffer then grows past them)
        assert_same(saved[r]["next"], back[r]["next"], f"{which} rank {r} next batch")
        assert saved[r]["head"] == back[r]["head"], f"{which} rank {r} buffer"
        strip = ("next", "pickled", "loaded", "buffered", "head")
        assert_same({k: v for k, v in saved[r].items() if k not in strip},
                    {k: v for k, v in back[r].items() if k not in strip}, f"{which} rank {r}")
    if which == "dckpt":  # each rank's blob is in its own data file, not the manifest
        import dckpt

        folder = os.path.join(base, "checkpoint")
        (step,) = [d for d in os.listdir(folder) if d.startswith("step-")]
        with dckpt.open(os.path.join(folder, step)) as ck:
            m = ck.manifest
            keys = sorted(k for k in m.tensors if m.tensors[k].bytes_value)
            assert [k.rsplit(".", 1)[1] for k in keys] == ["dp_rank_0", "dp_rank_1"], keys
            for r, k in enumerate(keys):
                assert m.files[int(m.tensors[k].chunks.file[0])].rank == r
                assert type(ck[k]) is bytes and len(ck[k]) == saved[r]["pickled"]
        assert os.path.getsize(os.path.join(folder, step, "manifest.json")) < 1 << 20
