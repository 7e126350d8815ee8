"""Prefect task wrappers around the library's stages (thin: the work is in ``hacrl``)."""
