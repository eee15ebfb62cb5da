"""The real-model benchmark on SmolLM2-135M (``make realbench``)."""
