"""The weights as a witness (issue 33, item 2): ``first_non_finite`` names the first saved tensor holding a NaN or an
infinity, through the containers a checkpoint is made of, and passes over what is not a float tensor."""

from __future__ import annotations

import math

import torch

from guard.inside.agent._torch import first_non_finite


def test_a_finite_state_dict_has_no_witness() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert first_non_finite(torch, model.state_dict()) is None
    assert first_non_finite(torch, {"model": model, "step": 3, "ids": torch.arange(5)}) is None


def test_the_first_non_finite_tensor_is_named_by_its_path() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    with torch.no_grad():
        model[1].bias.fill_(math.inf)
    saved = {"step": 7, "model": model.state_dict(), "optimizer": {"state": {}}}
    assert first_non_finite(torch, saved) == "model.1.bias"
    assert first_non_finite(torch, [torch.ones(2), {"w": torch.tensor([1.0, math.nan])}]) == "1.w"
    assert first_non_finite(torch, torch.tensor([math.nan])) == "tensor"
    assert first_non_finite(torch, model) == "1.bias"  # a module is looked at through its state_dict


def test_integer_empty_and_half_tensors() -> None:
    assert first_non_finite(torch, {"i": torch.tensor([1, 2]), "e": torch.empty(0), "b": torch.tensor([True])}) is None
    assert first_non_finite(torch, {"h": torch.tensor([1.0, math.inf], dtype=torch.bfloat16)}) == "h"


def test_a_minus_inf_mask_buffer_is_no_witness_but_a_nan_or_plus_inf_in_it_is() -> None:
    """An attention mask kept in the state dict (``register_buffer("mask", full(-inf).triu(1))``, as GPT-style and
    ALiBi code keeps one) holds -inf by design: every save of such a model was taken for non-finite weights."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.register_buffer("causal_mask", torch.full((4, 4), -math.inf).triu(1))

    model = torch.nn.Sequential(Attention(), Attention())
    assert first_non_finite(torch, {"model": model.state_dict()}) is None
    assert first_non_finite(torch, {"attn_mask": torch.full((3,), -math.inf, dtype=torch.bfloat16)}) is None
    model[1].causal_mask[0, 0] = math.inf
    assert first_non_finite(torch, model) == "1.causal_mask"
    model[1].causal_mask[0, 0] = math.nan
    assert first_non_finite(torch, model) == "1.causal_mask"
    model[1].causal_mask[0, 0] = 0.0
    with torch.no_grad():
        model[0].proj.weight[1, 1] = -math.inf  # a trained weight at -inf is never a mask
    assert first_non_finite(torch, model) == "0.proj.weight"
    assert first_non_finite(torch, {"mask_token": torch.tensor([-math.inf])}) == "mask_token"
