import torch

from foresight.engine.view import LazyStats, candidates


def test_candidates_protect_window_sinks_prefix_and_padding():
    token = torch.tensor([-1, -1, 5, 6, 7, 8, 9, 10, 11, 12])[None, None, None].expand(1, 1, 1, 10)
    ev = candidates(token, window=2, sinks=1, first_real=torch.tensor([5]), protected_prefix=0)
    assert ev[0, 0, 0].tolist() == [False, False, False, True, True, True, True, True, False, False]
    ev = candidates(token, window=2, sinks=0, first_real=torch.tensor([5]), protected_prefix=4)
    assert ev[0, 0, 0].tolist() == [False] * 4 + [True] * 4 + [False] * 2


def test_lazy_statistics_are_computed_once_on_first_read():
    calls = []
    stats = LazyStats({"sum": 1}, [({"w8", "w16"}, lambda: calls.append(1) or {"w8": 2, "w16": 3})], "not declared")
    assert "w8" not in stats and stats["w16"] == 3 and stats["w8"] == 2 and calls == [1]
    try:
        stats["max"]
    except KeyError as e:
        assert "not declared" in str(e)
    else:
        raise AssertionError("an undeclared statistic must raise")
