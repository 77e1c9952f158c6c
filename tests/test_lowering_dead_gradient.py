"""``sgdfuse lower``'s verification holds a gradient that the random data never makes non-zero to the rule that
``check`` and ``optimize``'s verification follow (docs/design.md, "A term that is never live proves nothing").

The GE graph is run against onnxruntime on the fused model. With ``g = Relu(x - 10)`` computed in the graph,
every standard-normal ``x`` gives ``g = 0``, so a lowered SGD op with another dampening (which scales only the
gradient term) agreed with onnxruntime on every step and passed. Now:

- when an SGD node's gradient was zero (or not finite) everywhere on every step, one more step feeds the data
  inputs wide-range values (``sgdfuse.verify.wide_values``); elements that overflow there are left out;
- so the lowered op with the wrong dampening fails at ``Relu(x - 10)``, and the right one passes;
- an SGD node whose gradient is still zero everywhere (``Relu(x - 1e30)``) fails as never compared, whatever
  its numbers, naming its gradient.

The wrong GE graph is the lowering of the fused model with the SGD node's dampening attribute edited; that it
computes another update where the gradient lives is shown on a live gradient (``Relu(x + 10)``).
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto

from sgdfuse.lowering import lower, verify_lowering
from test_check_dead_gradient import NEVER_COMPARED, _fused, _relu_step

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
SOC = "Ascend910B2"


def _with_dampening(fused: onnx.ModelProto, dampening: float) -> onnx.ModelProto:
    wrong = onnx.ModelProto()
    wrong.CopyFrom(fused)
    (sgd,) = [node for node in wrong.graph.node if node.op_type == "SGD"]
    (attribute,) = [a for a in sgd.attribute if a.name == "dampening"]
    attribute.f = dampening
    return wrong


def _verify(fused: onnx.ModelProto, lowered_from: onnx.ModelProto):
    return verify_lowering(fused, lower(lowered_from, soc=SOC, optimise=False), steps=3)


def test_a_lowered_op_with_another_dampening_fails_where_the_gradient_lives():
    # The premise: the edited dampening is a different update once the gradient is not zero.
    fused = _fused(_relu_step(-10.0))
    assert _verify(fused, fused).passed
    assert not _verify(fused, _with_dampening(fused, 0.5)).passed


@pytest.mark.parametrize("dtype", [F32, F16])
def test_a_gradient_the_wide_step_brings_to_life_passes_the_right_lowering(dtype):
    fused = _fused(_relu_step(10.0, dtype))
    check = _verify(fused, fused)
    assert check.passed, check.message


def test_a_lowered_op_with_another_dampening_fails_on_a_gradient_dead_on_random_data():
    fused = _fused(_relu_step(10.0))
    check = _verify(fused, _with_dampening(fused, 0.5))
    assert not check.passed
    assert NEVER_COMPARED not in check.message  # it failed on its numbers, at the wide step


def _negated_gradient(lowered) -> None:
    """The GE ``SGD`` op made to read ``Neg(g)`` for ``g`` (the ``Relu``'s output copied as a ``Neg`` of it): a wrong
    graph whose numbers agree wherever ``g`` is 0. (A wrong dampening attribute no longer serves: the check
    compares the op's attributes with the fused node's before any number.)"""
    ops = {op.name: op for op in lowered.graph.op}
    sgd = ops[lowered.sgd_ops[0]]
    source = ops[sgd.input[1].rpartition(":")[0]]
    negated = type(source)()
    negated.CopyFrom(source)
    negated.name, negated.type = "negated_gradient", "Neg"
    del negated.input[:], negated.input_desc[:]
    negated.input.append(f"{source.name}:0")
    negated.input_desc.append(source.output_desc[0])
    position = list(lowered.graph.op).index(sgd)
    ops_in_order = list(lowered.graph.op)
    ops_in_order.insert(position, negated)
    kept = [type(op)() for op in ops_in_order]
    for copy_, op in zip(kept, ops_in_order):
        copy_.CopyFrom(op)
    del lowered.graph.op[:]
    lowered.graph.op.extend(kept)
    lowered.op(lowered.sgd_ops[0]).input[1] = "negated_gradient:0"


@pytest.mark.parametrize("lowered_from", ["right", "wrong"])
def test_a_gradient_never_live_fails_as_never_compared_whatever_its_numbers(lowered_from):
    fused = _fused(_relu_step(1e30))
    lowered = lower(fused, soc=SOC, optimise=False)
    if lowered_from == "wrong":
        _negated_gradient(lowered)
        live = _fused(_relu_step(-10.0))  # the same edit where the gradient lives: caught on the numbers
        lowered_live = lower(live, soc=SOC, optimise=False)
        _negated_gradient(lowered_live)
        assert not verify_lowering(live, lowered_live).passed
    check = verify_lowering(fused, lowered, steps=3)
    assert not check.passed
    assert NEVER_COMPARED in check.message and "gradient g" in check.message and "computed from x" in check.message
