"""Framework integrations: each module imports its framework, so importing
:mod:`dckpt` (or this package) never does; import the module you need, e.g.
``dckpt.integrations.torchtitan`` (``pip install "dckpt[torchtitan]"``)."""
