"""Reward functions (--reward_fn) called as TRL's GRPOTrainer calls them: the keyword arguments they receive, the
checks on what they return (the error names the function and the batch rows), and a trial call on a few train rows
before any model loads. (With episodes, the lab's reward functions also receive them: lab/tasks.py.)"""
import asyncio
import inspect
import math
import numbers

import torch
from support import config

_TRAINER_STATE = []


def trainer_state():
    """What reward functions receive as trainer_state, as TRL passes its trainer's: a transformers TrainerState
    whose global_step is the optimizer steps done before the one being sampled (the engine sets it) and max_steps
    --num_steps. Made on first use: importing TrainerState costs a run without --reward_fn about 100 MiB."""
    if not _TRAINER_STATE:
        from transformers import TrainerState

        _TRAINER_STATE.append(TrainerState())
    return _TRAINER_STATE[0]


CHECK_ROWS = 4  # the train rows each --reward_fn is tried on before any model loads


class Completion(str):
    """A completion's text that also holds its token ids (the sampled ones, up to and including the first EOS),
    which a reward function receives as completion_ids."""

    def __new__(cls, text, token_ids=None):
        completion = super().__new__(cls, text)
        completion.token_ids = token_ids
        return completion


def reward_kwargs(cfg, examples, completions):
    """The keyword arguments of a reward function, as TRL's GRPOTrainer passes them, one list entry per completion:
    prompts (the dataset's prompt: text, or a conversation's messages), completions (text, or for a conversation
    [{"role": "assistant", "content": text}]), completion_ids (the sampled token ids, up to and including EOS),
    trainer_state, and every column of the dataset but the prompt's, by its name."""
    rows = [ex.get("row", ex) for ex in examples]
    prompt_column = "prompt" if cfg.dataset in ("arithmetic", "tool_arithmetic") else cfg.prompt_column
    columns = {key: [row[key] for row in rows] for key in rows[0] if key != prompt_column}
    prompts = [ex.get("raw_prompt", ex["prompt"]) for ex in examples]
    return {**columns, "prompts": prompts,
            "completions": [[{"role": "assistant", "content": c}] if isinstance(p, list) else c
                            for p, c in zip(prompts, completions)],
            "completion_ids": [getattr(c, "token_ids", None) for c in completions], "trainer_state": trainer_state()}


def call_reward_function(name, function, kwargs, when="step not applied"):
    """(values, error): the function's values f(**kwargs) on the batch (an `async def` function is run to its
    end), one per completion: a finite number, or None where it does not apply. Else values is None and error
    the line that names the function and the batch rows at fault, counted from 1 as dataset rows are."""
    what, n = f"--reward_fn {name}", len(kwargs["completions"])
    texts = [c[0]["content"] if isinstance(c, list) else c for c in kwargs["completions"]]

    def call(kwargs):
        values = function(**kwargs)
        return asyncio.run(values) if inspect.iscoroutine(values) else values

    try:
        values = call(kwargs)
    except Exception as e:
        def raises(i):
            try:
                call({k: v[i:i + 1] if isinstance(v, list) else v for k, v in kwargs.items()})
            except Exception:
                return True
            return False

        rows = [i for i in range(n) if raises(i)]
        where = f"batch rows {show(rows, texts)}" if rows else f"the batch of {n} (no row alone)"
        return None, f"error: {what} raised {type(e).__name__}: {e} on {where}; {when}."
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else f"a {type(values).__name__}"
        return None, (f"error: {what} returned {got} for {n} completions: it must return a list of one float (or "
                      f"None) per completion; {when}.")
    not_numbers = [i for i, v in enumerate(values) if v is not None and not isinstance(v, numbers.Real)]
    if not_numbers:
        return None, (f"error: {what} returned {type(values[not_numbers[0]]).__name__} "
                      f"{str(values[not_numbers[0]])[:100]!r}, not a number, at batch rows {show(not_numbers, texts)}; "
                      f"{when}.")
    floats = [None if v is None else finite_float(v) for v in values]
    non_finite = [i for i, (v, f) in enumerate(zip(values, floats)) if v is not None and f is None]
    if non_finite:
        v = values[non_finite[0]]
        said = v if isinstance(v, float) else f"a number too large for a float ({type(v).__name__})"
        return None, f"error: {what} returned {said} at batch rows {show(non_finite, texts)}; {when}."
    return floats, None


def finite_float(value):
    """float(value), or None where it is not finite (inf, NaN; an int or a Fraction past a float's range)."""
    try:
        value = float(value)
    except (OverflowError, ValueError):
        return None
    return value if math.isfinite(value) else None


def show(rows, completions):
    """"4, 8 of 16, counted from 1 (row 4's completion: '...')" for an error line: up to 5 batch rows (0-based
    indices in, counted from 1 out, as dataset rows are) and the first one's completion."""
    listed = ", ".join(str(i + 1) for i in rows[:5]) + (f" and {len(rows) - 5} more" if len(rows) > 5 else "")
    return f"{listed} of {len(completions)}, counted from 1 (row {rows[0] + 1}'s completion: " \
           f"{completions[rows[0]][:100]!r})"


def check_reward_functions(cfg, examples, tokenizer):
    """Each --reward_fn called once as a step calls it, on the first CHECK_ROWS train rows with placeholder
    completions (each row's answer, else ''), before any model loads (try_reward_functions)."""
    if cfg.reward_fn:
        examples, trainer_state().max_steps = examples[:CHECK_ROWS], cfg.num_steps
        try_reward_functions(cfg, examples, reward_kwargs(cfg, examples, trial_completions(examples, tokenizer)))


def trial_completions(examples, tokenizer):
    """The placeholder completions of the trial call: each row's answer, else ''."""
    return [Completion(ex["answer"] or "", tokenizer(ex["answer"] or "", add_special_tokens=False)["input_ids"]
                       + [tokenizer.eos_token_id]) if tokenizer is not None else ex["answer"] or ""
            for ex in examples]


def try_reward_functions(cfg, examples, kwargs):
    """The trial call of each --reward_fn on kwargs: a function whose parameters do not take the keywords it is
    given, or that fails on them (raises, or returns other than one number or None per completion), stops the run
    here with one line."""
    taken = [key for key in ("prompts", "completions", "completion_ids", "trainer_state", "episodes", "environments")
             if key in examples[0].get("row", {}) and key in kwargs]
    if taken:
        raise SystemExit(f"error: --dataset {cfg.dataset!r} has a column {taken[0]!r}, the name of an argument every "
                         "--reward_fn receives: rename the column.")
    for spec in cfg.reward_fn:
        name, function = spec.rpartition(":")[2], config.reward_function(spec)
        try:
            inspect.signature(function).bind(**kwargs)
        except TypeError as e:
            raise SystemExit(f"error: --reward_fn {name} cannot be called as a reward function is ({e}): it is called "
                             f"with keywords, f({', '.join(f'{k}=...' for k in kwargs)}), so write "
                             f"`def {name}(completions, **kwargs)`, naming the arguments it uses before **kwargs.")
        except ValueError:  # a callable without a signature Python can read: the call below tries it
            pass
        _, error = call_reward_function(name, function, kwargs, when=(
            f"tried before any model loads on the first {len(examples)} train rows, each row's answer as its "
            "completion"))
        if error is not None:
            raise SystemExit(error)
