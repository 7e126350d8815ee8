"""Errors that the CLI turns into one-line messages (kept import-light: no torch here).

The ground of the package: every layer raises these, the CLI and the orchestration catch them,
so they live below all of them.
"""


class ConfigError(ValueError):
    """A configuration value is invalid; the message is one line naming key and value."""


class DataError(ValueError):
    """A malformed dataset row or artifact; the message names the file (and line)."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm was NaN/inf; the stage fails without writing a checkpoint."""


class UnsafeStateError(RuntimeError):
    """A recovery-state file holds more than tensors, numbers and arrays: it is not unpickled."""


class StorageFull(OSError):
    """The disk (or the file-size limit) ran out while an artifact was written; nothing was
    renamed into place. Exit 4: retrying into the same full disk cannot help."""
