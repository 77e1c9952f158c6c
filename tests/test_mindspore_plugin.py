"""The MindSpore custom pass (sgdfuse.mindspore.register) on CPU.

The proof: a small network trained with ``mint.optim.SGD`` gives the same losses, parameters, momentum
buffers and step counter with and without the pass, and the IR MindSpore dumps after the pass holds one
``SGD`` per parameter and no ``Switch``. The reference is MindSpore itself running mint's unfused graph
(compiled under :func:`sgdfuse.mindspore.paused`), never our code.

Tolerance: ``rtol=1e-5, atol=1e-6`` on every compared FLOAT value after 6 steps. Both sides compute the same
FLOAT operations (grad + wd*p, m*buf + (1-d)*grad, p - lr*buf) so only rounding order may differ: seen here,
bit-identical without Nesterov and within 1.2e-7 with it. A wrong first step or dampening would be off by
25% (d = 0.25), a wrong lr or momentum by far more than the bound.
The MindSpore CPU ``SGD`` kernel's known divergences from the contract (momentum == 0; stat > 0 with a
non-zero accum) are outside these runs: momentum is 0.9 and every buffer is zero on the first step.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore", reason="MindSpore is not installed here (CI installs .[test,mindspore])")

from mindspore import mint, nn, ops  # noqa: E402

import sgdfuse.mindspore as sm  # noqa: E402
from sgdfuse.mindspore import plugin as plugin_module  # noqa: E402
from sgdfuse.mindspore.errors import PluginBuildError  # noqa: E402
from sgdfuse.report import Report  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
STEPS = 6


@pytest.fixture(scope="module")
def registration():
    # set_device is refused once another test ran a kernel in this process; the CPU wheel's default is CPU.
    ms.set_context(mode=ms.GRAPH_MODE)
    assert ms.get_context("device_target") == "CPU"
    return sm.register("cpu")


class _Mlp(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Dense(4, 3)
        self.l2 = nn.Dense(3, 2)

    def construct(self, x):
        return self.l2(ops.relu(self.l1(x)))


def _train_step(net: nn.Cell, opt):
    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    @ms.jit
    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    return step


def _data(steps: int = STEPS):
    rng = np.random.default_rng(0)
    return [
        (ms.Tensor(rng.standard_normal((8, 4)).astype(np.float32)), ms.Tensor(rng.standard_normal((8, 2)).astype(np.float32)))
        for _ in range(steps)
    ]


def _pair(make_optimizer):
    """Two identical networks and optimizers (the second copies the first's initial values)."""
    out = []
    for _ in range(2):
        net = _Mlp()
        out.append((net, make_optimizer(net)))
    for a, b in zip(out[0][1].parameters, out[1][1].parameters):
        b.set_data(ms.Tensor(a.asnumpy()))
    return out


def _run(net, opt, data):
    step = _train_step(net, opt)
    losses = np.array([step(x, y).asnumpy() for x, y in data])
    return {
        "losses": losses,
        "parameters": {p.name: p.asnumpy() for p in opt.parameters},
        "buffers": {b.name: b.asnumpy() for b in opt.momentum_buf},
        "step_t": int(opt.step_t.asnumpy()),
    }


def _compare(unfused: dict, fused: dict) -> None:
    np.testing.assert_allclose(fused["losses"], unfused["losses"], rtol=RTOL, atol=ATOL)
    assert fused["parameters"].keys() == unfused["parameters"].keys()
    for name in unfused["parameters"]:
        np.testing.assert_allclose(fused["parameters"][name], unfused["parameters"][name], rtol=RTOL, atol=ATOL, err_msg=name)
    for name in unfused["buffers"]:
        np.testing.assert_allclose(fused["buffers"][name], unfused["buffers"][name], rtol=RTOL, atol=ATOL, err_msg=name)
    assert fused["step_t"] == unfused["step_t"] == STEPS


def _train_both(registration, make_optimizer) -> tuple[dict, dict, Report]:
    (net_a, opt_a), (net_b, opt_b) = _pair(make_optimizer)
    data = _data()
    graphs_before = len(registration.graphs())
    with sm.paused():
        unfused = _run(net_a, opt_a, data)
    assert len(registration.graphs()) == graphs_before, "the paused compile must not run the pass"
    fused = _run(net_b, opt_b, data)
    graphs = registration.graphs()
    assert len(graphs) == graphs_before + 1
    return unfused, fused, registration.report(graphs[-1])


def test_mint_sgd_with_dampening_and_weight_decay_trains_the_same_fused(registration):
    unfused, fused, report = _train_both(
        registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, dampening=0.25, weight_decay=1e-4)
    )
    _compare(unfused, fused)
    assert len(report.fused) == 4 and not report.refused
    for update in report.fused:
        assert (update.learning_rate, update.momentum, update.dampening, update.weight_decay) == (0.1, 0.9, 0.25, 1e-4)
        assert not update.nesterov and update.dtype == "FLOAT"
        assert update.accum == "momentum_buf." + update.parameters


def test_mint_sgd_nesterov_trains_the_same_fused(registration):
    unfused, fused, report = _train_both(
        registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, weight_decay=1e-4, nesterov=True)
    )
    _compare(unfused, fused)
    assert len(report.fused) == 4 and all(u.nesterov and u.dampening == 0.0 for u in report.fused)


def test_parameter_groups_without_weight_decay_and_with_maximize_fuse_per_group(registration):
    def make(net):
        weights = [p for p in net.trainable_params() if p.name.endswith("weight")]
        biases = [p for p in net.trainable_params() if p.name.endswith("bias")]
        return mint.optim.SGD(
            [{"params": weights, "weight_decay": 1e-4, "dampening": 0.25}, {"params": biases, "maximize": True, "lr": 0.05}],
            lr=0.1,
            momentum=0.9,
        )

    unfused, fused, report = _train_both(registration, make)
    _compare(unfused, fused)
    by_name = {u.parameters: u for u in report.fused}
    assert by_name["l1.weight"].weight_decay == 1e-4 and by_name["l1.weight"].dampening == 0.25
    assert by_name["l1.bias"].learning_rate == 0.05 and by_name["l1.bias"].weight_decay == 0.0
    assert by_name["l1.bias"].maximize and not by_name["l1.weight"].maximize


def _top_graph(ir_text: str) -> str:
    """The first subgraph body of a MindSpore .ir dump (the top graph)."""
    start = ir_text.index("subgraph @")
    return ir_text[start : ir_text.index("\n}\n", start)]


def _count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


# MindSpore reads MS_DEV_SAVE_GRAPHS once per process, at its first compile: dump in a fresh process.
_DUMP_SCRIPT = """
import sys, numpy as np, mindspore as ms
from mindspore import mint, nn, ops
import sgdfuse.mindspore as sm
ms.set_context(mode=ms.GRAPH_MODE)
ms.set_device("CPU")
sm.register("cpu")
layers = []
for _ in range(int(sys.argv[2])):
    layers += [nn.Dense(4, 4), nn.ReLU()]
net = nn.SequentialCell(layers + [nn.Dense(4, 2)])
opt = mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, dampening=0.25, weight_decay=1e-4)
def forward(x, y):
    return ((net(x) - y) ** 2).mean()
grad_fn = ms.value_and_grad(forward, None, opt.parameters)
@ms.jit
def step(x, y):
    loss, grads = grad_fn(x, y)
    opt(grads)
    return loss
x = ms.Tensor(np.ones((8, 4), np.float32)); y = ms.Tensor(np.zeros((8, 2), np.float32))
if sys.argv[1] == "paused":
    with sm.paused():
        step(x, y)
else:
    step(x, y)
print(",".join(p.name for p in opt.parameters))
"""


def _dump(tmp_path: Path, mode: str, hidden_layers: int = 1) -> tuple[Path, list[str]]:
    import subprocess
    import sys

    script = tmp_path / "dump_step.py"
    script.write_text(_DUMP_SCRIPT)
    dumps = tmp_path / mode
    env = dict(os.environ, MS_DEV_SAVE_GRAPHS="1", MS_DEV_SAVE_GRAPHS_PATH=str(dumps))
    result = subprocess.run(
        [sys.executable, str(script), mode, str(hidden_layers)], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return dumps, result.stdout.strip().splitlines()[-1].split(",")


@pytest.mark.slow
@pytest.mark.parametrize("hidden_layers", [1, 20], ids=["inlined-updates", "shared-update-graphs"])
def test_ir_after_the_pass_has_one_sgd_per_parameter_and_no_switch(registration, tmp_path, hidden_layers):
    """With few parameters MindSpore inlines each update into the top graph; with many (here 42) it keeps
    one update graph per parameter shape and calls it per parameter, which the pass rewrites and inlines."""
    dumps, params = _dump(tmp_path, "fused", hidden_layers)
    after_files = sorted(dumps.rglob(f"*_custom_frontend_pass_{sm.PASS_NAME}_*.ir"))
    assert after_files, "MindSpore dumped no IR after the custom pass"
    after = after_files[0].read_text()
    # The updates run as one call of a no_inline subgraph holding one SGD per parameter (see
    # OutlineUpdateRuns in sgdfuse_pass.cc: in-place writes inside the backward's kernel graph slow it).
    assert len(params) == 2 * hidden_layers + 2 and _count(r"= SGD\(", after) == len(params)
    for name in params:  # each SGD updates one parameter with its own momentum buffer
        pattern = rf"= SGD\(%para\d+_{re.escape(name)}, [^\n]*%para\d+_momentum_buf\.{re.escape(name)},"
        assert _count(pattern, after) == 1, name
    assert _count(r"subgraph @[^\n]*sgdfuse_updates", after) == 1
    assert "Switch(" not in after, "a Switch (or a branch graph) survived the pass"
    assert "InplaceCopy" not in after and "InplaceMuls" not in after
    # The graph the pass was given had one Switch per parameter (or per shared update graph).
    before = sorted(dumps.rglob("*_cse_after_recomputation_*.ir"))[0].read_text()
    assert 0 < _count(r"= Switch\(", before) <= len(params)
    # And the kernel graphs that run hold the SGD kernels.
    built = sorted(dumps.rglob("graph_build_*.ir"))
    assert built and sum(_count(r"= SGD\(", f.read_text()) for f in built) == len(params)


@pytest.mark.slow
def test_paused_compiles_keep_the_unfused_graph(registration, tmp_path):
    dumps, params = _dump(tmp_path, "paused")
    validate = sorted(dumps.rglob("*_validate_*.ir"))[0].read_text()
    assert _count(r"= Switch\(", _top_graph(validate)) == len(params)
    assert "= SGD(" not in validate


class _Deep(nn.Cell):
    """Enough parameters (42) that MindSpore shares one update graph per parameter shape."""

    def __init__(self) -> None:
        super().__init__()
        layers = [nn.Dense(4, 4)]
        for _ in range(19):
            layers += [nn.ReLU(), nn.Dense(4, 4)]
        self.body = nn.SequentialCell(layers + [nn.ReLU(), nn.Dense(4, 2)])

    def construct(self, x):
        return self.body(x)


def test_many_parameters_sharing_an_update_graph_train_the_same_fused(registration, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_Mlp", _Deep)
    for nesterov in (False, True):
        kw = {"nesterov": True} if nesterov else {"dampening": 0.25}
        unfused, fused, report = _train_both(
            registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.05, momentum=0.9, weight_decay=1e-4, **kw)
        )
        _compare(unfused, fused)
        assert len(report.fused) == 42 and not report.refused
        # The weight decay the callers of the shared graphs applied is folded into each SGD op.
        assert all(u.weight_decay == 1e-4 and not u.gradient.startswith("AddExt") for u in report.fused)
        assert {u.parameters for u in report.fused} == set(unfused["parameters"])
        graph = [r for r in registration.records() if r.get("event") == "graph"][-1]
        # 40 updates (20 weights of one shape, 20 biases of another) sat in shared graphs and were inlined;
        # the last layer's two parameters have shapes of their own, which MindSpore inlines itself.
        assert graph["switch_calls_after"] == 0 and graph["inlined_calls"] == 40
        assert graph["outlined_update_runs"] == 1


def test_register_is_idempotent_and_checks_the_device(registration):
    again = sm.register("cpu")
    assert again.plugin.path == registration.plugin.path
    with pytest.raises(ValueError, match="device must be one of"):
        sm.register("tpu")


def test_plugin_build_is_cached_per_mindspore_version_and_compiler(registration):
    build = sm.build_plugin()
    assert build.cached and build.path == registration.plugin.path and build.path.is_file()
    assert f"mindspore-{ms.__version__}" in str(build.path)


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-sgdfuse")
    with pytest.raises(PluginBuildError, match="no C\\+\\+ compiler found") as info:
        sm.build_plugin(cache_dir=tmp_path)
    assert info.value.reason == "no-compiler"


def test_missing_headers_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(plugin_module, "_HEADER_PROBE", "include/no-such-header.h")
    with pytest.raises(PluginBuildError, match="ships no custom pass headers") as info:
        sm.build_plugin(cache_dir=tmp_path)
    assert info.value.reason == "no-headers"


def test_compile_failure_reports_the_compiler_output(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cc"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(plugin_module, "_SOURCE", broken)
    with pytest.raises(PluginBuildError, match="failed; last lines") as info:
        sm.build_plugin(cache_dir=tmp_path / "cache")
    assert info.value.reason == "compile-failed" and "error" in info.value.log
    assert not list((tmp_path / "cache").rglob("*.so")), "a failed build must leave no library behind"
