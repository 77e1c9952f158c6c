"""One name per value across a model's scopes, so that subgraphs can be inlined into the main graph.

ONNX lets a subgraph (an ``If`` branch, a ``Loop`` body) define a value whose name another scope also
defines: two branches of one ``If`` may each compute a ``tmp``, and the checker and onnxruntime accept it.
Lowering inlines ``If`` branches into the one GE graph (:mod:`sgdfuse.lowering.rules_control`), where each
value needs a name of its own, and shape inference records one type per name. :func:`unique_value_names`
renames such a subgraph-local value (its definition and every use in its scope) to a name no scope uses.
"""

from __future__ import annotations

import onnx

__all__ = ["unique_value_names"]


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    found: list[onnx.GraphProto] = []
    for attribute in node.attribute:
        if attribute.type == onnx.AttributeProto.GRAPH:
            found.append(attribute.g)
        elif attribute.type == onnx.AttributeProto.GRAPHS:
            found.extend(attribute.graphs)
    return found


def _local(graph: onnx.GraphProto) -> list[str]:
    names = [v.name for v in graph.input] + [t.name for t in graph.initializer] + [s.values.name for s in graph.sparse_initializer]
    names += [o for node in graph.node for o in node.output if o]
    return [n for n in names if n]


def _all_names(graph: onnx.GraphProto, into: set[str]) -> None:
    into.update(_local(graph))
    into.update(o.name for o in graph.output)
    for node in graph.node:
        into.update(i for i in node.input if i)
        for sub in _subgraphs(node):
            _all_names(sub, into)


def _rename(graph: onnx.GraphProto, mapping: dict[str, str]) -> None:
    """Rename ``mapping``'s keys everywhere in ``graph`` and its nested subgraphs (in place)."""
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        value.name = mapping.get(value.name, value.name)
    for tensor in graph.initializer:
        tensor.name = mapping.get(tensor.name, tensor.name)
    for node in graph.node:
        node.input[:] = [mapping.get(i, i) for i in node.input]
        node.output[:] = [mapping.get(o, o) for o in node.output]
        for sub in _subgraphs(node):
            _rename(sub, mapping)


def _needs_renaming(graph: onnx.GraphProto, defined: set[str]) -> bool:
    for node in graph.node:
        for sub in _subgraphs(node):
            local = _local(sub)
            if any(name in defined for name in local) or len(set(local)) != len(local):
                return True
            if _needs_renaming(sub, defined | set(local)):
                return True
            defined |= set(local)
    return False


def unique_value_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every subgraph-local value whose name another scope defines renamed (a copy; the model
    itself when nothing needs renaming). Semantics are unchanged: a use inside the subgraph of a name it
    defines refers to the local value, and is renamed with it."""
    defined = set(_local(model.graph))
    if not _needs_renaming(model.graph, set(defined)):
        return model
    result = onnx.ModelProto()
    result.CopyFrom(model)
    used: set[str] = set()
    _all_names(result.graph, used)

    def fresh(name: str) -> str:
        counter = 1
        while f"{name}__{counter}" in used:
            counter += 1
        used.add(f"{name}__{counter}")
        return f"{name}__{counter}"

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for sub in _subgraphs(node):
                mapping: dict[str, str] = {}
                for name in _local(sub):
                    if name in defined or name in mapping:
                        mapping[name] = fresh(name)
                if mapping:
                    _rename(sub, mapping)
                defined.update(_local(sub))
                visit(sub)

    visit(result.graph)
    return result
