"""Reports: what was fused, what was refused and why, and what the verification found.

Dataclasses that print well (``str(report)``) and serialise to JSON (``report.to_json()``); the CLI only
formats them. Top-level keys of the JSON: ``tool``, ``fused``, ``refused``, ``verification``,
``added_state``, ``model``, ``memory_traffic`` (see :meth:`Report.to_dict`; the README lists every field).
"""

from __future__ import annotations

import dataclasses
import json
import json.encoder
import math
from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["FusedUpdate", "Refusal", "Verification", "Report", "format_value"]

# Element types whose constants are shown with the decimal the user most likely wrote (the shortest one that
# rounds to the same value in that type) next to the exact value the fused op computes with.
_NARROW_TYPES = {"FLOAT16": np.float16, "BFLOAT16": ml_dtypes.bfloat16}


def format_value(value: float | str | None, dtype: str = "FLOAT") -> str:
    """A hyper-parameter as the CLI and ``str(report)`` show it.

    ``value`` is a float (the exact value the fused op computes with), an expression over graph values
    (shown as is), or None (``"-"``). When ``dtype`` (an ONNX element type name) is FLOAT16 or BFLOAT16 and
    the float is a value of that type whose shortest decimal in the type differs from its FLOAT spelling, both
    are shown: ``0.1 (FLOAT16 = 0.099975586)`` reads "the graph's FLOAT16 constant 0.1, which is exactly
    0.099975586".
    """
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if not math.isfinite(value):
        return str(value)
    # Report values are FLOAT values written as their shortest decimal (0.099975586 for FLOAT16's 0.1).
    exact = float(np.float32(value))
    spelled = f"{exact:g}" if float(np.float32(f"{exact:g}")) == exact else str(np.float32(value))
    narrow = _NARROW_TYPES.get(dtype)
    if narrow is None or float(narrow(exact)) != exact:
        return spelled
    short = next(s for s in (f"{exact:.{digits}g}" for digits in range(1, 18)) if float(narrow(float(s))) == exact)
    return spelled if float(np.float32(short)) == exact else f"{short} ({dtype} = {spelled})"


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None (strict JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# Values dataclasses.asdict returns as they are (deepcopy keeps an immutable) and _finite too.
_IMMUTABLE_LEAVES = frozenset({str, int, bool, type(None)})


def _plain_records(records: list) -> list[dict[str, Any]]:
    """``[_finite(dataclasses.asdict(r)) for r in records]`` for flat records (the report's fused and
    refused entries), built without ``asdict``'s recursive deep copy and a second walk over the result
    (:func:`_plain_record`)."""
    names_by_type: dict[type, tuple[str, ...]] = {}
    result = []
    for record in records:
        kind = type(record)
        names = names_by_type.get(kind)
        if names is None:
            names = names_by_type[kind] = tuple(f.name for f in dataclasses.fields(kind))
        result.append(_plain_record(record, names))
    return result


def _plain_record(record: Any, names: tuple[str, ...]) -> dict[str, Any]:
    """``_finite(dataclasses.asdict(record))`` (``names``: its fields, in ``dataclasses.fields`` order, which
    ``asdict`` follows) for a flat record: a field holding a string, an int, a bool or None is taken as it
    is (``asdict`` deep-copies an immutable to itself), a float made finite, a list, tuple or dict of those
    copied one level deep (as a list, as ``_finite`` turns a tuple). Any other value (a nested dataclass, a
    numpy scalar, a subclass of a leaf type) sends the record down the general path."""
    result: dict[str, Any] = {}
    leaves = _IMMUTABLE_LEAVES
    for name in names:
        value = getattr(record, name)
        kind = type(value)
        if kind in leaves:
            result[name] = value
        elif kind is float:
            result[name] = value if math.isfinite(value) else None
        elif (kind is list or kind is tuple) and all(type(v) in leaves or type(v) is float for v in value):
            result[name] = [v if type(v) is not float or math.isfinite(v) else None for v in value]
        elif kind is dict and all(type(k) in leaves and (type(v) in leaves or type(v) is float) for k, v in value.items()):
            result[name] = {k: v if type(v) is not float or math.isfinite(v) else None for k, v in value.items()}
        else:
            return _finite(dataclasses.asdict(record))
    return result


def _dumps(value: Any, step: str, level: int) -> str:
    """``json.dumps(value, indent=step, default=str, allow_nan=False)`` as it stands ``level`` levels deep in
    an indented document: JSON text holds a line break only between items (a string's is escaped), so each
    one gains the indent of the level."""
    return json.dumps(value, indent=step, sort_keys=False, default=str, allow_nan=False).replace("\n", "\n" + step * level)


_encode_string = json.encoder.encode_basestring_ascii  # what json.dumps writes a str with (ensure_ascii)


def _indented_json(document: dict[str, Any], step: str, records: dict[str, list] | None = None) -> str:
    """``json.dumps(document, indent=step, default=str, allow_nan=False)``, written faster for the report:
    json's indented writer is Python, a generator per container (a quarter of writing a report at 10,000
    updates). ``records``: per key whose value in ``document`` stands for a list of flat records (the fused and
    refused entries), the records, written straight from their fields (:func:`_record_json`) as
    ``_plain_records`` would make them; every other value by ``json.dumps`` itself.
    tests/test_report_json.py holds the text to ``json.dumps``'s."""
    records = records or {}
    if not document or any(type(key) is not str for key in document):
        return json.dumps(document, indent=step, sort_keys=False, default=str, allow_nan=False)
    inner = "\n" + step
    parts = []
    for key, value in document.items():
        if key in records:
            text = _records_json(records[key], step)
        else:
            text = _dumps(value, step, 1)
        parts.append(_encode_string(key) + ": " + text)
    return "{" + inner + ("," + inner).join(parts) + "\n}"


def _records_json(records: list, step: str) -> str:
    """``_dumps(_plain_records(records), step, 1)``: a record of leaves (strings, ints, floats, bools, None, and
    lists or dicts of those) is written from its fields here, any other through ``_plain_record`` and
    ``json.dumps``."""
    if not records:
        return "[]"
    items = "\n" + step * 2
    inner = "\n" + step * 3
    close = "\n" + step * 2 + "}"
    names_by_type: dict[type, tuple[str, ...]] = {}
    keys: dict[str, str] = {}  # field name -> its JSON key and the separator
    texts = []
    for record in records:
        kind = type(record)
        names = names_by_type.get(kind)
        if names is None:
            names = names_by_type[kind] = tuple(f.name for f in dataclasses.fields(kind))
        parts = []
        for name in names:
            value = getattr(record, name)
            kind = type(value)
            if kind is str:
                text = _encode_string(value)
            elif kind is int:
                text = int.__repr__(value)
            elif kind is float:
                text = float.__repr__(value) if math.isfinite(value) else "null"  # _finite's None
            elif value is None:
                text = "null"
            elif kind is bool:
                text = "true" if value else "false"
            elif kind is list or kind is tuple or kind is dict:
                text = _flat_container(value, step, 3)  # type: ignore[arg-type]
                if text is None:
                    break
            else:
                break
            key = keys.get(name)
            if key is None:
                key = keys[name] = _encode_string(name) + ": "
            parts.append(key + text)
        else:
            texts.append("{" + inner + ("," + inner).join(parts) + close if parts else "{}")
            continue
        texts.append(_dumps(_plain_record(record, names), step, 2))
    return "[" + items + ("," + items).join(texts) + "\n" + step + "]"


def _flat_container(value: list | tuple | dict, step: str, level: int) -> str | None:
    """A list or tuple, or a dict with string keys, of leaves (:func:`_leaf`, a non-finite float as None) as
    ``json.dumps`` writes it ``level`` levels deep once ``_plain_record`` has made it plain; None for any other
    content."""
    if not value:
        return "{}" if type(value) is dict else "[]"
    inner = "\n" + step * (level + 1)
    if type(value) is not dict:
        texts = [_leaf(item) for item in value]
        if None in texts:
            return None
        return "[" + inner + ("," + inner).join(texts) + "\n" + step * level + "]"  # type: ignore[arg-type]
    parts = []
    for key, item in value.items():
        text = _leaf(item)
        if text is None or type(key) is not str:
            return None
        parts.append(_encode_string(key) + ": " + text)
    return "{" + inner + ("," + inner).join(parts) + "\n" + step * level + "}"


def _leaf(value: Any) -> str | None:
    """A string, int, float, bool or None (exactly those types) as ``json.dumps`` writes it once ``_finite``
    has made a non-finite float None; else None."""
    kind = type(value)
    if kind is str:
        return _encode_string(value)
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        return float.__repr__(value) if math.isfinite(value) else "null"
    if value is None:
        return "null"
    if kind is bool:
        return "true" if value else "false"
    return None


class _Text:
    """A text field of a report record that may be given as an object whose ``str()`` is the text (the
    matcher's ``LazyText`` equations): it is written on first read, and every read (attribute access,
    ``dataclasses.asdict``, ``==``, ``repr``) sees a ``str``. Formatting an equation costs about as much as
    matching it was spared by its structural class, and the console summary never shows one: only the JSON
    report and ``--verbose`` read them. A dataclass field with this descriptor as its "default" has no
    default (``__get__`` on the class raises ``AttributeError``, the dataclasses rule for descriptor
    fields)."""

    __slots__ = ("_slot",)

    def __set_name__(self, owner: type, name: str) -> None:
        self._slot = "_text_" + name

    def __get__(self, record: object, owner: type | None = None) -> str:
        if record is None:
            raise AttributeError(self._slot)  # no default: the field stays a required argument
        value = record.__dict__[self._slot]
        if not isinstance(value, str):
            value = record.__dict__[self._slot] = str(value)
        return value

    def __set__(self, record: object, value: object) -> None:
        record.__dict__[self._slot] = value


@dataclasses.dataclass
class FusedUpdate:
    """One update fused into an ``ai.sgdfuse::SGD`` node.

    Attributes:
        node: the fused node's name.
        parameters, gradient, accum: value names of the old weights, the gradient, the momentum buffer.
        parameters_out, accum_out: the outputs now produced by the fused node (names unchanged).
        learning_rate, momentum: the value (a float) or the expression over graph values it was solved to.
        learning_rate_input, momentum_input: the value names fed to the fused node.
        dampening, weight_decay, nesterov, maximize: the solved hyper-parameters.
        stat: how the ``stat`` input is provided.
        dtype: ONNX element type name of the parameters; shape: their dims.
        parameter_equation, accum_equation: the normalised equations that were matched.
        matched_nodes: how many nodes of the original graph the matched update spans.
        traffic_before_bytes, traffic_after_bytes: estimated bytes read and written per step by the update
            before and after fusion (see :mod:`sgdfuse.passes.traffic`); None when a shape is not static.
        source: how it was found: ``"pattern"`` (algebraic matching), ``"pattern with first-step Where"``,
            ``"onnx-momentum"`` (an ``ai.onnx.preview.training::Momentum`` node converted).
        roles_from: which evidence decided the roles (``pin``, ``names``, ``structure``, ``conventions``,
            ``plausibility``; see ``sgdfuse.passes.sgd_match.ROLE_EVIDENCE``), ``"onnx-momentum"`` for a converted
            ``Momentum`` node.
        guard: when the graph skips the update under a condition (``"skipped where found_inf is true"``): the
            graph's ``Where(condition, old, new)`` outputs stay and read the fused node's outputs; a guard on one
            state says which (``"parameters skipped where found_inf is true (the buffer is updated on every
            step)"``); "" otherwise.
        rounded: hyper-parameters the op's dtype rounds (only with rounding allowed): name → the graph's value;
            ``learning_rate`` and ``momentum`` above are then the values the op uses.
    """

    node: str
    parameters: str
    gradient: str
    accum: str
    parameters_out: str
    accum_out: str
    learning_rate: float | str
    momentum: float | str
    learning_rate_input: str
    momentum_input: str
    dampening: float
    weight_decay: float
    nesterov: bool
    maximize: bool
    stat: str
    dtype: str
    shape: list
    parameter_equation: str = _Text()  # type: ignore[assignment]  # str, or an object written by str() on first read
    accum_equation: str = _Text()  # type: ignore[assignment]
    matched_nodes: int = 0
    source: str = "pattern"
    traffic_before_bytes: int | None = None
    traffic_after_bytes: int | None = None
    rounded: dict = dataclasses.field(default_factory=dict)
    roles_from: str = "structure"
    guard: str = ""

    def __getstate__(self) -> dict[str, Any]:
        # Pickling and copying take the texts written: unwritten text holds a closure over the matcher's forms.
        for name in ("parameter_equation", "accum_equation"):
            getattr(self, name)
        return self.__dict__


@dataclasses.dataclass
class Refusal:
    """A candidate left unfused: the graph output, a reason code, one sentence, and the equations.

    Attributes:
        candidate: the graph output that looked like an update.
        reason: stable code (``no-momentum-buffer``, ``extra-term``, ``constant-state``, ... see
            :data:`sgdfuse.passes.sgd_match.REASONS`).
        detail: what did not fit and what to do about it.
        equation: the recovered update equation(s).
        nearest: the closest SGD form reached.
        differing: the term(s) that differ.
    """

    candidate: str
    reason: str
    detail: str
    equation: str = ""
    nearest: str = ""
    differing: str = ""

    def explanation(self) -> list[str]:
        """The lines that explain the refusal: the detail, then ``found:``, ``nearest:`` and ``differs:``
        for each of the equations that the detail does not already quote (so nothing is printed twice)."""
        lines = [self.detail]
        for label, text in (("found:  ", self.equation), ("nearest:", self.nearest), ("differs:", self.differing)):
            if text and text not in self.detail:
                lines.append(f"{label} {text}")
        return lines


@dataclasses.dataclass
class Verification:
    """What the differential check did.

    Attributes:
        enabled: False with ``verify=False`` (nothing was checked).
        steps: chained steps per update.
        tolerance: how the per-element bound is derived (text).
        runner: what ran the original and the rewritten graph (``"onnxruntime"``, or MindSpore for MindIR).
        updates: per update: ``{"parameters_out", "passed", "max_abs_error", "max_bound_ratio", "message"}``,
            plus ``"runs"`` (precisions and sizes run) and ``"note"`` (what could not be run) from
            :class:`sgdfuse.verify.UpdateCheck`.
    """

    enabled: bool
    steps: int = 0
    tolerance: str = ""
    runner: str = "onnxruntime"
    updates: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every checked update passed (vacuously true when disabled)."""
        return all(u["passed"] for u in self.updates)


@dataclasses.dataclass
class Report:
    """The result of an analysis or optimisation of one model.

    Attributes:
        source: where the model came from (a path, or ``"<ModelProto>"``).
        fused: updates fused (or, for ``inspect``, that would be fused).
        refused: candidates refused, with reasons.
        verification: what the differential check did.
        added_state: values the rewrite added that a caller may see (name, what, initial value).
        nodes_before, nodes_after: node counts of the main graph.
        written: False for ``inspect`` (a dry run).
        already_fused: ``ai.sgdfuse::SGD`` nodes the input already had (a model optimised before).
        existing_sgd: those nodes, one dict each: ``node``, ``parameters``, ``gradient``, ``accum``,
            ``learning_rate`` and ``momentum`` (the constant's value when the input is a one-element constant,
            else the input's name), ``dampening``, ``weight_decay``, ``nesterov`` (the node's attributes, contract
            defaults filled in).
        sorted_nodes: the input's nodes were not in topological order (ONNX requires it): the output holds
            them sorted.
    """

    source: str
    fused: list[FusedUpdate] = dataclasses.field(default_factory=list)
    refused: list[Refusal] = dataclasses.field(default_factory=list)
    verification: Verification = dataclasses.field(default_factory=lambda: Verification(False))
    added_state: list[dict[str, str]] = dataclasses.field(default_factory=list)
    nodes_before: int = 0
    nodes_after: int = 0
    written: bool = True
    already_fused: int = 0
    existing_sgd: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    sorted_nodes: bool = False

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``tool``, ``fused``, ``refused``, ``verification``, ``added_state``, ``model``,
        ``memory_traffic``; non-finite floats become None so the JSON is strict."""
        plain = self._summary()
        plain["fused"] = _plain_records(self.fused)
        plain["refused"] = _plain_records(self.refused)
        return plain

    def _summary(self) -> dict[str, Any]:
        """:meth:`to_dict` with None for the fused and refused entries (written apart: :meth:`to_json`)."""
        from sgdfuse import __version__

        return _finite({
            "tool": {"name": "sgdfuse", "version": __version__, "report_format": 1},
            "fused": None,  # below: one entry per update, each walked once
            "refused": None,
            "verification": {**dataclasses.asdict(self.verification), "passed": self.verification.passed},
            "added_state": list(self.added_state),
            "model": {
                "source": self.source, "nodes_before": self.nodes_before, "nodes_after": self.nodes_after,
                "already_fused": self.already_fused, "existing_sgd": list(self.existing_sgd),
                "sorted_nodes": self.sorted_nodes,
            },
            "memory_traffic": self.memory_traffic(),
        })

    def memory_traffic(self) -> dict[str, Any]:
        """Estimated bytes per step moved by the fused updates before and after fusion, in total and by
        dtype (updates whose shapes are not static are counted in ``unknown``)."""
        by_dtype: dict[str, dict[str, int]] = {}
        unknown = 0
        for f in self.fused:
            if f.traffic_before_bytes is None or f.traffic_after_bytes is None:
                unknown += 1
                continue
            entry = by_dtype.setdefault(f.dtype, {"before_bytes": 0, "after_bytes": 0, "updates": 0})
            entry["before_bytes"] += f.traffic_before_bytes
            entry["after_bytes"] += f.traffic_after_bytes
            entry["updates"] += 1
        before = sum(e["before_bytes"] for e in by_dtype.values())
        after = sum(e["after_bytes"] for e in by_dtype.values())
        return {"before_bytes": before, "after_bytes": after, "by_dtype": by_dtype, "unknown": unknown}

    def to_json(self, indent: int | str | None = 2) -> str:
        """The report as JSON text (keys sorted within each record for stable diffs): exactly
        ``json.dumps(self.to_dict(), indent=indent, default=str, allow_nan=False)``, the fused and refused
        entries written from their fields (:func:`_indented_json`)."""
        if indent is None:
            return json.dumps(self.to_dict(), sort_keys=False, default=str, allow_nan=False)
        step = " " * indent if isinstance(indent, int) else indent
        return _indented_json(self._summary(), step, {"fused": self.fused, "refused": self.refused})

    def __str__(self) -> str:
        lines = [f"{self.source}: {len(self.fused)} fused, {len(self.refused)} refused"]
        for f in self.fused:
            flags = ", ".join(x for x in ("nesterov" if f.nesterov else "", "maximize" if f.maximize else "") if x)
            lines.append(
                f"  fused {f.parameters} (grad {f.gradient}, buffer {f.accum}): lr={format_value(f.learning_rate, f.dtype)} "
                f"momentum={format_value(f.momentum, f.dtype)} dampening={format_value(f.dampening, f.dtype)} "
                f"weight_decay={format_value(f.weight_decay, f.dtype)}"
                + (f" [{flags}]" if flags else "")
            )
        for r in self.refused:
            detail, *more = r.explanation()
            lines.append(f"  refused {r.candidate} [{r.reason}]: {detail}")
            lines.extend(f"      {line}" for line in more)
        if self.verification.enabled:
            state = "passed" if self.verification.passed else "FAILED for some updates"
            lines.append(f"  verification: {self.verification.steps} chained steps in {self.verification.runner}, {state}")
        return "\n".join(lines)
