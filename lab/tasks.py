"""The lab's tasks and rewards, built on the lesson's (support/tasks.py, whose every name is this module's too, and
support/reward_functions.py): the agents' task (--dataset tool_arithmetic), math answers (--answer_check math,
--prompt_template r1_zero, --format_reward_weight: lab/math_answers.py), a reward model (--reward_model:
lab/reward_model.py), the rule reward's and the functions' weights, an environment's get_reward and reward functions
that receive the episodes (lab/environments.py), and held-out evaluation of greedy episodes. The lab's loops call
this module's load_task, make_reward_fn, reward_scorer, evaluate, decode_completions and PromptSampler; each does what
the lesson's does when no lab flag is given."""
import random

import torch

from lab import decode, environments
from support import config, reward_functions, tasks
from support.tasks import *  # noqa: F401,F403 (the shared task: what this module does not replace)

# ----------------------------------------------------------------------------------------
# The built-in task for agents (--dataset tool_arithmetic): a calculator worth calling
# ----------------------------------------------------------------------------------------
# An episode's completion region holds the model's turns and the calculator's replies, e.g. for 12+34*5=
#     <tool>34*5</tool><result>170</result><tool>12+170</tool><result>182</result>182
# The calculator does ONE binary integer operation per call, so a+b*c takes two calls.
# name: (operand digit counts, operators).
TOOL_FAMILIES = {
    "add_2x1": ((2, 1), "+"),      # easy: answered directly
    "mul_2x2": ((2, 2), "*"),      # hard without the calculator: one call
    "add_mul": ((2, 2, 1), "+*"),  # a+b*c: two calls, b*c then a+r
}


def tool_arithmetic_example(family, rng):
    digits, ops = TOOL_FAMILIES[family]
    x = [rng.randint(10 ** (d - 1) if d > 1 else 0, 10 ** d - 1) for d in digits]
    if ops == "+*":
        answer = x[0] + x[1] * x[2]
    else:
        answer = x[0] + x[1] if ops == "+" else x[0] * x[1]
    prompt = str(x[0]) + "".join(op + str(v) for op, v in zip(ops, x[1:])) + "="
    return {"prompt": prompt, "answer": str(answer), "family": family, "check": "final_answer"}


def tool_arithmetic_examples(n, seed, held_out):
    """n examples of --dataset tool_arithmetic, families in turn, all from the held-out split or all from the train
    split (held out by hash as tasks.arithmetic_examples's)."""
    rng, examples, families = random.Random(seed), [], list(TOOL_FAMILIES)
    while len(examples) < n:
        ex = tool_arithmetic_example(families[len(examples) % len(families)], rng)
        if tasks.is_held_out(ex["prompt"]) == held_out:
            examples.append(ex)
    return examples


def final_answer(episode_text):
    """The final answer of an episode: the text after the last `</result>` (the model's last turn), or the whole
    text when it called no tool. '<tool>3*4</tool><result>12</result>12' -> '12'."""
    return episode_text.rpartition("</result>")[2]


# ----------------------------------------------------------------------------------------
# Data: the agents' task, and real data with R1-Zero's prompt or math answers
# ----------------------------------------------------------------------------------------
def math_answers():
    """lab/math_answers.py, loaded only when a flag asks for it (--answer_check math, --prompt_template r1_zero,
    --format_reward_weight)."""
    from lab import math_answers

    return math_answers


def load_task(cfg, tokenizer=None):
    """tasks.load_task with the lab's data: --dataset tool_arithmetic (whose examples also hold check 'final_answer':
    an episode's final answer, see is_correct), and real data under --prompt_template r1_zero or --answer_check math
    (math_examples). The --reward_fn functions are tried on the first train rows, with trial episodes under
    --environment or --tools (check_reward_functions), before this returns."""
    if cfg.dataset == "tool_arithmetic":
        train, held_out = tool_arithmetic_examples(20_000, seed=cfg.seed, held_out=False), \
            tool_arithmetic_examples(250, seed=1234, held_out=True)
    elif cfg.dataset != "arithmetic" and (cfg.prompt_template == "r1_zero" or cfg.answer_check == "math"):
        train, held_out = [math_examples(rows, cfg, tokenizer, split, first)
                           for rows, split, first in tasks.dataset_splits(cfg)]
    else:
        train, held_out = tasks.task_examples(cfg, tokenizer)
    train = train[:cfg.train_size or len(train)]  # --train_size: a small pool, each prompt visited again and again
    check_reward_functions(cfg, train, tokenizer)
    return train, held_out


def math_examples(rows, cfg, tokenizer, split, first_row=1):
    """tasks.math_examples with R1-Zero's prompt (--prompt_template r1_zero: a text prompt in its template, for a
    base model: no chat template) and --answer_check math's gold answers: a row whose gold answer math-verify cannot
    parse is left out, counted in one warning."""
    examples, too_long, unparsable, chat = [], 0, [], tasks.uses_chat(cfg, tokenizer)
    for number, row in enumerate(rows, first_row):
        where, question = tasks.row_name(cfg, split, number), row[cfg.prompt_column]
        if cfg.prompt_template == "r1_zero" and isinstance(question, str) and question.strip():
            question = question.strip()
            prompt = math_answers().R1_ZERO_TEMPLATE.format(question=question)
        else:
            question, prompt = tasks.row_prompt(question, cfg, tokenizer, chat, where)
        answer = read_answer(row[cfg.answer_column], cfg.answer_check, where, cfg) if cfg.answer_column else None
        if answer == "":  # --answer_check math: a gold answer math-verify cannot parse, counted and left out
            unparsable.append(number)
            continue
        example = tasks.real_example(cfg, tokenizer, row, question, prompt, answer)
        if example is None:
            too_long += 1
        else:
            examples.append(example)
    tasks.warn_too_long(cfg, split, too_long)
    if unparsable:
        listed = ", ".join(map(str, unparsable[:5])) + (", ..." if len(unparsable) > 5 else "")
        print(f"warning: left out {len(unparsable)} {split} rows of --dataset {cfg.dataset!r} whose --answer_column "
              f"{cfg.answer_column!r} math-verify cannot parse (rows {listed})", flush=True)
    if not examples:
        raise SystemExit(f"error: no usable {split} prompts in --dataset {cfg.dataset!r} (all longer than "
                         f"--max_prompt_length{', or with gold answers math-verify cannot parse' * bool(unparsable)}).")
    return examples


def read_answer(value, check, where, cfg):
    """tasks.read_answer, and under --answer_check math the gold answer as math-verify reads it ('' when it cannot:
    the row is counted and left out, math_examples)."""
    if check != "math":
        return tasks.read_answer(value, check, where, cfg)
    return math_answers().gold_answer(tasks.answer_value(value, where, cfg))


def is_correct(completion, answer, check="exact"):
    """tasks.is_correct, and the lab's checks: 'math' (equal values by math-verify) and 'final_answer' (an episode's
    final answer, exactly: --dataset tool_arithmetic)."""
    if check == "math":
        return answer is not None and math_answers().is_equivalent(completion, answer)
    return tasks.is_correct(final_answer(completion) if check == "final_answer" else completion, answer, check)


def compute_rewards(examples, completions, reward_scales="uniform"):
    """tasks.compute_rewards with the lab's checks (is_correct)."""
    correct = [is_correct(c, ex["answer"], ex.get("check", "exact")) for c, ex in zip(completions, examples)]
    return tasks.scaled_rewards(examples, correct, reward_scales)


# ----------------------------------------------------------------------------------------
# The reward: the rule reward's weight, a reward model, R1's terms, weighted functions, an environment's get_reward
# ----------------------------------------------------------------------------------------
class Completion(reward_functions.Completion):
    """A completion's text and token ids (reward_functions.Completion) and, in an episode (agents.py), its
    agents.Episode."""

    def __new__(cls, text, token_ids=None, episode=None):
        completion = super().__new__(cls, text, token_ids)
        completion.episode = episode
        return completion


def decode_completions(tokenizer, completion_ids, mask, episodes=None):
    """tasks.decode_completions, each completion with its agents.Episode (episodes: one per row, or None)."""
    return [Completion(text, text.token_ids, None if episodes is None else episodes[i])
            for i, text in enumerate(tasks.decode_completions(tokenizer, completion_ids, mask))]


def make_reward_fn(cfg, accelerator):
    """reward_fn(examples, completions, scored=None, episodes=None) -> (rewards, correct, stats) on the accelerator's
    device (episodes: the multi-turn episodes, agents.Episode, which --reward_fn functions receive; by default the
    completions' own): the weighted sum of the rule reward, the reward model's score and each --reward_fn function's
    values (None counts 0); stats holds each function's mean over the rows it scored, as train/reward/<name>. A
    reward that raises, or a value that is not a finite number, stops every rank before any update, naming what and
    where. scored: the (rewards, correct, stats, error) the sampler process computed with the same function
    (--async_rollouts: rollout.rewards), not computed again; None: compute them."""
    reward_model = None
    if cfg.reward_model:  # its module loads only then
        from lab.reward_model import RewardModel

        reward_model = RewardModel(cfg.reward_model, cfg.reward_model_dtype, accelerator, cfg.micro_batch_size)
    score = reward_scorer(cfg, accelerator.device, reward_model)

    def reward_fn(examples, completions, scored=None, episodes=None):
        rewards, correct, stats, error = score(examples, completions, episodes) if scored is None else scored
        tasks.stop_on_reward_error(accelerator, error)
        return rewards, correct, stats

    return reward_fn


def reward_scorer(cfg, device, reward_model=None):
    """score(examples, completions, episodes=None) -> (rewards, correct, stats, error): reward_fn's values in one
    process, on `device`, with no agreement between ranks; error: the line to stop with, or None. It needs no
    accelerator: the sampler process of --async_rollouts calls it too (lab/async_sampling.py)."""
    weights = cfg.reward_weights or [1.0] * len(cfg.reward_fn)
    functions = [(spec.rpartition(":")[2], config.reward_function(spec), weight)
                 for spec, weight in zip(cfg.reward_fn, weights)]
    source = environments.reward_source(cfg)
    if source:  # an environment's get_reward (TRL's): one more function, of weight 1
        functions.append((*source, 1.0))
    if functions:
        reward_functions.trainer_state().max_steps = cfg.num_steps

    def score(examples, completions, episodes=None):
        if episodes is None and getattr(completions[0], "episode", None):
            episodes = [completion.episode for completion in completions]  # sampled episodes carry theirs
        prompts = [ex.get("raw_prompt", ex["prompt"]) for ex in examples]
        stats = {}
        try:
            rewards, correct = compute_rewards(examples, completions, cfg.reward_scales)
            rewards, correct = cfg.rule_reward_weight * rewards.to(device), correct.to(device)
            if reward_model is not None:
                rewards = rewards + cfg.reward_model_weight * reward_model(prompts, completions)
            if cfg.answer_check == "math" or cfg.format_reward_weight:  # R1's reward terms, each logged
                rewards, stats = math_answers().add_format_reward(cfg, rewards, correct, completions)
        except Exception as e:  # a reward that raises: say on what, and apply nothing
            return tasks.reward_raised(e, examples, completions, device)
        for name, function, weight in functions:
            kwargs = reward_kwargs(cfg, examples, completions, episodes)
            rewards, error = tasks.add_reward(name, function, weight, kwargs, rewards, stats)
            if error is not None:
                return rewards, correct, stats, error
        return rewards, correct, stats, tasks.non_finite(rewards, examples, completions)

    return score


def reward_kwargs(cfg, examples, completions, episodes=None):
    """reward_functions.reward_kwargs and, with multi-turn episodes (agents.Episode, one per completion), episodes
    and, with --environment and --reward_fn, environments: each episode's environment instance, as TRL passes them
    (unpickled in this process: Environment.instance)."""
    kwargs = reward_functions.reward_kwargs(cfg, examples, completions)
    if episodes is not None:
        kwargs["episodes"] = episodes
        if getattr(cfg, "environment", "") and cfg.reward_fn:
            kwargs["environments"] = [episode.env.instance for episode in episodes]
    return kwargs


def check_reward_functions(cfg, examples, tokenizer):
    """reward_functions.check_reward_functions, with --environment or --tools each function also given trial episodes
    (environments.trial_episodes: a fresh environment per row, reset called, no turns yet)."""
    if cfg.reward_fn:
        examples, reward_functions.trainer_state().max_steps = examples[:reward_functions.CHECK_ROWS], cfg.num_steps
        completions = reward_functions.trial_completions(examples, tokenizer)
        kwargs = reward_kwargs(cfg, examples, completions, environments.trial_episodes(cfg, examples))
        reward_functions.try_reward_functions(cfg, examples, kwargs)


# ----------------------------------------------------------------------------------------
# Prompts and held-out evaluation
# ----------------------------------------------------------------------------------------
class PromptSampler(tasks.PromptSampler):
    """tasks.PromptSampler, which also gives the trainer its sample function (budget.BudgetSampler's may sample a
    prompt's completions as a tree)."""

    def sample_with(self, independent):
        """The rollouts' sample function: `independent` itself (decode.generate or common.generate), each prompt's
        completions sampled on their own."""
        return independent


@torch.no_grad()
def evaluate(model, tokenizer, examples, cfg, accelerator, batch_size=256, generate=None, play=None):
    """tasks.evaluate with the lab's checks (is_correct) and `play`: sampling.play's greedy episodes, with
    eval/tool_calls, the tool calls per episode, overall and per family."""
    generate, unwrapped, counted = generate or decode.generate, accelerator.unwrap_model(model), []
    for batch in tasks.eval_batches(examples, accelerator, batch_size):
        episodes = [None] * len(batch)
        if play is None:
            texts = tasks.greedy_texts(unwrapped, tokenizer, batch, cfg, accelerator.device, generate)
        else:
            _, _, completion_ids, _, mask, episodes = play(unwrapped, tokenizer, examples=batch)
            texts = tasks.decode_completions(tokenizer, completion_ids, mask)
        counted += [(ex["family"], is_correct(text, ex["answer"], ex.get("check", "exact")), 1,
                     0 if episode is None else len(episode.tool_calls))
                    for text, ex, episode in zip(texts, batch, episodes)]
    families, (correct, total, calls) = tasks.summed_per_family(examples, counted, 3, accelerator)
    metrics = tasks.accuracy_metrics(families, correct, total)
    if play is not None:
        metrics["eval/tool_calls"] = sum(calls) / sum(total)
        metrics.update({f"eval/tool_calls_{fam}": calls[j] / max(total[j], 1) for j, fam in enumerate(families)})
    return metrics
