"""Resuming a fused training step from a checkpoint (``sgdfuse state``, :mod:`sgdfuse.checkpoint`).

The data in testdata/checkpoint/ comes from testdata/checkpoint/make_checkpoint.py (PyTorch 2.13): a step of
torch's functional SGD exported to ONNX, the state of ``torch.optim.SGD`` after K eager steps (``gate`` had no
gradient then, so it has no momentum buffer), and N further eager steps of ``torch.optim.SGD``. Expected
values are PyTorch's; the tolerance is the per-step bound of :mod:`sgdfuse.verify` carried through the
N steps (derived below).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import sgdfuse
from sgdfuse import cli
from sgdfuse.checkpoint import Checkpoint, checkpoint_feeds, model_state, read_checkpoint
from sgdfuse.errors import CheckpointError
from sgdfuse.runtime import make_session
from sgdfuse.verify import error_bound_values

DATA = Path(__file__).resolve().parent.parent / "testdata" / "checkpoint"
MANIFEST = json.loads((DATA / "manifest.json").read_text())
NAMES = [n for group in MANIFEST["groups"] for n in group["names"]]
GROUP = {n: group for group in MANIFEST["groups"] for n in group["names"]}


@pytest.fixture(scope="module")
def fused(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fused") / "fused.onnx"
    result = sgdfuse.optimize(DATA / "step.onnx")
    assert len(result.report.fused) == len(NAMES)
    result.save(path)
    return path


def _flat() -> dict[str, np.ndarray]:
    with np.load(DATA / "checkpoint.npz") as data:
        return {k: data[k] for k in data.files}


def _write_npz(path: Path, flat: dict[str, np.ndarray]) -> Path:
    np.savez(path, **flat)
    return path


def _run_steps(model: Path, feeds: dict[str, np.ndarray], expected: dict[str, np.ndarray], steps: int) -> list[dict[str, np.ndarray]]:
    """Run ``steps`` steps of the fused step in onnxruntime, feeding each step's eager gradients and the
    previous step's outputs as state."""
    session = make_session(onnx.load(model))
    state = {n: feeds[n] for n in NAMES} | {f"buf.{n}": feeds[f"buf.{n}"] for n in NAMES}
    results = []
    for t in range(steps):
        run_feeds = dict(state) | {f"grad.{n}": expected[f"grad/{t}/{n}"] for n in NAMES}
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, run_feeds)))
        state = {n: outputs[f"{n}.out"] for n in NAMES} | {f"buf.{n}": outputs[f"buf.{n}.out"] for n in NAMES}
        results.append(state)
    return results


def _accumulated_bounds(start: dict[str, np.ndarray], expected: dict[str, np.ndarray], steps: int) -> list[dict[str, np.ndarray]]:
    """Per-element bounds on |fused - eager| after each step.

    One step from the same inputs differs by at most the bound of :func:`sgdfuse.verify.error_bound_values`
    (``b_p``, ``b_a``). Inputs that already differ by ``e_p``, ``e_a`` move the results by at most what the
    update's linear map gives them: ``e_a' = m·e_a + |1-d|·wd·e_p + b_a`` and ``e_p' = e_p + lr·(e_a'`` (times
    ``m``, plus ``wd·e_p`` for Nesterov)``) + b_p``. The bounds are computed on PyTorch's values.
    """
    bounds, e_p, e_a = [], {n: 0.0 for n in NAMES}, {n: 0.0 for n in NAMES}
    params = {n: start[n] for n in NAMES}
    bufs = {n: start.get(f"{n}/momentum_buffer", np.zeros_like(start[n])) for n in NAMES}
    for t in range(steps):
        step_bounds = {}
        for n in NAMES:
            h = GROUP[n]
            m, d, wd, lr, nesterov = h["momentum"], h["dampening"], h["weight_decay"], h["lr"], h["nesterov"]
            b_p, b_a = error_bound_values(m, d, wd, nesterov, params[n], expected[f"grad/{t}/{n}"], bufs[n], lr, TensorProto.FLOAT)
            e_a[n] = m * e_a[n] + abs(1 - d) * wd * e_p[n] + b_a
            e_p[n] = e_p[n] + lr * ((m * e_a[n] + wd * e_p[n]) if nesterov else e_a[n]) + b_p
            step_bounds[n], step_bounds[f"buf.{n}"] = e_p[n], e_a[n]
            params[n], bufs[n] = expected[f"param/{t}/{n}"], expected[f"buf/{t}/{n}"]
        bounds.append(step_bounds)
    return bounds


def test_resume_from_torch_checkpoint_matches_torch_sgd_including_a_parameter_without_buffer(fused):
    flat = _flat()
    assert "gate/momentum_buffer" not in flat  # the generator's premise: gate's buffer is still None
    result = checkpoint_feeds(DATA / "checkpoint.npz", fused)
    entries = {u.checkpoint_name: u for u in result.updates}
    assert entries["gate"].stat == 1 and not entries["gate"].has_buffer
    assert all(entries[n].stat == 0 and entries[n].has_buffer for n in NAMES if n != "gate")
    assert not result.warnings
    with np.load(DATA / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    steps = MANIFEST["n"]
    ran = _run_steps(fused, result.feeds, expected, steps)
    bounds = _accumulated_bounds(flat, expected, steps)
    for t in range(steps):
        for n in NAMES:
            for got, want, bound in ((ran[t][n], expected[f"param/{t}/{n}"], bounds[t][n]), (ran[t][f"buf.{n}"], expected[f"buf/{t}/{n}"], bounds[t][f"buf.{n}"])):
                excess = np.abs(got.astype(np.float64) - want) - bound
                assert np.all(excess <= 0), (t, n, float(np.max(excess)))


def test_safetensors_export_gives_the_same_feeds_as_npz(fused):
    from_npz = checkpoint_feeds(DATA / "checkpoint.npz", fused).feeds
    from_safetensors = checkpoint_feeds(DATA / "checkpoint.safetensors", fused).feeds
    assert from_npz.keys() == from_safetensors.keys()
    for name in from_npz:
        np.testing.assert_array_equal(from_safetensors[name], from_npz[name])


def test_feeds_are_the_checkpoint_tensors_by_onnx_input_name_and_zeros_for_a_missing_buffer(fused):
    flat = _flat()
    feeds = checkpoint_feeds(DATA / "checkpoint.npz", fused).feeds
    assert set(feeds) == set(NAMES) | {f"buf.{n}" for n in NAMES}
    for n in NAMES:
        np.testing.assert_array_equal(feeds[n], flat[n])
        np.testing.assert_array_equal(feeds[f"buf.{n}"], flat.get(f"{n}/momentum_buffer", np.zeros_like(flat[n])))


def test_ge_init_feeds_start_the_lowered_step_where_onnxruntime_starts(fused):
    result = checkpoint_feeds(DATA / "checkpoint.npz", fused, soc="Ascend910B2")
    assert result.init_feeds is not None and all(k.endswith("/initial_value") for k in result.init_feeds)
    lowered = sgdfuse.lower(fused, soc="Ascend910B2")
    runner = lowered.runner()
    runner.executor.run(lowered.init_model.graph[0], result.init_feeds)  # the init graph, fed by Data op name
    with np.load(DATA / "expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    want = _run_steps(fused, result.feeds, expected, 1)[0]
    got = runner.step({f"grad.{n}": expected[f"grad/0/{n}"] for n in NAMES})
    for n in NAMES:
        np.testing.assert_array_equal(got[f"{n}.out"], want[n])


# -- the command: outputs, warnings, errors -----------------------------------------------------------------
def _cli(*args, capsys) -> tuple[int, str, str]:
    try:
        cli.main([str(a) for a in args])
        code = 0
    except SystemExit as exit_:
        code = int(exit_.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_state_command_writes_feeds_init_feeds_and_json(fused, tmp_path, capsys):
    code, out, err = _cli("state", DATA / "checkpoint.npz", "--model", fused, "-o", tmp_path / "feeds.npz", "--soc", "ascend910b2", "--json", tmp_path / "map.json", capsys=capsys)
    assert code == 0, err
    with np.load(tmp_path / "feeds.npz") as feeds, np.load(tmp_path / "feeds.init.npz") as init:
        assert set(feeds.files) == set(NAMES) | {f"buf.{n}" for n in NAMES}
        assert set(init.files) == {f"{k}/initial_value" for k in feeds.files}
        for k in feeds.files:
            np.testing.assert_array_equal(init[f"{k}/initial_value"], feeds[k])
    mapping = json.loads((tmp_path / "map.json").read_text())
    assert {u["checkpoint_name"]: u["stat"] for u in mapping["updates"]}["gate"] == 1
    assert "gate" in out


def _assert_refused(code: int, err: str, tensor: str, tmp_path: Path, written: str = "feeds.npz") -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error:") and repr(tensor) in lines[0], err
    assert not (tmp_path / written).exists() and not list(tmp_path.glob(".sgdfuse-*"))


@pytest.mark.parametrize(
    "edit, tensor",
    [
        (lambda f: f.update({"fc1.bias": f["fc1.bias"][:4]}), "fc1.bias"),
        (lambda f: f.update({"fc2.weight": f["fc2.weight"].astype(np.float64)}), "fc2.weight"),
        (lambda f: f.update({"fc1.weight/momentum_buffer": f["fc1.weight/momentum_buffer"].T.copy()}), "fc1.weight/momentum_buffer"),
        (lambda f: f.pop("gate"), "gate"),
    ],
    ids=["shape", "dtype", "buffer-shape", "missing-parameter"],
)
def test_a_mismatch_is_one_error_naming_the_tensor_and_nothing_is_written(fused, tmp_path, capsys, edit, tensor):
    flat = _flat()
    edit(flat)
    checkpoint = _write_npz(tmp_path / "ckpt.npz", flat)
    code, _, err = _cli("state", checkpoint, "--model", fused, "-o", tmp_path / "feeds.npz", "--soc", "Ascend910B2", capsys=capsys)
    _assert_refused(code, err, tensor, tmp_path)
    assert not (tmp_path / "feeds.init.npz").exists()


def test_an_extra_tensor_is_a_warning_and_the_feeds_are_written(fused, tmp_path, capsys):
    flat = _flat() | {"bn.running_mean": np.zeros(3, np.float32)}
    code, _, err = _cli("state", _write_npz(tmp_path / "ckpt.npz", flat), "--model", fused, "-o", tmp_path / "feeds.npz", capsys=capsys)
    assert code == 0
    assert [line for line in err.splitlines() if line.startswith("warning:") and "'bn.running_mean'" in line]
    assert (tmp_path / "feeds.npz").exists()


def test_name_map_feeds_a_renamed_parameter(fused, tmp_path, capsys):
    flat = _flat()
    flat["model.gate"] = flat.pop("gate")
    checkpoint = _write_npz(tmp_path / "ckpt.npz", flat)
    code, _, err = _cli("state", checkpoint, "--model", fused, "-o", tmp_path / "feeds.npz", "--map", "model.gate=gate", capsys=capsys)
    assert code == 0, err
    with np.load(tmp_path / "feeds.npz") as feeds:
        np.testing.assert_array_equal(feeds["gate"], flat["model.gate"])
        assert not np.any(feeds["buf.gate"])


def test_name_map_to_no_parameter_input_is_an_error(fused, tmp_path, capsys):
    code, _, err = _cli("state", DATA / "checkpoint.npz", "--model", fused, "-o", tmp_path / "feeds.npz", "--map", "gate=grad.gate", capsys=capsys)
    _assert_refused(code, err, "gate", tmp_path)


def test_first_step_with_dampening_is_refused_when_stat_is_computed_as_zero(fused, tmp_path, capsys):
    # fc1.* dampens (0.25): torch's first step (buf = grad) is not m*0 + 0.75*grad, and this model has no
    # input that could say "first step".
    flat = _flat()
    del flat["fc1.weight/momentum_buffer"]
    code, _, err = _cli("state", _write_npz(tmp_path / "ckpt.npz", flat), "--model", fused, "-o", tmp_path / "feeds.npz", capsys=capsys)
    _assert_refused(code, err, "fc1.weight", tmp_path)
    assert "dampen" in err


def test_a_model_that_is_not_fused_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="optimize"):
        checkpoint_feeds(DATA / "checkpoint.npz", DATA / "step.onnx")


def test_unknown_checkpoint_extension_is_refused(tmp_path):
    path = tmp_path / "ckpt.bin"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(CheckpointError, match="extension"):
        read_checkpoint(path)


# -- a model whose first step is an input -------------------------------------------------------------------
M, D, LR = 0.9, 0.25, 0.1


def _first_step_model(counter: bool) -> onnx.ModelProto:
    """PyTorch's rule with a first-step input: buf' = g on the first step, m*buf + (1-d)*g after;
    w' = w - lr*buf'. The flag is a boolean ``first`` or ``Equal(step, 0)`` on an INT64 counter."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, [3, 2]) for n in ("w", "g", "buf")]
    nodes = []
    if counter:
        inputs.append(helper.make_tensor_value_info("step", TensorProto.INT64, []))
        nodes.append(helper.make_node("Equal", ["step", "zero"], ["first"]))
    else:
        inputs.append(helper.make_tensor_value_info("first", TensorProto.BOOL, []))
    nodes += [
        helper.make_node("Mul", ["buf", "m"], ["mb"]),
        helper.make_node("Mul", ["g", "omd"], ["dg"]),
        helper.make_node("Add", ["mb", "dg"], ["later"]),
        helper.make_node("Where", ["first", "g", "later"], ["buf_new"]),
        helper.make_node("Mul", ["lr", "buf_new"], ["step_size"]),
        helper.make_node("Sub", ["w", "step_size"], ["w_new"]),
    ]
    constants = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("m", M), ("omd", 1 - D), ("lr", LR))]
    constants.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
    outputs = [helper.make_tensor_value_info(n, f, [3, 2]) for n in ("w_new", "buf_new")]
    graph = helper.make_graph(nodes, "first_step", inputs, outputs, constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("counter", [False, True], ids=["bool-input", "step-counter"])
@pytest.mark.parametrize("has_buffer", [False, True], ids=["first-step", "later-step"])
def test_first_step_input_is_fed_from_the_checkpoint_and_reproduces_torch_rule(counter, has_buffer):
    result = sgdfuse.optimize(_first_step_model(counter))
    assert len(result.report.fused) == 1
    rng = np.random.default_rng(0)
    w, g, buf = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(3))
    flat = {"w": w} | ({"w/momentum_buffer": buf} if has_buffer else {})
    mapped = checkpoint_feeds(Checkpoint.from_flat(flat), result.model)
    assert mapped.updates[0].stat == (0 if has_buffer else 1)
    flag = "step" if counter else "first"
    assert flag in mapped.feeds
    outputs = make_session(result.model).run(["w_new", "buf_new"], mapped.feeds | {"g": g})
    # torch.optim.SGD's rule in float64: first step buf = g, else m*buf + (1-d)*g.
    want_buf = g.astype(np.float64) if not has_buffer else M * buf.astype(np.float64) + (1 - D) * g
    np.testing.assert_allclose(outputs[1], want_buf, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(outputs[0], w - LR * want_buf, rtol=1e-6, atol=1e-7)


def test_parameters_sharing_one_first_step_input_must_agree():
    # Two parameters read the same flag input `first`: one with a buffer, one without.
    f = TensorProto.FLOAT
    nodes, inputs, outputs = [], [helper.make_tensor_value_info("first", TensorProto.BOOL, [])], []
    for p in ("w", "v"):
        inputs += [helper.make_tensor_value_info(f"{p}{s}", f, [3, 2]) for s in ("", "_g", "_buf")]
        nodes += [
            helper.make_node("Mul", [f"{p}_buf", "m"], [f"{p}_mb"]),
            helper.make_node("Mul", [f"{p}_g", "omd"], [f"{p}_dg"]),
            helper.make_node("Add", [f"{p}_mb", f"{p}_dg"], [f"{p}_later"]),
            helper.make_node("Where", ["first", f"{p}_g", f"{p}_later"], [f"{p}_buf_new"]),
            helper.make_node("Mul", ["lr", f"{p}_buf_new"], [f"{p}_step"]),
            helper.make_node("Sub", [p, f"{p}_step"], [f"{p}_new"]),
        ]
        outputs += [helper.make_tensor_value_info(f"{p}{s}", f, [3, 2]) for s in ("_new", "_buf_new")]
    constants = [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in (("m", M), ("omd", 1 - D), ("lr", LR))]
    model = helper.make_model(helper.make_graph(nodes, "two", inputs, outputs, constants), opset_imports=[helper.make_opsetid("", 18)])
    fused_model = sgdfuse.optimize(model).model
    ones = np.ones((3, 2), np.float32)
    with pytest.raises(CheckpointError, match="'first'"):
        checkpoint_feeds(Checkpoint.from_flat({"w": ones, "w/momentum_buffer": ones, "v": ones}), fused_model)
    agreed = checkpoint_feeds(Checkpoint.from_flat({"w": ones, "v": ones}), fused_model)
    assert agreed.feeds["first"].tolist() is True


def test_npz_checkpoint_is_read_without_pickle(tmp_path):
    path = tmp_path / "ckpt.npz"
    np.savez(path, w=np.array([object()], dtype=object))
    with pytest.raises(CheckpointError, match="plain arrays"):
        read_checkpoint(path)


# -- MindSpore mint.optim.SGD checkpoints -------------------------------------------------------------------
def _mindspore():
    return pytest.importorskip("mindspore", reason="MindSpore is not installed here (CI installs .[test,mindspore])")


def test_mindspore_checkpoint_resumes_the_fused_step_like_mint_optim_sgd(fused):
    # testdata/checkpoint/make_mindspore_checkpoint.py: the same network, names and groups in MindSpore; the
    # checkpoint after K steps (step_t = K), and mint.optim.SGD's next step.
    _mindspore()
    checkpoint = read_checkpoint(DATA / "mindspore.ckpt")
    assert checkpoint.step == 2 and set(checkpoint.buffers) == set(NAMES)
    result = checkpoint_feeds(checkpoint, fused)
    assert [u.stat for u in result.updates] == [0] * len(NAMES) and not result.warnings
    with np.load(DATA / "mindspore_expected.npz") as data:
        expected = {k: data[k] for k in data.files}
    ran = _run_steps(fused, result.feeds, {f"grad/0/{n}": expected[f"grad/{n}"] for n in NAMES}, 1)[0]
    start = {n: checkpoint.tensors[n] for n in NAMES} | {f"{n}/momentum_buffer": checkpoint.buffers[n] for n in NAMES}
    after = {f"grad/0/{n}": expected[f"grad/{n}"] for n in NAMES} | {f"param/0/{n}": expected[f"param/{n}"] for n in NAMES}
    after |= {f"buf/0/{n}": expected[f"buf/{n}"] for n in NAMES}
    bounds = _accumulated_bounds(start, after, 1)[0]
    for n in NAMES:
        assert np.all(np.abs(ran[n].astype(np.float64) - expected[f"param/{n}"]) <= bounds[n]), n
        assert np.all(np.abs(ran[f"buf.{n}"].astype(np.float64) - expected[f"buf/{n}"]) <= bounds[f"buf.{n}"]), n


def test_mindspore_checkpoint_at_step_zero_is_every_parameters_first_step(fused):
    # step_t == 0: mint.optim.SGD copies the gradient into every buffer, so the saved zero buffers are not
    # state; fc1 dampens (0.25) and this model computes stat = 0, so its first step is refused.
    _mindspore()
    checkpoint = read_checkpoint(DATA / "mindspore_step0.ckpt")
    assert checkpoint.step == 0 and checkpoint.buffers == {}
    with pytest.raises(CheckpointError, match="'fc1.weight'.*first"):
        checkpoint_feeds(checkpoint, fused)


@pytest.mark.parametrize("has_buffer", [False, True], ids=["first-step", "later-step"])
def test_onnx_momentum_update_count_is_fed_from_the_checkpoint(has_buffer):
    # ONNX's ai.onnx.preview.training::Momentum (standard mode) decides its first step with T <= 0 on the
    # update count T; fused, stat comes from that comparison. Expected: torch.optim.SGD's rule with
    # m = alpha, 1 - d = beta, weight decay = norm_coefficient, lr = R, in float64.
    alpha, beta, norm, lr = 0.9, 0.25, 0.01, 0.1
    f = TensorProto.FLOAT
    node = helper.make_node("Momentum", ["R", "T", "X", "G", "V"], ["X_new", "V_new"], domain="ai.onnx.preview.training",
                            alpha=alpha, beta=beta, norm_coefficient=norm, mode="standard")
    inputs = [helper.make_tensor_value_info("R", f, []), helper.make_tensor_value_info("T", TensorProto.INT64, [])]
    inputs += [helper.make_tensor_value_info(n, f, [3, 2]) for n in ("X", "G", "V")]
    outputs = [helper.make_tensor_value_info(n, f, [3, 2]) for n in ("X_new", "V_new")]
    model = helper.make_model(helper.make_graph([node], "m", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)])
    result = sgdfuse.optimize(model)
    rng = np.random.default_rng(1)
    x, g, v = (rng.standard_normal((3, 2)).astype(np.float32) for _ in range(3))
    mapped = checkpoint_feeds(Checkpoint.from_flat({"X": x} | ({"X/momentum_buffer": v} if has_buffer else {})), result.model)
    assert mapped.feeds["T"].dtype == np.int64
    feeds = mapped.feeds | {"G": g, "R": np.array(lr, np.float32)}
    got_x, got_v = make_session(result.model).run(["X_new", "V_new"], feeds)
    grad = g.astype(np.float64) + norm * x
    want_v = grad if not has_buffer else alpha * v.astype(np.float64) + beta * grad
    np.testing.assert_allclose(got_v, want_v, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got_x, x - lr * want_v, rtol=1e-6, atol=1e-6)


def test_a_missing_checkpoint_file_is_one_error_line(fused, tmp_path, capsys):
    code, _, err = _cli("state", tmp_path / "nope.npz", "--model", fused, "-o", tmp_path / "feeds.npz", capsys=capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1 and "nope.npz" in lines[0] and "no such file" in lines[0]
    assert not (tmp_path / "feeds.npz").exists()


def test_first_step_is_refused_when_the_fused_gradient_carries_the_dampening(tmp_path):
    # The clipped CNN step dampens by 0.25; sgdfuse reads it with dampening 0 and the graph's own 0.75*grad
    # as the gradient. A parameter without a buffer takes torch's first step, buf = grad, which that node
    # (fed 0.75*grad) cannot give: refused, not called exact.
    fused = tmp_path / "cnn_clip.fused.onnx"
    sgdfuse.optimize(Path("testdata/steps/cnn_clip.onnx"), verify=False).save(fused)
    updates = model_state(onnx.load(fused))
    scaled = [u for u in updates if u.gradient_scaling]
    assert scaled, "the premise: some SGD node takes a constant-scaled gradient"
    flat = {}
    for u in updates:
        shape = tuple(d if isinstance(d, int) else 1 for d in u.shape)
        flat[u.parameters] = np.zeros(shape, np.float32)
        flat[u.parameters + "/momentum_buffer"] = np.zeros(shape, np.float32)
    del flat[scaled[0].parameters + "/momentum_buffer"]
    checkpoint = _write_npz(tmp_path / "ckpt.npz", flat)
    with pytest.raises(CheckpointError, match="scaled gradient"):
        checkpoint_feeds(checkpoint, fused)
