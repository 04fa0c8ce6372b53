"""Renamed loads: map the keys of a load's target to the keys of the checkpoint.

Pure (no torch, no I/O, no collective). A *rename* is given by the user as

- ``None``: keys are used as they are;
- a callable ``str -> str``: called with every target key (the flattened, dotted key
  as ``dckpt inspect`` shows it) and returning the checkpoint key to read it from;
- a dict ``{target prefix: checkpoint prefix}``: a target key that starts with a
  prefix has it replaced; the longest matching prefix wins; a key that matches none is
  used as it is. ``{"module.": ""}`` loads a checkpoint saved from plain module keys
  into a DDP-style state_dict ("module.fc.weight" reads "fc.weight"); ``{"": "module."}``
  the reverse ("fc.weight" reads "module.fc.weight"). Prefixes are plain strings: end
  them with "." to match whole key parts.

Direction is always target -> checkpoint, so that the target's every key has exactly
one source. Two target keys mapped to one checkpoint key are refused
(:func:`map_keys`): one of them would silently get the other's value.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Union

from ..errors import StateMismatchError

Rename = Union[None, Callable[[str], str], Mapping[str, str]]
KeyMap = Callable[[str], str]


def resolve(rename: Rename) -> KeyMap | None:
    """The key function of ``rename`` (None for no renaming: None or an empty dict).
    O(prefixes log prefixes) for a dict. Raises StateMismatchError for a dict with a
    non-str prefix, or anything else that is neither a dict nor a callable."""
    if rename is None:
        return None
    if isinstance(rename, Mapping):
        bad = [(k, v) for k, v in rename.items() if type(k) is not str or type(v) is not str]
        if bad:
            raise StateMismatchError(f"rename: prefixes must map str to str, not {bad[0]!r}")
        if not rename:
            return None
        table = dict(rename)
        # longest first: the first match is the longest one
        order = sorted(table, key=len, reverse=True)

        def by_prefix(key: str) -> str:
            for p in order:
                if key.startswith(p):
                    return table[p] + key[len(p):]
            return key

        return by_prefix
    if callable(rename):
        return rename
    raise StateMismatchError(f"rename must be a dict of prefix -> prefix or a callable "
                             f"str -> str, not a {type(rename).__name__}")


def nested(prefix: str, rename: Rename) -> KeyMap | None:
    """``rename`` applied under ``prefix`` only: a key ``prefix + k`` maps to
    ``prefix + rename(k)``; keys outside ``prefix`` stay. The manager's target is
    ``{"state": state}``: the user renames the keys as they see them in their state,
    and the manager's own "rng."/"manager." keys are never renamed. Pure."""
    fn = resolve(rename)
    if fn is None:
        return None

    def inner(key: str) -> str:
        if not key.startswith(prefix):
            return key
        return prefix + _call(fn, key[len(prefix):])

    return inner


def _call(fn: KeyMap, key: str) -> str:
    try:
        out = fn(key)
    except Exception as e:
        raise StateMismatchError(f"rename of key {key!r} failed: {type(e).__name__}: {e}") from e
    if type(out) is not str:
        raise StateMismatchError(f"rename of key {key!r} returned a {type(out).__name__} "
                                 f"({out!r}), not a str")
    return out


def map_keys(keys: Iterable[str], fn: KeyMap | None) -> dict[str, str]:
    """{target key: checkpoint key} for every key of ``keys``, through ``fn`` (the
    identity for None). O(keys) calls of ``fn``. Raises StateMismatchError (a
    CheckpointError) naming the key when ``fn`` fails or returns a non-str, and naming
    both target keys and the checkpoint key when two keys map to one."""
    if fn is None:
        return {k: k for k in keys}
    out: dict[str, str] = {}
    seen: dict[str, str] = {}
    for k in keys:
        ck = _call(fn, k)
        first = seen.setdefault(ck, k)
        if first != k:
            raise StateMismatchError(
                f"rename maps two keys of the state_dict, {first!r} and {k!r}, to the one "
                f"checkpoint key {ck!r}: each key must have its own source")
        out[k] = ck
    return out
