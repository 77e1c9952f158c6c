"""``optimize`` and ``inspect`` pause Python's cyclic garbage collector while they run (docs/design.md,
"Performance") and always leave it as they found it: on, off, and after an error."""

from __future__ import annotations

import gc

import pytest

import sgdfuse
from sgdfuse.errors import ModelLoadError
from graphs import momentum_sgd


@pytest.fixture
def collector_state():
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


@pytest.mark.parametrize("enabled", [True, False])
def test_optimize_pauses_the_collector_and_leaves_it_as_it_was(collector_state, enabled):
    (gc.enable if enabled else gc.disable)()
    seen: list[bool] = []
    result = sgdfuse.optimize(momentum_sgd(), verify=False, progress=lambda stage: seen.append(gc.isenabled()))
    assert len(result.report.fused) == 1
    assert seen and not any(seen)
    assert gc.isenabled() is enabled


@pytest.mark.parametrize("enabled", [True, False])
def test_inspect_leaves_the_collector_as_it_was(collector_state, enabled):
    (gc.enable if enabled else gc.disable)()
    assert len(sgdfuse.inspect(momentum_sgd()).fused) == 1
    assert gc.isenabled() is enabled


def test_the_collector_is_restored_after_an_error(collector_state, tmp_path):
    gc.enable()
    with pytest.raises(ModelLoadError):
        sgdfuse.optimize(tmp_path / "missing.onnx")
    assert gc.isenabled()
