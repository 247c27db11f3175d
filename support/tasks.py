"""Tasks and rewards: the built-in arithmetic task, real data (GSM8K or a local file) with its rule reward
(--answer_check math: support/math_answers.py), an optional reward model (support/reward_model.py), the reward that
adds the --reward_fn functions to them (how those are called: support/reward_functions.py), the prompt sampler,
held-out evaluation, and prompts to token ids and completions back to text."""
import ast
import hashlib
import math
import random
import re

import torch

import common
from support import config, environments, fast, reward_functions, user_files

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
# reward for (wrong, right) per family under --reward_scales hetero: one offset and scale per
# family, as a learned reward model puts different prompt kinds on different scales.
# Same gap (1) between right and wrong everywhere, offsets from -5 to +5: a baseline removes the
# offsets exactly; plain REINFORCE pushes up whatever it samples on the positive families and
# down on the negative ones. All within ReMax's advantage clip of 5.
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


def arithmetic_examples(n, seed, held_out, tools=False):
    """n examples, families in turn, all from the held-out split or all from the train split (`tools`: those of
    --dataset tool_arithmetic)."""
    rng, examples, families = random.Random(seed), [], list(TOOL_FAMILIES if tools else FAMILIES)
    example = tool_arithmetic_example if tools else arithmetic_example
    while len(examples) < n:
        ex = example(families[len(examples) % len(families)], rng)
        if is_held_out(ex["prompt"]) == held_out:
            examples.append(ex)
    return examples


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


def final_answer(episode_text):
    """The final answer of an episode: the text after the last `</result>` (the model's last turn), or the whole
    text when it called no tool. '<tool>3*4</tool><result>12</result>12' -> '12'."""
    return episode_text.rpartition("</result>")[2]


# ----------------------------------------------------------------------------------------
# Real data (GSM8K or a local file) and the math reward
# ----------------------------------------------------------------------------------------
# never from a comma: `-?[\d,]*\.?\d+` tried a run of commas from each of them, in time quadratic in its length
NUMBER = r"-?(?:\d[\d,]*)?\.?\d+"


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


def math_answers():
    """support/math_answers.py, loaded only when a flag asks for it (--answer_check math, --prompt_template r1_zero,
    --format_reward_weight)."""
    from support import math_answers

    return math_answers


def load_task(cfg, tokenizer=None):
    """(train examples, held-out eval examples). Every example: prompt (as fed to the policy), answer,
    family and, for real data, raw_prompt (the dataset's prompt: text, or a conversation's messages), check
    (--answer_check) and row (the dataset row, whose columns reward functions receive). An arithmetic example
    is its own row; a tool_arithmetic one also holds check 'final_answer' (an episode's final answer, see
    is_correct). The --reward_fn functions are tried on the first train rows before this returns."""
    if cfg.dataset in ("arithmetic", "tool_arithmetic"):
        tools = cfg.dataset == "tool_arithmetic"
        train, held_out = arithmetic_examples(20_000, seed=cfg.seed, held_out=False, tools=tools), \
            arithmetic_examples(250, seed=1234, held_out=True, tools=tools)
    else:
        train, held_out = load_rows(cfg, tokenizer)
    train = train[:cfg.train_size or len(train)]  # --train_size: a small pool, each prompt visited again and again
    reward_functions.check_reward_functions(cfg, train, tokenizer)
    return train, held_out


def load_rows(cfg, tokenizer):
    """(train, eval) examples of gsm8k or a local file, each row checked (math_examples)."""
    import datasets

    try:
        if cfg.dataset == "gsm8k":
            splits = datasets.load_dataset("openai/gsm8k", "main")
            train_rows = splits["train"]
            eval_rows = splits["test"].select(range(min(cfg.eval_size, len(splits["test"]))))
        else:
            kind = "parquet" if cfg.dataset.endswith(".parquet") else "json"
            if cfg.dataset.endswith(".jsonl"):
                user_files.check_json_lines(cfg.dataset)
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
    return [math_examples(train_rows, cfg, tokenizer, "train"),
            math_examples(eval_rows, cfg, tokenizer, "test" if cfg.dataset == "gsm8k" else "eval", first_eval_row)]


def is_conversation(prompt):
    """A prompt in TRL's conversational format: a list of {"role": ..., "content": ...} messages."""
    return isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)


def math_examples(rows, cfg, tokenizer, split, first_row=1):
    """The examples of a real dataset's rows, each checked first: its prompt is text that is not empty (or a
    conversation, for a tokenizer with a chat template), and its answer one that --answer_check can read. A row
    that fails is an error naming it (`first_row`: the number of rows[0] in the file or split, counting from 1);
    under --answer_check math one whose gold answer math-verify cannot parse is left out, counted in one warning."""
    examples, too_long, unparsable = [], 0, []
    chat = cfg.use_chat_template and tokenizer is not None and bool(tokenizer.chat_template)
    for number, row in enumerate(rows, first_row):
        where = f"--dataset {cfg.dataset!r}" + (f" ({split} split)" if cfg.dataset == "gsm8k" else "") + \
            f" row {number}"
        question = row[cfg.prompt_column]
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        if is_conversation(question):
            if not chat:
                raise SystemExit(f"error: {where}: --prompt_column {cfg.prompt_column!r} holds chat messages, which "
                                 "need a chat template: give a --model_name_or_path whose tokenizer has one (and "
                                 "--use_chat_template True), or prompts as text.")
            if question[0]["role"] == "system":
                system = []
            prompt = tokenizer.apply_chat_template(system + question, tokenize=False, add_generation_prompt=True)
        elif not isinstance(question, str) or not question.strip():
            held = "empty text" if isinstance(question, str) else f"{question!r:.100}"
            raise SystemExit(f"error: {where}: --prompt_column {cfg.prompt_column!r} holds {held}; every prompt must "
                             "be text, or a list of {'role': ..., 'content': ...} messages.")
        else:
            question = prompt = question.strip()
            if cfg.prompt_template == "r1_zero":  # a base model's prompt: no chat template
                prompt = math_answers().R1_ZERO_TEMPLATE.format(question=question)
            elif chat:
                prompt = tokenizer.apply_chat_template(system + [{"role": "user", "content": question}],
                                                       tokenize=False, add_generation_prompt=True)
            elif cfg.system_prompt:
                prompt = f"{cfg.system_prompt}\n\n{question}"
        answer = read_answer(row[cfg.answer_column], cfg.answer_check, where, cfg) if cfg.answer_column else None
        if answer == "":  # --answer_check math: a gold answer math-verify cannot parse, counted and left out
            unparsable.append(number)
            continue
        n_tokens = len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) if tokenizer is not None else 0
        if n_tokens > cfg.max_prompt_length:
            too_long += 1
            continue
        examples.append({"prompt": prompt, "raw_prompt": question, "answer": answer, "family": "all",
                         "check": cfg.answer_check, "row": dict(row)})
    if too_long:
        print(f"warning: dropped {too_long} {split} prompts longer than --max_prompt_length "
              f"{cfg.max_prompt_length} tokens", flush=True)
    if unparsable:
        listed = ", ".join(map(str, unparsable[:5])) + (", ..." if len(unparsable) > 5 else "")
        print(f"warning: left out {len(unparsable)} {split} rows of --dataset {cfg.dataset!r} whose --answer_column "
              f"{cfg.answer_column!r} math-verify cannot parse (rows {listed})", flush=True)
    if not examples:
        raise SystemExit(f"error: no usable {split} prompts in --dataset {cfg.dataset!r} (all longer than "
                         f"--max_prompt_length{', or with gold answers math-verify cannot parse' * bool(unparsable)}).")
    return examples


def read_answer(value, check, where, cfg):
    """A row's answer as the check compares it: the final number ('number', e.g. '#### 1,234' -> '1234') or the
    stripped text ('exact'). An answer the check cannot read is an error naming the row, whose advice is one
    that works: another check only where the other check would read it."""
    no_answers = "--answer_column '' (no answers: a --reward_fn or --reward_model scores the completions)"
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise SystemExit(f"error: {where}: --answer_column {cfg.answer_column!r} holds {value!r:.100}, not text or a "
                         f"number, which no --answer_check reads. Fill in or remove the row, or give {no_answers}.")
    if check == "math":  # '' when unparsable: the row is counted and left out (math_examples)
        return math_answers().gold_answer(value)
    answer = extract_final_number(str(value)) if check == "number" else str(value).strip()
    if answer:
        return answer
    problem = f"holds {str(value)[:100]!r}, in which --answer_check {check} finds " + \
        ("no number" if check == "number" else "no text")
    advice = f"Give --answer_check exact (the completion must equal the answer), or {no_answers}" \
        if check == "number" and str(value).strip() else f"Fill in or remove the row, or give {no_answers}"
    raise SystemExit(f"error: {where}: --answer_column {cfg.answer_column!r} {problem}. {advice}.")


def is_correct(completion, answer, check="exact"):
    """`check`: 'exact' (the stripped text), 'number' (the final number), 'math' (equal values by math-verify) or
    'final_answer' (an episode's final answer, exactly: --dataset tool_arithmetic)."""
    if answer is None:
        return False
    if check == "number":
        return extract_final_number(completion) == answer
    if check == "math":
        return math_answers().is_equivalent(completion, answer)
    if check == "final_answer":
        completion = final_answer(completion)
    return completion.strip() == answer


def compute_rewards(examples, completions, reward_scales="uniform"):
    """Rule-based reward. Returns (rewards, correct) as float tensors (B,)."""
    correct = [is_correct(c, ex["answer"], ex.get("check", "exact")) for c, ex in zip(completions, examples)]
    correct = torch.tensor(correct, dtype=torch.float32)
    if reward_scales == "uniform":
        return correct.clone(), correct
    lo_hi = torch.tensor([HETERO_SCALES.get(ex["family"], (0.0, 1.0)) for ex in examples])
    return lo_hi[:, 0] + (lo_hi[:, 1] - lo_hi[:, 0]) * correct, correct


def make_reward_fn(cfg, accelerator):
    """reward_fn(examples, completions, scored=None, episodes=None) -> (rewards, correct, stats) on the accelerator's
    device (episodes: the multi-turn episodes, agents.Episode, which --reward_fn functions receive; by default the
    completions' own): the weighted sum of the rule reward, the reward model's score and each --reward_fn function's
    values (None counts 0); stats holds each function's mean over the rows it scored, as train/reward/<name>. A
    reward that raises, or a value that is not a finite number, stops every rank before any update, naming what and
    where. scored: the (rewards, correct, stats, error) the sampler process computed with the same function
    (--async_rollouts: rollout.rewards), not computed again; None: compute them."""
    reward_model = None
    if cfg.reward_model:  # a lab flag: its module loads only then
        from support.reward_model import RewardModel

        reward_model = RewardModel(cfg.reward_model, cfg.reward_model_dtype, accelerator, cfg.micro_batch_size)
    score = reward_scorer(cfg, accelerator.device, reward_model)

    def reward_fn(examples, completions, scored=None, episodes=None):
        rewards, correct, stats, error = score(examples, completions, episodes) if scored is None else scored
        stop_on_reward_error(accelerator, error)
        return rewards, correct, stats

    return reward_fn


def reward_scorer(cfg, device, reward_model=None):
    """score(examples, completions, episodes=None) -> (rewards, correct, stats, error): reward_fn's values in one
    process, on `device`, with no agreement between ranks; error: the line to stop with, or None. It needs no
    accelerator: the sampler process of --async_rollouts calls it too (lab/async_sampling.py)."""
    functions = [(spec.rpartition(":")[2], config.reward_function(spec)) for spec in cfg.reward_fn]
    weights = list(cfg.reward_weights or [1.0] * len(functions))
    if environments.reward_source(cfg):  # an environment's get_reward (TRL's): one more function, of weight 1
        functions, weights = functions + [environments.reward_source(cfg)], weights + [1.0]
    if functions:
        reward_functions.trainer_state().max_steps = cfg.num_steps

    def score(examples, completions, episodes=None):
        if episodes is None and isinstance(completions[0], reward_functions.Completion) and completions[0].episode:
            episodes = [completion.episode for completion in completions]  # sampled episodes carry theirs
        prompts = [ex.get("raw_prompt", ex["prompt"]) for ex in examples]
        stats, error = {}, None
        try:
            rewards, correct = compute_rewards(examples, completions, cfg.reward_scales)
            rewards, correct = cfg.rule_reward_weight * rewards.to(device), correct.to(device)
            if reward_model is not None:
                rewards = rewards + cfg.reward_model_weight * reward_model(prompts, completions)
            if cfg.answer_check == "math" or cfg.format_reward_weight:  # R1's reward terms, each logged
                rewards, stats = math_answers().add_format_reward(cfg, rewards, correct, completions)
        except Exception as e:  # a reward that raises: say on what, and apply nothing
            rewards = correct = torch.zeros(len(completions), device=device)
            error = (f"error: the reward raised {type(e).__name__}: {e} (first prompt {examples[0]['prompt'][:200]!r}, "
                     f"completion {completions[0][:200]!r}); step not applied.")
        for (name, function), weight in zip(functions, weights):
            if error is not None:
                break
            kwargs = reward_functions.reward_kwargs(cfg, examples, completions, episodes)
            values, error = reward_functions.call_reward_function(name, function, kwargs)
            if error is None:
                scored = [v for v in values if v is not None]
                rewards = rewards + weight * torch.tensor([0.0 if v is None else v for v in values], device=device)
                stats[f"train/reward/{name}"] = sum(scored) / len(scored) if scored else float("nan")
        bad = (~torch.isfinite(rewards)).nonzero().flatten().tolist()
        if bad and error is None:
            i = bad[0]
            error = (f"error: non-finite reward {rewards[i].item()} for prompt {examples[i]['prompt'][:200]!r} and "
                     f"completion {completions[i][:200]!r}; step not applied. Check --reward_model and the rule "
                     "reward's weight.")
        return rewards, correct, stats, error

    return score


def stop_on_reward_error(accelerator, error):
    """Every rank stops if one has an error, agreed by one all-reduce (a rank that stopped alone would leave the
    others waiting in their next collective); the ranks with an error print it, the others exit with 1."""
    failed = accelerator.reduce(torch.tensor(float(error is not None), device=accelerator.device), reduction="sum")
    if failed.item():
        raise SystemExit(error or 1)


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

    def sample_with(self, independent):
        """The rollouts' sample function: `independent` itself (fast.generate or common.generate), each prompt's
        completions sampled on their own (budget.BudgetSampler's may sample them as a tree)."""
        return independent


@torch.no_grad()
def evaluate(model, tokenizer, examples, cfg, accelerator, batch_size=256, generate=None, play=None):
    """Held-out greedy accuracy per family and overall, sharded over ranks and summed (`generate`:
    fast.generate by default, or the plain common.generate it equals; `play`: sampling.play's greedy episodes,
    with eval/tool_calls, the tool calls per episode, overall and per family)."""
    generate = generate or fast.generate
    shard = examples[accelerator.process_index::accelerator.num_processes]
    families = sorted({ex["family"] for ex in examples})
    counts = [[0, 0, 0] for _ in families]  # (correct, total, tool calls) per family, in Python: no device op each
    unwrapped = accelerator.unwrap_model(model)
    # as many generate calls on every rank (under ZeRO-3 each is a collective), each at most batch_size prompts
    num_calls = math.ceil(math.ceil(len(examples) / accelerator.num_processes) / batch_size)
    for batch in (shard[i::num_calls] for i in range(num_calls)):
        episodes = [None] * len(batch)
        if play is None:
            prompt_ids, prompt_mask = tokenize_prompts(tokenizer, [ex["prompt"] for ex in batch], accelerator.device)
            completion_ids = generate(unwrapped, tokenizer, prompt_ids, prompt_mask, cfg, greedy=True)
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
        else:
            _, _, completion_ids, _, mask, episodes = play(unwrapped, tokenizer, examples=batch)
        texts = decode_completions(tokenizer, completion_ids, mask)
        for text, ex, episode in zip(texts, batch, episodes):
            j = families.index(ex["family"])
            counts[j][0] += is_correct(text, ex["answer"], ex.get("check", "exact"))
            counts[j][1] += 1
            counts[j][2] += 0 if episode is None else len(episode.tool_calls)
    counts = torch.tensor(counts, dtype=torch.float32, device=accelerator.device).T  # (3, families)
    correct, total, calls = accelerator.reduce(counts, reduction="sum").tolist()
    metrics = {"eval/accuracy": sum(correct) / sum(total)}
    for j, fam in enumerate(families):
        metrics[f"eval/acc_{fam}"] = correct[j] / max(total[j], 1)
    if play is not None:
        metrics["eval/tool_calls"] = sum(calls) / sum(total)
        metrics.update({f"eval/tool_calls_{fam}": calls[j] / max(total[j], 1) for j, fam in enumerate(families)})
    return metrics


def tokenize_prompts(tokenizer, prompts, device):
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


def decode_completions(tokenizer, completion_ids, mask, episodes=None):
    """The text of each completion's tokens where mask is 1, with those tokens (as Python lists: one batched
    decode, no tensor op per row) and its agents.Episode (episodes: one per row, or None)."""
    kept = [[t for t, m in zip(ids, row_mask) if m] for ids, row_mask in zip(completion_ids.tolist(), mask.tolist())]
    texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
    return [reward_functions.Completion(text, ids, None if episodes is None else episodes[i])
            for i, (text, ids) in enumerate(zip(texts, kept))]
