"""The manager wing: :class:`CheckpointManager` (``core``: when to save, what to keep,
a restore that heals itself), its restore and retention halves, the save policies,
the failure history behind ``every_steps="auto"`` and the save history (``dckpt
history``). Above the tiers, the catalog and the protocol; below the CLI."""
