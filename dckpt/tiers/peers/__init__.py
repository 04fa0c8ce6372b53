"""Peer replicas of the fast tier (``replicas=r``): a lost node restored from its
peers' memory. ``plan`` (pure: ring, holder tables, schedules), ``xfer``/``ranges`` (a
file or byte ranges point to point, verified as they arrive: ``streamcheck``),
``part`` (what a node holds), ``replication`` (the background copies) and
``restore``. See docs/TIERS.md, Replicas."""
