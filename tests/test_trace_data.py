import pytest

from foresight.data.trace_data import TraceDataError, load_traces


def test_load_traces_rejects_malformed(tmp_path):
    import datasets

    d = tmp_path / "bad"
    row = {"input_ids": [1, 2, 3], "prompt_len": 1, "token_loss": [0.0], "token_entropy": [0.0, 1, 2]}
    datasets.Dataset.from_list([row]).save_to_disk(str(d))
    with pytest.raises(TraceDataError, match="malformed"):
        load_traces(d)
    with pytest.raises(TraceDataError, match="not found"):
        load_traces(tmp_path / "missing")


def _save(rows):
    import datasets

    return lambda path: datasets.Dataset.from_list(rows).save_to_disk(path)


ROW = {"input_ids": [1, 2, 3], "prompt_len": 1, "token_loss": [0.0, 1, 2], "token_entropy": [0.0, 1, 2]}


@pytest.mark.parametrize("fail_at", ["rename", "symlink", "replace", "rmtree", None])
def test_a_kill_while_publishing_leaves_the_old_or_the_new_dataset(tmp_path, monkeypatch, fail_at):
    """Reproduction: the merge deleted the old dataset before renaming the new one. Now, wherever the switch is cut
    off, the folder loads: the old rows or the new ones."""
    import datasets
    import os
    import shutil

    from foresight.data import trace_data

    datasets.Dataset.from_list([ROW]).save_to_disk(str(tmp_path / "dataset"))  # a folder from before versions
    new = dict(ROW, input_ids=[4, 5, 6, 7], token_loss=[0.0] * 4, token_entropy=[0.0] * 4)

    class Killed(Exception):
        pass

    calls = {"rename": 0}
    real = {"rename": os.rename, "symlink": os.symlink, "replace": os.replace, "rmtree": shutil.rmtree}

    def cut(name):
        def f(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            if name == fail_at and (name != "rename" or calls[name] == 2):
                raise Killed()
            return real[name](*a, **k)
        return f

    for name, mod in (("rename", os), ("symlink", os), ("replace", os), ("rmtree", shutil)):
        monkeypatch.setattr(mod, name, cut(name))
    try:
        trace_data.publish(tmp_path, _save([new]))
    except Killed:
        pass
    monkeypatch.undo()
    got = load_traces(tmp_path)["input_ids"]
    assert got in ([ROW["input_ids"]], [new["input_ids"]])
    if fail_at is None:
        assert got == [new["input_ids"]] and (tmp_path / "dataset").is_symlink()
        trace_data.publish(tmp_path, _save([ROW]))  # and again: versions replace each other
        assert load_traces(tmp_path)["input_ids"] == [ROW["input_ids"]]
        assert sorted(p.name for p in tmp_path.iterdir()) == ["dataset", "dataset.v2"]


def test_leftovers_of_killed_runs_are_cleaned_when_a_run_takes_the_folder(tmp_path):
    from foresight.runtime.locks import output_lock

    (tmp_path / "parts").mkdir()
    for name in (".meta.json.x1y2.tmp", "parts/.prompts-0000000-0000002.json.abc.tmp", "state.pt.tmp4242"):
        (tmp_path / name).write_text("half")
    (tmp_path / ".dataset.tmp-99").mkdir()
    (tmp_path / "meta.json").write_text("{}")
    with output_lock(tmp_path, "traces"):
        pass
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["meta.json", "parts"]


def test_training_fingerprints_name_the_trained_traces_and_prompts_and_keep_an_initialisation_s():
    """What a scorer checkpoint records of its training traces: a fingerprint per trace (its tokens) and per prompt
    (its first prompt_len tokens), the same for the same tokens wherever they are read from; a run started from
    another scorer (GRPO from SFT) keeps that scorer's too."""
    import datasets
    import torch

    from foresight.data.trace_data import fingerprint, training_fingerprints

    rows = {"input_ids": [[1, 2, 3, 4], [1, 2, 9, 9], [5, 6, 7, 8]], "prompt_len": [2, 2, 2]}
    ds = datasets.Dataset.from_dict(rows)
    assert fingerprint([1, 2, 3, 4]) == fingerprint(torch.tensor([1, 2, 3, 4])) != fingerprint([1, 2, 3, 5])
    first = training_fingerprints(ds, [0, 1])
    assert first["traces"] == sorted({fingerprint([1, 2, 3, 4]), fingerprint([1, 2, 9, 9])})
    assert first["prompts"] == [fingerprint([1, 2])]  # two samples of one prompt
    later = training_fingerprints(ds, [2], init={"training_traces": first})
    assert set(later["traces"]) == set(first["traces"]) | {fingerprint([5, 6, 7, 8])}
    assert set(later["prompts"]) == {fingerprint([1, 2]), fingerprint([5, 6])}
    assert training_fingerprints(ds, []) == {"traces": [], "prompts": []}
