"""Tasks and rewards: the built-in arithmetic task, real data (GSM8K or a local file) with its rule reward, the reward
that adds the --reward_fn functions to it (how those are called: support/reward_functions.py), the prompt sampler,
held-out evaluation, and prompts to token ids and completions back to text. The lab's tasks and rewards (the agents'
task, math answers, a reward model, environments) build on these: lab/tasks.py."""
import ast
import hashlib
import math
import random
import re

import torch

import common
from support import config, models, reward_functions

# ----------------------------------------------------------------------------------------
# The built-in task: arithmetic in families of different difficulty
# ----------------------------------------------------------------------------------------
# name: (operand digit counts, operator). Easy to hard for a 1M-parameter model.
FAMILIES = {
    "add_2x1": ((2, 1), "+"),
    "sub_2x2": ((2, 2), "-"),
    "add_2x2": ((2, 2), "+"),
    "mul_2x1": ((2, 1), "*"),
    "add_3x3": ((3, 3), "+"),
}
# reward for (wrong, right) per family under --reward_scales hetero (docs/baselines.md): one offset per family, as
# a learned reward model puts prompt kinds on different scales; the same gap of 1, within ReMax's advantage clip of 5.
HETERO_SCALES = {"add_2x1": (4.0, 5.0), "sub_2x2": (-5.0, -4.0), "add_2x2": (2.0, 3.0), "mul_2x1": (-3.0, -2.0),
                 "add_3x3": (0.0, 1.0)}
HELD_OUT_FRACTION = 5  # one prompt in 5 (by hash) is held out: never trained on


def is_held_out(prompt):
    return int(hashlib.md5(prompt.encode()).hexdigest(), 16) % HELD_OUT_FRACTION == 0


def arithmetic_example(family, rng):
    (da, db), op = FAMILIES[family]
    a = rng.randint(10 ** (da - 1) if da > 1 else 0, 10 ** da - 1)
    b = rng.randint(10 ** (db - 1) if db > 1 else 0, 10 ** db - 1)
    if op == "-" and b > a:
        a, b = b, a
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(answer), "family": family}


def arithmetic_examples(n, seed, held_out):
    """n examples, families in turn, all from the held-out split or all from the train split."""
    rng, examples, families = random.Random(seed), [], list(FAMILIES)
    while len(examples) < n:
        ex = arithmetic_example(families[len(examples) % len(families)], rng)
        if is_held_out(ex["prompt"]) == held_out:
            examples.append(ex)
    return examples


# ----------------------------------------------------------------------------------------
# Real data (GSM8K or a local file) and the rule reward
# ----------------------------------------------------------------------------------------
# never from a comma: `-?[\d,]*\.?\d+` tried a run of commas from each of them, in time quadratic in its length
NUMBER = r"-?(?:\d[\d,]*)?\.?\d+"
NO_ANSWERS = "--answer_column '' (no answers: a --reward_fn or --reward_model scores the completions)"


def normalize_number(text):
    """'1,234.50' -> '1234.5'; exact string comparison after this."""
    text = text.replace(",", "").strip()
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def extract_final_number(text):
    """The final answer of a math completion: after '####', else in \\boxed{}, else the last
    number; None if there is no number."""
    for pattern in (r"####\s*(" + NUMBER + ")", r"\\boxed\{\s*(" + NUMBER + r")\s*\}", "(" + NUMBER + ")"):
        found = re.findall(pattern, text)
        if found:
            return normalize_number(found[-1] if pattern != r"####\s*(" + NUMBER + ")" else found[0])
    return None


def load_task(cfg, tokenizer=None):
    """(train examples, held-out eval examples). Every example: prompt (as fed to the policy), answer,
    family and, for real data, raw_prompt (the dataset's prompt: text, or a conversation's messages), check
    (--answer_check) and row (the dataset row, whose columns reward functions receive). An arithmetic example
    is its own row. The --reward_fn functions are tried on the first train rows before this returns."""
    train, held_out = task_examples(cfg, tokenizer)
    train = train[:cfg.train_size or len(train)]  # --train_size: a small pool, each prompt visited again and again
    reward_functions.check_reward_functions(cfg, train, tokenizer)
    return train, held_out


def task_examples(cfg, tokenizer):
    """(train, eval) examples of --dataset: the arithmetic task, or gsm8k's or a local file's rows (math_examples)."""
    if cfg.dataset == "arithmetic":
        return arithmetic_examples(20_000, seed=cfg.seed, held_out=False), \
            arithmetic_examples(250, seed=1234, held_out=True)
    if cfg.dataset == "tool_arithmetic":
        raise SystemExit("error: --dataset 'tool_arithmetic' is the agents' task (docs/agents.md), a dataset of the "
                         "lab's scripts (lab/), not of the lessons'.")
    return [math_examples(rows, cfg, tokenizer, split, first) for rows, split, first in dataset_splits(cfg)]


def dataset_splits(cfg):
    """[(rows, split, the number of its first row)] of gsm8k's train and test splits or a local file's rows (its last
    --eval_size held out), with the --prompt_column and --answer_column they must have."""
    import datasets

    try:
        if cfg.dataset == "gsm8k":
            splits = datasets.load_dataset("openai/gsm8k", "main")
            train_rows = splits["train"]
            eval_rows = splits["test"].select(range(min(cfg.eval_size, len(splits["test"]))))
        else:
            kind = "parquet" if cfg.dataset.endswith(".parquet") else "json"
            if cfg.dataset.endswith(".jsonl"):
                config.check_json_lines(cfg.dataset)
            rows = datasets.load_dataset(kind, data_files=cfg.dataset, split="train")
            if len(rows) < 2:
                raise SystemExit(f"error: --dataset {cfg.dataset!r} has {len(rows)} rows; "
                                 "need at least 2 (train and eval).")
            n_eval = min(cfg.eval_size, len(rows) // 2)
            train_rows = rows.select(range(len(rows) - n_eval))
            eval_rows = rows.select(range(len(rows) - n_eval, len(rows)))
    except (ConnectionError, OSError) as e:
        raise SystemExit(f"error: --dataset {cfg.dataset!r} could not be loaded ({type(e).__name__}: {str(e)[:200]}). "
                         "Offline? Download it first, or pass a local .jsonl file.")
    columns = [c for c in (cfg.prompt_column, cfg.answer_column) if c]
    missing = [c for c in columns if c not in train_rows.column_names]
    if missing:
        flags = " / ".join(f"--{'prompt' if c == cfg.prompt_column else 'answer'}_column {c!r}" for c in missing)
        raise SystemExit(f"error: --dataset {cfg.dataset!r} has no column {flags}; "
                         f"its columns are {train_rows.column_names}.")
    first_eval_row = 1 if cfg.dataset == "gsm8k" else len(train_rows) + 1  # a file's held-out rows are its last
    return [(train_rows, "train", 1), (eval_rows, "test" if cfg.dataset == "gsm8k" else "eval", first_eval_row)]


def is_conversation(prompt):
    """A prompt in TRL's conversational format: a list of {"role": ..., "content": ...} messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def math_examples(rows, cfg, tokenizer, split, first_row=1):
    """The examples of a real dataset's rows, each checked first: its prompt is text that is not empty (or a
    conversation, for a tokenizer with a chat template), and its answer one that --answer_check can read. A row
    that fails is an error naming it (`first_row`: the number of rows[0] in the file or split, counting from 1)."""
    examples, too_long, chat = [], 0, uses_chat(cfg, tokenizer)
    for number, row in enumerate(rows, first_row):
        where = row_name(cfg, split, number)
        question, prompt = row_prompt(row[cfg.prompt_column], cfg, tokenizer, chat, where)
        answer = read_answer(row[cfg.answer_column], cfg.answer_check, where, cfg) if cfg.answer_column else None
        example = real_example(cfg, tokenizer, row, question, prompt, answer)
        if example is None:
            too_long += 1
        else:
            examples.append(example)
    warn_too_long(cfg, split, too_long)
    if not examples:
        raise SystemExit(f"error: no usable {split} prompts in --dataset {cfg.dataset!r} (all longer than "
                         "--max_prompt_length).")
    return examples


def uses_chat(cfg, tokenizer):
    return cfg.use_chat_template and tokenizer is not None and bool(tokenizer.chat_template)


def row_name(cfg, split, number):
    return f"--dataset {cfg.dataset!r}" + (f" ({split} split)" if cfg.dataset == "gsm8k" else "") + f" row {number}"


def row_prompt(question, cfg, tokenizer, chat, where):
    """(the prompt as reward functions receive it, the prompt as the policy reads it) of a row's --prompt_column: a
    conversation in the chat template; text, stripped, in the chat template (`chat`) or after --system_prompt. Any
    other prompt is an error naming the row (`where`)."""
    system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    if is_conversation(question):
        if not chat:
            raise SystemExit(f"error: {where}: --prompt_column {cfg.prompt_column!r} holds chat messages, which "
                             "need a chat template: give a --model_name_or_path whose tokenizer has one (and "
                             "--use_chat_template True), or prompts as text.")
        if question[0]["role"] == "system":
            system = []
        return question, tokenizer.apply_chat_template(system + question, tokenize=False, add_generation_prompt=True)
    if not isinstance(question, str) or not question.strip():
        held = "empty text" if isinstance(question, str) else f"{question!r:.100}"
        raise SystemExit(f"error: {where}: --prompt_column {cfg.prompt_column!r} holds {held}; every prompt must "
                         "be text, or a list of {'role': ..., 'content': ...} messages.")
    question = question.strip()
    if chat:
        return question, tokenizer.apply_chat_template(system + [{"role": "user", "content": question}],
                                                       tokenize=False, add_generation_prompt=True)
    return question, f"{cfg.system_prompt}\n\n{question}" if cfg.system_prompt else question


def real_example(cfg, tokenizer, row, question, prompt, answer):
    """A row's example; None when its prompt is longer than --max_prompt_length tokens (it is dropped)."""
    n_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 0
    return None if n_tokens > cfg.max_prompt_length else {"prompt": prompt, "raw_prompt": question, "answer": answer,
                                                          "family": "all", "check": cfg.answer_check, "row": dict(row)}


def warn_too_long(cfg, split, too_long):
    if too_long:
        print(f"warning: dropped {too_long} {split} prompts longer than --max_prompt_length "
              f"{cfg.max_prompt_length} tokens", flush=True)


def answer_value(value, where, cfg):
    """A row's answer, which must be text or a number (what an --answer_check reads), else an error naming the row."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SystemExit(f"error: {where}: --answer_column {cfg.answer_column!r} holds {value!r:.100}, not text or a "
                         f"number, which no --answer_check reads. Fill in or remove the row, or give {NO_ANSWERS}.")
    return value


def read_answer(value, check, where, cfg):
    """A row's answer as the check compares it: the final number ('number', e.g. '#### 1,234' -> '1234') or the
    stripped text ('exact'). An answer the check cannot read is an error naming the row, whose advice is one
    that works: another check only where the other check would read it."""
    value = str(answer_value(value, where, cfg))
    answer = extract_final_number(value) if check == "number" else value.strip()
    if answer:
        return answer
    problem = f"holds {value[:100]!r}, in which --answer_check {check} finds " + \
        ("no number" if check == "number" else "no text")
    advice = f"Give --answer_check exact (the completion must equal the answer), or {NO_ANSWERS}" \
        if check == "number" and value.strip() else f"Fill in or remove the row, or give {NO_ANSWERS}"
    raise SystemExit(f"error: {where}: --answer_column {cfg.answer_column!r} {problem}. {advice}.")


def is_correct(completion, answer, check="exact"):
    """`check`: 'exact' (the stripped text) or 'number' (the final number)."""
    if answer is None:
        return False
    if check == "number":
        return extract_final_number(completion) == answer
    return completion.strip() == answer


def compute_rewards(examples, completions, reward_scales="uniform"):
    """Rule-based reward. Returns (rewards, correct) as float tensors (B,)."""
    correct = [is_correct(c, ex["answer"], ex.get("check", "exact")) for c, ex in zip(completions, examples)]
    return scaled_rewards(examples, correct, reward_scales)


def scaled_rewards(examples, correct, reward_scales):
    """(rewards, correct) of each completion's correctness: 1 or 0, or under --reward_scales hetero its family's."""
    correct = torch.tensor(correct, dtype=torch.float32)
    if reward_scales == "uniform":
        return correct.clone(), correct
    lo_hi = torch.tensor([HETERO_SCALES.get(ex["family"], (0.0, 1.0)) for ex in examples])
    return lo_hi[:, 0] + (lo_hi[:, 1] - lo_hi[:, 0]) * correct, correct


# ----------------------------------------------------------------------------------------
# The reward: the rule reward plus the --reward_fn functions (how those are called: support/reward_functions.py)
# ----------------------------------------------------------------------------------------
def make_reward_fn(cfg, accelerator):
    """reward_fn(examples, completions) -> (rewards, correct, stats) on the accelerator's device: the rule reward plus
    each --reward_fn function's values (None counts 0); stats holds each function's mean over the rows it scored, as
    train/reward/<name>. A reward that raises, or a value that is not a finite number, stops every rank before any
    update, naming what and where (`score`: the values and the error in this process; then every rank agrees)."""
    functions = [(spec.rpartition(":")[2], config.reward_function(spec), 1.0) for spec in cfg.reward_fn]
    if functions:
        reward_functions.trainer_state().max_steps = cfg.num_steps
    device = accelerator.device

    def score(examples, completions):
        try:
            rewards, correct = (t.to(device) for t in compute_rewards(examples, completions, cfg.reward_scales))
        except Exception as e:  # a reward that raises: say on what, and apply nothing
            return reward_raised(e, examples, completions, device)
        stats = {}
        for name, function, weight in functions:
            kwargs = reward_functions.reward_kwargs(cfg, examples, completions)
            rewards, error = add_reward(name, function, weight, kwargs, rewards, stats)
            if error is not None:
                return rewards, correct, stats, error
        return rewards, correct, stats, non_finite(rewards, examples, completions)

    def reward_fn(examples, completions):
        rewards, correct, stats, error = score(examples, completions)
        stop_on_reward_error(accelerator, error)
        return rewards, correct, stats

    return reward_fn


def reward_raised(e, examples, completions, device):
    """score's answer when the reward raised e: zeros, and the line that says on what (nothing is applied)."""
    zeros = torch.zeros(len(completions), device=device)
    return zeros, zeros, {}, (f"error: the reward raised {type(e).__name__}: {e} (first prompt "
                              f"{examples[0]['prompt'][:200]!r}, completion {completions[0][:200]!r}); step not "
                              "applied.")


def add_reward(name, function, weight, kwargs, rewards, stats):
    """(rewards + weight x the function's values on the batch (None counts 0), error): its mean over the rows it
    scored goes in stats as train/reward/<name>; error: the line that names it (rewards unchanged), or None."""
    values, error = reward_functions.call_reward_function(name, function, kwargs)
    if error is None:
        scored = [v for v in values if v is not None]
        rewards = rewards + weight * torch.tensor([0.0 if v is None else v for v in values], device=rewards.device)
        stats[f"train/reward/{name}"] = sum(scored) / len(scored) if scored else float("nan")
    return rewards, error


def non_finite(rewards, examples, completions):
    """The line to stop with for the first reward that is not a finite number, or None."""
    bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
    if not bad:
        return None
    i = bad[0]
    return (f"error: non-finite reward {rewards[i].item()} for prompt {examples[i]['prompt'][:200]!r} and "
            f"completion {completions[i][:200]!r}; step not applied. Check --reward_model and the rule "
            "reward's weight.")


def stop_on_reward_error(accelerator, error):
    """Every rank stops if one has an error, agreed by one all-reduce (a rank that stopped alone would leave the
    others waiting in their next collective); the ranks with an error print it, the others exit with 1."""
    failed = accelerator.reduce(torch.tensor(float(error is not None), device=accelerator.device), reduction="sum")
    if failed.item():
        raise SystemExit(error or 1)


# ----------------------------------------------------------------------------------------
# Prompts, held-out evaluation, token ids and text
# ----------------------------------------------------------------------------------------
class PromptSampler:
    """Endless shuffled batches of examples; each rank draws from its own shard."""

    def __init__(self, examples, batch_size, seed, rank=0, world_size=1):
        self.examples, self.batch_size = examples[rank::world_size], batch_size
        self.rng, self.order = random.Random(seed), []

    def state_dict(self):
        return {"rng": repr(self.rng.getstate()), "order": self.order}

    def load_state_dict(self, state):
        self.rng.setstate(ast.literal_eval(state["rng"]))
        self.order = list(state["order"])

    def next(self):
        batch = []
        while len(batch) < self.batch_size:
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch


@torch.no_grad()
def evaluate(model, tokenizer, examples, cfg, accelerator, batch_size=256, generate=None):
    """Held-out greedy accuracy per family and overall, sharded over ranks and summed (`generate`: models.generate by
    default, or the plain common.generate it equals)."""
    generate, unwrapped, counted = generate or models.generate, accelerator.unwrap_model(model), []
    for batch in eval_batches(examples, accelerator, batch_size):
        texts = greedy_texts(unwrapped, tokenizer, batch, cfg, accelerator.device, generate)
        counted += [(ex["family"], is_correct(text, ex["answer"], ex.get("check", "exact")), 1)
                    for text, ex in zip(texts, batch)]
    families, (correct, total) = summed_per_family(examples, counted, 2, accelerator)
    return accuracy_metrics(families, correct, total)


def greedy_texts(model, tokenizer, examples, cfg, device, generate):
    """The greedy completion of each example's prompt (decode_completions)."""
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [ex["prompt"] for ex in examples], device)
    completion_ids = generate(model, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
    return decode_completions(tokenizer, completion_ids, common.completion_mask(completion_ids, tokenizer.eos_token_id))


def eval_batches(examples, accelerator, batch_size):
    """This rank's shard of the examples in batches of at most batch_size, as many on every rank (under ZeRO-3 each
    generate call is a collective)."""
    shard = examples[accelerator.process_index::accelerator.num_processes]
    num_calls = math.ceil(math.ceil(len(examples) / accelerator.num_processes) / batch_size)
    return [shard[i::num_calls] for i in range(num_calls)]


def summed_per_family(examples, counted, width, accelerator):
    """(the examples' families, sorted; per count, its sums per family over the ranks) of this rank's rows (family,
    `width` counts), added up in Python (no device op per row), then over the ranks by one all-reduce."""
    families = sorted({ex["family"] for ex in examples})
    counts = [[0] * width for _ in families]
    for family, *values in counted:
        for k, value in enumerate(values):
            counts[families.index(family)][k] += value
    counts = torch.tensor(counts, dtype=torch.float32, device=accelerator.device).T  # (width, families)
    return families, accelerator.reduce(counts, reduction="sum").tolist()


def accuracy_metrics(families, correct, total):
    metrics = {"eval/accuracy": sum(correct) / sum(total)}
    for j, fam in enumerate(families):
        metrics[f"eval/acc_{fam}"] = correct[j] / max(total[j], 1)
    return metrics


def tokenize_prompts(tokenizer, prompts, device):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def decode_completions(tokenizer, completion_ids, mask):
    """The text of each completion's tokens where mask is 1, with those tokens (as Python lists: one batched
    decode, no tensor op per row)."""
    kept = [[t for t, m in zip(ids, row_mask) if m] for ids, row_mask in zip(completion_ids.tolist(), mask.tolist())]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    return [reward_functions.Completion(text, ids) for text, ids in zip(texts, kept)]
