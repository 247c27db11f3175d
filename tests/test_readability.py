"""The files read as a tutorial: each loop short and parallel to the others, the diff between two
algorithm files the idea that separates them (with the counts the README prints), the math in
common.py apart from the machinery, every shared module short, every file self-contained, one definition per
constant."""
import ast
import re
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT

ROOT = Path(ROOT)
ALGORITHMS = ("remax", "rloo", "grpo", "dapo", "ppo")
# Changed lines that a diff between two files may show (the README prints the counts). grpo.py carries more
# options than the others (GSPO's sequence level, Dr. GRPO's scalings, three KL estimators, dual clip, batch
# reuse), which its two diffs show beside the idea that separates the files.
# The update is written out in each main(): GRPO and DAPO nest it in their --num_epochs loop, which RLOO
# (on-policy) does not, and DAPO's dynamic sampling is in dapo.py, not the engine. The group methods' exploration
# options (--budget, --sampler: each row's group by id) add a few lines to rloo.py that remax.py has no use for.
DIFF_BUDGET = {("remax", "rloo"): 128, ("rloo", "grpo"): 182, ("grpo", "dapo"): 200}
MAIN_BUDGET = {"ppo": 140}  # the others: 110
# Lines of each module of support/ and of common.py, read in one sitting; a module that outgrows it is split by
# topic. The algorithm files keep their own budgets: the diffs and main() above.
MODULE_BUDGET = 450


def changed_lines(a, b):
    out = subprocess.run(["diff", f"{a}.py", f"{b}.py"], cwd=ROOT, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines() if line[:1] in "<>")


def main_function(name):
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), tree


def local_imports(path):
    """The project modules a file imports, at any depth (function-level imports included)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    local = {p.stem for p in ROOT.glob("*.py")} | {f"support.{p.stem}" for p in (ROOT / "support").glob("*.py")}
    return {m for m in modules if m in local}


def test_readme_prints_the_current_diff_counts_and_they_are_within_budget():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- diff-counts -->\n```\n(.*?)```\n<!-- /diff-counts -->", readme, re.S).group(1)
    printed = {tuple(m[:2]): int(m[2]) for m in re.findall(r"(\w+) -> (\w+): (\d+)", block)}
    measured = {pair: changed_lines(*pair) for pair in DIFF_BUDGET}
    assert printed == measured
    for pair, budget in DIFF_BUDGET.items():
        assert measured[pair] <= budget, f"diff {pair[0]}.py {pair[1]}.py changes {measured[pair]} lines"


@pytest.mark.parametrize("name", ALGORITHMS)
def test_main_is_short_and_calls_each_loss_once(name):
    main, tree = main_function(name)
    assert main.end_lineno - main.lineno + 1 <= MAIN_BUDGET.get(name, 110)
    losses = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.endswith("_loss")]
    calls = [n.func.id for n in ast.walk(main) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
    assert losses and all(calls.count(loss) == 1 for loss in losses), (losses, calls)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_algorithm_file_imports_no_other_algorithm_file(name):
    assert not local_imports(ROOT / f"{name}.py") & set(ALGORITHMS)


def test_common_is_the_math_alone():
    source = (ROOT / "common.py").read_text()
    assert local_imports(ROOT / "common.py") == set()
    assert len(source.splitlines()) <= 400
    assert not re.search(r"past_key_values|cache", source)  # the key-value cache lives in support/fast.py


@pytest.mark.parametrize("path", ["common.py", *sorted(f"support/{p.name}" for p in (ROOT / "support").glob("*.py"))])
def test_each_shared_module_is_within_its_line_budget(path):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= MODULE_BUDGET, f"{path} has {lines} lines, over {MODULE_BUDGET}: split it by topic"


def test_support_has_no_import_cycle():
    graph = {p.stem: {m.split(".")[1] for m in local_imports(p) if m.startswith("support.")}
             for p in (ROOT / "support").glob("*.py")}

    def reaches(start, target, seen=()):
        return any(n == target or (n not in seen and reaches(n, target, seen + (n,))) for n in graph.get(start, ()))
    assert not [module for module in graph if reaches(module, module)]


def test_each_constant_is_defined_once():
    files = [ROOT / "common.py", *(ROOT / "support").glob("*.py"), *(ROOT / f"{a}.py" for a in ALGORITHMS)]
    where = {}
    for path in files:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            for target in targets:
                for name in [t.id for t in ast.walk(target) if isinstance(t, ast.Name) and t.id.isupper()]:
                    where.setdefault(name, []).append(path.name)
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_engine_and_the_losses_stay_small_and_the_shared_config_sniffs_nothing():
    """The Trainer reads in one sitting (the viewer's state and the sampler live elsewhere); grpo_loss takes at most
    10 parameters (GSPO's clip and the dual clip are a common.Clip, the KL term a common.KLTerm, the aggregation a
    common.Aggregation); support/config.py asks no config object what fields it has: each script checks its own."""
    tree = ast.parse((ROOT / "support" / "engine.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 220
    loss = next(n for n in ast.parse((ROOT / "grpo.py").read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "grpo_loss")
    assert len(loss.args.args) + len(loss.args.kwonlyargs) <= 10
    assert not re.search(r"\b(hasattr|getattr)\(", (ROOT / "support" / "config.py").read_text())
