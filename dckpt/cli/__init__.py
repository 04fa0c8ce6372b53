"""The ``dckpt`` command (:func:`dckpt.cli.main.main`): ls, inspect, du, verify, gc,
export, import, history, diff. ``main`` parses and dispatches, ``show`` prints, ``diff``
is ``dckpt diff``, ``common`` holds what they share. The listing commands read JSON only
(no torch import)."""
