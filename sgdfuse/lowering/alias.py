"""Which GE ops may hand out their input's memory as their output: one rule, used by lowering and executor.

An op *may alias* its input when its output has the same elements in the same memory order: GE (and the
numpy executor, :mod:`sgdfuse.lowering.executor`) may then return the input's buffer, re-described, instead
of a copy. A read through such an op is a read of the input's memory, so a reader of a state variable
through any chain of them must run before the variable's in-place write (:mod:`sgdfuse.lowering.state`).

The rule: an op preserves the layout when it keeps every element at its place in row-major order.

- ``Identity``, ``Reshape``, ``Squeeze``, ``Unsqueeze``, ``ExpandDims``, ``Flatten``, ``FlattenV2`` always do
  (they only re-describe the shape);
- ``Transpose`` does when the axes it moves that have more than one element keep their relative order: a
  transpose that only moves size-1 axes, or the identity perm, is a reshape, and GE may compile it as one.
  An axis of unknown size counts as possibly size 1 (so such a transpose may alias: the safe side);
- ``Cast`` to its input's own dtype, and ``Expand``/``BroadcastTo`` to its input's own shape, are no-ops a
  graph optimiser may remove (then the readers read the input).

Every other op writes a new buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ALIAS_OP_TYPES", "keeps_layout", "may_alias"]

ALIAS_OP_TYPES = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "ExpandDims", "Flatten", "FlattenV2"})
"""GE ops whose output always may share its input's memory (they re-describe the shape only)."""


def keeps_layout(perm: Sequence[int], shape: Sequence[int | None] | None) -> bool:
    """True when transposing a tensor of ``shape`` by ``perm`` keeps its elements in row-major order.

    Args:
        perm: the permutation (output axis k is input axis ``perm[k]``); negative entries count from the end.
        shape: the input's dimensions; None or negative entries are unknown (counted as possibly 1), and an
            unknown rank (``shape`` None) may alias.
    """
    if shape is None:
        return True
    rank = len(shape)
    moved = [int(p) % rank for p in perm] if rank else []
    sized = [axis for axis in moved if shape[axis] is not None and int(shape[axis]) > 1]
    return sized == sorted(sized)


def may_alias(
    op_type: str,
    *,
    perm: Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    output_shape: Sequence[int | None] | None = None,
    same_dtype: bool | None = None,
) -> bool:
    """True when a GE op of ``op_type`` may return its input's memory (module docstring).

    Args:
        op_type: the GE op type.
        perm: for ``Transpose``, its permutation (None: unknown, may alias).
        shape: the input's dimensions (``Transpose``: see :func:`keeps_layout`; ``Expand``: compared with
            ``output_shape``); None or negative entries are unknown.
        output_shape: for ``Expand``/``BroadcastTo``, the output's dimensions.
        same_dtype: for ``Cast``, whether the output dtype is the input's (None: unknown, may alias).
    """
    if op_type in ALIAS_OP_TYPES:
        return True
    if op_type == "Transpose":
        return perm is None or keeps_layout(perm, shape)
    if op_type == "Cast":
        return same_dtype is None or same_dtype
    if op_type in ("Expand", "BroadcastTo"):
        if shape is None or output_shape is None:
            return True
        # Same rank and every dimension equal or unknown: the output may be the input itself.
        return len(shape) == len(output_shape) and all(a is None or b is None or a < 0 or b < 0 or a == b for a, b in zip(shape, output_shape))
    return False
