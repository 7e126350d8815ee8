"""Prefect flows: ``hacrl/iterate`` (one RL iteration per run) and ``hacrl-stage/gpu``."""
