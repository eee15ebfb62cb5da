"""Evaluation: methods, the harness (``foresight eval``), metrics, reports, plots, paired comparison and the
whole-heads / layer-budgets search (``foresight heads``)."""
