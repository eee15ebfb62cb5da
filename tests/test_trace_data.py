import pytest

from foresight.trace_data import TraceDataError, load_traces


def test_load_traces_rejects_malformed(tmp_path):
    import datasets

    d = tmp_path / "bad"
    row = {"input_ids": [1, 2, 3], "prompt_len": 1, "token_loss": [0.0], "token_entropy": [0.0, 1, 2]}
    datasets.Dataset.from_list([row]).save_to_disk(str(d))
    with pytest.raises(TraceDataError, match="malformed"):
        load_traces(d)
    with pytest.raises(TraceDataError, match="not found"):
        load_traces(tmp_path / "missing")
