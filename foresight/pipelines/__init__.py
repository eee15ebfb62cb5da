"""Whole pipelines chained from the stages: ``make demo``."""
