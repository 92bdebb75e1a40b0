"""records/call_sites: the first frame up the stack not passed over, each rule of passing over on its own."""

from __future__ import annotations

import functools

from types import SimpleNamespace
from typing import Any, Callable

from lightning_dp.records.call_sites import STANDARD, first_caller, package_of


def _through(*modules: str, probe: Callable[[], Any]) -> Any:
    """``probe()`` called through one frame of each module named (outermost first): functions made in namespaces
    whose ``__name__`` is that module's, as their frames report it."""
    call = probe
    for name in reversed(modules):
        namespace: dict[str, Any] = {"__name__": name, "inner": call}
        exec("def relay():\n    return inner()\n", namespace)  # noqa: S102  (a frame of module ``name``)
        call = namespace["relay"]
    return call()


def _found(*modules: str, **rules: Any) -> Any:
    """The module of the first caller not passed over above a call made through ``modules``, or ``None``."""
    def probe() -> Any:
        frame = first_caller(1, **rules)
        return None if frame is None else frame.f_globals["__name__"]
    return _through(*modules, probe=probe)


def test_nothing_passed_over_is_the_nearest_caller():
    assert _found("users_code", "lightning_dp.validators.checked") == "lightning_dp.validators.checked"


def test_a_named_module_is_passed_over_but_not_its_package():
    found = _found("users_code", "lightning_dp.other", "lightning_dp.validators.checked",
                   modules=("lightning_dp.validators.checked",))
    assert found == "lightning_dp.other"


def test_a_named_package_is_passed_over_at_any_depth_of_its_modules():
    assert _found("users_code", "torch._tensor", "torch.overrides", packages=("torch",)) == "users_code"
    assert _found("users_code", "torchmetrics.metric", packages=("torch",)) == "torchmetrics.metric"


def test_the_standard_library_is_passed_over_only_when_asked():
    assert _found("users_code", "json.decoder", "contextlib", standard=True) == "users_code"
    assert _found("users_code", "json.decoder", "contextlib") == "contextlib"


def test_a_script_run_as_main_is_never_the_standard_library():
    assert "__main__" not in STANDARD
    assert _found("__main__", "contextlib", standard=True) == "__main__"


def test_also_passes_over_the_frames_it_names():
    def helper(frame: Any) -> bool:
        return frame.f_globals["__name__"].endswith("helpers")

    assert _found("users_code", "users_helpers", also=helper) == "users_code"
    assert _found("users_code", "users_helpers") == "users_helpers"


def test_the_rules_combine():
    found = _found("users_code", "json.decoder", "torch.nn", "users_helpers", "lightning_dp.validators.checked",
                   modules=("lightning_dp.validators.checked",), packages=("torch",), standard=True,
                   also=lambda frame: frame.f_globals["__name__"] == "users_helpers")
    assert found == "users_code"


def test_none_when_every_frame_is_passed_over():
    assert first_caller(0, also=lambda frame: True) is None


def test_depth_counts_from_the_function_that_asks():
    def inner() -> tuple[Any, Any]:
        return first_caller(0), first_caller(1)

    own, caller = inner()
    assert own.f_code.co_name == "inner"
    assert caller.f_code.co_name == "test_depth_counts_from_the_function_that_asks"


def test_package_of_a_frame():
    assert _through("torch.nn.modules", probe=lambda: package_of(first_caller(1))) == "torch"
    assert package_of(SimpleNamespace(f_globals={"__name__": None})) == ""  # type: ignore[arg-type]
    assert package_of(SimpleNamespace(f_globals={})) == ""  # type: ignore[arg-type]


# The checks that ask first_caller, each with a stack on which every rule it passes on decides the answer (one
# call below: the watched method the check skips by its depth, 2).

def _check(check: Callable[[], Any], *modules: str) -> Any:
    return _through(*modules, "watched_method", probe=check)


def test_sealed_loss_passes_over_torch_to_find_lightnings_own_operation():
    from lightning_dp.validators.sealed_loss import _libraries_own

    own = functools.partial(_libraries_own, None)  # (no torch function mode on the stack: no operation handed on)
    assert _check(own, "pytorch_lightning.loops.optimization", "torch._tensor") is True
    assert _check(own, "users_code", "torch._tensor") is False


def test_diagnostic_reads_pass_over_the_diagnostics_module_and_the_standard_library():
    from lightning_dp.validators.diagnostic_reads import _users_caller

    assert _check(_users_caller, "users_code", "contextlib", "lightning_dp.diagnostics") is True
    assert _check(_users_caller, "lightning_dp.callbacks.monitor", "contextlib", "lightning_dp.diagnostics") is False


def test_logger_outputs_pass_over_their_own_module_and_the_standard_library():
    from lightning_dp.validators.logger_outputs import _library_call

    this = "lightning_dp.validators.logger_outputs"
    assert _check(_library_call, "lightning_dp.callbacks.monitor", "contextlib", this) is True
    assert _check(_library_call, "users_code", "contextlib", this) is False


def test_metric_values_pass_over_torch_and_the_standard_library():
    from lightning_dp.validators.metric_values import _users_caller

    assert _check(lambda: _users_caller(3), "users_code", "contextlib", "torch.nn.modules.module") is True
    assert _check(lambda: _users_caller(3), "torchmetrics.metric", "contextlib", "torch.nn.modules.module") is False


def test_logged_reads_pass_over_their_own_module_and_the_standard_library():
    from lightning_dp.validators.logged_reads import _users_frame

    frame = _check(_users_frame, "users_code", "json.decoder", "lightning_dp.validators.logged_reads")
    assert frame is not None and frame.f_globals["__name__"] == "users_code"
    assert _check(_users_frame, "pandas.core.frame", "json.decoder", "lightning_dp.validators.logged_reads") is None


def test_record_reads_find_the_fetch_anywhere_above():
    from lightning_dp.validators.record_reads import _ours

    assert _check(_ours, "lightning_dp.records.fetch", "users_code", "torch.utils.data.dataset") is True
    assert _check(_ours, "users_code", "torch.utils.data.dataset") is False
