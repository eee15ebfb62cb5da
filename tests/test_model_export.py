"""``foresight export-model``: the recipe's model as a plain transformers folder a serving engine loads (the GGUF
SmolLM2 export itself, served by a real vLLM, is tested in tests/vllm)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from foresight import cli
from foresight.config.recipe import load_recipe
from foresight.data import model_export
from foresight.data.completions import exported_name
from foresight.engine.models import load_model

QUIET = dict(log=lambda *_: None)


def test_export_writes_a_folder_that_loads_with_the_same_logits_and_tokenizer(tmp_path):
    recipe = load_recipe("recipes/tiny-qwen3.yaml")
    summary = model_export.export_model(recipe, tmp_path / "teacher", **QUIET)
    out = tmp_path / "teacher"
    assert summary["written"] and summary["serve"] == f"vllm serve {out} --dtype {recipe.model.dtype}"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja", "foresight-export.json"} <= names
    assert [p.name for p in tmp_path.iterdir()] == ["teacher"]  # no temporary folder left beside it
    info = json.loads((out / "foresight-export.json").read_text())
    assert info["source"] == {"path": "builtin:tiny-qwen3", "gguf_file": None, "revision": None}
    ours, tok = load_model(recipe.model)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([tok("a b c 1 2 3")["input_ids"]])
    assert torch.equal(ours(ids).logits, back(ids).logits)
    chat = [{"role": "user", "content": "2+2?"}]
    assert AutoTokenizer.from_pretrained(out).apply_chat_template(chat, tokenize=False) == \
        tok.apply_chat_template(chat, tokenize=False)


def test_export_refuses_a_non_empty_folder_and_leaves_it_alone(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    rc = cli.main(["export-model", "--recipe", "recipes/tiny-qwen3.yaml", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "exists and is not empty" in err and str(out) in err
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_a_failed_check_publishes_nothing(tmp_path, monkeypatch):
    def differs(*_):
        raise ValueError("the exported model's logits differ from the source's")

    monkeypatch.setattr(model_export, "_check", differs)
    with pytest.raises(ValueError, match="logits differ"):
        model_export.export_model(load_recipe("recipes/tiny-qwen3.yaml"), tmp_path / "x", **QUIET)
    assert list(tmp_path.iterdir()) == []


def test_a_hub_model_is_a_no_op_that_says_so(tmp_path):
    said = []
    recipe = load_recipe("recipes/tiny-qwen3.yaml", ["model.path=Qwen/Qwen3-8B", "model.dtype=bfloat16"])
    summary = model_export.export_model(recipe, tmp_path / "q", log=said.append)
    assert summary == {"written": False, "model": "Qwen/Qwen3-8B", "serve": "vllm serve Qwen/Qwen3-8B --dtype bfloat16"}
    assert not (tmp_path / "q").exists() and "hub model" in said[0]


def test_traces_find_the_served_export_of_the_recipes_model(tmp_path):
    recipe = load_recipe("recipes/tiny-qwen3.yaml")
    model_export.export_model(recipe, tmp_path / "teacher", **QUIET)
    entries = [{"id": "other", "root": str(tmp_path)}, {"id": "teacher-fp32", "root": str(tmp_path / "teacher")}]
    said = []
    assert exported_name(entries, recipe.model, said.append) == "teacher-fp32" and "teacher-fp32" in said[-1]
    other = load_recipe("recipes/tiny-qwen3.yaml", ["model.revision=main"])
    assert exported_name(entries, other.model, said.append) is None
    bf16 = load_recipe("recipes/tiny-qwen3.yaml", ["model.dtype=bfloat16"])
    assert exported_name(entries, bf16.model, said.append) == "teacher-fp32" and "may differ" in said[-2]
