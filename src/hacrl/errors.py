"""Errors that the CLI turns into one-line messages (kept import-light: no torch here)."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm was NaN/inf; the stage fails without writing a checkpoint."""


class UnsafeStateError(RuntimeError):
    """A recovery-state file holds more than tensors, numbers and arrays: it is not unpickled."""
