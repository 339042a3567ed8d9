"""Internals of :mod:`torchgraft.registry` (the Python route into the dispatcher)."""
