"""dckpt's version: recorded in every manifest it writes (the format layer owns it, so
that writing a manifest needs nothing from the package's top level)."""
__version__ = "0.1.0"
