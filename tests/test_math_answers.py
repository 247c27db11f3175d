"""lab/math_answers.py: math answers checked with math-verify. A table of hand-picked (completion, gold, expected)
cases, each with the reason for its expected value; gold answers read from the datasets' published shapes; the time
limit per answer; R1's format; the reward functions called as TRL calls them; math-verify loaded only when asked for."""
import importlib.util
import subprocess
import sys
import threading

import pytest

from conftest import ROOT
from lab import math_answers

# requirements-math.txt (.ci/run installs it); the tests of what happens without it run either way
needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None, reason="math-verify")

# (completion, the dataset's gold value, expected, why)
CASES = [
    # fractions, decimals, radicals: equal values in any notation
    (r"The answer is $\boxed{\frac{3}{4}}$.", r"\frac{3}{4}", True, "the same fraction, boxed"),
    ("The answer is 0.75", r"\frac{3}{4}", True, "0.75 = 3/4: compared as numbers, not as text"),
    (r"so \boxed{0.75}.", "3/4", True, "a decimal against a plain-text fraction"),
    (r"\boxed{\dfrac{3}{4}}", r"\frac34", True, r"\dfrac and \frac34 are both LaTeX for 3/4"),
    (r"\boxed{\frac{4}{3}}", r"\frac{3}{4}", False, "the inverse fraction: a different value"),
    (r"\boxed{2\sqrt{2}}", r"2\sqrt{2}", True, "the same radical"),
    (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", True, "sqrt(8) simplifies to 2 sqrt(2)"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", True, "a fraction of a radical"),
    (r"\boxed{0.3333333}", r"\frac{1}{3}", True, "equal to 1/3 within math-verify's 6-decimal rounding"),
    (r"\boxed{0.333}", r"\frac{1}{3}", False, "0.333 differs from 1/3 in the 4th decimal: not rounded away"),
    (r"\boxed{3.0}", "3", True, "3.0 = 3"),
    (r"\boxed{\pi}", r"\pi", True, "the same constant"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2", True, "the same polynomial, expanded: symbolic equality"),
    (r"\boxed{x^2+1}", "(x+1)^2", False, "a different polynomial"),
    # intervals, tuples, sets
    (r"\boxed{(1, 2)}", "(1, 2)", True, "the same open interval"),
    (r"\boxed{[1, 3)}", "[1,3)", True, "the same half-open interval, spaced differently"),
    (r"\boxed{(1, 3)}", "[1,3)", False, "open where the gold is closed: another interval"),
    (r"\boxed{(2, 1)}", "(1, 2)", False, "an ordered pair in the other order is another answer"),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", True, "sets: order does not matter"),
    (r"\boxed{3, 5}", "5, 3", True, "a list of solutions is read as a set"),
    (r"\boxed{3, 5}", "3, 4", False, "one of the two solutions is wrong"),
    # equations, percent, units, currency
    (r"\boxed{x = 5}", "5", True, "x = 5 against 5: the right side of an assignment is the answer"),
    ("Solving gives x = 5", "5", True, "unboxed, the last expression: the assignment's value"),
    (r"\boxed{50\%}", "50", True, "percent stripped: math-verify accepts 50% for 50 (its documented choice)"),
    (r"\boxed{50\%}", "0.5", True, "and 50% for 0.5, its value"),
    (r"\boxed{5 \text{ cm}}", "5", True, "units stripped"),
    (r"\boxed{\$18}", "18", True, "the dollar sign stripped"),
    (r"\boxed{\text{Evelyn}}", r"\text{Evelyn}", True, "a text answer, the same text"),
    (r"\boxed{\text{(C)}}", r"\text{(C)}", True, "a multiple-choice letter, the same letter"),
    (r"\boxed{\text{(B)}}", r"\text{(C)}", False, "another letter"),
    # the traps
    ("We get 72 apples, so 8 per box. Final answer: 8", "72", False,
     "the right number inside a wrong final answer: the final answer counts, not any number in the text"),
    (r"First 72, then \boxed{8}", "72", False, "the boxed answer wins over an earlier right number"),
    (r"\boxed{\boxed{7}}", "7", True, r"\boxed{} nested: the innermost value"),
    (r"The answer is \boxed{\frac{1}{2}} so far.", "0.5", True, "nested braces in the box, read whole"),
    ("The answer is 3.", "3", True, "a trailing period is punctuation, not a decimal point"),
    ("The answer is 1,000.", "1000", True, "1,000 is one thousand (thousands separator), then a period"),
    ("The answer is 1000.", "1,000", True, "the same, the comma in the gold"),
    (r"\boxed{-0}", "0", True, "negative zero is zero"),
    ("", "5", False, "an empty completion has no answer"),
    ("no number here", "5", False, "nothing to parse: wrong, not an error"),
    ("I think it's 5, no, 6", "5", False, "the last expression is the answer given: 6"),
    # R1's format: the answer is the last <answer> block's
    ("<think>2+2=4, so 4</think> <answer>4</answer>", "4", True, "the answer tag holds the right answer"),
    ("<think>it is 4</think> <answer>5</answer>", "4", False, "a right number in the reasoning, a wrong answer"),
    (r"<think>half</think> <answer>\frac{1}{2}</answer>", "0.5", True, "LaTeX inside the answer tag"),
    # gold answers in the datasets' shapes
    ("so 72 clips", "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", True,
     "GSM8K: the gold is after ####, not the 24 in the worked solution"),
    ("#### 1800", "18 eggs a day\n#### 1,800", True, "GSM8K's gold with a thousands comma"),
    (r"\boxed{\frac{14}{3}}", r"So the answer is $\boxed{\frac{14}{3}}$.", True,
     r"MATH: the gold is the solution's last \boxed{}"),
    (r"\boxed{3}", r"First $\boxed{2}$ is wrong; the answer is $\boxed{\frac{6}{2}}$", True,
     r"MATH: the last \boxed{} of the solution, 6/2 = 3"),
]


@needs_math_verify
@pytest.mark.parametrize("completion, gold, expected, why", CASES, ids=[c[3][:60] for c in CASES])
def test_math_verify_decides_each_case_of_the_table(completion, gold, expected, why):
    right, timed_out = math_answers.check(completion, math_answers.gold_answer(gold))
    assert (right, timed_out) == (expected, False), why


def test_the_table_has_at_least_40_cases_with_both_verdicts():
    assert len(CASES) >= 40 and {c[2] for c in CASES} == {True, False}


@needs_math_verify
@pytest.mark.parametrize("value, gold", [
    ("Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\n#### 10", "10"),
    (r"The area is $\boxed{\frac{\sqrt{3}}{4}}$.", r"\frac{\sqrt{3}}{4}"),
    (r"$\boxed{(3, \frac{\pi}{2})}$", r"(3, \frac{\pi}{2})"),
    (r"\left( 3, \frac{\pi}{2} \right)", r"\left( 3, \frac{\pi}{2} \right)"),
    ("5", "5"),
    (7, "7"),
    (r"no box, no number: \boxed{", ""),
    ("", ""),
])
def test_gold_answers_are_read_from_gsm8k_math_and_answer_columns(value, gold):
    """After '####' (GSM8K), in the last \\boxed{} with its nested braces (MATH), else the whole value (MATH-500's
    answer column); '' when math-verify can parse nothing there."""
    assert math_answers.gold_answer(value) == gold


def test_last_boxed_reads_nested_braces_and_ignores_an_unclosed_box():
    assert math_answers.last_boxed(r"a \boxed{1} b \boxed{\frac{1}{\sqrt{2}}} c") == r"\frac{1}{\sqrt{2}}"
    assert math_answers.last_boxed(r"\fbox{7}") == "7"
    assert math_answers.last_boxed(r"\boxed{\frac{1}{2}") is None


@needs_math_verify
def test_a_pathological_answer_scores_0_within_the_time_limit_and_is_counted():
    """10^(10^10) has ten billion digits: sympy would compute it for hours. The answer's check stops at its time
    limit, scores 0 and is counted, and the next answer is checked as usual (the timer is cleared)."""
    import time

    math_answers.take_timeouts()
    assert math_answers.check(r"\boxed{10^{10^{10}}}", "1", time_limit_s=0.5) == (False, True)
    assert math_answers.accuracy_reward([r"\boxed{10^{10^{10}}}", r"\boxed{1}"], answer=["1", "1"]) == [0.0, 1.0]
    assert math_answers.take_timeouts() == 1 and math_answers.take_timeouts() == 0
    time.sleep(0.6)  # no timer left over: nothing fires after the check returned


@needs_math_verify
def test_a_gold_answer_parse_cut_short_is_not_remembered_as_unparsable():
    """A parse stopped by the time limit (a loaded machine) raises through the gold answers' cache: the next check
    parses that gold again, instead of finding it unparsable for the rest of the run."""
    assert math_answers.check(r"\boxed{12345}", "12345/1", time_limit_s=1e-6) == (False, True)
    assert math_answers.check(r"\boxed{12345}", "12345/1") == (True, False)
    assert math_answers.gold_answer("12346/2") == "12346/2"


@needs_math_verify
def test_importing_math_verify_is_outside_the_first_answers_time_limit():
    """A fresh process's first check imports math-verify and builds its parser (seconds on a loaded machine) before
    its timer starts: its answer gets the whole limit, and no import is cut half-way."""
    code = ("from lab import math_answers\n"
            "print(math_answers.gold_answer('#### 3/4'), math_answers.check('0.75', '3/4', time_limit_s=0.5))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.strip() == "3/4 (True, False)", proc.stderr[-2000:]


@needs_math_verify
def test_outside_the_main_thread_the_check_says_it_needs_the_main_thread():
    errors = []

    def run():
        try:
            math_answers.check(r"\boxed{1}", "1")
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


@needs_math_verify
def test_reward_functions_take_trl_arguments_text_or_conversations():
    """TRL calls f(completions, **columns): completions as text, or as [{"role": "assistant", "content": ...}];
    the gold from `answer`, else from `solution`; an unparsable gold gives None (the row does not count)."""
    completions = [r"\boxed{2}", "<think>x</think> <answer>3</answer>", "3"]
    assert math_answers.accuracy_reward(completions, answer=["2", "3", ""], prompts=["p"] * 3) == [1.0, 1.0, None]
    chat = [[{"role": "assistant", "content": c}] for c in completions]
    solutions = [r"so $\boxed{2}$", r"$\boxed{4}$", r"$\boxed{3}$"]
    assert math_answers.accuracy_reward(chat, solution=solutions) == [1.0, 0.0, 1.0]
    assert math_answers.format_reward(chat) == [0.0, 1.0, 0.0]
    assert math_answers.format_reward(["<think>a</think><answer>b</answer> trailing"]) == [0.0]
    with pytest.raises(ValueError, match="'answer' or a 'solution' column"):
        math_answers.accuracy_reward(completions)


def test_the_r1_zero_template_holds_the_question():
    prompt = math_answers.R1_ZERO_TEMPLATE.format(question="What is 2+2?")
    assert prompt.endswith("User: What is 2+2?. Assistant:") and "<think> reasoning process here </think>" in prompt


def test_without_math_verify_asking_for_it_is_one_error_line_naming_the_install_step():
    code = ("import sys; sys.modules['math_verify'] = None\n"
            "from lab import math_answers\n"
            "math_answers.check('1', '1')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "error: checking math answers (--answer_check math, or its reward functions) needs math-verify, which is not "
        "installed: pip install -r requirements-math.txt"]


def test_the_lessons_load_neither_this_module_nor_math_verify():
    """Their import closure stays the lesson's machinery: the math check, the reward model and pass@k load only when
    a (lab) flag asks for them."""
    code = ("import sys, grpo, remax, rloo, dapo, ppo, reinforce_pp\n"
            "print(sorted(m for m in sys.modules if m.startswith(('math_verify', 'sympy', 'lab.math_answers', "
            "'lab.reward_model', 'lab'))))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"
