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
            assert catcher in [node.split("::")[1] for node in wrong_answers.grading_tests(key)], (key, description)
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


# ---------------------------------------------------------------- the grader (classroom/grade.py)

import shutil  # noqa: E402
import textwrap  # noqa: E402

import grade  # noqa: E402

CHEATS = {
    # the numpy copies of the bandit, called for the answer
    "rloo_advantages": """
        import toy_bandit
        return torch.as_tensor(toy_bandit.rloo_advantages(rewards.view(-1, group_size).numpy())).view(-1)""",
    "grpo_advantages": """
        from toy_bandit import grpo_advantages
        return torch.as_tensor(grpo_advantages(rewards.view(-1, group_size).numpy())).view(-1)""",
    # the reference read from a sibling folder with ast
    "gae": """
        import ast, pathlib
        source = (pathlib.Path(__file__).resolve().parents[1] / "main" / "ppo.py").read_text()
        namespace = {"torch": torch}
        exec(compile(ast.parse(source), "ppo", "exec"), namespace)
        return namespace["gae"](rewards, values, mask, gamma, lam)""",
}
# ways around the rules a body might try, each refused before anything runs
EVASIONS = [
    "return torch.load('answer.pt')",
    "return torch.os.system('true')",
    "f = open('/etc/passwd')",
    "return getattr(torch, 'lo' + 'ad')('answer.pt')",
    "return __import__('toy_bandit').rloo_advantages(rewards)",
    "t = torch\n        return t.os.getcwd()",
    "torch.testing.assert_close = lambda *a, **k: None",
    "common.masked_mean = None",
    "return rewards.__class__.__subclasses__()",
    "global common",
    "from torch import serialization",
    "import numpy.lib",
    "return tasks.reward_fn",
    "return engine",
    "import os",
]


def write_student(tmp_path, bodies):
    """A student copy: the files of the exercises, each body the reference's unless given in `bodies`."""
    out = tmp_path / "student"
    out.mkdir()
    for rel in sorted({key.split("::")[0] for key in msc.EXERCISES}):
        text = (ROOT / rel).read_text(encoding="utf-8")
        for key in msc.EXERCISES:
            file, name = key.split("::")
            if file == rel and name in bodies:
                lines = text.splitlines(keepends=True)
                ((start, end, indent, *_),) = [r for r in msc.regions(text) if r[3] == name]
                body = textwrap.indent(textwrap.dedent(bodies[name]).strip("\n"), indent) + "\n"
                text = "".join(lines[:start]) + body + "".join(lines[end + 1:])
        (out / rel).write_text(text, encoding="utf-8")
    return out


def test_every_reference_body_passes_the_grader_checks_and_evasions_do_not():
    for key in msc.EXERCISES:
        file, name = key.split("::")
        tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
        assert grade.check_body(grade.student_body(grade.function_node(tree, name)), grade.Rules(key)) == [], key
    for text in EVASIONS:
        body = ast.parse(textwrap.dedent("        " + text).strip()).body
        assert grade.check_body(body, grade.Rules("rloo.py::rloo_advantages")), text
    for name, text in CHEATS.items():
        key = next(k for k in msc.EXERCISES if msc.exercise_name(k) == name)
        problems = grade.check_body(ast.parse(textwrap.dedent(text).strip()).body, grade.Rules(key))
        assert problems, name


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
    assert "| `grpo_loss` | `grpo.py` | 3 / 3 |" in proc.stdout


def test_cheats_an_empty_copy_and_a_conftest_score_zero(tmp_path):
    """The cheats of CHEATS and a completion_mask that special-cases the visible test's tensor score 0;
    so does the student copy as written (nothing implemented) with a conftest.py at its root that
    passes every test, and a body that returns nothing with that conftest beside it."""
    special_case = """
        if completion_ids.shape == (4, 5) and completion_ids[0, 0] == 5:  # the visible test's ids
            return torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
        return torch.ones_like(completion_ids)"""
    student = write_student(tmp_path, {**CHEATS, "completion_mask": special_case, "masked_sum": "return None"})
    (student / "conftest.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(item, call):
            outcome = yield
            outcome.get_result().outcome = "passed"
        """))
    results, _ = grade.grade(student, only={*CHEATS, "completion_mask", "masked_sum"}, seed=7)
    assert {r.name: r.score for r in results} == {name: 0 for name in [*CHEATS, "completion_mask", "masked_sum"]}
    assert all(r.status.startswith("refused") for r in results if r.name in CHEATS)
    empty = tmp_path / "empty"
    assert subprocess.run([sys.executable, str(ROOT / msc.__file__), str(empty)], capture_output=True,
                          env={**os.environ, **ENV_KEYS}, timeout=120).returncode == 0
    shutil.copy(student / "conftest.py", empty / "conftest.py")
    results, _ = grade.grade(empty, seed=7)
    assert len(results) == len(msc.EXERCISES) and all(r.score == 0 for r in results)
    assert {r.status for r in results} == {"not implemented"}


def test_the_audit_hook_refuses_a_file_to_the_students_code_even_past_the_static_check(tmp_path):
    """Defence in depth: a body that opens a file, spliced in without the static check, fails its tests
    with the hook's PermissionError (and the reference's own file reads are untouched)."""
    base = grade.make_base(tmp_path)
    body = ast.parse("x = torch.where(mask.bool(), x, torch.zeros_like(x))\nopen('/etc/hostname')\n"
                     "return x.sum() if dim is None else x.sum(dim)").body
    text, first, last = grade.splice((base / "common.py").read_text(encoding="utf-8"), "masked_sum", body)
    (base / "common.py").write_text(text, encoding="utf-8")
    outcomes, status = grade.run_tests(base, "common.py::masked_sum", first, last, 0, 120, tmp_path / "out.xml")
    assert status == "" and outcomes
    assert all(not ok and "PermissionError" in message for _, ok, message in outcomes), outcomes
