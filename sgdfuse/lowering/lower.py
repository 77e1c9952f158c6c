"""``lower(model, soc=...)``: a fused ONNX model → a GE graph (:class:`GEModel`) for one Ascend SoC.

Flow:

1. the SoC string → its product line (unknown strings are refused, listing the accepted families);
2. the model is loaded; if it has no ``ai.sgdfuse::SGD`` node it is optimised first (:func:`sgdfuse.api.optimize`);
3. every ``SGD`` node is checked against the product line (:mod:`sgdfuse.lowering.soc`);
4. every node must have a rule (:mod:`sgdfuse.lowering.registry`); all nodes without one are listed in one
   :class:`~sgdfuse.lowering.errors.UnsupportedOpError`;
5. the state plan (:mod:`sgdfuse.lowering.state`): writable ``SGD`` inputs become ``Variable`` ops;
6. ``Data`` ops for the other graph inputs, then each node through its rule, then ``NetOutput`` for the
   graph outputs; ops nothing needs are pruned (``Shape``/``Fill`` of a ``stat`` that became a variable);
7. reads of old state values are ordered before the in-place writes (control edges, snapshots);
8. the init graph assigns the state's initial values.
"""

from __future__ import annotations

import logging
import os

import onnx

from sgdfuse import api
from sgdfuse.contract import product_line_for_soc
from sgdfuse.fused_op import default_opset, is_sgd_node
from sgdfuse.lowering import ge_ir
from sgdfuse.lowering import rules_elementwise, rules_linalg, rules_tensor  # noqa: F401  (fill the rule table)
from sgdfuse.lowering.context import GraphLowering, NodeLowering
from sgdfuse.lowering.errors import UnsupportedOpError
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.lowering.graph_builder import GraphBuilder, strings
from sgdfuse.lowering.registry import DEFAULT_DOMAIN, rule_for
from sgdfuse.lowering.soc import check_product_line
from sgdfuse.lowering.state import add_variables, build_init_graph, order_state_access, plan_state, prune
from sgdfuse.passes.index import build_index

__all__ = ["lower", "fused_model", "OUTPUT_NAMES_ATTR"]

logger = logging.getLogger(__name__)

OUTPUT_NAMES_ATTR = "_sgdfuse_onnx_outputs"
"""Graph attribute (list of strings) naming the ONNX graph output behind each ``NetOutput`` input."""


def fused_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """``model`` loaded, and optimised when it has no ``ai.sgdfuse::SGD`` node yet (never mutated).

    Raises:
        ModelLoadError: ``model`` is a path that cannot be loaded as ONNX.
    """
    proto = model if isinstance(model, onnx.ModelProto) else api.load_model(model, load_external_data=True)
    if any(is_sgd_node(node) for node in proto.graph.node):
        return proto
    result = api.optimize(proto)
    logger.info("optimised the unfused model first: %d update(s) fused", len(result.report.fused))
    return result.model


def lower(model: str | os.PathLike | onnx.ModelProto, *, soc: str) -> GEModel:
    """Lower an ONNX model to a GE graph for the Ascend SoC ``soc`` (an ATC ``--soc_version`` string).

    Args:
        model: a path or ``ModelProto``, fused or not (an unfused model is optimised first).
        soc: e.g. ``"Ascend910B2"`` (Atlas A2), ``"Ascend310P3"``, ``"Ascend950PR_9599"``.

    Returns:
        The :class:`GEModel` (step graph, init graph, names of inputs, outputs and state).

    Raises:
        ProductLineError: unknown ``soc`` (the message lists the accepted families), or an ``SGD`` node the
            product line cannot run (dtype, dynamic shape, rank, empty tensor), naming node, tensor and clause.
        UnsupportedOpError: nodes without a lowering rule, every one listed.
        InPlaceStateError: a writable ``SGD`` input that cannot become a state variable.
        LoweringError: a node whose operands GE needs at compile time are only known at run time.
        ModelLoadError: ``model`` is a path that cannot be loaded.
    """
    line = product_line_for_soc(soc)
    proto = fused_model(model)
    graph = proto.graph
    index = build_index(proto)
    sgd_nodes = [node for node in graph.node if is_sgd_node(node)]
    check_product_line(index, sgd_nodes, line)

    missing = [
        (node.op_type if node.domain in ("", DEFAULT_DOMAIN) else f"{node.domain}::{node.op_type}", node.name or f"#{k}")
        for k, node in enumerate(graph.node)
        if rule_for(node.domain, node.op_type) is None
    ]
    if missing:
        raise UnsupportedOpError(missing)

    plan = plan_state(index)
    builder = GraphBuilder(graph.name or "sgdfuse_graph")
    lowering = GraphLowering(index, builder, default_opset(proto))

    data_ops: list[str] = []
    for value in graph.input:
        if value.name in plan.readable:
            continue
        spec = index.spec(value.name)
        record = builder.add("Data", value.name, outputs=[("y", spec)], attrs={"index": len(data_ops)})
        record.unconnected = [("x", spec)]
        data_ops.append(record.name)
        lowering.values[value.name] = record.output(0)
    add_variables(lowering, plan)

    for position, node in enumerate(graph.node):
        rule_for(node.domain, node.op_type)(NodeLowering(lowering, node, position))  # type: ignore[misc]

    outputs = [lowering.tensor(value.name, reader="graph output") for value in graph.output]
    net_output = builder.add("NetOutput", "NetOutput", [(f"x{k}", t) for k, t in enumerate(outputs)])
    prune(builder)
    order_state_access(lowering)
    final_outputs = [t for _, t in builder.ops[net_output.name].inputs]

    output_names = [value.name for value in graph.output]
    model_def = ge_ir.ModelDef(name=graph.name or "sgdfuse_model")
    model_def.graph.append(builder.to_graph_def(inputs=data_ops, outputs=final_outputs, attrs={OUTPUT_NAMES_ATTR: strings(output_names)}))
    model_def.attr["soc_version"].s = soc.encode()

    init_builder, init_data, init_feeds = build_init_graph(plan, f"{model_def.name}_init")
    init_outputs = [t for _, t in init_builder.ops["NetOutput"].inputs]
    init_def = ge_ir.ModelDef(name=f"{model_def.name}_init")
    init_def.graph.append(init_builder.to_graph_def(inputs=init_data, outputs=init_outputs))
    init_def.attr["soc_version"].s = soc.encode()

    return GEModel(
        model=model_def,
        init_model=init_def,
        soc=soc,
        product_line=line,
        inputs=data_ops,
        outputs=output_names,
        state=list(plan.variables),
        init_inputs=init_feeds,
        sgd_ops=sorted(set(lowering.writers.values()), key=lambda n: builder.ops[n].position),
    )
