"""The table of ONNX → GE lowering rules (the shape of JAX's ``register_lowering``).

A rule is a small function ``rule(ctx: NodeLowering) -> None`` that reads one ONNX node through ``ctx``
and emits GE ops for it, binding each ONNX output to a GE tensor. Rules register themselves with
:func:`register`; lowering looks them up with :func:`rule_for`. A node whose ``(domain, op_type)`` has no
rule is never dropped: lowering collects every such node and raises
:class:`~sgdfuse.lowering.errors.UnsupportedOpError`.

The rule modules are imported by :mod:`sgdfuse.lowering.lower`, which fills the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from sgdfuse.lowering.context import NodeLowering

__all__ = ["Rule", "register", "rule_for", "registered", "DEFAULT_DOMAIN"]

Rule = Callable[["NodeLowering"], None]

DEFAULT_DOMAIN = "ai.onnx"
"""The standard ONNX domain; ``""`` in a model means the same."""

_RULES: dict[tuple[str, str], Rule] = {}


def _domain(domain: str) -> str:
    return DEFAULT_DOMAIN if domain in ("", DEFAULT_DOMAIN) else domain


def register(*op_types: str, domain: str = DEFAULT_DOMAIN) -> Callable[[Rule], Rule]:
    """Decorator: register ``rule`` as the lowering of each of ``op_types`` in ``domain``.

    Raises:
        ValueError: an op type already has a rule (two rules for one op would make the table ambiguous).
    """

    def decorate(rule: Rule) -> Rule:
        for op_type in op_types:
            key = (_domain(domain), op_type)
            if key in _RULES and _RULES[key] is not rule:
                raise ValueError(f"{key[0]}::{op_type} already has a lowering rule ({_RULES[key].__name__})")
            _RULES[key] = rule
        return rule

    return decorate


def rule_for(domain: str, op_type: str) -> Rule | None:
    """The rule for an ONNX node's ``(domain, op_type)``, or None."""
    return _RULES.get((_domain(domain), op_type))


def registered() -> list[tuple[str, str]]:
    """Every ``(domain, op_type)`` with a rule, sorted."""
    return sorted(_RULES)
