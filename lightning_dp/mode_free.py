"""The mechanism's own tensor operations run outside the user's torch modes.

A ``TorchDispatchMode`` or ``TorchFunctionMode`` entered around ``trainer.fit`` (an op counter, a tracer, a FLOP
counter) is handed every torch call made while it is on the stack, the library's included, and may answer any of them
as it likes: a mode returning zeros for ``aten.normal_`` removes the Gaussian noise from the release while the ledger
charges for it; one answering ``div``, ``mul`` or ``linalg_vector_norm`` changes the division by the expected batch B,
the clipping's scale factors or the per-example norms they come from. :func:`without_user_modes` takes every such mode
off the stack (the library's own modes stay) for the span of one of the mechanism's computations and puts them back,
in their order, afterwards, so that the release is computed by torch itself whatever modes are entered: the noise
draw and the noised mean (:mod:`~lightning_dp.privacy.noise` and the other mechanisms, through
:class:`~lightning_dp.privacy.noise.NoiseMechanism`), the clipping and the release of
:class:`~lightning_dp.privacy.private_step.PrivateStep`, and the norms the capture engine folds during the backward
(:mod:`~lightning_dp.grad_sample.capture.activations`).

What a mode still sees and may change: the model's own forward and backward (its loss, its outputs, the gradients
autograd computes for it, hence the per-example gradients the engine clips): that is the user's function, whose
every value is clipped to C like any other gradient. A pass-through mode (a counter, a profiler's FLOP count) keeps
working there and simply does not see the mechanism's operations. What is not done: while torch.compile's tracing
modes (fake tensors, proxy, functionalisation) are on the stack the stack is left as it is (popping them would mix real
and traced tensors); the mechanism does not run inside a traced region in this library.
"""

from __future__ import annotations

import functools
from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch.utils import _python_dispatch as dispatch

from lightning_dp.records.library_code import library_named
from lightning_dp.sealed_noise import seal

F = TypeVar("F", bound=Callable[..., Any])
_function_stack, _dispatch_stack = torch._C._len_torch_function_stack, torch._C._len_torch_dispatch_stack


def _tracing() -> bool:
    """Whether torch.compile's (or export's) tracing modes are on the dispatch stack, or Dynamo is tracing."""
    if torch.compiler.is_compiling():
        return True
    names = {"FakeTensorMode", "ProxyTorchDispatchMode", "FunctionalTensorMode", "PreDispatchTorchFunctionMode"}
    stack = [*dispatch._get_current_dispatch_mode_stack(), *torch.overrides._get_current_function_mode_stack()]
    return any(type(m).__name__ in names for m in stack)


def user_modes() -> list[Any]:
    """The torch function and dispatch modes on this thread's stacks but the library's own (outermost first, function
    modes first)."""
    stacks = [*torch.overrides._get_current_function_mode_stack(), *dispatch._get_current_dispatch_mode_stack()]
    return [m for m in stacks if not _library_mode(m)]


def _library_mode(mode: Any) -> bool:
    """One of this library's own modes (the capture's broadcast sites, the probe's, the wide replay's float64): left
    in place, as the library enters and leaves it (it pops itself when it closes). Decided by where the class was
    written and the code it runs (:func:`~lightning_dp.records.library_code.library_named`), not by its
    ``__module__``: a user's mode claiming ``__module__ = "lightning_dp.x"`` is taken off like any other."""
    return library_named(type(mode), "lightning_dp.")


@contextmanager
def _modes_off(length: Callable[[], int], pop: Callable[[], Any], push: Callable[[Any], None]) -> Iterator[None]:
    """One stack's modes but the library's own taken off, and put back under whatever is on the stack at the end (a
    library mode closed inside is not put back; one entered inside stays innermost)."""
    held = [pop() for _ in range(length())][::-1]  # outermost first
    users = [m for m in held if not _library_mode(m)]
    for mode in held:
        if _library_mode(mode):
            push(mode)
    try:
        yield
    finally:
        now = [pop() for _ in range(length())][::-1]
        for mode in (*users, *now):
            push(mode)


@contextmanager
def without_user_modes() -> Iterator[None]:
    """No torch function mode and no dispatch mode of the user's is active inside (restored on exit, also on an
    exception); a no-op when none is on the stack or while a compile-time tracer is (see the module's docstring)."""
    if not (_function_stack() or _dispatch_stack()) or _tracing() or not user_modes():
        yield
        return
    with ExitStack() as stack:
        stack.enter_context(_modes_off(_function_stack, torch._C._pop_torch_function_stack,
                                       torch._C._push_on_torch_function_stack))
        stack.enter_context(_modes_off(_dispatch_stack, dispatch._pop_mode, dispatch._push_mode))
        yield


def mode_free(fn: F) -> F:
    """``fn`` run inside :func:`without_user_modes` (a decorator for the mechanism's methods)."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not (_function_stack() or _dispatch_stack()):  # the common case: no mode, no context (≈ 1 µs a call)
            return fn(*args, **kwargs)
        with without_user_modes():
            return fn(*args, **kwargs)
    return run  # type: ignore[return-value]


seal(__name__)
