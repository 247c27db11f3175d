"""Math answers checked as the field checks them, with math-verify (Hugging Face's verifier, the one TRL's
accuracy_reward uses): gold answers read from GSM8K's `#### N`, MATH's last `\\boxed{...}` or a column of answers;
completions parsed as math-verify parses them (LaTeX, fractions, radicals, intervals, sets, percent, units); each
answer checked within a time limit. Also DeepSeek-R1's output format and its R1-Zero prompt.

Loaded only when asked for: by --answer_check math (lab/tasks.py imports it then), --format_reward_weight,
--prompt_template r1_zero, or as a reward function file (--reward_fn lab/math_answers.py:accuracy_reward, or
from TRL: `GRPOTrainer(reward_funcs=[accuracy_reward, format_reward], ...)`). math-verify itself is imported on
the first check: `pip install -r requirements-math.txt`.
"""
import contextlib
import functools
import re
import signal
import threading

INSTALL = "pip install -r requirements-math.txt"
TIME_LIMIT_S = 2.0  # per answer (its parse and its comparison together): past it the answer scores 0, counted
# DeepSeek-R1-Zero's template (DeepSeek-AI, 2025, table 1), {question} the dataset's prompt
R1_ZERO_TEMPLATE = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. The assistant "
    "first thinks about the reasoning process in the mind and then provides the user with the answer. The reasoning "
    "process and answer are enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
    "<think> reasoning process here </think> <answer> answer here </answer>. User: {question}. Assistant:")
# R1's output format: the reasoning in <think> tags, then the answer in <answer> tags, and nothing else
THINK_THEN_ANSWER = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


class TimeLimit(BaseException):
    """An answer's check ran past its time limit (a BaseException: math-verify's `except Exception` lets it by)."""


_LOADED = []


def math_verify():
    """The math_verify module, imported on first use and warmed up; not installed: one error line naming the
    install step."""
    if not _LOADED:
        try:
            import math_verify
        except ImportError:
            raise SystemExit(f"error: checking math answers (--answer_check math, or its reward functions) needs "
                             f"math-verify, which is not installed: {INSTALL}") from None
        import logging

        # its own timers are off (ours bounds the whole answer, below): it would warn so once per process
        logging.getLogger("math_verify").setLevel(logging.ERROR)
        # the first parse and comparison build math-verify's LaTeX parser and load sympy's parts, slowly: here,
        # outside any answer's time limit
        one = math_verify.parse("$1$", parsing_timeout=None)
        math_verify.verify(one, one, timeout_seconds=None)
        _LOADED.append(math_verify)
    return _LOADED[0]


def last_boxed(text):
    """The content of the last \\boxed{...} (or \\fbox{...}) in text, nested braces included; None if none closes.
    'so \\boxed{\\frac{1}{2}}.' -> '\\frac{1}{2}'."""
    starts = [m.end() for m in BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def gold_answer(value):
    """A dataset's gold answer as text: after GSM8K's '####', else in MATH's last \\boxed{}, else the whole (a column
    of answers, as MATH-500's `answer`); '' when math-verify finds no answer in it (the row is counted and left out
    by lab/tasks.py). '18 eggs\\n#### 1,800' -> '1,800'."""
    text = str(value)
    gold = text.rpartition("####")[2] if "####" in text else last_boxed(text)
    gold = (text if gold is None else gold).strip()
    math_verify()  # imported and warmed up outside the time limit
    try:
        with time_limit(TIME_LIMIT_S):
            return gold if gold and parse_gold(gold) else ""
    except TimeLimit:
        return ""


@functools.lru_cache(maxsize=65536)
def parse_gold(gold):
    """The gold answer parsed by math-verify, as if the model had boxed it (a tuple: cached); () if unparsable. No
    time limit of its own: its callers run it under theirs, and a parse cut short raises, so is not cached."""
    return tuple(math_verify().parse("\\boxed{" + gold + "}", parsing_timeout=None))


def final_answer_text(completion):
    """The part of a completion that holds its answer: the last <answer>...</answer> when there is one (R1's
    format), else all of it (math-verify then takes the last \\boxed{}, else the last expression)."""
    tagged = ANSWER_TAG.findall(completion)
    return tagged[-1] if tagged else completion


def check(completion, gold, time_limit_s=TIME_LIMIT_S):
    """(right, timed_out): whether math-verify finds the completion's answer equal to the gold answer (text, as
    gold_answer returns it), parsing and comparing within time_limit_s; past it the answer is wrong and timed_out.
    Main thread only: the limit is a SIGALRM timer (math-verify's own are too), which Python runs there alone."""
    mv = math_verify()  # imported and warmed up outside the time limit
    if not gold or not completion:
        return False, False
    try:
        with time_limit(time_limit_s):
            golds, answer = parse_gold(gold), mv.parse(final_answer_text(completion), parsing_timeout=None)
            return bool(golds) and bool(mv.verify(list(golds), answer, timeout_seconds=None)), False
    except TimeLimit:
        return False, True


def expire(signum, frame):
    raise TimeLimit()


@contextlib.contextmanager
def time_limit(seconds):
    """`with time_limit(seconds):` raises TimeLimit in the block once `seconds` have passed (a SIGALRM timer, as
    math-verify's; in another thread than the main one: a RuntimeError saying so). The timer and the previous
    handler are restored however the block ends, the limit's own TimeLimit included."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("math answers are checked in the main thread only: their time limit is a SIGALRM timer, "
                           "which Python runs there alone (math-verify's own timers too).")
    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL if previous is None else previous)


class Timeouts:
    """The answers whose check ran out of time in this process: counted, the first one shown once."""
    count = 0
    shown = False


def is_equivalent(completion, gold):
    """check()'s verdict, a time-out counted in Timeouts (and the first shown on stderr, once per process)."""
    right, timed_out = check(completion, gold)
    if timed_out:
        Timeouts.count += 1
        if not Timeouts.shown:
            import sys

            Timeouts.shown = True
            print(f"warning: checking the answer of {completion[-200:]!r} against {gold!r} took over {TIME_LIMIT_S} "
                  "s: scored 0; train/answer_timeouts counts such answers.", file=sys.stderr, flush=True)
    return right


def take_timeouts():
    """The answers timed out since the last call (a step's, for train/answer_timeouts)."""
    count, Timeouts.count = Timeouts.count, 0
    return count


def is_r1_format(completion):
    return THINK_THEN_ANSWER.fullmatch(completion) is not None


def add_format_reward(cfg, rewards, correct, completions):
    """(rewards + --format_reward_weight x R1's format reward, stats) with the terms' shares logged apart:
    train/reward/accuracy (the rule reward's correctness), train/reward/format (the format reward, unweighted,
    when it is on) and, under --answer_check math, train/answer_timeouts (answers past the time limit since the
    last step's count, evaluations' included)."""
    import torch

    stats = {"train/reward/accuracy": correct.float().mean().item()}
    if cfg.format_reward_weight:
        formatted = torch.tensor(format_reward(completions), device=rewards.device)
        rewards = rewards + cfg.format_reward_weight * formatted
        stats["train/reward/format"] = formatted.mean().item()
    if cfg.answer_check == "math":
        stats["train/answer_timeouts"] = take_timeouts()
    return rewards, stats


# ---- reward functions, called as TRL's GRPOTrainer calls them (docs/your_task.md) ----
def text_of(completion):
    """A completion's text: itself, or the content of its one assistant message (TRL's conversational format)."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def accuracy_reward(completions, answer=None, solution=None, **kwargs):
    """1.0 where math-verify finds the completion's answer equal to the row's gold answer (the `answer` column,
    else `solution`'s last \\boxed{}), 0.0 where not or past the time limit; None where the gold answer cannot be
    parsed (TRL's convention: the row does not count)."""
    golds = answer if answer is not None else solution
    if golds is None:
        raise ValueError("accuracy_reward needs an 'answer' or a 'solution' column in the dataset.")
    scores = []
    for completion, value in zip(completions, golds):
        gold = gold_answer(value)
        scores.append(float(is_equivalent(text_of(completion), gold)) if gold else None)
    return scores


def format_reward(completions, **kwargs):
    """1.0 for a completion that is '<think>...</think><answer>...</answer>' and nothing else (R1's format), else
    0.0."""
    return [float(is_r1_format(text_of(completion))) for completion in completions]
