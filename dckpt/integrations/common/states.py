"""A prepared model and an optimizer of it as dckpt Statefuls, FQN-keyed through
torch's distributed state_dict helpers (as :class:`dckpt.TrainingState`), so FSDP2,
FSDP1, DDP and plain modules save sharded and load at any world size and parallelism.
No I/O; ``state_dict()``/``load_state_dict()`` may run collectives (FSDP1).

Three things torch's helpers do that a drop-in must not, handled here:
- reading a fresh optimizer's state runs a zero-learning-rate ``step()`` to create it
  (Adam's step count becomes 1: every later bias correction is off by one), so a save
  before the first step would change what it saves; a save never initialises, and a
  load initialises only when the checkpoint holds state to load into it;
- an empty parameter group (the Trainer's no-decay group of a LoRA model) is dropped by
  the flattened form and breaks its load (an IndexError in torch); it is stored beside
  it (:data:`EMPTY_GROUPS`) and put back in place;
- an optimizer is keyed by one model's parameter names, so one over two models, or
  holding a parameter of no model, could not be saved: :func:`span` keys it by a
  container of every model (``m<i>.<fqn>``) and its loose parameters (``loose<k>``).
"""
from __future__ import annotations

import contextlib
import json
import threading
from typing import Any, Iterator

import torch

# the flattened optimizer state's entry holding the hyperparameters of its empty groups
EMPTY_GROUPS = "dckpt_empty_groups"
_patch_lock = threading.Lock()


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch's helpers without their optimizer initialisation step (a module global
    they look up at call time; patched under a lock, restored on exit)."""
    import torch.distributed.checkpoint.state_dict as sd

    with _patch_lock:
        real = sd._init_optim_state
        sd._init_optim_state = lambda optim: None
        try:
            yield
        finally:
            sd._init_optim_state = real


class ModelState:
    """``module``'s sharded state (torch's ``get_model_state_dict``: the live
    parameters, no copy) and ``set_model_state_dict``. ``strict=False``: missing and
    unexpected keys are the module's business (stock ``load_state_dict(strict=False)``).
    ``resize``: {key: saved shape} of buffers whose live shape differs (a load hands
    the module a tensor of the saved shape, as stock does: the module's own
    ``load_state_dict`` decides)."""

    def __init__(self, module: torch.nn.Module, strict: bool = True) -> None:
        self.module, self.strict = module, strict
        self.resize: dict[str, tuple[int, ...]] = {}

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self.module, options=_options(self.strict))
        for k, shape in self.resize.items():
            v = sd.get(k)
            if isinstance(v, torch.Tensor) and type(v) is torch.Tensor:
                sd[k] = torch.empty(shape, dtype=v.dtype, device=v.device)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, sd, options=_options(self.strict))

    def buffers_to_resize(self, saved: dict[str, tuple[int, ...]]) -> dict[str, tuple]:
        """{key: saved shape} of this module's plain (non-distributed) buffers whose
        live shape differs from ``saved`` ({key: shape} from a manifest). O(buffers)."""
        names = {n for n, _ in self.module.named_buffers()}
        out: dict[str, tuple] = {}
        if not names:
            return out
        for k, v in self.state_dict().items():
            # the shape test first: only a mismatched key pays for the buffer lookup
            if (k in saved and type(v) is torch.Tensor
                    and tuple(v.shape) != tuple(saved[k]) and _is_buffer(k, names)):
                out[k] = tuple(saved[k])
        return out


def _is_buffer(key: str, names: set[str]) -> bool:
    # a wrapper's prefix (DDP's "module.") is not in the helpers' keys
    return key in names or any(n.endswith("." + key) for n in names)


class OptimizerState:
    """``optimizer``'s state keyed by parameter name (flattened: independent of the
    parameter order) and ``set_optimizer_state_dict``, plus the hyperparameters of its
    empty groups. A save never initialises a fresh optimizer's state. As a load target,
    ``saved_has_state`` (set from the manifest before the load) says whether the
    checkpoint holds state: True, a fresh optimizer's state is initialised to receive
    it (torch's zero-lr step, then overwritten); False, the optimizer's state is
    cleared and nothing initialised (it was saved before its first step)."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        self.saved_has_state: bool | None = None
        # a load target: the checkpoint's "state.<fqn>.<name>" keys of this optimizer
        self.saved_state_keys: set[str] = set()

    def _stateless(self) -> list[tuple[torch.Tensor, str]]:
        """(parameter, name) of this optimizer's parameters the checkpoint holds no
        state for (one that never had a gradient: AdamW keeps nothing for it). A load
        leaves them without state, as stock's ``load_state_dict``. O(parameters)."""
        from torch.distributed.checkpoint.state_dict import _get_fqns

        # every dotted prefix of the saved "<fqn>.<name>" keys: a parameter has state
        # when its fqn is one (a set lookup each: linear in the keys' length)
        have: set[str] = set()
        for k in self.saved_state_keys:
            rest = k.split(".", 1)[1]
            i = rest.find(".")
            while i != -1:
                have.add(rest[:i])
                i = rest.find(".", i + 1)
        mine = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        out = []
        for name, p in self.module.named_parameters():
            if id(p) not in mine:
                continue
            fqns = _get_fqns(self.module, name)
            if not any(f in have for f in fqns):
                out.extend((p, f) for f in fqns)
        return out

    def _empty(self) -> list[int]:
        return [i for i, g in enumerate(self.optimizer.param_groups) if not g["params"]]

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        empty = self._empty()
        with _without_groups(self.optimizer, empty) as removed:
            if self.saved_has_state:
                sd = get_optimizer_state_dict(self.module, self.optimizer, options=_options())
                # a target: no state where the checkpoint holds none for a parameter
                gone = tuple(f"state.{f}." for _, f in self._stateless())
                if gone:
                    sd = {k: v for k, v in sd.items() if not k.startswith(gone)}
            else:
                with _no_init():
                    sd = get_optimizer_state_dict(self.module, self.optimizer,
                                                  options=_options())
                if self.saved_has_state is False:  # the target of a fresh optimizer's
                    sd = {k: v for k, v in sd.items() if not k.startswith("state.")}
        if removed:
            sd[EMPTY_GROUPS] = json.dumps([[i, _jsonable(g)] for i, g in removed])
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        sd = dict(sd)
        saved_empty = json.loads(sd.pop(EMPTY_GROUPS, "[]"))
        if self.saved_has_state is False:
            self.optimizer.state.clear()
        else:  # torch would fill a stateless parameter's live state names with {}
            for p, _ in self._stateless():
                self.optimizer.state.pop(p, None)
        with _without_groups(self.optimizer, self._empty()) as removed:
            if self.saved_has_state is False:
                with _no_init():
                    set_optimizer_state_dict(self.module, self.optimizer,
                                             optim_state_dict=sd, options=_options())
            else:
                set_optimizer_state_dict(self.module, self.optimizer,
                                         optim_state_dict=sd, options=_options())
        if self.saved_has_state is not None:  # torch's load leaves {} per parameter
            for p in [p for p, v in self.optimizer.state.items() if not v]:
                del self.optimizer.state[p]
        by_index = {int(i): h for i, h in saved_empty}
        for i, g in removed:  # back in place, with the saved hyperparameters
            for k, v in by_index.get(i, {}).items():
                if k in g and k != "params" and not isinstance(g[k], torch.Tensor):
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v


@contextlib.contextmanager
def _without_groups(optimizer: torch.optim.Optimizer,
                    indices: list[int]) -> Iterator[list[tuple[int, dict]]]:
    """The optimizer with its groups at ``indices`` taken out for the duration (torch's
    flattened form cannot carry an empty group), yielding [(index, group)]; put back
    at their places on exit, whatever happens."""
    groups = optimizer.param_groups
    removed = [(i, groups[i]) for i in indices]
    if removed:
        optimizer.param_groups = [g for i, g in enumerate(groups) if i not in set(indices)]
    try:
        yield removed
    finally:
        if removed:
            live = list(optimizer.param_groups)
            for i, g in removed:
                live.insert(i, g)
            optimizer.param_groups = live


def _jsonable(group: dict) -> dict:
    """A group's JSON-able hyperparameters (tensors and objects left out). Pure."""
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, (bool, int, float, str)) or v is None:
            out[k] = v
        elif isinstance(v, (tuple, list)) and all(isinstance(x, (int, float)) for x in v):
            out[k] = list(v)
    return out


class Span(torch.nn.Module):
    """The key space of an optimizer over several models or loose parameters: model
    i's parameters as ``m<i>.<fqn>``, a parameter of no model as ``loose<k>`` (k: its
    position among them in the optimizer's order). Holds references only."""

    def __init__(self, models: list[torch.nn.Module], loose: list[torch.nn.Parameter]) -> None:
        super().__init__()
        for i, m in enumerate(models):
            self.add_module(f"m{i}", m)
        for k, p in enumerate(loose):
            self.register_parameter(f"loose{k}", p)


def owner(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module],
          default: int | None) -> int | None:
    """The index of the model in ``models`` holding every parameter of ``optimizer``;
    -1 when they span several models or include one of no model (key it with
    :func:`span`); ``default`` when it has no parameter. O(parameters)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        return default
    ids = [{id(p) for p in m.parameters()} for m in models]
    for i, s in enumerate(ids):
        if all(id(p) in s for p in params):
            return i
    return -1


def span(optimizer: torch.optim.Optimizer, models: list[torch.nn.Module]) -> Span:
    """The :class:`Span` keying ``optimizer`` across ``models``. O(parameters)."""
    known = {id(p) for m in models for p in m.parameters()}
    loose, seen = [], set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in known and id(p) not in seen:
                seen.add(id(p))
                loose.append(p)
    return Span(models, loose)
