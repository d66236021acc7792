"""meshjobs: a fault-tolerant, Raft-replicated job service (meshd, meshctl, HTTP)."""

import functools

# The version of this source tree; pyproject.toml's version is the same (tests/test_version.py).
__version__ = "0.1.0"


@functools.cache
def version() -> str:
    """The installed package's version (what `meshd --version`, `meshctl --version` and the
    member hello say); `__version__` when meshjobs runs from a source tree not installed."""
    from importlib import metadata

    try:
        return metadata.version("meshjobs")
    except metadata.PackageNotFoundError:
        return __version__
