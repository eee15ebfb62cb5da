"""Moving a query further along the sequence after RoPE: the query written at position ``p`` as it would be at
``p + Δ`` (same content, rotated by ``Δ`` more positions), for the ``ahead`` statistics of :mod:`foresight.engine.features`.

RoPE rotates each pair of dimensions ``(i, i + r/2)`` (transformers' rotate-half layout) by ``position · inv_freq[i]``
and rotations compose, so rotating a post-RoPE query by ``Δ · inv_freq`` gives the post-RoPE query of position
``p + Δ``. Dimensions past the rotary part (``partial_rotary_factor < 1``) stay as they are. The frequencies come
from the model config (``rope_parameters``, or the older ``rope_theta`` / ``rope_scaling``) through transformers' own
initialisers for scaled types (``llama3``, ``yarn``, …); their attention factor scales cos and sin alike in the model
and is not a rotation, so it is left out here.
"""

from __future__ import annotations

import torch

from foresight.engine.attention_shape import AttentionShape, text_config


def rope_parameters(config) -> dict:
    """The config's RoPE parameters as one dict (``rope_type``, ``rope_theta``, …), old or new style."""
    c = text_config(config)
    params = getattr(c, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    scaling = dict(getattr(c, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    theta = getattr(c, "rope_theta", None)
    if theta is None:
        raise ValueError(f"{type(c).__name__} names no RoPE base (rope_parameters / rope_theta): the 'ahead' "
                         "statistics need a rotary model")
    return {"rope_theta": theta, **scaling}


def inverse_frequencies(config) -> torch.Tensor:
    """[r/2] fp32: the rotary frequencies of the config's attention (r: the rotary dimensions of a head)."""
    c = text_config(config)
    params = rope_parameters(c)
    kind = params.get("rope_type", "default")
    head_dim = AttentionShape.of(c).head_dim
    factor = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0
    if kind == "default":
        dim = int(head_dim * factor)
        return 1.0 / (float(params["rope_theta"]) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)).float()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"RoPE type {kind!r} is not known to transformers ({', '.join(ROPE_INIT_FUNCTIONS)})")
    inv, _ = ROPE_INIT_FUNCTIONS[kind](c, torch.device("cpu"))
    return inv.float()


def shift_tables(config, shifts, device=None) -> torch.Tensor:
    """[len(shifts), 2, r] fp32: cos and sin of each shift's rotation, in rotate-half layout."""
    inv = inverse_frequencies(config)
    angles = torch.tensor([float(s) for s in shifts], dtype=torch.float64)[:, None] * inv.double()[None]  # [S, r/2]
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()], dim=1).float().to(device)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half: ``[x1, x2] -> [-x2, x1]`` over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x`` [..., d] (post-RoPE) rotated by one shift's ``table`` [2, r] (r ≤ d); computed in fp32, returned in
    ``x``'s dtype."""
    r = table.shape[-1]
    rot, rest = x[..., :r].float(), x[..., r:]
    out = (rot * table[0] + rotate_half(rot) * table[1]).to(x.dtype)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out
