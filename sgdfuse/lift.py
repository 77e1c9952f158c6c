"""Lift an ONNX model to DOUBLE: every FLOAT, FLOAT16 and BFLOAT16 tensor becomes DOUBLE.

The lifted model computes the same formula as the original with (almost) no rounding: constants and
initializers are converted exactly (every FLOAT16/BFLOAT16/FLOAT value is a DOUBLE value), ``Cast`` and
``CastLike`` to a float type become casts to DOUBLE (their rounding is removed), and model-local functions
are lifted the same way, so the fused ``ai.sgdfuse::SGD`` op computes its contract formula in DOUBLE with its
FLOAT attributes taken exactly as stored. What is left between an original and its fused form, lifted, is the
difference of their coefficients: :mod:`sgdfuse.verify` uses this to see a 1e-5 relative coefficient error
that FLOAT roundoff would hide.

onnxruntime's CPU provider lacks DOUBLE kernels for some ops (``Conv``, say); a lifted model using one
cannot run, and :func:`missing_kernels` names them from onnxruntime's error.
"""

from __future__ import annotations

import re
from collections.abc import Collection

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["FLOAT_TYPES", "bfloat16_through_float", "lift_to_double", "missing_kernels", "specialise"]

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16})
"""The ONNX float types that are lifted (DOUBLE stays as it is)."""

_DTYPE_ATTRIBUTES = ("dtype", "to", "stash_type")
_STASH_TYPE_OPS = frozenset({"LayerNormalization"})
"""Ops whose ``stash_type`` (the type they compute their statistics in) defaults to FLOAT in every opset they
exist in (``GroupNormalization`` has the attribute only from opset 21: not added to an older one here)."""


def lift_to_double(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in which every FLOAT/FLOAT16/BFLOAT16 tensor is DOUBLE (module docstring).

    Inputs and outputs of those types are declared DOUBLE, so feed DOUBLE arrays (the original values
    converted exactly). Tensor data stored externally is left as it is (such a model will not run lifted).
    ``model`` is not modified.
    """
    lifted = onnx.ModelProto()
    lifted.CopyFrom(model)
    _lift_graph(lifted.graph)
    for function in lifted.functions:
        nodes = _lift_nodes(function.node)
        del function.node[:]
        function.node.extend(nodes)
        for info in function.value_info:
            _lift_type(info.type)
    return lifted


def missing_kernels(error: BaseException | str) -> list[str]:
    """Op types onnxruntime reports having no kernel for (``Could not find an implementation for
    Conv(11) node ...``), from its error text; empty when the error says something else."""
    return sorted(set(re.findall(r"Could not find an implementation for (\w+)\(", str(error))))


def bfloat16_through_float(model: onnx.ModelProto, op_types: Collection[str] | None) -> tuple[onnx.ModelProto, bool]:
    """:func:`narrow_through_float` for BFLOAT16 (the ops onnxruntime has no BFLOAT16 kernel for)."""
    return narrow_through_float(model, op_types, TensorProto.BFLOAT16)


def float16_through_float(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """:func:`narrow_through_float` for FLOAT16, every op. onnxruntime's CPU provider runs most FLOAT16 ops
    by casting to FLOAT and drops the casts between consecutive ops, so a chain ``(a*b + c)*d - e`` rounds to
    FLOAT16 once at its end instead of after each op as ONNX defines (22 of 64 random elements differ, seen
    with onnxruntime 1.32; an intermediate that overflows FLOAT16 to inf stays finite). Computed through this
    transform, every FLOAT16 op rounds its own result: FLOAT's 24-bit significand holds 2 x 11 + 2 bits, so
    the double rounding is innocuous for ``+``, ``-``, ``*``, ``/`` and square roots (Figueroa, SIGNUM 1995)."""
    return narrow_through_float(model, None, TensorProto.FLOAT16)


def narrow_through_float(model: onnx.ModelProto, op_types: Collection[str] | None, narrow: int) -> tuple[onnx.ModelProto, bool]:
    """A copy of ``model`` in which every default-domain node of an op in ``op_types`` (None: of any op but
    ``Cast``, ``CastLike`` and control flow) that reads or writes ``narrow`` (BFLOAT16 or FLOAT16; BFLOAT16 in
    what follows) computes in FLOAT: each BFLOAT16 operand goes through ``Cast(to=FLOAT)`` and each BFLOAT16
    result comes back through ``Cast(to=BFLOAT16)`` under its own name; and whether any node was changed.
    For onnxruntime's CPU provider, which has no BFLOAT16 kernel for ``Add``, ``Sub``, ``Mul``, ``Div``, ``Neg``, ``Where``, ``Expand`` and most others (seen
    with onnxruntime 1.32; ``Cast`` to and from BFLOAT16 it runs), nor for the ops it runs through their ONNX
    function bodies (``Softmax``, ``LessOrEqual`` at opset 18, whose error names the body's ``ReduceMax`` or
    ``Less``: ``op_types`` None widens those too).

    The result is what BFLOAT16 arithmetic gives, rounding once per op to nearest even: a BFLOAT16 value is a
    FLOAT value exactly, so moves and sign changes (``Where``, ``Expand``, ``Neg``) are exact, and for ``+``,
    ``-``, ``*``, ``/`` and square roots the FLOAT result rounded to BFLOAT16 is the correctly rounded BFLOAT16
    result, since FLOAT's 24-bit significand holds at least 2 x 8 + 2 bits (Figueroa, "When is double rounding
    innocuous?", SIGNUM 1995). Other ops round their FLOAT result once, as a device computing them in FLOAT does.

    Model-local functions are inlined first (``onnx.inliner``: their bodies are nodes like any other), and
    subgraphs (``If``, ``Loop`` bodies) are widened the same way. Operand and result types come from ONNX shape
    inference; a node any of whose operands or results it leaves untyped is left as it is (onnxruntime then
    reports it again). Graph inputs and outputs keep their types, so the model is fed and read as before.
    ``model`` is not modified.
    """
    from onnx import inliner

    source = inliner.inline_local_functions(model) if len(model.functions) else model
    inferred = onnx.shape_inference.infer_shapes(source)
    copy = onnx.ModelProto()
    copy.CopyFrom(source)
    taken = _all_names(copy.graph)

    def fresh(base: str) -> str:
        name, counter = base, 1
        while name in taken:
            name, counter = f"{base}_{counter}", counter + 1
        taken.add(name)
        return name

    changed = _widen_graph(copy.graph, inferred.graph, {}, None if op_types is None else set(op_types), fresh, narrow)
    return copy, changed


_NOT_WIDENED = frozenset({"Cast", "CastLike", "If", "Loop", "Scan", "SequenceMap"})
"""Ops :func:`bfloat16_through_float` leaves as they are even when asked for every op: onnxruntime runs the
casts in BFLOAT16, and control flow computes nothing itself (its bodies are widened)."""


def _graph_types(graph: onnx.GraphProto, outer: dict[str, int]) -> dict[str, int]:
    types = dict(outer)
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.HasField("tensor_type"):
            types[info.name] = info.type.tensor_type.elem_type
    for tensor in graph.initializer:
        types[tensor.name] = tensor.data_type
    return types


def _widen_graph(graph: onnx.GraphProto, inferred: onnx.GraphProto, outer: dict[str, int], wanted: set[str] | None, fresh, narrow: int) -> bool:
    """Widen ``graph``'s nodes in place (:func:`narrow_through_float`), reading types from ``inferred``, the
    same graph after shape inference, and from the enclosing scopes' ``outer``; True when any node changed."""
    types = _graph_types(inferred, outer)
    changed = False
    nodes: list[onnx.NodeProto] = []
    for node, typed in zip(graph.node, inferred.node):
        for attribute, inferred_attribute in zip(node.attribute, typed.attribute):
            if attribute.type == onnx.AttributeProto.GRAPH:
                changed |= _widen_graph(attribute.g, inferred_attribute.g, types, wanted, fresh, narrow)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub, inferred_sub in zip(attribute.graphs, inferred_attribute.graphs):
                    changed |= _widen_graph(sub, inferred_sub, types, wanted, fresh, narrow)
        names = [n for n in (*node.input, *node.output) if n]
        chosen = node.op_type not in _NOT_WIDENED if wanted is None else node.op_type in wanted
        if not chosen or node.domain not in ("", "ai.onnx") or narrow not in {types.get(n) for n in names}:
            nodes.append(node)
            continue
        if any(n not in types for n in names):
            nodes.append(node)  # an operand of unknown type: nothing safe to cast
            continue
        widened: dict[str, str] = {}
        for k, name in enumerate(node.input):
            if name and types[name] == narrow:
                if name not in widened:
                    widened[name] = fresh(f"{name}/as_float")
                    nodes.append(helper.make_node("Cast", [name], [widened[name]], to=TensorProto.FLOAT))
                node.input[k] = widened[name]
        rounded = []
        for k, name in enumerate(node.output):
            if name and types[name] == narrow:
                wide = fresh(f"{name}/in_float")
                node.output[k] = wide
                rounded.append(helper.make_node("Cast", [wide], [name], to=narrow))
        nodes.append(node)
        nodes.extend(rounded)
        changed = True
    del graph.node[:]
    graph.node.extend(nodes)
    return changed


def _all_names(graph: onnx.GraphProto) -> set[str]:
    """Every value name of ``graph`` and its subgraphs (inputs, outputs, value infos, initializers, node ends)."""
    names: set[str] = set()
    stack = [graph]
    while stack:
        g = stack.pop()
        names.update(i.name for i in (*g.input, *g.output, *g.value_info))
        names.update(t.name for t in g.initializer)
        for node in g.node:
            names.update(node.input)
            names.update(node.output)
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    stack.append(attribute.g)
                elif attribute.type == onnx.AttributeProto.GRAPHS:
                    stack.extend(attribute.graphs)
    return names


def _lift_graph(graph: onnx.GraphProto) -> None:
    for info in list(graph.input) + list(graph.output) + list(graph.value_info):
        _lift_type(info.type)
    for k, tensor in enumerate(graph.initializer):
        graph.initializer[k].CopyFrom(_lift_tensor(tensor))
    for sparse in graph.sparse_initializer:
        sparse.values.CopyFrom(_lift_tensor(sparse.values))
    nodes = _lift_nodes(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def _lift_type(type_proto: onnx.TypeProto) -> None:
    kind = type_proto.WhichOneof("value")
    if kind == "tensor_type":
        if type_proto.tensor_type.elem_type in FLOAT_TYPES:
            type_proto.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sparse_tensor_type":
        if type_proto.sparse_tensor_type.elem_type in FLOAT_TYPES:
            type_proto.sparse_tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _lift_type(type_proto.sequence_type.elem_type)
    elif kind == "optional_type":
        _lift_type(type_proto.optional_type.elem_type)
    elif kind == "map_type":
        _lift_type(type_proto.map_type.value_type)


def _lift_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    if tensor.data_type not in FLOAT_TYPES or tensor.data_location == TensorProto.EXTERNAL:
        return tensor
    array = numpy_helper.to_array(tensor).astype(np.float64)  # exact: every float type embeds in DOUBLE
    return numpy_helper.from_array(array, name=tensor.name)


def _lift_nodes(nodes) -> list[onnx.NodeProto]:
    result: list[onnx.NodeProto] = []
    for original in nodes:
        node = onnx.NodeProto()
        node.CopyFrom(original)
        follow: list[onnx.NodeProto] = []
        for attribute in node.attribute:
            if attribute.ref_attr_name:
                if node.op_type == "Constant" and attribute.type in (onnx.AttributeProto.FLOAT, onnx.AttributeProto.FLOATS):
                    # A FLOAT attribute of the function (the SGD op's dampening): taken as stored, then
                    # converted exactly to DOUBLE.
                    stored = node.output[0] + "__sgdfuse_float"
                    follow.append(helper.make_node("Cast", [stored], [node.output[0]], to=TensorProto.DOUBLE))
                    node.output[0] = stored
                continue
            if attribute.type == onnx.AttributeProto.TENSOR:
                attribute.t.CopyFrom(_lift_tensor(attribute.t))
            elif attribute.type == onnx.AttributeProto.GRAPH:
                _lift_graph(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for sub in attribute.graphs:
                    _lift_graph(sub)
            elif attribute.type == onnx.AttributeProto.INT and attribute.name in _DTYPE_ATTRIBUTES and node.domain in ("", "ai.onnx"):
                if attribute.i in FLOAT_TYPES:
                    attribute.i = TensorProto.DOUBLE
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            _lift_constant_scalar_attributes(node)
        if node.op_type in _STASH_TYPE_OPS and node.domain in ("", "ai.onnx") and not any(a.name == "stash_type" for a in node.attribute):
            # The default stash type is FLOAT (the type of Mean and InvStdDev): lifted, DOUBLE. Left out, the lifted
            # model is ill-typed (those outputs FLOAT, what reads them DOUBLE) and no runtime accepts it.
            node.attribute.append(helper.make_attribute("stash_type", TensorProto.DOUBLE))
        if node.op_type == "ConstantOfShape" and node.domain in ("", "ai.onnx") and not any(a.name == "value" for a in node.attribute):
            # The default value is FLOAT 0: the lifted default is DOUBLE 0.
            node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(np.zeros((1,), np.float64), name="value")))
        result.append(node)
        result.extend(follow)
    return result


def _lift_constant_scalar_attributes(node: onnx.NodeProto) -> None:
    for k, attribute in enumerate(node.attribute):
        if attribute.ref_attr_name:
            continue
        if attribute.name == "value_float":
            array = np.array(attribute.f, dtype=np.float32).astype(np.float64)
        elif attribute.name == "value_floats":
            array = np.array(list(attribute.floats), dtype=np.float32).astype(np.float64)
        else:
            continue
        del node.attribute[k]
        node.attribute.append(helper.make_attribute("value", numpy_helper.from_array(array, name="value")))
        return


def specialise(model: onnx.ModelProto, outputs: list[str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` with its model-local functions inlined (``onnx.inliner``), every ``If`` whose
    condition is a compile-time constant replaced by the branch it selects, and nodes that no output needs
    dropped; ``outputs`` (default: the graph's) are the values kept.

    The arithmetic is untouched: an SGD node becomes its function body with its attributes as constants, and
    the body's ``If`` s on ``weight_decay == 0``, ``dampening == 0`` and ``nesterov`` select what they would
    select at run time. onnxruntime builds a session of it several times faster (every ``If`` branch is a
    graph of its own to initialise), which is what makes checking in several precisions affordable.
    """
    from onnx import inliner

    inlined = inliner.inline_local_functions(model)
    graph = inlined.graph
    known: dict[str, np.ndarray] = {}
    nodes = _fold(graph.node, known)
    wanted = set(outputs if outputs is not None else [o.name for o in graph.output])
    kept: list[onnx.NodeProto] = []
    for node in reversed(nodes):
        if any(o in wanted for o in node.output if o):
            kept.append(node)
            wanted.update(_reads(node))
    del graph.node[:]
    graph.node.extend(reversed(kept))
    del inlined.functions[:]
    return inlined


def _fold(nodes, known: dict[str, np.ndarray]) -> list[onnx.NodeProto]:
    result: list[onnx.NodeProto] = []
    for node in nodes:
        if node.domain not in ("", "ai.onnx"):
            result.append(node)
            continue
        if node.op_type == "Constant":
            value = _constant_value(node)
            if value is not None:
                known[node.output[0]] = value
        elif node.op_type == "Equal" and all(name in known for name in node.input):
            known[node.output[0]] = np.equal(known[node.input[0]], known[node.input[1]])
        elif node.op_type == "If" and node.input[0] in known and np.asarray(known[node.input[0]]).size == 1:
            chosen = "then_branch" if bool(np.asarray(known[node.input[0]]).reshape(-1)[0]) else "else_branch"
            branch = next(a.g for a in node.attribute if a.name == chosen)
            result.extend(_fold(branch.node, known))
            for source, target in zip(branch.output, node.output):
                if target:
                    result.append(helper.make_node("Identity", [source.name], [target]))
            continue
        result.append(node)
    return result


def _constant_value(node: onnx.NodeProto) -> np.ndarray | None:
    for attribute in node.attribute:
        if attribute.ref_attr_name:
            return None
        if attribute.name == "value":
            return numpy_helper.to_array(attribute.t)
        if attribute.name == "value_float":
            return np.array(attribute.f, dtype=np.float32)
        if attribute.name == "value_int":
            return np.array(attribute.i, dtype=np.int64)
    return None


def _reads(node: onnx.NodeProto) -> set[str]:
    names = {name for name in node.input if name}
    for attribute in node.attribute:
        subs = [attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else list(attribute.graphs)
        for sub in subs:
            for inner in sub.node:
                names.update(_reads(inner))
    return names
