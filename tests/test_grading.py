"""Grading that rejects wrong answers: every exercise has a list of plausible wrong versions
(classroom/wrong_answers.py) and its grading tests fail for each one. For teachers: the student
copy leaves this file out."""
import ast
import json
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "classroom"))
import make_student_copy as msc  # noqa: E402
import wrong_answers  # noqa: E402

ENV_KEYS = {"PYTHONDONTWRITEBYTECODE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def test_every_exercise_has_wrong_versions_each_an_edit_of_its_solution_and_a_named_grading_test():
    assert set(wrong_answers.WRONG_ANSWERS) == set(msc.EXERCISES)
    for key, wrong in wrong_answers.WRONG_ANSWERS.items():
        assert len(wrong) >= 2, key
        assert len({description for description, *_ in wrong}) == len(wrong), key
        right = wrong_answers.wrong_source(ROOT, key, None, None)
        for description, old, new, catcher in wrong:
            assert catcher in msc.EXERCISES[key][2], (key, description)
            source = wrong_answers.wrong_source(ROOT, key, old, new)  # old occurs once in the code
            compile(source, key, "exec")
            assert ast.dump(ast.parse(source)) != ast.dump(ast.parse(right)), (key, description)


def test_the_grading_tests_catch_every_wrong_version(tmp_path):
    """One pytest run of the grading tests: the reference passes, then each test reruns with each
    wrong version of what it grades; every wrong version must fail the test the table names."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "classroom/wrong_answers.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **ENV_KEYS}, timeout=300)
    assert out.is_file(), (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())
    assert results["reference_failed"] == [], proc.stdout[-3000:]
    missed = [(r["exercise"], r["wrong"], r["failed_tests"]) for r in results["rows"] if not r["caught"]]
    assert not missed
    assert len(results["rows"]) == sum(len(w) for w in wrong_answers.WRONG_ANSWERS.values())
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_teacher_docs_show_the_current_wrong_answer_table():
    assert wrong_answers.table() in (ROOT / "docs" / "classroom.md").read_text(encoding="utf-8")
