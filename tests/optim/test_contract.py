"""The PrivateOptimizer contract: releases before steps, clear errors, state in state_dict."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

from lightning_dp.privacy.release import PrivateOptimizer, Release
from lightning_dp.optim import DPAdagrad, DPAdam, variant_names

RELEASE = Release(noise_std=0.1, expected_batch_size=10.0, noise_multiplier=1.0, max_grad_norm=1.0)


def test_variant_names():
    assert variant_names() == sorted(
        ["post_processing", "bias_corrected", "independent_moments", "scale_then_privatize", "noiseless"])


@pytest.mark.parametrize("cls", [DPAdam, DPAdagrad])
def test_implements_the_protocol(cls):
    assert isinstance(cls([torch.nn.Parameter(torch.zeros(1))]), PrivateOptimizer)


@pytest.mark.parametrize("variant", ["bias_corrected", "independent_moments", "noiseless"])
def test_step_without_release_raises(variant):
    p = torch.nn.Parameter(torch.zeros(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = DPAdam([p], variant=variant)
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="DPStrategy"):
        opt.step()


def test_release_is_consumed_by_step():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DPAdam([p], variant="bias_corrected")
    p.grad = torch.ones(2)
    opt.observe_release(RELEASE)
    opt.step()
    with pytest.raises(RuntimeError, match="observe_release"):
        opt.step()


def test_release_may_be_observed_inside_the_closure():
    """Lightning's precision plugin runs the (privatising) closure inside optimizer.step."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DPAdam([p], variant="bias_corrected")

    def closure():
        p.grad = torch.ones(2)
        opt.observe_release(RELEASE)
        return torch.tensor(1.0)

    assert opt.step(closure) == 1.0
    assert int(opt.state[p]["step"]) == 1


def test_missing_second_moment_is_a_clear_error():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = DPAdam([p], variant="independent_moments")
    p.grad = torch.ones(2)
    opt.observe_release(RELEASE)
    with pytest.raises(RuntimeError, match="second_moment"):
        opt.step()


def test_bad_input_is_refused():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="unknown DP optimizer variant"):
        DPAdam(params, variant="nope")
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        DPAdam(params, variant="bias_corrected", eps_s=1.0)
    with pytest.raises(ValueError, match="betas"):
        DPAdam(params, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="amsgrad"):
        DPAdam([{"params": params, "amsgrad": True}])
    with pytest.raises(TypeError, match="Release"):
        DPAdam(params).observe_release({"noise_std": 1.0})


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = DPAdam([p], variant="bias_corrected", gamma=1e-4)
    grads = [torch.randn(4, dtype=torch.float64) for _ in range(6)]

    def step(o, q, g, std):
        q.grad = g.clone()
        o.observe_release(Release(noise_std=std, expected_batch_size=1.0, noise_multiplier=1.0, max_grad_norm=1.0))
        o.step()

    for k in range(3):
        step(opt, p, grads[k], 0.1 * (k + 1))
    saved, p_saved = copy.deepcopy(opt.state_dict()), p.detach().clone()
    assert saved["dp_variant"] == {"name": "bias_corrected", "hparams": {"gamma": 1e-4}}
    for k in range(3, 6):
        step(opt, p, grads[k], 0.1 * (k + 1))

    q = torch.nn.Parameter(p_saved)
    resumed = DPAdam([q], variant="bias_corrected", gamma=1e-4)
    resumed.load_state_dict(saved)
    for k in range(3, 6):
        step(resumed, q, grads[k], 0.1 * (k + 1))
    torch.testing.assert_close(q, p, atol=0, rtol=0)


def test_pickle_keeps_the_variant():
    opt = DPAdam([torch.nn.Parameter(torch.zeros(1))], variant="independent_moments", gamma=1e-3)
    clone = pickle.loads(pickle.dumps(opt))
    assert clone.variant == "independent_moments" and clone.preconditioner.gamma == 1e-3

