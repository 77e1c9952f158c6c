"""``lower(model, soc=...)``: a fused ONNX model → a GE graph (:class:`GEModel`) for one Ascend SoC.

Flow:

1. the SoC string → its product line (unknown strings are refused, listing the accepted families);
2. the model is loaded; if it has no ``ai.sgdfuse::SGD`` node it is optimised first (:func:`sgdfuse.api.optimize`,
   its report kept as :attr:`GEModel.optimization`; a model with no ``SGD`` node even then is lowered as it
   is, and ``sgdfuse lower`` warns);
3. every ``SGD`` node is checked against the product line (:mod:`sgdfuse.lowering.soc`);
4. every node must have a rule (:mod:`sgdfuse.lowering.registry`); all nodes without one are listed in one
   :class:`~sgdfuse.lowering.errors.UnsupportedOpError`;
5. the state plan (:mod:`sgdfuse.lowering.state`): writable ``SGD`` inputs become ``Variable`` ops (computed
   ones assigned on every step before the op);
6. ``Data`` ops for the other graph inputs, then each node through its rule (``If`` branches inlined, see
   :mod:`sgdfuse.lowering.rules_control`), then the write-backs of state whose next value is not the op's
   result (the runtime-momentum ``If``, a guarded update's ``Where``), then ``NetOutput`` for the graph
   outputs; ops nothing needs are pruned (``Shape``/``Fill`` of a ``stat`` that became a variable);
7. reads of old state values are ordered before the in-place writes (control edges, snapshots);
8. the init graph assigns the state's initial values.

Cost: linear in the size of the graph (each step is a sweep, the ordering walks are bounded, see
:mod:`sgdfuse.lowering.dag`); the sweeps read the index's node facts, not the nodes through protobuf. The GE
graphs are written from cached bytes: the ops made by the thousand (state variables, graph inputs, ``SGD``
ops, ``Const`` s, the init graph's) as op kinds whose tail is encoded once per class, the init graph as its
ops are added (:mod:`sgdfuse.lowering.graph_builder`; docs/lowering.md, "What `sgdfuse lower` costs").
"""

from __future__ import annotations

import logging
import os

import onnx

from sgdfuse import collector
from sgdfuse import api
from sgdfuse.contract import product_line_for_soc
from sgdfuse.fused_op import DOMAIN, OP_TYPE, default_opset, is_sgd_node
from sgdfuse.lowering import rules_control, rules_elementwise, rules_linalg, rules_nn, rules_tensor  # noqa: F401  (fill the rule table)
from sgdfuse.lowering.context import GraphLowering, NodeLowering
from sgdfuse.lowering.errors import UnsupportedOpError
from sgdfuse.lowering.ge_model import GEModel
from sgdfuse.lowering.graph_builder import GraphBuilder, strings
from sgdfuse.lowering.registry import DEFAULT_DOMAIN, rule_for
from sgdfuse.lowering.scopes import unique_value_names
from sgdfuse.lowering.soc import check_product_line
from sgdfuse.lowering.state import StatePlan, add_variables, add_write_backs, build_init_graph, order_state_access, plan_state, prune
from sgdfuse.passes.index import GraphIndex, _outer_reads, _subgraphs, build_index
from sgdfuse.report import Report

__all__ = ["lower", "fused_model", "prepare", "OUTPUT_NAMES_ATTR"]

logger = logging.getLogger(__name__)

OUTPUT_NAMES_ATTR = "_sgdfuse_onnx_outputs"
"""Graph attribute (list of strings) naming the ONNX graph output behind each ``NetOutput`` input."""


def prepare(model: str | os.PathLike | onnx.ModelProto, *, optimise: bool = True) -> tuple[onnx.ModelProto, Report | None]:
    """``model`` loaded, and optimised when it has no ``ai.sgdfuse::SGD`` node yet (never mutated).

    Args:
        model: a path or ``ModelProto``.
        optimise: False to take a model without ``SGD`` nodes as it is (a caller that optimised it already).

    Returns:
        ``(fused model, report)``: the optimisation's :class:`~sgdfuse.report.Report`, or None when the model
        already had ``SGD`` nodes and was not optimised again.

    Raises:
        ModelLoadError: ``model`` is a path that cannot be loaded as ONNX.
    """
    proto = model if isinstance(model, onnx.ModelProto) else api.load_model(model, load_external_data=True)
    if not optimise or any(is_sgd_node(node) for node in proto.graph.node):
        return proto, None
    result = api.optimize(proto)
    logger.info("optimised the unfused model first: %d update(s) fused, %d refused", len(result.report.fused), len(result.report.refused))
    if not any(is_sgd_node(node) for node in result.model.graph.node):
        # INFO, not WARNING: the CLI prints its own warning line; API callers see GEModel.sgd_ops == [].
        logger.info("no momentum-SGD update fused: the GE graph will have no SGD op")
    return result.model, result.report


def fused_model(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    """``model`` loaded, and optimised when it has no ``ai.sgdfuse::SGD`` node yet (see :func:`prepare`).

    Raises:
        ModelLoadError: ``model`` is a path that cannot be loaded as ONNX.
    """
    return prepare(model)[0]


def _sgd_positions(index: GraphIndex) -> list[int]:
    """Positions of the ``ai.sgdfuse::SGD`` nodes, from the index's node facts (no protobuf read)."""
    return [k for k, (op_type, domain, *_) in enumerate(index.nodes) if op_type == OP_TYPE and domain == DOMAIN]


def _needed_nodes(index: GraphIndex, plan: StatePlan, sgd_positions: list[int]) -> set[int]:
    """Positions of the nodes the GE graph needs: what the graph outputs, the ``SGD`` nodes and the state's
    assigned values depend on. An ``SGD`` input that became a variable is not followed, so the
    ``Shape``/``ConstantOfShape`` behind a zero ``stat`` are never lowered (they would only be pruned).
    Reads the index's node facts; only a node holding a subgraph is read through protobuf."""
    writable = plan.by_port
    stack = list(index.graph_outputs)
    stack.extend(v.next_value for v in plan.variables if v.next_value)
    needed: set[int] = set()
    nodes = index.nodes

    def visit(position: int) -> None:
        if position in needed:
            return
        needed.add(position)
        op_type, domain, inputs, _, has_subgraph, _ = nodes[position]
        if op_type == OP_TYPE and domain == DOMAIN:
            for port, value in enumerate(inputs):
                variable = writable.get((position, port))
                if variable is None:
                    stack.append(value)
                elif variable.assigned:
                    stack.append(variable.assigned)
            return
        stack.extend(inputs)
        if has_subgraph:  # no attribute of another node holds a graph
            for attribute in index.graph.node[position].attribute:
                for sub in _subgraphs(attribute):
                    stack.extend(sorted(_outer_reads(sub)))

    for position in sgd_positions:
        visit(position)
    seen: set[str] = set()
    while stack:
        value = stack.pop()
        if not value or value in seen:
            continue
        seen.add(value)
        position = index.producer.get(value)
        if position is not None:
            visit(position)
    return needed




def _require_rules(index: GraphIndex) -> None:
    """Every node has a lowering rule.

    Raises:
        UnsupportedOpError: listing every node without one (op type, with its domain unless standard; name).
    """
    missing = [
        (op_type if domain in ("", DEFAULT_DOMAIN) else f"{domain}::{op_type}", k)
        for k, (op_type, domain, *_) in enumerate(index.nodes)
        if rule_for(domain, op_type) is None
    ]
    if missing:
        nodes = index.graph.node
        raise UnsupportedOpError([(op, nodes[k].name or f"#{k}") for op, k in missing])


def lower(model: str | os.PathLike | onnx.ModelProto, *, soc: str, optimise: bool = True) -> GEModel:
    """Lower an ONNX model to a GE graph for the Ascend SoC ``soc`` (an ATC ``--soc_version`` string).

    Args:
        model: a path or ``ModelProto``, fused or not (an unfused model is optimised first, and the report of
            that run kept as :attr:`GEModel.optimization`).
        soc: e.g. ``"Ascend910B2"`` (Atlas A2), ``"Ascend310P3"``, ``"Ascend950PR_9599"``.
        optimise: False to lower a model without ``SGD`` nodes as it is (see :func:`prepare`).

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
    with collector.paused():
        return _lower(model, soc, optimise)


def _lower(model: str | os.PathLike | onnx.ModelProto, soc: str, optimise: bool) -> GEModel:
    line = product_line_for_soc(soc)
    proto, report = prepare(model, optimise=optimise)
    index = build_index(proto)
    if index.subgraph_nodes:  # If branches are inlined: one name per value across scopes
        renamed = unique_value_names(proto)
        if renamed is not proto:
            proto, index = renamed, build_index(renamed)
    graph = proto.graph
    sgd_positions = _sgd_positions(index)
    check_product_line(index, sgd_positions, line)
    _require_rules(index)

    plan = plan_state(index)
    builder = GraphBuilder(graph.name or "sgdfuse_graph")
    lowering = GraphLowering(index, builder, default_opset(proto))

    # Variables first: their names are shared with the init graph and must not be taken by another op.
    add_variables(lowering, plan)
    data_ops: list[str] = []
    data_names: list[str] = []
    for name in index.graph_inputs:
        if name in plan.readable:
            continue
        spec = index.spec(name)
        kind = builder.kind("graph input", (spec.dtype, spec.shape), "Data", own=("index",))  # the index is each Data op's own
        record = builder.add("Data", name, outputs=[("y", spec)], attrs={"index": len(data_ops)}, kind=kind, unconnected=[("x", spec)])
        data_ops.append(record.name)
        data_names.append(name)
        lowering.values[name] = record.output(0)

    nodes = graph.node
    for position in sorted(_needed_nodes(index, plan, sgd_positions)):
        op_type, domain, *_ = index.nodes[position]
        rule_for(domain, op_type)(NodeLowering(lowering, nodes[position], position))  # type: ignore[misc]
    add_write_backs(lowering)

    outputs = [lowering.tensor(value.name, reader="graph output") for value in graph.output]
    net_output = builder.add("NetOutput", "NetOutput", [(f"x{k}", t) for k, t in enumerate(outputs)])
    prune(builder)
    order_state_access(lowering)
    final_outputs = [t for _, t in builder.ops[net_output.name].inputs]

    output_names = [value.name for value in graph.output]
    name = graph.name or "sgdfuse_model"
    # Kept serialised (canonical bytes, parsed only if someone reads the messages): a parsed step graph of
    # 10,000 updates takes about 280 MB, its init graph 360 MB, their bytes 90 MB together.
    model_def = builder.to_model_def_bytes(
        name, {"soc_version": soc.encode()}, inputs=data_ops, outputs=final_outputs, attrs={OUTPUT_NAMES_ATTR: strings(output_names)}
    )
    sgd_ops = list(lowering.sgd_ops)
    del builder, lowering, index

    init_graph, init_data, init_feeds, init_outputs = build_init_graph(plan, f"{name}_init")
    init_def = init_graph.to_model_def_bytes(f"{name}_init", {"soc_version": soc.encode()}, inputs=init_data, outputs=init_outputs)
    del init_graph

    return GEModel(
        model=model_def,
        init_model=init_def,
        soc=soc,
        product_line=line,
        inputs=data_ops,
        input_names=dict(zip(data_ops, data_names)),
        outputs=output_names,
        state=list(plan.variables),
        init_inputs=init_feeds,
        sgd_ops=sgd_ops,
        optimization=report,
    )
