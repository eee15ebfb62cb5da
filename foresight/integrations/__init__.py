"""Use trained scorers in other tools: transformers' ``generate`` (:mod:`.hf`)."""
