"""Where does the CPU time of ``sgdfuse check ORIGINAL FUSED --steps 3`` go, in one or more source trees?
(issue 12)

    git worktree add --detach /tmp/base main
    python bench/generate.py /tmp/cf-bench --sizes 10000 50000 --seed 0
    sgdfuse optimize /tmp/cf-bench/sgd_bench_10000.onnx --no-verify -o /tmp/cf-bench/fused_10000.onnx
    python bench/check_stages.py /tmp/cf-bench/sgd_bench_10000.onnx /tmp/cf-bench/fused_10000.onnx --runs 3 /tmp/base .

Each tree's ``sgdfuse`` package is imported once (its modules swapped into ``sys.modules`` for its turn).
Then, run after run and tree after tree, the whole command runs in this process (``sgdfuse.cli.main``, its
console output captured) with timers (``time.process_time``, inclusive) wrapped around its stages, and the
floor (``onnx.load`` + ``onnx.save`` of ORIGINAL) is timed between the trees' runs. The least of the runs is
printed per stage and tree (a stage a tree does not have is ``-``), with the command's CPU and wall time, its
multiple of the floor, and a digest of its console output and exit code (equal digests: the same verdict,
table and messages). Indented stages are part of the stage above them. Wrapping costs about a microsecond a
call, which the many-called stages (feeds, comparisons) carry; the command's own CPU line is measured with
the same wrappers, so compare trees with each other, and the command's time with ``bench/run.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import os
import sys
import tempfile
import time

os.environ["COLUMNS"] = "200"  # the console's width, so that the output digests of separate invocations compare
_PACKAGE = "sgdfuse"
_MODULES = ["sgdfuse", "sgdfuse.api", "sgdfuse.verify", "sgdfuse.runtime", "sgdfuse.lift", "sgdfuse.cli"]

# (label, depth, module, attribute path): a stage that is missing in a tree is shown as "-".
STAGES = [
    ("load both models (api.load_model)", 0, "sgdfuse.api", "load_model"),
    ("check_models", 0, "sgdfuse.verify", "check_models"),
    ("declarations", 1, "sgdfuse.verify", "_declarations"),
    ("sides (_Side.of, node tables)", 1, "sgdfuse.verify", "_Side.of"),
    ("fused views", 1, "sgdfuse.verify", "_fused_views"),
    ("original pairs", 1, "sgdfuse.verify", "_original_pairs"),
    ("check inputs", 1, "sgdfuse.verify", "_check_inputs"),
    ("groups (_check_groups)", 1, "sgdfuse.verify", "_check_groups"),
    ("nodes described ahead (_describe_plain_nodes)", 1, "sgdfuse.verify", "_describe_plain_nodes"),
    ("class keys (_group_key)", 1, "sgdfuse.verify", "_group_key"),
    ("running the groups (_GroupRunner.run)", 1, "sgdfuse.verify", "_GroupRunner.run"),
    ("packed models (_GroupRunner._model)", 2, "sgdfuse.verify", "_GroupRunner._model"),
    ("pairs of sessions (_make_pairs)", 2, "sgdfuse.verify", "_make_pairs"),
    ("specialise", 3, "sgdfuse.verify", "specialise"),
    ("lift_to_double", 3, "sgdfuse.verify", "lift_to_double"),
    ("make_session", 3, "sgdfuse.verify", "make_session"),
    ("schedule (_check_schedule)", 2, "sgdfuse.verify", "_check_schedule"),
    ("feeds (_feed)", 3, "sgdfuse.verify", "_feed"),
    ("onnxruntime runs (_run_side)", 3, "sgdfuse.verify", "_run_side"),
    ("liveness (_live_views)", 3, "sgdfuse.verify", "_live_views"),
    ("comparisons (_compare_check_step)", 3, "sgdfuse.verify", "_compare_check_step"),
    ("bounds (_bounds)", 4, "sgdfuse.verify", "_bounds"),
    ("copied results (_copy_results)", 1, "sgdfuse.verify", "_copy_results"),
    ("overloads (_fail_inconsistent_overloads)", 1, "sgdfuse.verify", "_fail_inconsistent_overloads"),
    ("dead gradients (_fail_dead_gradients)", 1, "sgdfuse.verify", "_fail_dead_gradients"),
    ("console table (cli._check_table)", 0, "sgdfuse.cli", "_check_table"),
]


def _ours(name: str) -> bool:
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _load(tree: str) -> dict:
    """The sgdfuse modules of ``tree``, imported apart from any other tree's."""
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    sys.path.insert(0, os.path.abspath(tree))
    try:
        for name in _MODULES:
            importlib.import_module(name)
    finally:
        sys.path.remove(os.path.abspath(tree))
    return {n: m for n, m in sys.modules.items() if _ours(n)}


def _activate(modules: dict) -> None:
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    sys.modules.update(modules)


def _instrument(modules: dict, totals: dict[str, float]) -> None:
    """Wrap each stage of :data:`STAGES` that ``modules`` has with a timer adding to ``totals[label]``.
    A stage entered again from within itself is timed once (the outer call)."""
    clock = time.process_time
    for label, _, module_name, path in STAGES:
        owner = modules[module_name]
        *outer, attribute = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is None or attribute not in vars(owner):
            continue
        raw = vars(owner)[attribute]
        kind = type(raw) if isinstance(raw, (classmethod, staticmethod)) else None
        function = raw.__func__ if kind else raw
        active = [0]

        def timed(*args, __function=function, __label=label, __active=active, **kwargs):
            if __active[0]:
                return __function(*args, **kwargs)
            __active[0] = 1
            start = clock()
            try:
                return __function(*args, **kwargs)
            finally:
                totals[__label] = totals.get(__label, 0.0) + clock() - start
                __active[0] = 0

        setattr(owner, attribute, kind(timed) if kind else timed)
        totals.setdefault(label, 0.0)


def _run_check(modules: dict, original: str, fused: str, steps: int) -> tuple[dict[str, float], float, float, str]:
    """One run of ``sgdfuse check`` in ``modules``: stage times, CPU and wall seconds, digest of the output."""
    _activate(modules)
    totals: dict[str, float] = {}
    saved = {}
    for label, _, module_name, path in STAGES:  # keep the originals to restore after the run
        owner = modules[module_name]
        *outer, attribute = path.split(".")
        for part in outer:
            owner = getattr(owner, part, None)
        if owner is not None and attribute in vars(owner):
            saved[(id(owner), attribute)] = (owner, attribute, vars(owner)[attribute])
    _instrument(modules, totals)
    out, err = io.StringIO(), io.StringIO()
    cli = modules["sgdfuse.cli"]
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            consoles = [getattr(cli, name) for name in ("_out", "_err") if hasattr(cli, name)]
            files = [getattr(console, "file", None) for console in consoles]
            for console, stream in zip(consoles, (out, err)):
                console.file = stream
            start_cpu, start_wall = time.process_time(), time.perf_counter()
            try:
                cli.main(["check", original, fused, "--steps", str(steps)])
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
            cpu, wall = time.process_time() - start_cpu, time.perf_counter() - start_wall
            for console, stream in zip(consoles, files):
                console.file = stream
    finally:
        for owner, attribute, value in saved.values():
            setattr(owner, attribute, value)
    digest = hashlib.sha256(f"{code}\n{out.getvalue()}\n{err.getvalue()}".encode()).hexdigest()[:16]
    return totals, cpu, wall, digest


def _floor(original: str) -> tuple[float, float]:
    import onnx

    with tempfile.TemporaryDirectory() as directory:
        start_cpu, start_wall = time.process_time(), time.perf_counter()
        model = onnx.load(original)
        onnx.save(model, os.path.join(directory, "floor.onnx"))
        return time.process_time() - start_cpu, time.perf_counter() - start_wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("original")
    parser.add_argument("fused")
    parser.add_argument("trees", nargs="+", help="source trees holding an sgdfuse package (e.g. a worktree of main, and .)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    loaded = [_load(tree) for tree in args.trees]
    best: list[dict[str, float]] = [{} for _ in args.trees]
    whole: list[list[float]] = [[float("inf"), float("inf")] for _ in args.trees]
    digests: list[set[str]] = [set() for _ in args.trees]
    floors: list[tuple[float, float]] = []
    for run in range(args.runs):
        order = range(len(args.trees)) if run % 2 == 0 else reversed(range(len(args.trees)))
        for t in order:
            floors.append(_floor(args.original))
            totals, cpu, wall, digest = _run_check(loaded[t], args.original, args.fused, args.steps)
            for label, value in totals.items():
                best[t][label] = min(best[t].get(label, float("inf")), value)
            whole[t] = [min(whole[t][0], cpu), min(whole[t][1], wall)]
            digests[t].add(digest)
            print(f"run {run + 1} {args.trees[t]}: cpu {cpu:.2f} s, wall {wall:.2f} s, output {digest}", file=sys.stderr, flush=True)
    floor_cpu, floor_wall = min(f[0] for f in floors), min(f[1] for f in floors)
    width = max(len(label) + 2 * depth for label, depth, *_ in STAGES) + 2
    print(f"sgdfuse check {os.path.basename(args.original)} {os.path.basename(args.fused)} --steps {args.steps}: "
          f"CPU s, least of {args.runs} runs per tree")
    print("stage".ljust(width) + "".join(f"{tree[-18:]:>20}" for tree in args.trees))
    for label, depth, *_ in STAGES:
        cells = [f"{b[label]:20.3f}" if label in b else f"{'-':>20}" for b in best]
        print(("  " * depth + label).ljust(width) + "".join(cells))
    print("the command, CPU".ljust(width) + "".join(f"{w[0]:20.2f}" for w in whole))
    print("the command, wall".ljust(width) + "".join(f"{w[1]:20.2f}" for w in whole))
    print(f"floor (onnx.load + onnx.save), CPU {floor_cpu:.2f} s, wall {floor_wall:.2f} s (least of {len(floors)})")
    print("x floor (CPU)".ljust(width) + "".join(f"{w[0] / floor_cpu:20.1f}" for w in whole))
    print("x floor (wall)".ljust(width) + "".join(f"{w[1] / floor_wall:20.1f}" for w in whole))
    print("output digest".ljust(width) + "".join(f"{','.join(sorted(d)):>20}" for d in digests))
    same = len(set().union(*digests)) == 1
    print("outputs: " + ("the same in every run of every tree" if same else "DIFFER between runs or trees"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
