"""Reachability between the ops of a GE graph being built, kept cheap by an online topological order.

Ordering in-place state access (:func:`sgdfuse.lowering.state.order_state_access`) asks, for every reader of
a state variable's old value, whether it already runs before the write (an ancestor of the writer), can only
run after it (a descendant), or is unrelated (then a control edge is added). Walking the whole graph per
variable makes lowering quadratic in the number of updates (a 3000-update graph took minutes). Here:

- every op has a ``rank`` in a topological order, so a query ``a ⇝ b`` with ``a`` ranked above ``b`` is
  answered at once, and walks are bounded by rank: an op between ``a`` and ``b`` on a path ranks between
  them. Adding an edge against the order re-ranks only the ops between its two ends (the online
  topological-order algorithm of Pearce and Kelly, "A dynamic topological sort algorithm for directed
  acyclic graphs", JEA 2006), so the order is built once and never recomputed;
- a query walks from both ends at once (forward from ``a``, backward from ``b``, always the smaller
  frontier), so it costs about twice the smaller of the two neighbourhoods: an update's descendants are a
  few ops, so "does this reader depend on the update" is cheap;
- in a deep network a forward op reading a weight reaches that weight's update only through the loss: the
  path is as long as the network, for every weight. When a walk that finds its target has visited more than
  ``hub_after`` ops, the op where the two walks met (on such paths, near the loss) becomes a *hub*: its
  ancestors and descendants are collected once, and later queries whose ends lie on either side of a hub
  are answered by two set look-ups. Edges are only ever added, so a hub's sets may miss new paths but never
  claim a path that is not there; a query they do not answer walks as above.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from sgdfuse.lowering.graph_builder import GraphBuilder

__all__ = ["OpOrder"]


class OpOrder:
    """Predecessor/successor sets (data and control edges) and a topological rank of every op.

    Built from a :class:`GraphBuilder` once; kept in step by :meth:`add_op` and :meth:`add_edge`, which the
    caller uses alongside the builder's own edits.
    """

    def __init__(self, builder: GraphBuilder, *, hub_after: int = 256, max_hubs: int = 16) -> None:
        self.hub_after = hub_after
        self.max_hubs = max_hubs
        self._hubs: list[tuple[set[str], set[str]]] = []
        # An op's predecessors are read from its record when first asked for (a few walks visit a few ops);
        # the successors and the rank take one pass over every record.
        self.preds: dict[str, set[str]] = _Predecessors(builder)
        self.succs: dict[str, set[str]] = {name: set() for name in builder.ops}
        rank = _creation_rank(builder, self.succs)
        if rank is None:
            for name in builder.ops:
                self.preds[name]  # noqa: B018  (every op's, for the sort)
            rank = _sorted_rank(builder, self.preds, self.succs)
        self.rank: dict[str, int] = rank
        self._top = len(self.rank)

    def add_op(self, name: str, preds: Iterable[str] = ()) -> None:
        """Register a new op reading ``preds``; it is ranked above every op (edges out of it come later)."""
        self.preds[name] = set()
        self.succs[name] = set()
        self.rank[name] = self._top
        self._top += 1
        for source in preds:
            self.add_edge(source, name)

    def add_edge(self, before: str, after: str) -> None:
        """Record that ``after`` waits for ``before``, re-ranking the ops between them if needed.

        Raises:
            ValueError: ``before`` already waits for ``after`` (the edge would close a cycle).
        """
        if before == after:
            raise ValueError(f"{before} cannot wait for itself")
        low, high = self.rank[after], self.rank[before]
        if low > high:  # already in order
            self._link(before, after)
            return
        # Pearce-Kelly: the descendants of `after` and the ancestors of `before` ranked in [low, high] swap
        # places, ancestors first, reusing the same ranks.
        forward = self._walk(after, self.succs, lambda r: r <= high)
        if before in forward:
            raise ValueError(f"{after} already waits for {before}, so {before} cannot wait for it")
        backward = self._walk(before, self.preds, lambda r: r >= low)
        ranks = sorted(self.rank[n] for n in forward | backward)
        moved = sorted(backward, key=self.rank.__getitem__) + sorted(forward, key=self.rank.__getitem__)
        for name, rank in zip(moved, ranks):
            self.rank[name] = rank
        self._link(before, after)

    def _link(self, before: str, after: str) -> None:
        self.preds[after].add(before)
        self.succs[before].add(after)

    def _walk(self, start: str, edges: dict[str, set[str]], keep) -> set[str]:
        seen = {start}
        stack = [start]
        while stack:
            for other in edges[stack.pop()]:
                if other not in seen and keep(self.rank[other]):
                    seen.add(other)
                    stack.append(other)
        return seen

    def reaches(self, source: str, target: str) -> bool:
        """True when ``target`` transitively waits for ``source`` (see the module docstring)."""
        if source == target or self.rank[source] > self.rank[target]:
            return False
        for ancestors, descendants in self._hubs:
            if source in ancestors and target in descendants:
                return True
        low, high = self.rank[source], self.rank[target]
        forward, backward = {source}, {target}
        ahead, behind = [source], [target]
        while ahead and behind:
            # Expand the smaller frontier by one op; the walks meet on a path if there is one.
            if len(ahead) <= len(behind):
                for other in self.succs[ahead.pop()]:
                    if other in backward:
                        return self._found(other, len(forward) + len(backward))
                    if other not in forward and self.rank[other] < high:
                        forward.add(other)
                        ahead.append(other)
            else:
                for other in self.preds[behind.pop()]:
                    if other in forward:
                        return self._found(other, len(forward) + len(backward))
                    if other not in backward and self.rank[other] > low:
                        backward.add(other)
                        behind.append(other)
        return False

    def _found(self, meeting: str, visited: int) -> bool:
        if visited > self.hub_after and len(self._hubs) < self.max_hubs:
            self._hubs.append((self._walk(meeting, self.preds, lambda r: True), self._walk(meeting, self.succs, lambda r: True)))
        return True


class _Predecessors(dict):
    """Op name → the ops it waits for (data and control edges), read from its :class:`OpRecord` the first
    time they are asked for and kept: edges :meth:`OpOrder.add_edge` adds go into the kept set. A record
    edited before its set is first read is read as edited: :func:`sgdfuse.lowering.state.order_state_access`
    adds a control edge to the builder and then to the order, and reads a reader's set (adding the snapshot's
    edge) before it replaces the reader's input, so every set is the one a walk over all records at
    construction would have made, plus the edges added since."""

    def __init__(self, builder: GraphBuilder) -> None:
        super().__init__()
        self._ops = builder.ops

    def __missing__(self, name: str) -> set[str]:
        record = self._ops[name]
        sources = {t.op for _, t in record.inputs if t is not None}
        sources.update(record.controls)
        self[name] = sources
        return sources


def _creation_rank(builder: GraphBuilder, succs: dict[str, set[str]]) -> dict[str, int] | None:
    """Creation order as the rank, when it is topological (every op's sources were created before it, which
    is how rules build graphs), else None; ``succs`` gets every op's successors either way. Any topological
    order serves: reachability answers do not depend on which one, only how far a walk goes does, and a heap
    sort of every op cost more than the ordering pass's queries."""
    rank: dict[str, int] = {}
    topological = True
    for name, record in builder.ops.items():  # creation order
        for _, tensor in record.inputs:
            if tensor is not None:
                source = tensor.op
                topological = topological and source in rank
                succs[source].add(name)
        for source in record.controls:
            topological = topological and source in rank
            succs[source].add(name)
        rank[name] = len(rank)
    return rank if topological else None


def _sorted_rank(builder: GraphBuilder, preds: dict[str, set[str]], succs: dict[str, set[str]]) -> dict[str, int]:
    """A topological rank of every op, ties broken by creation order (Kahn's algorithm with a heap).

    Raises:
        ValueError: the graph has a cycle.
    """
    rank: dict[str, int] = {}
    waiting = {name: len(sources) for name, sources in preds.items()}
    ready = [(builder.ops[n].position, n) for n, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    while ready:
        _, name = heapq.heappop(ready)
        rank[name] = len(rank)
        for successor in succs[name]:
            waiting[successor] -= 1
            if waiting[successor] == 0:
                heapq.heappush(ready, (builder.ops[successor].position, successor))
    if len(rank) != len(preds):
        raise ValueError(f"graph {builder.name} has a cycle; this is a bug in sgdfuse")
    return rank
