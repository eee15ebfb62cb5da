"""Data: prompts and answer checks, traces (the data stage), the OpenAI-compatible client, references."""
