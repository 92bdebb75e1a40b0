"""Models fitted in this process outside the private step (validators/outside_fits.py): a teacher trained with a plain
optimizer on the training set, frozen and held by the student (a submodule, a list), and a fitted scikit-learn
estimator on the module are refused before any release; declared public, never stepped here, trained with DP first
(its ledger continues) or the student's own weights pretrained are not: those are warned of once
(OutsideStepsWarning; refused when it is an error), unless pretrained inside public_steps()."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "privacy" / "boundary"))
from cases import Classifier, data, fit, parameters, unchanged  # noqa: E402

import lightning_dp  # noqa: E402
from lightning_dp import PrivacyConfigurationError  # noqa: E402
from lightning_dp.validators.outside_fits import fitted_estimator, outside_fits_held  # noqa: E402

X, Y = data(64).tensors


def teacher(steps: int = 30) -> nn.Module:
    """A teacher fitted with plain Adam on the training set (``steps=0``: never stepped), then frozen."""
    torch.manual_seed(1)
    t = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(t.parameters(), 1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(t(X), Y).backward()
        opt.step()
    return t.requires_grad_(False).eval()


class Student(Classifier):
    """Distils from a frozen teacher's soft targets; the teacher a submodule or held in a list."""

    def __init__(self, t: nn.Module, held: str = "submodule", everything: bool = False) -> None:
        super().__init__()
        self.everything = everything  # the optimizer given self.parameters(), the frozen teacher's too
        if held == "submodule":
            self.teacher = t
        else:
            self._t = [t]  # outside the registry, the state_dict and the optimizer
        self.held = held

    def soft(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.softmax((self.teacher if self.held == "submodule" else self._t[0])(x), -1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        return F.kl_div(F.log_softmax(self(x), -1), self.soft(x), reduction="batchmean")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters() if self.everything else self.net.parameters(), lr=1.0)


class ForestStudent(Classifier):
    """Soft targets from a scikit-learn random forest fitted on the training set, kept on the module."""

    def __init__(self) -> None:
        super().__init__()
        from sklearn.ensemble import RandomForestClassifier

        self.clf = RandomForestClassifier(n_estimators=4, random_state=0).fit(X.numpy(), Y.numpy())

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        soft = torch.tensor(self.clf.predict_proba(x.detach().numpy()), dtype=torch.float32)
        return F.kl_div(F.log_softmax(self(x), -1), soft, reduction="batchmean")


@pytest.mark.parametrize("make, what", [
    (lambda: Student(teacher(), "submodule"), "the model's submodule teacher: 4 parameter"),
    (lambda: Student(teacher(), "submodule", everything=True), "the model's submodule teacher: 4 parameter"),
    (lambda: Student(teacher(), "list"), r"the model's attribute _t\[0\] \(a module held outside"),
    (ForestStudent, "the model's attribute clf: a fitted scikit-learn RandomForestClassifier"),
])
def test_a_model_fitted_here_outside_the_mechanism_is_refused_before_any_release(make, what):
    m = make()
    before = parameters(m)
    with pytest.raises(PrivacyConfigurationError, match=rf"(?s)fitted in this process outside the private step.*"
                                                        rf"{what}.*Train it with DP.*public_state="):
        fit(m, steps=2)
    assert unchanged(before, m)


@pytest.mark.parametrize("make, name", [
    (lambda: Student(teacher(), "submodule"), "teacher"),
    (lambda: Student(teacher(), "list"), "_t"),
    (ForestStudent, "clf"),
])
def test_the_same_teacher_declared_public_trains(make, name):
    m = make()
    before = parameters(m)
    assert fit(m, steps=2, public_state=[name]).ledger.steps == 2
    assert not unchanged(before, m)


@pytest.mark.parametrize("held", ["submodule", "list"])
def test_a_frozen_teacher_never_stepped_here_trains(held):
    stepped = teacher()
    loaded = teacher(steps=0)
    loaded.load_state_dict(stepped.state_dict())  # weights loaded into fresh tensors: their fit is not seen here
    assert fit(Student(teacher(steps=0), held), steps=2).ledger.steps == 2  # random initialisation
    assert fit(Student(loaded, held), steps=2, seed=1).ledger.steps == 2  # other records: its own ledger


class Trained(Classifier):
    """The teacher's architecture as a LightningModule, trained with DP before it teaches."""

    def __init__(self) -> None:
        super().__init__()
        self.net = teacher(steps=0).requires_grad_(True).train()


def test_a_teacher_trained_with_dp_first_continues_the_ledger():
    t = Trained()
    assert fit(t, steps=3).ledger.steps == 3
    student = Student(t.net.requires_grad_(False).eval(), "submodule")
    assert fit(student, steps=2).ledger.steps == 5  # rule 9: the teacher's releases, then the student's


def pretrained(m: nn.Module, public: bool = False) -> nn.Module:
    """``m`` pretrained with plain Adam on the training tensors (``public``: on other draws, inside
    ``public_steps()``: the training tensors there are refused, tests/records/test_public_inputs.py)."""
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data(64, seed=11).tensors if public else (X, Y)
    with lightning_dp.public_steps() if public else contextlib.nullcontext():
        for _ in range(10):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    return m


def _outside_warnings(caught: list) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, lightning_dp.OutsideStepsWarning)]


def test_the_students_own_weights_pretrained_here_are_warned_of_once_and_train():
    m = pretrained(Classifier())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fit(m, steps=2).ledger.steps == 2
        assert fit(m, steps=2).ledger.steps == 4  # the same outside steps: not warned of again
    found = _outside_warnings(caught)
    assert len(found) == 1
    assert found[0].startswith("4 of the trainable parameter tensors this private fit trains were stepped up to 10 ")
    assert "lightning_dp.public_steps()" in found[0] and "must be charged" in found[0]


def test_the_warning_made_an_error_refuses_before_any_release():
    m = pretrained(Classifier())
    before = parameters(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", lightning_dp.OutsideStepsWarning)
        with pytest.raises(PrivacyConfigurationError, match=r"(?s)Refused \(OutsideStepsWarning.*public_steps"):
            fit(m, steps=2)
    assert unchanged(before, m)


@pytest.mark.parametrize("make", [lambda: pretrained(Classifier(), public=True), Classifier,
                                  lambda: Trained()], ids=["public_steps", "fresh", "trained_with_dp_before"])
def test_public_pretraining_a_fresh_model_and_a_second_private_fit_are_not_warned_of(make):
    m = make()
    if isinstance(m, Trained):
        fit(m, steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", lightning_dp.OutsideStepsWarning)
        assert fit(m, steps=2).ledger.steps >= 2
    assert _outside_warnings(caught) == []


def test_a_callback_holding_a_fitted_estimator_or_a_stepped_module_is_found():
    from sklearn.tree import DecisionTreeClassifier
    from sklearn.preprocessing import StandardScaler

    class Helper:
        def __init__(self) -> None:
            self.tree = DecisionTreeClassifier().fit(X.numpy(), Y.numpy())
            self.scaler = StandardScaler().fit(X.numpy())  # judged by the data-statistics check instead
            self.fresh = DecisionTreeClassifier()  # not fitted
            self.nets = {"t": teacher()}

    found = outside_fits_held(Classifier(), None, [("model", Classifier()), ("MyCallback", Helper())])
    assert any(f.startswith("MyCallback.tree: a fitted scikit-learn DecisionTreeClassifier") for f in found)
    assert any(f.startswith("MyCallback.nets['t'] (a module held outside") for f in found)
    assert len(found) == 2
    assert outside_fits_held(Classifier(), None, [("MyCallback", Helper())], ["MyCallback.tree", "MyCallback.nets"]) \
        == []
    assert not fitted_estimator(StandardScaler().fit(np.ones((4, 2))))


def _plain_loop_teacher(steps: int = 3) -> nn.Module:
    """The teacher's architecture trained with DP in a plain loop whose optimizer is given only at ``release()``
    (none at ``attach()``), then frozen."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp.privacy.noise import GaussianNoise
    from lightning_dp.privacy.private_step import PrivateStep

    t = teacher(steps=0).requires_grad_(True).train()
    step = PrivateStep(1.0, 1.0, GaussianNoise(), sampler_seed=0)
    step.attach(t)
    batches = iter(step.poisson_loader(DataLoader(TensorDataset(X, Y), batch_size=16)))
    step.verify(lambda batch: F.cross_entropy(t(batch[0]), batch[1]))
    opt = torch.optim.SGD(t.parameters(), lr=0.5)
    try:
        for _ in range(steps):
            x, y = next(batches)
            opt.zero_grad()
            if step.begin():
                F.cross_entropy(t(x), y).backward()
            step.release(optimizer=opt)
            opt.step()
    finally:
        step.detach()
    return t.requires_grad_(False).eval()


def test_the_optimizer_given_at_release_is_the_private_steps_and_another_is_still_found():
    """The optimizer a plain loop gives only at release() steps releases: its teacher is not taken for an outside fit
    (its ledger continues into the student's); a plain optimizer's teacher held beside it still is."""
    from lightning_dp.records.outside_steps import stepped_outside

    t = _plain_loop_teacher()
    assert not any(stepped_outside(p) for p in t.parameters())
    student = Student(t, "submodule")
    student._plain = [teacher()]  # fitted with plain Adam
    assert outside_fits_held(student, None, [("model", student)]) == [
        "the model's attribute _plain[0] (a module held outside the model's registry): 4 parameter tensor(s) stepped "
        "by an optimizer that is not the private step's"]
    del student._plain
    assert fit(student, steps=2).ledger.steps == 5  # rule 9: the teacher's releases, then the student's
