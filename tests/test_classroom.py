"""classroom/make_student_copy.py: the student copy imports cleanly and its exercise
tests fail with NotImplementedError; the reference passes the same tests; the script is
idempotent and never touches the reference."""
import hashlib
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "classroom"))
import make_student_copy as msc  # noqa: E402

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


def test_student_copy_has_no_solution_left_and_prints_the_table(student):
    out, proc = student
    assert msc.table() in proc.stdout
    marked = {key.split("::")[0] for key in msc.EXERCISES}
    for rel, data in tree(out).items():
        if rel in marked:
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


def test_reference_passes_the_grading_tests(tmp_path):
    proc, results = run_grading_tests(ROOT, tmp_path / "reference.xml")
    assert proc.returncode == 0, proc.stdout[-3000:]  # 4 would mean a node id in EXERCISES does not exist
    assert set(results) == set(msc.grading_tests())


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
