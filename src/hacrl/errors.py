"""Errors that the CLI turns into one-line messages (kept import-light: no torch here)."""


class NonFiniteLossError(RuntimeError):
    """A loss or gradient norm was NaN/inf; the stage fails without writing a checkpoint."""
