"""The files read as a tutorial: each loop short and parallel to the others, the diff between two
algorithm files the idea that separates them (with the counts the README prints), the math in
common.py apart from the machinery, every shared module short, every file self-contained, one definition per
constant."""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

ROOT = Path(ROOT)
ALGORITHMS = ("remax", "rloo", "grpo", "dapo", "ppo", "reinforce_pp", "opd")
# The lesson tier's budgets, fixed (they are never raised to fit: what does not fit moves to the lab). A diff between
# two lesson files shows the idea that separates them (the README prints the counts); each file reads in one sitting,
# with its flags in one screen of --help and its lines as prose; the helper module stays short.
DIFF_BUDGET = {("remax", "rloo"): 160, ("rloo", "grpo"): 160, ("grpo", "dapo"): 160, ("grpo", "reinforce_pp"): 160,
               ("rloo", "opd"): 160}
MAIN_BUDGET = {"ppo": 140}  # the others: 110
FILE_BUDGET, FLAG_BUDGET = {"ppo": 420}, {"dapo": 36, "ppo": 36}  # the others: 320 lines, 30 flags
HELPERS_BUDGET = 400
# Lines of each module of support/ and of common.py, read in one sitting; a module that outgrows it is split by
# topic.
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
    local |= {f"lab.{p.stem}" for p in (ROOT / "lab").glob("*.py")} | {"lab"}
    local |= {m for m in modules if m.startswith(("support.helpers.", "support.models."))}
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
def test_a_lesson_file_is_within_its_budgets_and_writes_its_update_out(name):
    source = (ROOT / f"{name}.py").read_text()
    lines = source.splitlines()
    assert len(lines) <= FILE_BUDGET.get(name, 320)
    assert sum(len(line) > 100 for line in lines) * 20 <= len(lines), "over 5% of its lines are over 100 characters"
    assert re.search(r"accelerator\.backward\(", source) and re.search(r"optimizer\.step\(\)", source)
    help_text = subprocess.run([sys.executable, f"{name}.py", "--help"], cwd=ROOT, capture_output=True, text=True).stdout
    flags = set(re.findall(r"^  (--\w+)", help_text, re.M))
    assert 10 <= len(flags) <= FLAG_BUDGET.get(name, 30), sorted(flags)
    imported = {m.split(".")[0] if not m.startswith("support.") else m for m in local_imports(ROOT / f"{name}.py")}
    assert imported <= {"common", "support", "support.helpers", "support.models", "support.helpers.arg",
                        "support.helpers.check", "support.helpers.check_rules", "support.helpers.one_of",
                        "support.models.token_logprobs"}, imported


def test_the_lessons_helper_module_is_short():
    assert len((ROOT / "support" / "helpers.py").read_text().splitlines()) <= HELPERS_BUDGET


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
    assert not re.search(r"past_key_values|cache", source)  # the key-value cache lives in support/models.py


# the lab's engine, in lab/ beside its loops
ENGINE = ("engine", "sampling", "async_sampling", "budget", "tree", "priority")


@pytest.mark.parametrize("path", ["common.py", *sorted(f"support/{p.name}" for p in (ROOT / "support").glob("*.py")),
                                  *(f"lab/{name}.py" for name in ENGINE)])
def test_each_shared_module_is_within_its_line_budget(path):
    lines = len((ROOT / path).read_text().splitlines())
    assert lines <= MODULE_BUDGET, f"{path} has {lines} lines, over {MODULE_BUDGET}: split it by topic"


# A lesson file's whole import closure: the math, and the plumbing both tiers share (support/); no lab feature
LESSON_CLOSURE = {"common", "support", "support.config", "support.helpers", "support.models", "support.tasks",
                  "support.reward_functions", "support.run"}
CLOSURE_BUDGET = (8, 2500)  # project modules (package files included) and their lines, the lesson file apart


def lesson_closure(name):
    """{module: lines} of every project module that importing the lesson file `name` loads, the file apart."""
    code = ("import json, os, sys; sys.path.insert(0, os.getcwd()); import " + name + "; root = os.getcwd() + os.sep; "
            "print(json.dumps({m: f for m, f in ((m, getattr(mod, '__file__', None)) for m, mod in "
            "list(sys.modules.items())) if f and os.path.isabs(f) and f.startswith(root) and '.venv' not in f}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    files = json.loads(out.stdout)
    return {m: len(Path(f).read_text().splitlines()) for m, f in files.items() if m != name}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_lesson_file_loads_only_the_lessons_machinery(name):
    closure = lesson_closure(name)
    assert set(closure) <= LESSON_CLOSURE, f"not the lesson's: {sorted(set(closure) - LESSON_CLOSURE)}"
    modules, lines = CLOSURE_BUDGET
    assert len(closure) <= modules and sum(closure.values()) <= lines, closure


def test_support_holds_only_what_the_lesson_loads():
    """Everything in support/ is the lessons' machinery, which the lab builds on; what only the lab uses is in lab/."""
    support = {f"support.{p.stem}" if p.stem != "__init__" else "support" for p in (ROOT / "support").glob("*.py")}
    assert support <= LESSON_CLOSURE, sorted(support - LESSON_CLOSURE)


def test_support_has_no_import_cycle_and_imports_nothing_of_the_lab():
    graph = {p.stem: {m.split(".")[1] for m in local_imports(p) if m.startswith(("support.", "lab."))}
             for p in [*(ROOT / "support").glob("*.py"), *(ROOT / "lab" / f"{name}.py" for name in ENGINE)]}
    assert not any(m.startswith("lab") for p in (ROOT / "support").glob("*.py") for m in local_imports(p))

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
    10 parameters (GSPO's clip is a common.Clip, the aggregation a common.Aggregation; the dual clip, the corrections'
    weights and the KL term's ratio weight are the lab's, lab/losses.py); support/config.py asks no config object what fields it has: each script checks its own."""
    tree = ast.parse((ROOT / "lab" / "engine.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    assert trainer.end_lineno - trainer.lineno + 1 <= 220
    loss = next(n for n in ast.parse((ROOT / "grpo.py").read_text()).body
                if isinstance(n, ast.FunctionDef) and n.name == "grpo_loss")
    assert len(loss.args.args) + len(loss.args.kwonlyargs) <= 10
    assert not re.search(r"\b(hasattr|getattr)\(", (ROOT / "support" / "config.py").read_text())
