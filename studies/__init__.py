"""Studies behind the results under ``docs/results/`` (not part of the library)."""
