"""Storage tiers: a node-local fast tier staged in the background to a durable one.

* :mod:`.local`: the local tier writer (the commit protocol, rooted per node);
* :mod:`.stager`: the background copy to the durable root, a second two-phase commit;
* :mod:`.chooser`: the collective choice of the newest step every rank holds locally.

:class:`dckpt.CheckpointManager` wires them (``local_root=...``); see docs/TIERS.md.
"""
