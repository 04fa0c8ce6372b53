"""Finding, checking and collecting checkpoints from outside a job: ``listing`` (ls,
inspect, du), ``local`` (a fast tier's directories seen from outside), ``verify``,
``gc`` and the ``retention`` rule. No process group; the listing reads JSON only."""
