"""classroom/make_student_copy.py: the student copy imports cleanly and its exercise
tests fail with NotImplementedError; the reference passes the same tests; the script is
idempotent and never touches the reference."""
import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "classroom"))
import make_student_copy as msc  # noqa: E402
from hint import HINTS  # noqa: E402

SCRIPT = "classroom/make_student_copy.py"
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def make_copy(src, out):
    return subprocess.run([sys.executable, str(src / SCRIPT), str(out)], capture_output=True, text=True,
                          env=ENV, timeout=120)


def tree(root):
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}


def reference_hashes():
    return {rel: hashlib.sha256((ROOT / rel).read_bytes()).hexdigest() for rel in msc.project_files(ROOT)}


def run_grading_tests(cwd, xml_path):
    """Run every grading test in cwd; {node id without params: [(outcome, message), ...]}."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(xml_path),
                           *msc.grading_tests()], cwd=cwd, capture_output=True, text=True, env=ENV, timeout=300)
    results = {}
    for case in ET.parse(xml_path).iter("testcase"):
        node = case.get("classname").replace(".", "/") + ".py::" + case.get("name").split("[")[0]
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        outcome = "passed" if bad is None else bad.tag
        message = "" if bad is None else (bad.get("message") or "") + (bad.text or "")
        results.setdefault(node, []).append((outcome, message))
    return proc, results


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("classroom") / "student"
    before = reference_hashes()
    proc = make_copy(ROOT, out)
    assert proc.returncode == 0, proc.stderr
    assert reference_hashes() == before, "writing the student copy changed the reference"
    return out, proc


def test_every_marked_function_is_an_exercise_with_tests():
    assert set(msc.marked_functions()) == set(msc.EXERCISES)
    for key, (difficulty, test_file, names) in msc.EXERCISES.items():
        assert difficulty in (1, 2, 3) and names and (ROOT / test_file).is_file(), key
        assert all((ROOT / msc.node_id(test_file, name).split("::")[0]).is_file() for name in names), key
    assert set(HINTS) == {key.split("::")[1] for key in msc.EXERCISES}


def test_student_copy_has_no_solution_left_and_prints_the_table(student):
    out, proc = student
    assert msc.table() in proc.stdout
    marked = {key.split("::")[0] for key in msc.EXERCISES}
    for rel, data in tree(out).items():
        if rel == msc.TEACHER_PAGE:
            page = (ROOT / rel).read_text(encoding="utf-8")
            assert data.decode() == page[:page.index(msc.TEACHER_PART)].rstrip("\n") + "\n"
        elif rel == msc.ANSWER_PAGE:
            assert data.decode() == msc.without_answers((ROOT / rel).read_text(encoding="utf-8"))
        elif rel in marked:
            text = data.decode()
            assert msc.BEGIN not in text and msc.END not in text, rel
            assert text.count("raise NotImplementedError(") >= sum(k.startswith(rel + "::") for k in msc.EXERCISES)
        else:
            assert data == (ROOT / rel).read_bytes(), f"{rel} should be copied unchanged"


def test_student_copy_imports_cleanly(student):
    out, _ = student
    proc = subprocess.run([sys.executable, "-c", "import common, remax, grpo, rloo, dapo, ppo, toy_bandit"],
                          cwd=out, capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_student_exercise_tests_fail_with_not_implemented_error(student, tmp_path):
    out, _ = student
    proc, results = run_grading_tests(out, tmp_path / "student.xml")
    assert proc.returncode == 1, proc.stdout[-3000:]  # 1: tests ran and failed; 2-4: collection or usage error
    assert set(results) == set(msc.grading_tests())
    wrong = {node: r for node, runs in results.items() for r in runs
             if r[0] != "failure" or "NotImplementedError" not in r[1]}
    assert not wrong, wrong


def test_a_student_copy_with_the_reference_solutions_passes_the_grading_tests(student, tmp_path):
    """The grading works in the copy: with the reference's solutions written back (what a student
    who solves everything hands in) the copy's own tests pass, so nothing they need was left out."""
    out, _ = student
    solved = tmp_path / "solved"
    shutil.copytree(out, solved)
    for rel in {key.split("::")[0] for key in msc.EXERCISES}:
        shutil.copy(ROOT / rel, solved / rel)
    proc, results = run_grading_tests(solved, tmp_path / "solved.xml")
    assert proc.returncode == 0, proc.stdout[-3000:]  # 4 would mean a node id in EXERCISES does not exist
    assert set(results) == set(msc.grading_tests())


def test_student_copy_leaves_out_the_teachers_files_and_no_test_helper_is_a_solution(student):
    """The wrong versions (pieces of the solutions) stay with the teacher, and every helper the
    grading tests call is a fixture, a target or a tool listed in HELPERS, not a working version
    of an exercise (a test once shipped a whole GAE loop as its expected value)."""
    out, _ = student
    for rel in msc.TEACHER_ONLY:
        assert (ROOT / rel).exists() and not (out / rel).exists(), rel
    assert not (out / "classroom" / "teacher_tests").exists()
    called = {}
    for test_file in {node.split("::")[0] for node in msc.grading_tests()}:
        tree = ast.parse((out / test_file).read_text(encoding="utf-8"))
        helpers = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                   and not n.name.startswith("test_")}
        graded = {node.split("::")[1] for node in msc.grading_tests() if node.split("::")[0] == test_file}
        for test in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in graded):
            for node in ast.walk(test):
                if isinstance(node, ast.Name) and node.id in helpers:
                    called.setdefault(f"{test_file}::{node.id}", test.name)
    assert set(called) <= set(HELPERS), {k: v for k, v in called.items() if k not in HELPERS}
    for name in ("gae_loop",):
        assert all(name not in (out / rel).read_text() for rel in ("tests/test_ppo.py",)), name


# The helpers the grading tests call, and why none of them is a solution.
HELPERS = {
    "tests/test_kl.py::setup": "random logits of a policy and a reference",
    "tests/test_kl.py::expectation": "an exact expectation under the policy, by enumeration",
    "tests/test_kl.py::kl": "the exact KL of two categoricals: the target, not an estimator",
    "tests/test_kl.py::grad": "autograd",
    "tests/test_kl.py::reward_penalty_gradient": "the gradient of an estimator used as a reward penalty",
    "tests/test_kl.py::Sequences": "a tabular 2-token policy whose sequences are enumerated",
    "tests/test_kl.py::close": "allclose with atol 1e-12",
    "tests/test_grpo.py::one_token_loss": "calls grpo_loss on one token",
    "tests/test_grpo.py::seqs": "two completions' log-probs from random logits",
    "tests/test_gspo.py::sequence_loss": "calls grpo_loss at sequence level",
    "tests/test_gspo.py::seqs": "completions' log-probs from random logits",
    "tests/test_dapo.py::one_token_grad": "calls dapo_loss on one token",
    "tests/test_ppo.py::random_episodes": "random rewards, values and masks",
    "tests/test_ppo.py::policy_loss_and_grad": "calls ppo_policy_loss",
    "tests/test_ppo.py::value_loss_and_grad": "calls ppo_value_loss",
    "tests/test_toy_bandit.py::two_arm_variances": "calls gradient_variance for each baseline",
    "tests/test_toy_bandit.py::softmax_variances": "calls softmax_gradient_variance for each baseline",
    "tests/test_objectives.py::grad_of": "calls a loss on hand values and returns its gradient",
    "tests/test_objectives.py::random_batch": "random log-probs, advantages and masks",
    "tests/test_opd.py::two_token_tree": "random logits of a two-token student and teacher",
}


# a call of a function in the code's names or of an array op, a module, a statement: code, not words
CODE = (r"\b[a-z][a-z0-9]*_[a-z0-9_]*\(|\b(exp|log|clamp|sum|mean|std|where|cumsum|flip|min|max|abs|softmax)\("
        r"|torch\.|np\.|\bdef\b|\[:, ")


def test_every_exercise_has_a_two_level_hint_and_its_docstring_names_the_stats_its_tests_read():
    """The first level (in the copy) says what, where, the shapes and the traps, in words: no call, no
    torch; the second (hint.py NAME) has steps. Every key of a dict a solution returns, and every
    stats key a grading test reads, is in the docstring."""
    read = {}  # test file -> the string keys its tests read from a stats dict
    for _, test_file, _ in msc.EXERCISES.values():
        tree = ast.parse((ROOT / test_file).read_text(encoding="utf-8"))
        read[test_file] = {n.slice.value for n in ast.walk(tree) if isinstance(n, ast.Subscript)
                           and isinstance(n.value, ast.Name) and "stats" in n.value.id
                           and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)}
    for key, (stars, test_file, _) in msc.EXERCISES.items():
        file, name = key.split("::")
        hint = HINTS[name]
        assert hint.steps and hint.compute and hint.where and hint.shapes, key
        assert stars == 1 + bool(hint.traps) + bool(hint.work), key
        for line in hint.first_level(name)[:-1]:
            assert not re.search(CODE, line), (key, line)
        text = (ROOT / file).read_text(encoding="utf-8")
        lines = text.splitlines()
        ((start, end, *_),) = [r for r in msc.regions(text) if r[3] == name]
        func = next(n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name == name)
        doc = ast.get_docstring(func)
        region = "\n".join(lines[start:end + 1])
        returned = {k.value for n in ast.walk(ast.parse(textwrap.dedent(region))) if isinstance(n, ast.Dict)
                    for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        for stat in returned | {k for k in read[test_file] if f'"{k}"' in region}:
            assert stat in doc, f"{key}: the docstring does not name {stat!r}"


def test_the_copy_shows_the_first_level_hint_and_hint_py_prints_the_second(student):
    out, _ = student
    text = (out / "ppo.py").read_text(encoding="utf-8")
    for line in HINTS["gae"].first_level("gae"):
        assert f"{msc.HINT} {line}" in text
    proc = subprocess.run([sys.executable, "classroom/hint.py", "gae"], cwd=out, capture_output=True, text=True,
                          env=ENV, timeout=60)
    assert proc.returncode == 0 and all(step in proc.stdout for step in HINTS["gae"].steps)


def test_the_copy_holds_no_teachers_page_and_no_numpy_copy_of_an_exercise(student):
    """The student's page stops before the teacher's part, and the bandit's group advantages call
    the (blank) exercises instead of computing them."""
    out, _ = student
    page = (out / msc.TEACHER_PAGE).read_text(encoding="utf-8")
    assert msc.TEACHER_PART not in page and "wrong_answers" not in page and "grade.py" not in page
    reference = (msc.ROOT / msc.ANSWER_PAGE).read_text(encoding="utf-8")
    math = (out / msc.ANSWER_PAGE).read_text(encoding="utf-8")  # the bandit's closed forms are exercises there
    assert "b* = (1-p) r1 + p r0" in reference and "Var_mean   = p(1-p) (2p - 1)^2 Delta^2" in reference
    assert "b* = (1-p) r1 + p r0" not in math and "(2p - 1)^2" not in math and "sum_a pi_a r_a" not in math
    assert "exp(ref_logp - old_logp) - w" in reference and "exp(ref_logp - old_logp) - w" not in math
    assert math.count(msc.ANSWER_NOTE) == 3 and "b*     = E[ r ||s||^2 ] / E[ ||s||^2 ]" in math
    code = "import toy_bandit\ntry:\n    toy_bandit.{}([[1.0, 0.0]])\nexcept NotImplementedError:\n    print('blank')"
    for name in ("rloo_advantages", "mean_advantages", "grpo_advantages"):
        proc = subprocess.run([sys.executable, "-c", code.format(name)], cwd=out, capture_output=True, text=True,
                              env=ENV, timeout=120)
        assert proc.stdout.strip() == "blank", (name, proc.stderr[-2000:])


def test_script_is_idempotent_and_a_copy_of_the_copy_is_the_same(student, tmp_path):
    out, _ = student
    first = tree(out)
    before = reference_hashes()
    assert make_copy(ROOT, out).returncode == 0
    assert reference_hashes() == before
    assert tree(out) == first
    again = tmp_path / "from_the_student_copy"
    proc = make_copy(out, again)  # the student copy's own script, run on the student copy
    assert proc.returncode == 0, proc.stderr
    assert tree(again) == first


def test_refuses_to_write_into_the_reference():
    target = ROOT / "student_copy_inside_the_reference"
    proc = make_copy(ROOT, target)
    assert proc.returncode != 0 and "outside" in proc.stderr
    assert not target.exists()


def test_teacher_docs_show_the_current_exercise_table():
    assert msc.table() in (ROOT / "docs" / "classroom.md").read_text(encoding="utf-8")
