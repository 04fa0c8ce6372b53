"""Drop-in APIs of other checkpoint libraries on top of dckpt: :mod:`dckpt.compat.dcp`."""
