"""How long do the stages after matching take, in two source trees, measured side by side? (issue 12)

    git worktree add --detach /tmp/base main
    python bench/after_matching.py /tmp/perf-bench/sgd_bench_10000.onnx --runs 7 /tmp/base .

Each tree's ``sgdfuse`` package is imported once (its modules swapped into ``sys.modules`` for its turn), the
model is loaded, indexed and matched once per tree, and then, run after run and tree after tree, the stages
after matching are timed in CPU time (``time.process_time``) with the collector off, as ``optimize`` runs
them: the planner's set-up and plans, ``apply_plans``, the output guard (``api._check_output``), the report
entries, the JSON report and the output's serialisation. The minimum of the runs is printed per stage, with
a digest of the output and the report per tree (equal digests: equal bytes). Timings on a shared machine
are noisy; the minimum of runs alternating the trees in one process is what compares.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib
import sys
import time

_PACKAGE = "sgdfuse"
_MODULES = ["sgdfuse", "sgdfuse.api", "sgdfuse.passes.rewrite", "sgdfuse.passes.output_check", "sgdfuse.report", "sgdfuse.cli"]


def _ours(name: str) -> bool:
    return name == _PACKAGE or name.startswith(_PACKAGE + ".")


def _load(tree: str) -> dict:
    """The sgdfuse modules of ``tree``, imported apart from any other tree's."""
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    sys.path.insert(0, tree)
    try:
        for name in _MODULES:
            importlib.import_module(name)
    finally:
        sys.path.remove(tree)
    return {n: m for n, m in sys.modules.items() if _ours(n)}


def _activate(modules: dict) -> None:
    for name in [n for n in sys.modules if _ours(n)]:
        del sys.modules[name]
    sys.modules.update(modules)


def _matched(modules: dict, path: str):
    _activate(modules)
    api = modules["sgdfuse.api"]
    model = api.load_model(path)
    index = modules["sgdfuse.passes.index"].build_index(model)
    matches, _ = modules["sgdfuse.passes.sgd_match"].find_updates(index, modules["sgdfuse.passes.linear"].Normaliser(index))
    return model, index, matches, modules["sgdfuse.fused_op"].function_opset(model)


def _stages(modules: dict, path: str, matched) -> tuple[dict[str, float], str]:
    _activate(modules)
    api, rewrite, report_module = modules["sgdfuse.api"], modules["sgdfuse.passes.rewrite"], modules["sgdfuse.report"]
    model, index, matches, opset = matched
    clock = time.process_time
    times: dict[str, float] = {}
    start = clock()
    planner = rewrite.Planner(index, opset)
    times["planner set-up"] = clock() - start
    start = clock()
    plans = [planner.plan(match) for match in matches]
    times["plans"] = clock() - start
    start = clock()
    report = report_module.Report(source=path, nodes_before=len(model.graph.node))
    parts = api._EntryParts(index) if hasattr(api, "_EntryParts") else {}
    for plan in plans:
        report.fused.append(api._fused_entry(plan, index, parts))
    times["report entries"] = clock() - start
    start = clock()
    output = rewrite.apply_plans(model, index, plans)
    times["apply_plans"] = clock() - start
    start = clock()
    api._check_output(output, model, rewrite=(model, index, plans))
    times["output guard"] = clock() - start
    start = clock()
    text = report.to_json()
    times["JSON report"] = clock() - start
    start = clock()
    data = output.SerializeToString()
    times["serialise"] = clock() - start
    digest = hashlib.sha256(data).hexdigest()[:12] + "/" + hashlib.sha256(text.encode()).hexdigest()[:12]
    return times, digest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("trees", nargs="+", help="source trees, each holding an sgdfuse package")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    trees = [(tree, _load(tree)) for tree in args.trees]
    gc.disable()  # as optimize runs (sgdfuse.collector.paused)
    matched = {tree: _matched(modules, args.model) for tree, modules in trees}
    best: dict[str, dict[str, float]] = {tree: {} for tree, _ in trees}
    digests: dict[str, str] = {}
    for run in range(args.runs):
        for tree, modules in trees:
            times, digests[tree] = _stages(modules, args.model, matched[tree])
            gc.collect()
            for stage, seconds in times.items():
                best[tree][stage] = min(best[tree].get(stage, seconds), seconds)
            print(f"run {run} {tree}: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()), flush=True)
    stages = list(best[args.trees[0]])
    width = max(len(tree) for tree in args.trees) + 2
    print(f"\nCPU s, minimum of {args.runs} runs\n" + "stage".ljust(16) + "".join(t.rjust(width) for t in args.trees))
    for stage in stages + ["total"]:
        values = [sum(best[t].values()) if stage == "total" else best[t][stage] for t in args.trees]
        print(stage.ljust(16) + "".join(f"{v:{width}.3f}" for v in values))
    print("output/report digests: " + ", ".join(f"{t} {digests[t]}" for t in args.trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
