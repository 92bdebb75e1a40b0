"""to_dp_optimizer: a torch Adam/AdamW/Adagrad becomes the DP optimizer with the same groups and state."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.optim import DPAdagrad, DPAdam, to_dp_optimizer


def _two_groups():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))
    return a, b, [{"params": [a], "lr": 0.01}, {"params": [b], "lr": 0.002, "weight_decay": 0.3}]


@pytest.mark.parametrize("torch_cls,dp_cls", [(torch.optim.Adam, DPAdam), (torch.optim.AdamW, DPAdam),
                                              (torch.optim.Adagrad, DPAdagrad)])
def test_swap_mid_run_continues_the_torch_trajectory(torch_cls, dp_cls):
    """post_processing after the swap must continue exactly where torch's optimizer would have gone."""
    a, b, groups = _two_groups()
    twin = [torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone())]
    ours = torch_cls(groups, eps=1e-6)
    ref = torch_cls([{**groups[0], "params": [twin[0]]}, {**groups[1], "params": [twin[1]]}], eps=1e-6)
    for k in range(6):
        if k == 3:
            ours = to_dp_optimizer(ours, "post_processing")
            assert type(ours) is dp_cls
            assert [g["lr"] for g in ours.param_groups] == [0.01, 0.002]
            assert ours.param_groups[1]["weight_decay"] == 0.3
            assert ours.param_groups[0]["params"][0] is a
            assert int(ours.state[a]["step"]) == 3
        g1, g2 = torch.randn(3, 2), torch.randn(2)
        a.grad, b.grad, twin[0].grad, twin[1].grad = g1, g2, g1.clone(), g2.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, twin[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(b, twin[1], atol=1e-6, rtol=0)


def test_group_keys_and_defaults_carry_over():
    a, b, groups = _two_groups()
    adamw = torch.optim.AdamW(groups, betas=(0.8, 0.95))
    adamw.param_groups[0]["initial_lr"] = 0.01  # as an LR scheduler would set it
    new = to_dp_optimizer(adamw, "bias_corrected", gamma=1e-9)
    for old_g, new_g in zip(adamw.param_groups, new.param_groups):
        assert {k: v for k, v in old_g.items() if k != "params"} == {k: v for k, v in new_g.items() if k != "params"}
    assert new.param_groups[0]["decoupled_weight_decay"] is True
    assert new.defaults["weight_decay"] == 0.01  # AdamW's default, not DPAdam's
    assert new.variant == "bias_corrected" and new.preconditioner.gamma == 1e-9


def test_refusals():
    p = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match="torch.optim.Adam"):
        to_dp_optimizer(torch.optim.SGD([p], lr=0.1), "post_processing")
    with pytest.raises(ValueError, match="amsgrad"):
        to_dp_optimizer(torch.optim.Adam([p], amsgrad=True), "post_processing")
    with pytest.raises(ValueError, match="unknown DP optimizer variant"):
        to_dp_optimizer(torch.optim.Adam([p]), "dp_sgd")
