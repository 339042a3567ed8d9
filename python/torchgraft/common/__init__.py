"""Helpers that the grafts (:mod:`torchgraft.grafts`) and torchgraft's own operators
(:mod:`torchgraft.ops`) share; they import neither."""
