"""Shared pytest set-up: the `gpu` marker skips without CUDA; `gloo_world(n)` reuses N-rank worlds.

The quick tier (`scripts/test.sh --quick`, i.e. ``-m "not slow and not gpu"``) leaves out every
test marked `slow`: those that start other processes (a subprocess, torchrun, a gloo world).
A test that asks for the `gloo_world` fixture, directly or through another fixture, is marked
`slow` here, so a new multi-rank test cannot land in the quick tier by forgetting the marker;
tests that start processes another way carry ``@pytest.mark.slow`` themselves.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors through the interpreter, which must be chosen
# before triton is imported; with one they run compiled on CUDA tensors (tests/support/triton_helpers.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from xorl.testing.multirank import GlooWorld, set_deadline


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gloo_world" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    from xorl.config.rules.train import SPLIT_BACKWARD_TORCH, installed_torch, installed_torch_text

    if installed_torch() < SPLIT_BACKWARD_TORCH:  # the rules refuse zero-bubble schedules there
        old_torch = pytest.mark.skip(reason=f"zero-bubble schedules are refused on torch {installed_torch_text()}")
        for item in items:
            params = getattr(getattr(item, "callspec", None), "params", {})
            if "zero_bubble" in item.keywords or _names_a_zero_bubble_schedule(list(params.values())):
                item.add_marker(old_torch)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _names_a_zero_bubble_schedule(value) -> bool:
    """Whether a test's parameters (a layout's train dict, CLI overrides) name a zero-bubble schedule."""
    from xorl.distributed.parallel_config import PIPELINE_SCHEDULES

    if isinstance(value, str):
        return any(name in value for name, info in PIPELINE_SCHEDULES.items() if info.split_backward)
    if isinstance(value, dict):
        return _names_a_zero_bubble_schedule(list(value.values()))
    if isinstance(value, (list, tuple)):
        return any(_names_a_zero_bubble_schedule(v) for v in value)
    return False


# How long before pytest-timeout fires the harness gives up on a call: enough to kill the ranks
# and raise its own TimeoutError, which names the call that hung.
DEADLINE_MARGIN_S = 30.0


@pytest.hookimpl(hookwrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout starts a test's timer: every world call of this test ends before it fires."""
    set_deadline(time.monotonic() + settings.timeout - min(DEADLINE_MARGIN_S, settings.timeout / 4))
    yield


@pytest.hookimpl(hookwrapper=True, optionalhook=True)
def pytest_timeout_cancel_timer(item):
    set_deadline(None)
    yield


@pytest.fixture(scope="session")
def gloo_world():
    """Factory: ``gloo_world(4)`` returns a started 4-rank world shared by the whole session.

    A world whose call failed or timed out was torn down by the harness; the next
    ``gloo_world(n).run(...)`` starts it again.
    """

    worlds: dict[int, GlooWorld] = {}

    def get(world_size: int) -> GlooWorld:
        if world_size not in worlds:
            worlds[world_size] = GlooWorld(world_size)
        return worlds[world_size].start()

    yield get
    for world in worlds.values():
        world.close()
