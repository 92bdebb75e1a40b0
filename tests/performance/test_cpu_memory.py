"""lightning_dp.performance.cpu_memory: freed CPU memory kept for the next step (no page faults per step)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from lightning_dp.performance import cpu_memory
from lightning_dp.privacy.noise import GaussianNoise
from lightning_dp.privacy.private_step import PrivateStep

# A per-example convolution gradient as the ghost engine computes it (examples as groups): its oneDNN buffers are
# allocated and freed every call, and under glibc's adaptive thresholds re-faulted every call on this machine.
_WORKLOAD = textwrap.dedent("""
    import resource, sys, torch
    torch.set_num_threads(1)
    if sys.argv[1] == "retain":
        from lightning_dp.performance.cpu_memory import retain_freed_memory
        assert retain_freed_memory()
    n, C, O = 64, 16, 32
    x, d = torch.randn(1, n * C, 8, 8), torch.randn(1, n * O, 8, 8)
    def call():
        return torch.ops.aten.convolution_backward(d, x, x.new_empty(n * O, C, 3, 3), None, [1, 1], [1, 1],
                                                   [1, 1], False, [0, 0], n, [False, True, False])[1]
    for _ in range(5):
        call()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        call()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
""")


def _faults_per_call(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", _WORKLOAD, mode], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(cpu_memory._glibc() is None or cpu_memory.preloaded_allocator() is not None,
                    reason="glibc's malloc only")
def test_retained_memory_is_not_faulted_again():
    default = _faults_per_call("default")
    if default < 50:
        pytest.skip(f"this machine's allocator does not re-fault the workload ({default:.0f} faults per call)")
    retained = _faults_per_call("retain")  # 0 alone on this machine, ~15 beside a busy suite; the default ~600
    assert retained < default / 4, f"memory freed by one call was faulted in again by the next ({retained:.0f} faults)"


@pytest.fixture
def fresh(monkeypatch):
    """The module as if no step had tuned the allocator yet; mallopt recorded instead of called."""
    calls: list[tuple[int, int]] = []

    class Libc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: Libc())
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    return calls


def test_sets_both_thresholds_once_per_process(fresh):
    assert cpu_memory.retain_freed_memory() is True
    assert cpu_memory.retain_freed_memory() is True
    assert sorted(fresh) == sorted([(-3, cpu_memory.MMAP_THRESHOLD), (-1, cpu_memory.TRIM_THRESHOLD)])


def test_a_preloaded_allocator_is_left_alone(fresh, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert cpu_memory.preloaded_allocator() == "jemalloc"
    assert cpu_memory.retain_freed_memory() is False
    assert fresh == []


def test_another_c_library_is_left_alone(monkeypatch):
    monkeypatch.setattr(cpu_memory, "_applied", None)
    monkeypatch.setattr(cpu_memory, "_glibc", lambda: None)
    assert cpu_memory.retain_freed_memory() is False


@pytest.mark.parametrize("retain", [True, False])
def test_private_step_tunes_only_when_asked(fresh, retain):
    model = nn.Linear(4, 2)
    step = PrivateStep(1.0, 1.0, GaussianNoise(), engine="ghost", retain_cpu_memory=retain)
    assert step.execution.retain_cpu_memory is retain
    step.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        assert bool(fresh) is retain
    finally:
        step.detach()


def test_strategy_hands_the_option_down():
    from lightning_dp import DPStrategy

    assert DPStrategy(1.0, 1.0).execution_config.retain_cpu_memory is True
    assert DPStrategy(1.0, 1.0, retain_cpu_memory=False).execution_config.retain_cpu_memory is False
