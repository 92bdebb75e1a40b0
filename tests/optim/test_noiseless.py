"""The noiseless baseline (docs/algorithms.md §5) is loudly non-private."""

from __future__ import annotations

import warnings

import pytest
import torch

from lightning_dp.optim import DPAdagrad, DPAdam, NotPrivateWarning


@pytest.mark.parametrize("cls", [DPAdam, DPAdagrad])
def test_noiseless_warns_and_requests_the_clean_mean(cls):
    with pytest.warns(NotPrivateWarning, match="NOT differentially private"):
        opt = cls([torch.nn.Parameter(torch.zeros(2))], variant="noiseless")
    request = opt.mechanism_request()
    assert request.clean_mean is True
    assert request.second_moment is False and request.scale is None


def test_private_variants_do_not_warn_or_request_the_clean_mean():
    for variant in ("post_processing", "bias_corrected", "independent_moments", "scale_then_privatize"):
        with warnings.catch_warnings():
            warnings.simplefilter("error", NotPrivateWarning)
            opt = DPAdam([torch.nn.Parameter(torch.zeros(2))], variant=variant)
        assert opt.mechanism_request().clean_mean is False


def test_independent_moments_requests_the_second_moment():
    opt = DPAdam([torch.nn.Parameter(torch.zeros(2))], variant="independent_moments")
    assert opt.mechanism_request().second_moment is True
    assert opt.mechanism_request().noise_split == 2
