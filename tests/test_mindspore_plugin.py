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
non-zero accum) are outside the training comparisons: momentum is 0.9 and every buffer is zero on the first
step. Where CPU cannot show what the contract computes (a first step with non-zero buffers), the test applies
``sgdfuse.reference`` to the values the fused graph feeds the op, read from MindSpore's kernel data dump.
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


_step_factory = _train_step  # tests that need another train step swap this (monkeypatch)


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
    step = _step_factory(net, opt)
    losses = np.array([step(x, y).asnumpy() for x, y in data])
    return {
        "losses": losses,
        # asnumpy() can share memory with the Parameter: copy before the next run touches it.
        "parameters": {p.name: p.asnumpy().copy() for p in opt.parameters},
        "buffers": {b.name: b.asnumpy().copy() for b in opt.momentum_buf},
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


# ---------------------------------------------------------------------------------------------------------
# A first step with non-zero buffers (step_t reset by a schedule, or buffers restored without step_t).
#
# mint's first step sets buf = grad whatever buf holds; so does MindSpore's CPU SGD kernel where stat > 0,
# so CPU numbers cannot show what Ascend would compute. The contract (sgdfuse.reference) computes
# accum*m + grad with stat = 1: the fused graph must feed the op a zeroed buffer on that step. The test reads
# the values the fused graph computes for the op's inputs from MindSpore's own kernel data dump (the buffer
# as written right before each SGD kernel, and the stat tensor), applies the contract to them, and compares
# with mint's unfused numbers.

_RESET_SCRIPT = """
import json, sys, numpy as np, mindspore as ms
from mindspore import mint, nn, ops
import sgdfuse.mindspore as sm
ms.set_context(mode=ms.GRAPH_MODE)
sm.register("cpu")
sys.path.insert(0, sys.argv[1])
from reset_model import build, data
net, opt = build()
def forward(x, y):
    return ((net(x) - y) ** 2).mean()
grad_fn = ms.value_and_grad(forward, None, opt.parameters)
@ms.jit
def step(x, y):
    loss, grads = grad_fn(x, y)
    opt(grads)
    return loss
@ms.jit
def gradients(x, y):
    return grad_fn(x, y)[1]
@ms.jit
def reset():
    ops.assign(opt.step_t, ms.Tensor(0, ms.int32))
    return opt.step_t + 0
x, y = data()
step(x, y); step(x, y)
reset()
with sm.paused():
    g = gradients(x, y)
before = {p.name: p.asnumpy().copy().tolist() for p in opt.parameters}
buffers = {b.name: b.asnumpy().copy().tolist() for b in opt.momentum_buf}
step(x, y)
print(json.dumps({"before": before, "buffers": buffers, "grads": [t.asnumpy().tolist() for t in g],
                  "names": [p.name for p in opt.parameters], "step_t": int(opt.step_t.asnumpy())}))
"""

_RESET_MODEL = '''
import numpy as np, mindspore as ms
from mindspore import mint, nn, ops

class Mlp(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1 = nn.Dense(4, 3)
        self.l2 = nn.Dense(3, 2)

    def construct(self, x):
        return self.l2(ops.relu(self.l1(x)))

def build():
    net = Mlp()
    rng = np.random.default_rng(1)
    for p in net.trainable_params():
        p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
    return net, mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, dampening=0.25)

def data():
    rng = np.random.default_rng(2)
    return ms.Tensor(rng.standard_normal((8, 4)).astype(np.float32)), ms.Tensor(rng.standard_normal((8, 2)).astype(np.float32))
'''


def _latest_dumps(directory: Path) -> dict[tuple[str, str, str, str], np.ndarray]:
    """{(op type, kernel, input|output, slot): array} from a MindSpore e2e dump, last execution of each."""
    latest: dict[tuple[str, str, str, str], tuple[int, Path]] = {}
    for path in directory.rglob("*.npy"):
        match = re.match(r"(\w+)\.(.+?)\.\d+\.\d+\.(\d+)\.(input|output)\.(\d+)\.", path.name)
        if match is None:
            continue
        op, kernel, stamp, io, slot = match.groups()
        key = (op, kernel, io, slot)
        if key not in latest or int(stamp) > latest[key][0]:
            latest[key] = (int(stamp), path)
    return {key: np.load(path) for key, (_, path) in latest.items()}


@pytest.mark.slow
def test_first_step_after_a_step_t_reset_with_nonzero_buffers_meets_the_contract(registration, tmp_path):
    import json
    import subprocess

    from sgdfuse.reference import sgd as contract_sgd

    (tmp_path / "reset_model.py").write_text(_RESET_MODEL)
    script = tmp_path / "reset_step.py"
    script.write_text(_RESET_SCRIPT)
    dump = tmp_path / "dump"
    config = tmp_path / "dump.json"
    config.write_text(json.dumps({
        "common_dump_settings": {"dump_mode": 1, "path": str(dump), "net_name": "Net", "iteration": "all",
                                 "saved_data": "tensor", "input_output": 0, "kernels": ["Assign", "BroadcastTo"],
                                 "support_device": [0, 1, 2, 3, 4, 5, 6, 7], "op_debug_mode": 0, "file_format": "npy"},
        "e2e_dump_settings": {"enable": True, "trans_flag": True},
    }))
    # The graph the contract needs: on CPU the pass leaves the zeroing to MindSpore's kernel (which sets
    # accum = grad where stat > 0) unless told otherwise.
    env = dict(os.environ, MINDSPORE_DUMP_CONFIG=str(config), SGDFUSE_MINDSPORE_FIRST_STEP_ZERO="1")
    result = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    fused = json.loads(result.stdout.strip().splitlines()[-1])
    assert fused["step_t"] == 1

    # The unfused reference: mint's own graph, same start, same reset.
    sys.path.insert(0, str(tmp_path))
    try:
        import reset_model
    finally:
        sys.path.remove(str(tmp_path))
    net, opt = reset_model.build()
    x, y = reset_model.data()
    with sm.paused():
        step = _train_step(net, opt)

        @ms.jit
        def reset():
            ops.assign(opt.step_t, ms.Tensor(0, ms.int32))
            return opt.step_t + 0

        step(x, y)
        step(x, y)
        reset()
        step(x, y)
    mint_params = {p.name: p.asnumpy().copy() for p in opt.parameters}
    mint_buffers = {b.name: b.asnumpy().copy() for b in opt.momentum_buf}

    # The CPU graph (no zeroing: the CPU kernel sets accum = grad where stat > 0) gives mint's numbers too.
    net, opt = reset_model.build()
    step = _train_step(net, opt)

    @ms.jit
    def reset_cpu():
        ops.assign(opt.step_t, ms.Tensor(0, ms.int32))
        return opt.step_t + 0

    step(x, y)
    step(x, y)
    with sm.paused():
        reset_cpu()
    step(x, y)
    for p in opt.parameters:
        np.testing.assert_allclose(p.asnumpy(), mint_params[p.name], rtol=RTOL, atol=ATOL, err_msg=p.name)
    for b in opt.momentum_buf:
        np.testing.assert_allclose(b.asnumpy(), mint_buffers[b.name], rtol=RTOL, atol=ATOL, err_msg=b.name)
    assert registration.report(registration.graphs()[-1]).fused, "the CPU step was fused"

    dumps = _latest_dumps(dump)
    # What the fused graph feeds each SGD on the reset step, by shape (the four shapes differ): the buffer as
    # written right before the op (float Assign outputs) and stat (float BroadcastTo outputs).
    accum_fed = {v.shape: v for (op, _, io, _), v in dumps.items() if op == "Assign" and io == "output" and v.dtype == np.float32}
    stat_fed = {v.shape: v for (op, _, io, _), v in dumps.items() if op == "BroadcastTo" and io == "output" and v.dtype == np.float32}
    f32 = np.float32
    for name, grad in zip(fused["names"], fused["grads"]):
        before = np.array(fused["before"][name], f32)
        old_buffer = np.array(fused["buffers"]["momentum_buf." + name], f32)
        assert np.abs(old_buffer).max() > 1e-3, "the buffers must be non-zero when step_t is reset"
        accum, stat = accum_fed[before.shape], stat_fed[before.shape]
        assert np.all(stat == 1), "stat is 1 on the step after the reset"
        p_out, accum_out, _ = contract_sgd(before, np.array(grad, f32), np.array(0.1, f32), accum, np.array(0.9, f32), stat, dampening=0.25)
        np.testing.assert_allclose(p_out, mint_params[name], rtol=RTOL, atol=ATOL, err_msg=name)
        np.testing.assert_allclose(accum_out, mint_buffers["momentum_buf." + name], rtol=RTOL, atol=ATOL, err_msg=name)


# ---------------------------------------------------------------------------------------------------------
# Train steps built to break the pass: a caller's own gradient term read before the weight changes, several
# parameter groups, `if`s around and before the optimizer. Each must give mint's unfused numbers and a
# report that names every parameter once.


class _SameShapes(nn.Cell):
    """Two same-shaped Dense layers: MindSpore shares mint's update graph between their parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.SequentialCell([nn.Dense(4, 4), nn.ReLU(), nn.Dense(4, 4), nn.ReLU(), nn.Dense(4, 2)])

    def construct(self, x):
        return self.body(x)


def _written_before_update_step(kind: str):
    """A train step whose caller adds its own L2 term (grad + 0.1*w) and then writes w before opt(grads):
    ``sam`` moves w by +e, recomputes the gradients, adds the term and moves w back by -e (SAM-style);
    ``assign`` adds the term and then halves w."""

    def factory(net: nn.Cell, opt):
        params = opt.parameters

        def forward(x, y):
            return ((net(x) - y) ** 2).mean()

        grad_fn = ms.value_and_grad(forward, None, params)

        @ms.jit
        def step(x, y):
            loss, grads = grad_fn(x, y)
            if kind == "sam":
                for p in params:
                    ops.assign_add(p, p * 0 + 0.01)
                loss, grads = grad_fn(x, y)
                grads = tuple(mint.add(g, p, alpha=0.1) for g, p in zip(grads, params))
                for p in params:
                    ops.assign_sub(p, p * 0 + 0.01)
            else:
                grads = tuple(mint.add(g, p, alpha=0.1) for g, p in zip(grads, params))
                for p in params:
                    ops.assign(p, p * 0.5)
            opt(grads)
            return loss

        return step

    return factory


def _names_once(report: Report, expected: set[str]) -> None:
    names = [u.parameters for u in report.fused] + [r.candidate for r in report.refused]
    assert sorted(names) == sorted(expected), "every parameter is named exactly once"


@pytest.mark.parametrize("kind", ["sam", "assign"])
def test_a_callers_gradient_term_read_before_the_weight_is_written_stays_in_the_gradient(registration, monkeypatch, kind):
    monkeypatch.setattr(sys.modules[__name__], "_Mlp", _SameShapes)
    monkeypatch.setattr(sys.modules[__name__], "_step_factory", _written_before_update_step(kind))
    unfused, fused, report = _train_both(
        registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.05, momentum=0.9, dampening=0.1)
    )
    _compare(unfused, fused)
    _names_once(report, set(unfused["parameters"]))
    assert len(report.fused) == 6
    # The term grad + 0.1*w read w before the writes: it is not the op's weight decay (which reads w later).
    assert all(u.weight_decay == 0.0 for u in report.fused)
    graph = [r for r in registration.records() if r.get("event") == "graph"][-1]
    assert graph["inlined_calls"] == 4, "the four same-shaped parameters went through a shared update graph"


def test_parameter_groups_with_equal_hyperparameters_all_fuse(registration, monkeypatch):
    """42 parameters in 4 groups: the shared update graph is reached through each group's hyper_map graph,
    which passes step_t down as a graph parameter."""
    monkeypatch.setattr(sys.modules[__name__], "_Mlp", _Deep)

    def make(net):
        params = net.trainable_params()
        groups = [{"params": params[i::4]} for i in range(4)]
        return mint.optim.SGD(groups, lr=0.05, momentum=0.9, dampening=0.25, weight_decay=1e-4)

    unfused, fused, report = _train_both(registration, make)
    _compare(unfused, fused)
    _names_once(report, set(unfused["parameters"]))
    assert len(report.fused) == 42 and not report.refused
    assert all(u.weight_decay == 1e-4 and not u.gradient.startswith("AddExt") for u in report.fused)
    graph = [r for r in registration.records() if r.get("event") == "graph"][-1]
    assert graph["switch_calls_after"] == 0


def _if_step(kind: str):
    """``side``: an `if` with a side effect before opt(grads) (MindSpore copies the code after it into both
    branches); ``around``: the user's own `if loss > 0: opt(grads)`."""

    def factory(net: nn.Cell, opt):
        def forward(x, y):
            return ((net(x) - y) ** 2).mean()

        grad_fn = ms.value_and_grad(forward, None, opt.parameters)
        counter = ms.Parameter(ms.Tensor(0, ms.int32), name=f"counter_{id(net)}")

        @ms.jit
        def step(x, y):
            loss, grads = grad_fn(x, y)
            if kind == "side":
                if loss > 0.5:
                    ops.assign_add(counter, ms.Tensor(1, ms.int32))
                opt(grads)
            else:
                if loss > 0:
                    opt(grads)
            return loss

        return step

    return factory


@pytest.mark.parametrize("kind", ["side", "around"])
def test_ifs_near_the_optimizer_report_each_parameter_once(registration, monkeypatch, kind):
    monkeypatch.setattr(sys.modules[__name__], "_step_factory", _if_step(kind))
    unfused, fused, report = _train_both(
        registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    )
    _compare(unfused, fused)
    _names_once(report, set(unfused["parameters"]))
    assert not report.refused, "the user's `if` is not an SGD update"
    assert all(u.gradient and u.accum == "momentum_buf." + u.parameters for u in report.fused)


def _lr_parameter_step(net: nn.Cell, opt):
    """A train step whose learning rate lives in a Parameter (group 0's ``lr_float``), changed between
    compiled steps by a compiled assign (``set_data`` after compiling is not seen by the compiled graph)."""
    lr = opt.param_groups[0]["lr_float"]

    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)

    @ms.jit
    def step(x, y):
        loss, grads = grad_fn(x, y)
        opt(grads)
        return loss

    @ms.jit
    def set_lr(value):
        ops.assign(lr, value)
        return lr + 0

    frozen: dict[str, np.ndarray] = {}

    def run(x, y):
        if int(opt.step_t.asnumpy()) == 3:
            with sm.paused():  # nothing to fuse in it; and one fused graph per run, as _train_both counts
                set_lr(ms.Tensor(0.0, ms.float32))
            frozen.update({p.name: p.asnumpy().copy() for p in opt.parameters})
        loss = step(x, y)
        for p in opt.parameters:  # lr 0 from step 4 on: the compiled step saw the new value
            if frozen:
                np.testing.assert_array_equal(p.asnumpy(), frozen[p.name], err_msg=p.name)
        return loss

    return run


def test_a_learning_rate_held_in_a_parameter_is_fed_to_the_op(registration, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_step_factory", _lr_parameter_step)

    def make(net):
        opt = mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9, dampening=0.25)
        # A second optimizer in one process needs Parameter names of its own.
        opt.param_groups[0]["lr_float"] = ms.Parameter(ms.Tensor(0.1, ms.float32), name=f"lr_{id(opt)}")
        return opt

    unfused, fused, report = _train_both(registration, make)
    _compare(unfused, fused)
    assert len(report.fused) == 4 and not report.refused
    assert all(u.learning_rate == u.learning_rate_input and u.learning_rate.startswith("lr_") for u in report.fused)


def test_momentum_zero_parameters_are_listed_as_left_alone(registration):
    unfused, fused, report = _train_both(registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.1))
    _compare(unfused, fused)
    assert not report.fused
    assert sorted(r.candidate for r in report.refused) == sorted(unfused["parameters"])
    assert all(r.reason == "momentum" and "momentum 0" in r.detail for r in report.refused)


_REGISTER_SCRIPT = """
import json, sys, warnings, numpy as np, mindspore as ms
from mindspore import mint, nn, ops
import sgdfuse.mindspore as sm
ms.set_context(mode=ms.GRAPH_MODE)

def train_step():
    net = nn.Dense(4, 2)
    opt = mint.optim.SGD(net.trainable_params(), lr=0.1, momentum=0.9)
    opt.step_t.name = f"step_t_{id(opt)}"  # a second optimizer needs Parameter names of its own
    def forward(x):
        return net(x).sum()
    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    @ms.jit
    def step(x):
        loss, grads = grad_fn(x)
        opt(grads)
        return loss
    return step

x = ms.Tensor(np.ones((2, 4), np.float32))
train_step()(x)  # compiled before any registration
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    registration = sm.register(sys.argv[1])
out["warnings"] = [str(w.message) for w in caught]
out["report_path"] = str(registration.report_path)
train_step()(x)
out["records"] = registration.records()
print(json.dumps(out))
"""


def _register_in_fresh_process(tmp_path: Path, device: str) -> dict:
    import json
    import subprocess

    script = tmp_path / "register.py"
    script.write_text(_REGISTER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGDFUSE_MINDSPORE_")}
    result = subprocess.run([sys.executable, str(script), device], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_registering_for_another_device_or_after_a_compile_warns_and_the_record_file_goes_away(tmp_path):
    out = _register_in_fresh_process(tmp_path, "Ascend")
    device_warnings = [w for w in out["warnings"] if "registered for 'ascend'" in w]
    assert len(device_warnings) == 1 and "'CPU'" in device_warnings[0] and "unfused" in device_warnings[0]
    assert any("compiled graphs in this process before register()" in w for w in out["warnings"])
    # The CPU graph compiled afterwards is left alone, and the record says why.
    assert [r["event"] for r in out["records"]] == ["skipped"] and out["records"][0]["device"] == "CPU"
    assert not Path(out["report_path"]).exists(), "the temporary record file is removed when the process exits"

    out = _register_in_fresh_process(tmp_path, "CPU")  # MindSpore's own spelling
    assert not any("registered for" in w for w in out["warnings"])
    assert [r["event"] for r in out["records"]].count("fused") == 2


def _buffers_halved_step(net: nn.Cell, opt):
    def forward(x, y):
        return ((net(x) - y) ** 2).mean()

    grad_fn = ms.value_and_grad(forward, None, opt.parameters)
    buffers = opt.momentum_buf

    @ms.jit
    def step(x, y):
        loss, grads = grad_fn(x, y)
        for b in buffers:
            ops.assign(b, b * 0.5)
        opt(grads)
        return loss

    return step


def test_buffers_written_by_the_caller_are_refused_alike_in_shared_and_own_update_graphs(registration, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_Mlp", _SameShapes)
    monkeypatch.setattr(sys.modules[__name__], "_step_factory", _buffers_halved_step)
    unfused, fused, report = _train_both(
        registration, lambda net: mint.optim.SGD(net.trainable_params(), lr=0.05, momentum=0.9, dampening=0.1)
    )
    _compare(unfused, fused)
    _names_once(report, set(unfused["parameters"]))
    assert not report.fused and {r.reason for r in report.refused} == {"other-writes"}
