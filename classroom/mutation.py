"""Mutation score of the grading tests: mutmut over the exercise functions, each with its own tests.

    python classroom/mutation.py                      # every exercise (tens of minutes on 2 CPUs)
    python classroom/mutation.py --only gae,masked_sum --json mutation.json

For each exercise: a fresh copy of this repository in a temporary folder in which every other
function of the exercise's file carries mutmut's `# pragma: no mutate block`, so mutmut (3.x)
mutates that one function (every operator, constant, comparison, argument...) and runs, on each
mutant, the exercise's grade: one test that calls the mutant on the exercise's cases for two seeds
and compares its answers with the reference's (classroom/grade.py's check_function, the reference
loaded from an unmutated copy), with mutmut's own time limit per mutant. A mutant is killed when the
grade fails (or times out); the score is killed / (killed + survived). Prints each survivor's diff,
for the teacher's docs to show why it computes what the solution computes, or to list it as a gap of
the cases.
"""
import argparse
import ast
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_student_copy as msc  # noqa: E402

SEEDS = (0, 1)
GRADE_TEST = """import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "classroom"))
import grade  # noqa: E402


def test_the_grade_passes():
    function = getattr(importlib.import_module({module!r}), {name!r})
    for seed in {seeds!r}:
        passed, status = grade.check_function({key!r}, function, seed, root=Path({reference!r}))
        assert passed, status
"""

PRAGMA = "  # pragma: no mutate block"
SIGNATURE = "  # signature: not the exercise"  # do_not_mutate_patterns: the body is the exercise, not its defaults


def header_end_lines(text):
    """{name: (first line, line of the colon that ends its header)} of every top-level def/class, 1-based."""
    tree = ast.parse(text)
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        depth, started = 0, False
        for tok in tokens:
            if tok.start[0] < node.lineno:
                continue
            if tok.type == tokenize.NAME and tok.string in ("def", "class"):
                started = True
            if not started:
                continue
            if tok.string in "([{" and tok.type == tokenize.OP:
                depth += 1
            elif tok.string in ")]}" and tok.type == tokenize.OP:
                depth -= 1
            elif tok.string == ":" and depth == 0:
                lines[node.name] = (node.lineno, tok.start[0])
                break
    return lines


def only_this_function(text, name):
    """The file with every other top-level function and class marked `# pragma: no mutate block`, and the
    signature of `name` (its default values) marked for do_not_mutate_patterns."""
    lines = text.splitlines()
    for function, (first, colon) in header_end_lines(text).items():
        if function == name:
            for n in range(first, colon + 1):
                lines[n - 1] += SIGNATURE
        elif "#" not in lines[colon - 1].split(":")[-1]:  # (a header that ends in a comment is left alone)
            lines[colon - 1] += PRAGMA
    return "\n".join(lines) + "\n"


def mutate_one(key, base, work, timeout):
    """Run mutmut on one exercise; returns {"killed", "survived", "other", "survivors": [diff, ...]}."""
    file, name = key.split("::")
    sandbox = work / msc.exercise_name(key)
    shutil.copytree(base, sandbox)
    target = sandbox / file
    target.write_text(only_this_function(target.read_text(encoding="utf-8"), name), encoding="utf-8")
    (sandbox / "test_grade_exercise.py").write_text(GRADE_TEST.format(
        module=msc.module_name(file), name=name, seeds=SEEDS, key=key, reference=str(base)), encoding="utf-8")
    tests = ["test_grade_exercise.py"]
    also_copy = sorted({p.split("/")[0] for p in msc.project_files(base)} - {file, "tests"}) + tests
    (sandbox / "pyproject.toml").write_text(
        "[tool.mutmut]\n"
        f"source_paths = [{json.dumps(file)}]\n"
        f"also_copy = {json.dumps(also_copy)}\n"
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}\n"
        f"pytest_add_cli_args = [\"-p\", \"no:cacheprovider\", \"-q\"]\n"
        f"timeout_constant = {timeout}\n"
        f"do_not_mutate_patterns = [{json.dumps(SIGNATURE.strip())}]\n"
        "use_git_change_detection = false\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONDONTWRITEBYTECODE": "1"}
    mutmut = [sys.executable, "-m", "mutmut"]
    run = subprocess.run([*mutmut, "run", "--max-children", "1"], cwd=sandbox, env=env, capture_output=True,
                         text=True)
    results = subprocess.run([*mutmut, "results", "--all", "true"], cwd=sandbox, env=env, capture_output=True,
                             text=True)
    status = {}
    for line in results.stdout.splitlines():
        m = re.match(r"\s*(\S+__mutmut_\d+): (.+)$", line)
        if m and f"x_{name}__mutmut_" in m.group(1):
            status[m.group(1)] = m.group(2).strip()
    killed = [m for m, s in status.items() if s in ("killed", "timeout")]
    survived = [m for m, s in status.items() if s == "survived"]
    other = {m: s for m, s in status.items() if m not in killed and m not in survived}
    survivors = []
    for mutant in survived:
        diff = subprocess.run([*mutmut, "show", mutant], cwd=sandbox, env=env, capture_output=True, text=True)
        survivors.append("\n".join(l for l in diff.stdout.splitlines() if l.startswith(("+", "-"))
                                   and not l.startswith(("+++", "---"))))
    shutil.rmtree(sandbox, ignore_errors=True)
    if not status:
        other = {"mutmut": (run.stdout + run.stderr)[-2000:]}
    return {"exercise": key, "killed": len(killed), "survived": len(survived), "other": other,
            "survivors": survivors}


def make_base(work):
    """A clean copy of the reference (the git-tracked files, or a tree walk outside a checkout)."""
    base = work / "reference"
    for rel in msc.project_files(msc.ROOT):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(msc.ROOT / rel, base / rel)
    for rel in msc.project_files(msc.ROOT / "classroom"):  # in case the grader's files are not committed yet
        (base / "classroom" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(msc.ROOT / "classroom" / rel, base / "classroom" / rel)
    return base


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="Only these exercises: NAME[,NAME].")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="mutmut's time limit per mutant (its constant part), seconds.")
    parser.add_argument("--json", help="Write the results here.")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    keys = [k for k in msc.EXERCISES if only is None or msc.exercise_name(k) in only]
    rows, t0 = [], time.time()
    with tempfile.TemporaryDirectory(prefix="mutation-") as tmp:
        work = Path(tmp)
        base = make_base(work)
        for key in keys:
            row = mutate_one(key, base, work, args.timeout)
            rows.append(row)
            total = row["killed"] + row["survived"]
            print(f"{key}: {row['killed']} of {total} mutants killed" + (f"; other: {row['other']}" if row["other"]
                                                                          else ""), flush=True)
            for diff in row["survivors"]:
                print("  survived:\n    " + diff.replace("\n", "\n    "), flush=True)
    killed, survived = sum(r["killed"] for r in rows), sum(r["survived"] for r in rows)
    score = killed / max(1, killed + survived)
    print(f"\nmutation score: {killed} of {killed + survived} mutants killed ({100 * score:.1f}%) "
          f"in {len(rows)} exercises, {time.time() - t0:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"killed": killed, "survived": survived, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
