"""The package's version, in a module that imports nothing: the runtime and the backends put it in
cache keys and package metadata without importing ``attncomp`` itself (whose ``__init__`` imports
the op and the layers above them)."""

__version__ = "0.1.0"
