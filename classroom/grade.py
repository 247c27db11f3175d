"""Grade a student copy from the teacher's tree: one exercise at a time, in a clean copy of the reference.

    python classroom/grade.py ../student                       # every exercise: a table, one row each
    python classroom/grade.py ../student --json results.json   # and Gradescope's results.json
    python classroom/grade.py ../student --only gae,rloo_loss  # just those exercises (a regrade)

Nothing of the student's copy runs but the bodies of the exercise functions. The grader reads each
exercise's function from the student's file with `ast` (by name, never by importing it), checks
its body (imports only of torch, math and numpy; no file, process or introspection access; names
of the project only where the exercise may call them: its own module's exercises and what the
reference solution uses), and puts the body in place of the reference solution in a fresh copy of
this repository, the reference everywhere else. There it runs the exercise's tests, the visible
ones of make_student_copy.py and the hidden ones of classroom/teacher_tests/, in a new Python
(-I: nothing from the student's tree or the environment on the path, no plugin autoloaded, no
conftest but the teacher's), with randomised inputs (--seed, random by default), an audit hook that
refuses files, processes and sockets to the student's code, and a time limit. An exercise scores
its stars when all its tests pass and 0 otherwise.
"""
import argparse
import ast
import concurrent.futures
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_student_copy as msc  # noqa: E402
from teacher_tests import TEACHER_TESTS  # noqa: E402

ROOT = msc.ROOT
IMPORTABLE = {"torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.special", "math", "numpy",
              "numpy.linalg"}
# builtins a body may not name: code from strings, attribute access by name, the namespaces, I/O
DENIED_NAMES = {"open", "exec", "eval", "compile", "getattr", "setattr", "delattr", "globals", "locals", "vars",
                "dir", "input", "breakpoint", "help", "exit", "quit", "memoryview", "print", "super", "object", "type"}
# attributes that lead to frames, code or files (any attribute starting with "_" is refused too)
DENIED_ATTRS = {"tb_frame", "tb_next", "f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame",
                "gi_code", "cr_frame", "cr_code", "ag_frame", "ag_code", "load", "save", "from_file", "fromfile",
                "tofile", "loadtxt", "savetxt", "genfromtxt", "memmap", "savez", "savez_compressed", "dump", "dumps",
                "load_library", "ctypes", "hub", "ops", "compile", "jit", "utils", "testing", "lib", "package",
                "serialization", "multiprocessing", "backends", "classes", "library"}
RUNNER = r'''
import os, sys
target, first, last = os.environ["GRADE_FILE"], int(os.environ["GRADE_FIRST"]), int(os.environ["GRADE_LAST"])
allowed = tuple(os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} | set(sys.path)
                if p and not os.path.realpath(p).startswith(os.path.realpath(os.getcwd())))
guarded = ("open", "os.listdir", "os.scandir", "os.chdir", "os.remove", "os.rename", "os.mkdir", "os.system",
           "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "subprocess.Popen", "socket.connect", "socket.bind",
           "ctypes.dlopen", "shutil.copyfile", "glob.glob")

def student_on_stack():
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_filename == target and first <= frame.f_lineno <= last:
            return True
        frame = frame.f_back
    return False

def hook(event, args):
    if event.startswith(guarded) and student_on_stack():
        if event == "open" and isinstance(args[0], str) and os.path.realpath(args[0]).startswith(allowed):
            return  # a library reading its own files
        raise PermissionError(f"the exercise's code may not use {event}")

sys.addaudithook(hook)
import pytest
sys.exit(pytest.main(sys.argv[1:]))
'''


@dataclass
class Result:
    key: str  # "file::function"
    stars: int
    score: int = 0
    status: str = "not graded"
    output: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def name(self):
        return msc.exercise_name(self.key)


def grading_tests(key):
    """pytest node ids of the tests that grade an exercise: the visible ones, then the hidden ones."""
    _, test_file, names = msc.EXERCISES[key]
    hidden_file, hidden = TEACHER_TESTS.get(key, (None, []))
    return [msc.node_id(test_file, n) for n in names] + [f"{hidden_file}::{n}" for n in hidden]


def function_node(tree, name):
    found = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name]
    return found[-1] if found else None


def student_body(function):
    """The statements of a function, without its docstring."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return body


def not_implemented(body):
    """True for the blank of the student copy: nothing but `raise NotImplementedError(...)` (and `pass`)."""
    statements = [s for s in body if not isinstance(s, ast.Pass)]
    if len(statements) != 1 or not isinstance(statements[0], ast.Raise):
        return not statements
    exc = statements[0].exc
    exc = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


class Rules:
    """What one exercise's body may name: computed from the reference module and its solution."""

    def __init__(self, key, root=ROOT):
        file, self.name = key.split("::")
        self.module_name = Path(file).stem
        text = (root / file).read_text(encoding="utf-8")
        tree = ast.parse(text)
        self.module_level = set()  # every name the reference module binds at its top level
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.module_level.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                self.module_level |= {(a.asname or a.name).split(".")[0] for a in node.names}
            else:
                self.module_level |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)
                                      and isinstance(n.ctx, ast.Store)}
        solution = function_node(tree, self.name)
        used = {n.id for n in ast.walk(solution) if isinstance(n, ast.Name)}
        same_file = {k.split("::")[1] for k in msc.EXERCISES if k.split("::")[0] == file}
        self.modules = {}  # name in the module -> the module it names (torch, np, common, ...)
        for node in tree.body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.modules[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:  # `from torch.nn import functional as F`
                    self.modules.setdefault(a.asname or a.name, f"{node.module}.{a.name}")
        self.allowed = (used | same_file) & self.module_level
        # attributes of a project module the body may use (common.masked_sum, ...)
        self.project_attrs = {}
        for k in msc.EXERCISES:
            self.project_attrs.setdefault(Path(k.split("::")[0]).stem, set()).add(k.split("::")[1])
        for node in ast.walk(solution):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                self.project_attrs.setdefault(self.modules.get(node.value.id, ""), set()).add(node.attr)


def resolve(path):
    """The object a dotted path of torch, numpy or math names, or None (imports nothing new)."""
    parts = path.split(".")
    if parts[0] not in ("torch", "numpy", "math"):
        return None
    obj = __import__(parts[0])
    for part in parts[1:]:
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def chain(node):
    """`a.b.c` -> ["a", "b", "c"] when the chain starts at a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def check_body(body, rules):
    """Reasons the body may not be graded (empty when it may)."""
    problems = []
    modules = dict(rules.modules)  # names bound to modules: the module's imports, then the body's
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom) and (node.level or not node.module):
                problems.append(f"line {node.lineno}: a relative import")
                continue
            for alias in node.names:
                if isinstance(node, ast.Import):  # import torch.nn.functional [as F]
                    full, ok = alias.name, alias.name in IMPORTABLE
                    bound = (alias.asname, full) if alias.asname else (full.split(".")[0], full.split(".")[0])
                else:  # from torch.nn import functional [as F] / from math import log
                    full = f"{node.module}.{alias.name}"
                    target = resolve(full)
                    if isinstance(target, types.ModuleType):
                        ok, bound = full in IMPORTABLE, (alias.asname or alias.name, full)
                    else:
                        ok = node.module in IMPORTABLE and target is not None and not alias.name.startswith("_") \
                            and alias.name not in DENIED_ATTRS and alias.name not in DENIED_NAMES
                        bound = None  # a function or a constant
                if not ok:
                    problems.append(f"line {node.lineno}: imports {full} (only torch, math and numpy)")
                elif bound:
                    modules[bound[0]] = bound[1]
        elif isinstance(node, ast.Global):
            problems.append(f"line {node.lineno}: a global statement")
        elif isinstance(node, ast.Name):
            if node.id.startswith("__") or node.id in DENIED_NAMES:
                problems.append(f"line {node.lineno}: uses {node.id}")
            elif node.id in rules.module_level and node.id not in rules.allowed and node.id not in modules:
                problems.append(f"line {node.lineno}: uses {node.id} of {rules.module_name}.py, which this "
                                f"exercise does not need")
        elif isinstance(node, ast.Attribute):
            if node.attr.startswith("_") or node.attr in DENIED_ATTRS:
                problems.append(f"line {node.lineno}: uses the attribute {node.attr}")
    # module names: only as the start of an attribute chain that ends in a function, class or constant
    parents = {child: parent for stmt in body for parent in ast.walk(stmt) for child in ast.iter_child_nodes(parent)}
    for node in (n for stmt in body for n in ast.walk(stmt)):
        if not (isinstance(node, ast.Name) and node.id in modules):
            continue
        top = node
        while isinstance(parents.get(top), ast.Attribute) and parents[top].value is top:
            top = parents[top]
        parts = chain(top)
        module = modules[node.id]
        if top is node:
            problems.append(f"line {node.lineno}: uses the module {node.id} other than as module.name")
        elif not isinstance(getattr(top, "ctx", None), ast.Load):
            problems.append(f"line {node.lineno}: assigns to {'.'.join(parts)}")
        elif module.split(".")[0] in ("torch", "numpy", "math"):
            for i in range(2, len(parts) + 1):
                path = ".".join([module, *parts[1:i]])
                obj = resolve(path)
                if isinstance(obj, types.ModuleType) and (path not in IMPORTABLE or i == len(parts)):
                    problems.append(f"line {node.lineno}: uses {'.'.join(parts[:i])} (a module)")
                    break
        elif parts[1] not in rules.project_attrs.get(module, set()):
            problems.append(f"line {node.lineno}: uses {'.'.join(parts[:2])}, which this exercise does not need")
    return sorted(set(problems), key=lambda p: int(p.split()[1].rstrip(":")))


def splice(reference_text, name, body):
    """The reference file with the solution region of `name` replaced by the student's statements.
    Returns (text, first line, last line) of the student's code, 1-based."""
    ((start, end, indent, *_),) = [r for r in msc.regions(reference_text) if r[3] == name]
    lines = reference_text.splitlines(keepends=True)
    code = "\n".join(ast.unparse(stmt) for stmt in body) if body else "pass"
    new = textwrap.indent(code, indent) + "\n"
    text = "".join(lines[:start]) + new + "".join(lines[end + 1:])
    compile(text, "<spliced>", "exec")
    return text, start + 1, start + new.count("\n")


def junit_outcomes(xml_path):
    """[(test, passed, message)] from a junit xml file."""
    outcomes = []
    for case in ET.parse(xml_path).iter("testcase"):
        bad = next((case.find(tag) for tag in ("failure", "error") if case.find(tag) is not None), None)
        skipped = case.find("skipped") is not None
        message = "" if bad is None else bad.get("message") or ((bad.text or "").strip().splitlines() or [""])[-1]
        name = f"{Path(case.get('classname').replace('.', '/')).name}.py::{case.get('name')}"
        outcomes.append((name, bad is None and not skipped, "skipped" if skipped else message))
    return outcomes


def run_tests(copy, key, first, last, seed, timeout, xml_path):
    """Run the exercise's tests in the copy; returns (outcomes, status)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(copy), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "GRADE_SEED": str(seed), "MPLBACKEND": "Agg",
           "GRADE_FILE": str(copy / key.split("::")[0]), "GRADE_FIRST": str(first), "GRADE_LAST": str(last)}
    cmd = [sys.executable, "-I", "-B", "-c", RUNNER, "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "--rootdir", str(copy),
           "--junitxml", str(xml_path), *grading_tests(key)]
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return [], f"time limit: the tests ran past {timeout:g} s"
    if not xml_path.is_file():
        return [], "the tests did not run: " + " | ".join(out.strip().splitlines()[-3:])
    outcomes = junit_outcomes(xml_path)
    if proc.returncode not in (0, 1) or not outcomes:
        return outcomes, f"pytest stopped with status {proc.returncode}: " + " | ".join(out.strip().splitlines()[-3:])
    return outcomes, ""


def grade_one(key, student, base, work, seed, timeout):
    file, name = key.split("::")
    result = Result(key, msc.EXERCISES[key][0])
    t0 = time.time()
    path = student / file
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        result.status = f"{file} is missing"
        return result
    except (SyntaxError, ValueError, UnicodeDecodeError) as e:
        result.status = f"{file} does not parse: {e}"
        return result
    function = function_node(tree, name)
    if function is None:
        result.status = f"no function {name} in {file}"
        return result
    body = student_body(function)
    if not_implemented(body):
        result.status = "not implemented"
        return result
    problems = check_body(body, Rules(key, base))
    if problems:
        result.status = "refused: " + "; ".join(problems)
        return result
    try:
        spliced, first, last = splice((base / file).read_text(encoding="utf-8"), name, body)
    except SyntaxError as e:
        result.status = f"does not compile in the reference: {e}"
        return result
    copy = work / msc.exercise_name(key)
    shutil.copytree(base, copy, copy_function=os.link)
    (copy / file).unlink()
    (copy / file).write_text(spliced, encoding="utf-8")
    outcomes, status = run_tests(copy, key, first, last, seed, timeout, work / f"{msc.exercise_name(key)}.xml")
    shutil.rmtree(copy, ignore_errors=True)
    expected = len(grading_tests(key))
    failed = [(test, message) for test, ok, message in outcomes if not ok]
    result.output = [f"{'passed' if ok else 'FAILED'} {test}" + (f": {message}" if not ok else "")
                     for test, ok, message in outcomes]
    if status:
        result.status = status
    elif failed:
        result.status = f"{len(failed)} of {len(outcomes)} tests failed"
    elif len({t.split("[")[0] for t, *_ in outcomes}) < expected:
        result.status = f"only {len(outcomes)} tests ran"
    else:
        result.status, result.score = f"all {len(outcomes)} tests passed", result.stars
    result.seconds = time.time() - t0
    return result


def make_base(work):
    """A clean copy of the reference (the git-tracked files, or a tree walk outside a checkout)."""
    base = work / "reference"
    for rel in msc.project_files(ROOT):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, base / rel)
    for rel in msc.project_files(ROOT / "classroom" / "teacher_tests"):  # in case they are not committed yet
        target = base / "classroom" / "teacher_tests" / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "classroom" / "teacher_tests" / rel, target)
    return base


def grade(student, only=None, seed=None, timeout=120.0, jobs=None, progress=None):
    """Grade every exercise (or those named in `only`); returns a list of Result in table order."""
    student = Path(student).resolve()
    keys = [k for k in msc.EXERCISES if only is None or msc.exercise_name(k) in only]
    seed = random.randrange(2**31) if seed is None else seed
    jobs = jobs or max(1, min(4, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        work = Path(tmp)
        base = make_base(work)
        with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
            futures = {k: pool.submit(grade_one, k, student, base, work, seed, timeout) for k in keys}
            results = []
            for k in keys:
                results.append(futures[k].result())
                if progress:
                    progress(results[-1])
    return results, seed


def results_json(results, seed):
    """Gradescope's format: one test entry per exercise, named by its function."""
    return {"score": sum(r.score for r in results),
            "output": f"graded with seed {seed}",
            "tests": [{"name": r.name, "score": r.score, "max_score": r.stars,
                       "output": "\n".join([r.status, *r.output])} for r in results]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("student_dir", help="The student's copy (made by make_student_copy.py).")
    parser.add_argument("--json", help="Write Gradescope's results.json here.")
    parser.add_argument("--only", help="Grade only these exercises: NAME[,NAME] (function names).")
    parser.add_argument("--seed", type=int, help="Seed of the randomised inputs (default: a random one, printed).")
    parser.add_argument("--timeout", type=float, default=120.0, help="Time limit of one exercise's tests, seconds.")
    parser.add_argument("--jobs", type=int, help="Exercises graded at once (default: up to 4 CPUs).")
    args = parser.parse_args()
    only = None
    if args.only:
        only = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = only - {msc.exercise_name(k) for k in msc.EXERCISES}
        if unknown:
            parser.error(f"no exercise named {', '.join(sorted(unknown))}; the exercises are "
                         + ", ".join(msc.exercise_name(k) for k in msc.EXERCISES))
    if not Path(args.student_dir).is_dir():
        parser.error(f"{args.student_dir} is not a folder")
    print("| Exercise | File | Score | Result |\n|---|---|---|---|", flush=True)

    def row(r):
        print(f"| `{r.name}` | `{r.key.split('::')[0]}` | {r.score} / {r.stars} | {r.status} |", flush=True)

    results, seed = grade(args.student_dir, only, args.seed, args.timeout, args.jobs, progress=row)
    total, most = sum(r.score for r in results), sum(r.stars for r in results)
    print(f"\nscore {total} / {most} ({len([r for r in results if r.score])} of {len(results)} exercises); "
          f"seed {seed}")
    for r in results:
        failed = [line for line in r.output if line.startswith("FAILED")]
        if failed:
            print(f"\n{r.name}:\n  " + "\n  ".join(line[:300] for line in failed))
    if args.json:
        Path(args.json).write_text(json.dumps(results_json(results, seed), indent=1) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
