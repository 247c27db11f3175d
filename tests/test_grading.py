"""Grading that rejects wrong answers: every exercise has a list of plausible wrong versions
(classroom/wrong_answers.py), its tests fail for each one and the grade gives each 0; the grader
gives the reference full marks (an untouched copy 0 and the attack table: test_grader_attacks.py).
For teachers: the student copy leaves this file out."""
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
            assert catcher in [node.split("::")[1] for node in wrong_answers.grading_tests(key)], (key, description)
            source = wrong_answers.wrong_source(ROOT, key, old, new)  # old occurs once in the code
            compile(source, key, "exec")
            assert ast.dump(ast.parse(source)) != ast.dump(ast.parse(right)), (key, description)


def test_the_tests_catch_every_wrong_version_and_the_grade_gives_each_zero(tmp_path):
    """One pytest run of the tests: the reference passes, then each test reruns with each wrong
    version of what it tests; every wrong version must fail the test the table names, and score 0
    when graded on the grader's cases (three seeds)."""
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "classroom/wrong_answers.py", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, **ENV_KEYS}, timeout=300)
    assert out.is_file(), (proc.stdout + proc.stderr)[-3000:]
    results = json.loads(out.read_text())
    assert results["reference_failed"] == [], proc.stdout[-3000:]
    missed = [(r["exercise"], r["wrong"], r["failed_tests"]) for r in results["rows"] if not r["caught"]]
    assert not missed
    passed = [(r["exercise"], r["wrong"]) for r in results["rows"] if not r["graded_zero"]]
    assert not passed
    assert len(results["rows"]) == sum(len(w) for w in wrong_answers.WRONG_ANSWERS.values())
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_teacher_docs_show_the_current_wrong_answer_table():
    assert wrong_answers.table() in (ROOT / "docs" / "classroom.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------- the grader (classroom/grade.py)

import grade  # noqa: E402
from teacher_tests.cases import CASES  # noqa: E402


def test_every_exercise_has_cases_that_change_with_the_seed_and_the_reference_agrees_with_itself():
    """Hidden random inputs for all exercises: a lookup table of what one run saw fails the next."""
    assert set(CASES) == set(msc.EXERCISES)
    for key in msc.EXERCISES:
        cases = grade.make_cases(key, 0)
        assert len(cases) >= 2 and cases != grade.make_cases(key, 1), key
        assert grade.check_function(key, grade.reference_function(key), 0)[0], key


def test_the_reference_scores_full_marks_and_results_json_has_gradescopes_format(tmp_path):
    only = {"masked_mean", "completion_mask", "grpo_loss", "softmax_baselines"}
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "classroom/grade.py", str(ROOT), "--only", ",".join(sorted(only)),
                           "--json", str(out), "--seed", "5"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **ENV_KEYS}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    assert {t["name"] for t in results["tests"]} == only
    assert all(t["score"] == t["max_score"] > 0 and t["output"] for t in results["tests"]), results
    assert results["score"] == sum(t["max_score"] for t in results["tests"])
    assert "| `grpo_loss` | `grpo.py` | 3 / 3 |" in proc.stdout and "bubblewrap sandbox" in results["output"]
    proc = subprocess.run([sys.executable, "classroom/grade.py", str(ROOT), "--only", "kl_k3", "--json", str(out),
                           "--no-sandbox"], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **ENV_KEYS},
                          timeout=300)
    results = json.loads(out.read_text())
    assert results["score"] == 2 and "WITHOUT a sandbox" in results["output"], proc.stdout + proc.stderr
