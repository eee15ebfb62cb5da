import json
import math

import pytest
import torch

from conftest import killed_after_checkpoint, tiny_qwen3
from foresight.runtime import atomic
from foresight.scorers.checkpoint import load_scorer
from foresight.config.recipe import GRPOConfig, SFTConfig, load_recipe
from foresight.scorers.bank import bank_for_model
from foresight.data.stage_inputs import split_traces
from foresight.training.outputs import RunOutput, finish_run, progress_bar, summary_writer
from foresight.training.runs import TrainPlan, TrainState, load_checkpoint, lr_lambda, setup_training, train_plan
from foresight.training.steps import full_state_dict, mean_step, optimizer_step, save_progress


def test_schedule_warms_up_then_decays_or_stays():
    assert [lr_lambda(s, 4, 20, "cosine") for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_lambda(4, 4, 20, "cosine") == 1.0
    assert lr_lambda(12, 4, 20, "cosine") == pytest.approx(0.5)
    assert lr_lambda(20, 4, 20, "cosine") == pytest.approx(0.0) and lr_lambda(99, 4, 20, "cosine") == pytest.approx(0.0)
    assert lr_lambda(12, 4, 20, "constant") == 1.0
    assert lr_lambda(0, 0, 10, "cosine") == 1.0  # no warm-up
    assert lr_lambda(5, 0, 10, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))


def test_split_keeps_the_last_traces_for_validation():
    assert split_traces(10, 2) == (list(range(8)), [8, 9])
    assert split_traces(5, 2) == ([0, 1, 2, 3], [4])  # at most a quarter validates
    assert split_traces(3, 2) == ([0, 1, 2], [])


def test_train_plan_reads_a_section_and_its_overrides():
    sft = SFTConfig(lr=0.1, steps=7, ckpt_every=3)
    assert train_plan(sft) == TrainPlan(lr=0.1, warmup=sft.warmup, steps=7, schedule="cosine",
                                        batch_traces=sft.batch_traces, grad_clip=sft.grad_clip, ckpt_every=3)
    g = GRPOConfig(traces_per_step=6)
    plan = train_plan(g, schedule="constant", batch_traces=g.traces_per_step, grad_clip=1.0, engine_schedules=False)
    assert (plan.lr, plan.steps, plan.schedule, plan.batch_traces, plan.engine_schedules) == \
        (g.lr, g.steps, "constant", 6, False)


def _run(module, plan, out, resume=False, stop=None):
    opt, sched, ckpt, start, engine = setup_training(module, plan, out, resume, 0, None, "Test", lambda *_: None)
    saved = {}
    for step in range(start, plan.steps if stop is None else stop):
        x = torch.linspace(-1, 1, 8).view(4, 2) * (step + 1)
        loss = (module(x) ** 2).mean()
        optimizer_step(loss, module, opt, engine, plan.grad_clip)
        sched.step()
        w = save_progress(step, plan, TrainState(module, opt, sched, ckpt, engine), 0)
        if w is not None:
            saved[step + 1] = w
    return opt, sched, ckpt, start, saved


def test_checkpoints_resume_exactly_and_a_used_folder_is_refused(tmp_path):
    plan = TrainPlan(lr=0.05, warmup=1, steps=5, schedule="cosine", batch_traces=1, grad_clip=1.0, ckpt_every=2)
    torch.manual_seed(0)
    ref = torch.nn.Linear(2, 1)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    opt, sched, ckpt, start, saved = _run(ref, plan, tmp_path / "a")
    assert start == 0 and sorted(saved) == [2, 4, 5]  # every ckpt_every steps and at the end
    assert ckpt == tmp_path / "a" / "ckpt" / "state.pt"
    st = torch.load(ckpt, weights_only=False)
    assert st["step"] == 5 and st["opt"] is not None and st["sched"] == sched.state_dict()
    assert all(torch.equal(st["bank"][k], v) for k, v in ref.state_dict().items())
    saved[5]["weight"].add_(1.0)  # the saved weights are copies
    assert not torch.equal(saved[5]["weight"], ref.weight)
    assert not list(ckpt.parent.glob("*.tmp*"))
    with pytest.raises(ValueError, match="already holds a Test run; pass --resume"):
        setup_training(torch.nn.Linear(2, 1), plan, tmp_path / "a", False, 0, None, "Test", print)
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        setup_training(torch.nn.Linear(2, 1), plan, tmp_path / "new", True, 0, None, "Test", print)
    # killed right after the step-2 checkpoint, resumed: the same weights as the uninterrupted run
    part = torch.nn.Linear(2, 1)
    part.load_state_dict(init)
    with killed_after_checkpoint():
        _run(part, plan, tmp_path / "b")
    again = torch.nn.Linear(2, 1)
    logs = []
    _, _, _, start, _ = setup_training(again, plan, tmp_path / "b", True, 0, None, "Test", logs.append)
    assert start == 2 and logs == ["[test] resumed at step 2"]
    again = torch.nn.Linear(2, 1)
    _run(again, plan, tmp_path / "b", resume=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_load_checkpoint_restores_bank_optimizer_and_schedule(tmp_path):
    m = torch.nn.Linear(3, 1)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_lambda(s, 2, 10, "cosine"))
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()
    atomic.torch_save({"bank": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "step": 1},
                      tmp_path / "ckpt" / "state.pt")
    m2 = torch.nn.Linear(3, 1)
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: lr_lambda(s, 2, 10, "cosine"))
    state2 = TrainState(m2, opt2, sched2, tmp_path / "ckpt" / "state.pt")
    assert load_checkpoint(state2, True, 0, "SFT", lambda *_: None) == 1
    assert torch.equal(m.weight, m2.weight) and sched2.last_epoch == 1
    assert torch.equal(opt.state_dict()["state"][0]["exp_avg"], opt2.state_dict()["state"][0]["exp_avg"])
    # rank 0 refuses a used folder; the other ranks leave that to it
    with pytest.raises(ValueError, match="already holds"):
        load_checkpoint(state2, False, 0, "SFT")
    assert load_checkpoint(state2, False, 1, "SFT") == 0


def test_optimizer_step_clips_the_gradient():
    m = torch.nn.Linear(4, 1, bias=False)
    before = m.weight.detach().clone()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    optimizer_step((m(torch.full((1, 4), 100.0)) * 100).sum(), m, opt, None, grad_clip=0.5)
    assert (m.weight.detach() - before).norm().item() == pytest.approx(0.5, rel=1e-5)
    assert full_state_dict(m, None)["weight"] is not m.weight


def test_mean_step_takes_the_mean_gradient_one_item_graph_at_a_time():
    """SFT's step: the same update as one backward of the stacked mean, but each item's graph is backpropagated (and
    freed) before the next item's is built: the hook on the weight fires once per item, not once per step."""
    torch.manual_seed(0)
    xs = [torch.randn(3, 4) for _ in range(4)]
    a, b = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)  # scale-sensitive
    before, calls = a.weight.detach().clone(), []
    a.weight.register_hook(lambda g: calls.append(1))
    out = mean_step(xs, lambda x: (a(x).pow(2).sum(), x.shape[0]), a, opt_a, None, grad_clip=1e6)
    optimizer_step(torch.stack([b(x).pow(2).sum() for x in xs]).mean(), b, opt_b, None, grad_clip=1e6)
    assert len(calls) == len(xs) and not torch.allclose(a.weight, before)
    assert torch.allclose(a.weight, b.weight, atol=1e-6) and torch.allclose(a.bias, b.bias, atol=1e-6)
    assert [e for _, e in out] == [3] * 4 and all(not loss.requires_grad for loss, _ in out)


def test_writer_and_bar_only_on_rank_zero(tmp_path):
    assert summary_writer(tmp_path / "r1", 1) is None and not (tmp_path / "r1").exists()
    w = summary_writer(tmp_path / "r0", 0)
    w.add_scalar("x", 1.0, 0)
    w.close()
    assert any((tmp_path / "r0" / "tb").iterdir())
    bar = progress_bar(3, 7, "sft", True, 0)
    assert not bar.disable and (bar.n, bar.total, bar.desc) == (3, 7, "sft")
    assert list(bar) == [3, 4, 5, 6] and bar.n == 7
    assert progress_bar(0, 2, "sft", True, 1).disable and progress_bar(0, 2, "sft", False, 0).disable


def test_finish_run_writes_the_standalone_checkpoint_and_rank_weights(tmp_path):
    model = tiny_qwen3()
    recipe = load_recipe(None, ["cache.budget=12", "cache.interval=4", "cache.sinks=1"])
    bank = bank_for_model(model, seed=5)
    weights = full_state_dict(bank, None)
    w = summary_writer(tmp_path / "run", 0)
    logs = []
    finish_run(RunOutput(tmp_path / "run", model, recipe, "sft", {"training_data": "somewhere"}), 0, 1, weights, bank,
               {"train_loss": 0.5}, w, logs.append)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (cfg["stage"], cfg["budget"], cfg["interval"], cfg["sinks"]) == ("sft", 12, 4, 1)
    assert cfg["llm"]["num_layers"] == 2 and cfg["llm"]["path"] == recipe.model.path
    assert cfg["training_data"] == "somewhere" and cfg["metrics"] == {"train_loss": 0.5}
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == {"train_loss": 0.5}
    assert logs == ['[sft] done: {"train_loss": 0.5}'] and not (tmp_path / "run" / "ckpt").exists()
    loaded, _ = load_scorer(tmp_path / "run", model)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in bank.state_dict().items())
    # a multi-process run: every rank writes its final weights; only rank 0 the checkpoint
    from safetensors.torch import load_file

    finish_run(RunOutput(tmp_path / "r1", model, recipe, "sft", {}), 1, 2, weights, bank, {}, None, logs.append)
    assert not (tmp_path / "r1" / "config.json").exists() and len(logs) == 1
    got = load_file(str(tmp_path / "r1" / "ckpt" / "final-rank1.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in weights.items())


def test_a_checkpoint_from_before_a_recipe_field_existed_resumes_at_its_default():
    from foresight.config.recipe import load_recipe
    from foresight.training.runs import identity_changes, run_identity

    now = run_identity(load_recipe("recipes/tiny-qwen3.yaml"), ("sft",), None)
    old = {"recipe": {"sft": {k: v for k, v in now["recipe"]["sft"].items() if k != "budgets"}}, "traces": None}
    assert identity_changes(old, now) == []  # sft.budgets did not exist: it ran with the default ""
    changed = run_identity(load_recipe("recipes/tiny-qwen3.yaml", ["sft.budgets=8:4,16:4"]), ("sft",), None)
    assert identity_changes(old, changed) == ["sft.budgets: '' -> '8:4,16:4'"]
