import torch

from foresight.engine.cache.slots import SlotStore


def test_gather_keeps_the_chosen_slots_in_order_and_empties_the_rest():
    s = SlotStore(num_layers=1, batch=1, kv_heads=2, head_dim=3, capacity=6, device="cpu", dtype=torch.float32)
    s.keys[..., :5, :] = torch.arange(5.0)[:, None]
    s.token[..., :5] = torch.arange(5)
    prio = s.tensor("p", fill=-1.0)
    prio[..., :5] = torch.arange(5.0) * 10
    order = torch.tensor([[[[0, 2, 4], [1, 3, 4]]]])  # per KV head
    s.gather(order, 5)
    assert s.token[0, 0].tolist() == [[0, 2, 4, -1, -1, -1], [1, 3, 4, -1, -1, -1]]
    assert s.keys[0, 0, 1, :3, 0].tolist() == [1.0, 3.0, 4.0]
    assert s.tensor("p")[0, 0, 0, :3].tolist() == [0.0, 20.0, 40.0]


def test_grow_adds_empty_slots_everywhere():
    s = SlotStore(2, 1, 1, 4, 3, "cpu", torch.float32)
    s.tensor("p")
    s.grow(5)
    assert s.capacity == 8 and s.keys.shape[3] == 8 and s.tensor("p").shape[-1] == 8
    assert (s.token == -1).all() and s.nbytes() == 2 * 2 * 1 * 1 * 8 * 4 * 4
