"""Episodes (agents.py): the action mask, the plain episode loop and its cached one, CachedTurns (equal: the same
draws, the same tokens), the single turn as the special case of an episode, the loss's gradient on the model's
tokens only, and PPO's GAE over actions with the environment's tokens between them.

The environment here is a toy that needs no tool file: a turn that ends with "=" calls it, and its reply is the
value of the turn's expression (or "0"). A randomly initialised model writes "=" often, so its episodes run to
several turns, cut by the turn and token budgets.
"""
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import agents
import common
from support import config, models

PROMPTS = ["12+3=", "7*8=", "123+45=", "9-2=", "5+5=", "60-7="]


@dataclass
class Call:
    name: str
    arguments: dict
    error: str = None


@dataclass
class Result:
    text: str
    error: bool
    cut: bool = False


class Toy:
    """The per-episode handle of a toy environment: evaluates the expression before "=" (lab/environments.py's
    interface)."""
    instance, cut = None, False

    def call(self, call):
        try:
            return Result(str(eval(call.arguments["expression"], {}))[:3], False)
        except Exception:
            return Result("0", True)


class ToySpec:
    def __init__(self, tokenizer, stop="="):
        self.tokenizer, self.stop_ids = tokenizer, [tokenizer.convert_tokens_to_ids(stop)] if stop else []

    def episode(self, example):
        return Toy()

    def prompt_text(self, example, env):
        return example["prompt"]

    def parse(self, text):
        return [Call("calc", {"expression": text[:-1]})] if text.endswith("=") else []

    def observation_ids(self, results):
        return self.tokenizer("+" + results[0].text + "*", add_special_tokens=False)["input_ids"]


@dataclass
class Sampling:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 24
    generation_batch_size: int = 0


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.EMBEDDED_MODEL)).eval()


def prompts(tokenizer, names=PROMPTS):
    enc = tokenizer(names, return_tensors="pt", padding=True, add_special_tokens=False)
    return [{"prompt": p} for p in names], enc["input_ids"], enc["attention_mask"]


def play(model, tokenizer, spec, cfg, plain, max_turns=4, seed=5, greedy=False):
    """(completion_ids, mask, token_mask, episodes) of one episode per prompt."""
    sample_turn = (agents.sample_turn_plain if plain else agents.CachedTurns)(model, tokenizer, cfg, spec.stop_ids,
                                                                             greedy)
    torch.manual_seed(seed)
    prompt_ids, _, *played = agents.play_episodes(sample_turn, spec, tokenizer, prompts(tokenizer)[0],
                                                  cfg.max_new_tokens, max_turns)
    assert torch.equal(prompt_ids, prompts(tokenizer)[1])
    return played


def test_episode_masks_lay_out_segments_one_after_the_other():
    lengths = torch.tensor([[3, 4, 2], [2, 0, 0], [1, 1, 5]])
    is_action = torch.tensor([[True, False, True], [True, False, False], [False, True, True]])
    mask, token_mask = agents.episode_masks(lengths, is_action, 8)
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0]]
    assert token_mask.tolist() == [[1] * 8, [1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_k=6, top_p=0.9)],
                         ids=["plain-sampler", "top-k-top-p"])
def test_cached_turns_give_the_plain_loops_draws_and_tokens(tokenizer, random_model, sampling):
    plain = play(random_model, tokenizer, ToySpec(tokenizer), sampling, plain=True)
    cached = play(random_model, tokenizer, ToySpec(tokenizer), sampling, plain=False)
    for a, b in zip(plain[:3], cached[:3]):
        assert torch.equal(a, b)
    turns = [e.num_turns for e in plain[3]]
    assert max(turns) >= 3 and min(turns) < max(turns)  # several turns, and episodes of different lengths
    assert any(e.truncated for e in plain[3])
    assert [e.tool_calls for e in plain[3]] == [e.tool_calls for e in cached[3]]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.7, top_k=6, top_p=0.9)],
                         ids=["plain-sampler", "top-k-top-p"])
def test_cached_turns_keep_the_log_probs_of_the_actions_as_drawn(tokenizer, random_model, sampling):
    """CachedTurns(logprobs=True), the behaviour log-probs of episodes in the sampler process: the same draws as
    without, and at every action the log-prob that scoring the whole episode gives it (the environment's tokens in
    the context, the same temperature, top-k, top-p), to 1e-5; 0 at the environment's tokens and the padding."""
    spec = ToySpec(tokenizer)
    sample_turn = agents.CachedTurns(random_model, tokenizer, sampling, spec.stop_ids, logprobs=True)
    torch.manual_seed(5)
    prompt_ids, prompt_mask, ids, mask, token_mask, episodes = agents.play_episodes(
        sample_turn, spec, tokenizer, prompts(tokenizer)[0], sampling.max_new_tokens, 4)
    assert [torch.equal(a, b) for a, b in zip((ids, mask, token_mask), play(random_model, tokenizer, spec, sampling,
                                                                              plain=False)[:3])] == [True] * 3
    logp = sample_turn.drawn_logprobs(mask)
    assert any(e.truncated for e in episodes) and (token_mask - mask).sum() > 0  # cut turns, replies in context
    scored = models.token_logprobs(random_model, torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, token_mask], 1),
                                 ids.shape[1], sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    torch.testing.assert_close(logp[mask.bool()], scored[mask.bool()], rtol=0, atol=1e-5)
    assert (logp[~mask.bool()] == 0).all()


def test_the_ids_are_the_sampled_and_inserted_ones_and_the_mask_marks_the_models(tokenizer, random_model):
    ids, mask, token_mask, episodes = play(random_model, tokenizer, ToySpec(tokenizer), Sampling(), plain=False)
    spec = ToySpec(tokenizer)
    for row, episode in enumerate(episodes):
        inserted = [t for t, m, k in zip(ids[row].tolist(), mask[row].tolist(), token_mask[row].tolist())
                    if k and not m]
        replies = [spec.observation_ids([Result(c["result"], c["error"])]) for c in episode.tool_calls]
        read = len([turn for turn in episode.turns if turn["role"] == "tool"])  # a cut episode reads no last reply
        assert inserted == [t for reply in replies[:read] for t in reply]
        assert int(token_mask[row].sum()) <= Sampling.max_new_tokens


def test_an_episode_of_one_turn_is_todays_completion(tokenizer):
    """No tool call: the episode is the single-turn completion, the same ids, the same mask, whatever the path."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    cfg = Sampling(max_new_tokens=8)
    spec = ToySpec(tokenizer, stop=None)  # the arithmetic model never ends a turn with a call: one turn each
    _, prompt_ids, prompt_mask = prompts(tokenizer)
    torch.manual_seed(5)
    single = models.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=1)
    for plain in (True, False):
        ids, mask, token_mask, episodes = play(model, tokenizer, spec, cfg, plain=plain, max_turns=1)
        assert torch.equal(ids, single)
        assert torch.equal(mask, common.completion_mask(single, tokenizer.eos_token_id))
        assert torch.equal(token_mask, mask)


def test_the_loss_has_gradient_at_every_model_token_and_at_no_environment_token(tokenizer, random_model):
    """The action mask in the losses: the log-probs of an episode's environment tokens get no gradient, every
    model token's does (non-zero advantages), for each aggregation."""
    import grpo

    ids, mask, token_mask, _ = play(random_model, tokenizer, ToySpec(tokenizer), Sampling(), plain=False)
    _, prompt_ids, prompt_mask = prompts(tokenizer)
    assert (token_mask - mask).sum() > 0
    input_ids, attention_mask = torch.cat([prompt_ids, ids], 1), torch.cat([prompt_mask, token_mask], 1)
    logp = models.token_logprobs(random_model, input_ids, attention_mask, ids.shape[1]).detach().requires_grad_()
    adv = torch.linspace(-1, 1, len(ids)) + 0.05
    for mode in common.LOSS_AGG_MODES:
        logp.grad = None
        loss, _ = grpo.grpo_loss(logp, logp.detach() + 0.01, logp.detach() - 0.02, adv, mask, common.Clip(0.2, 0.2), 0.04,
                                 common.Aggregation(mode))
        loss.backward()
        assert (logp.grad[mask == 0] == 0).all(), mode
        assert (logp.grad[mask == 1] != 0).all(), mode


def test_gae_over_actions_skips_the_environments_tokens():
    """GAE on an episode's tokens with the environment's between them equals GAE on its actions alone, laid end to
    end: the environment's tokens are neither steps nor rewards."""
    import ppo

    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 1, 0], [1, 0, 1, 0, 1, 0, 0, 0]])
    rewards, values = torch.randn(2, 8), torch.randn(2, 8)
    adv, returns = ppo.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    for row in range(2):
        acts = mask[row].bool()
        n = int(acts.sum())
        a, r = ppo.gae(rewards[row, acts][None], values[row, acts][None], torch.ones(1, n), gamma=0.9, lam=0.8)
        assert torch.allclose(adv[row, acts], a[0], atol=1e-6) and torch.allclose(returns[row, acts], r[0], atol=1e-6)
        assert (adv[row, ~acts] == 0).all()
    assert ppo.last_action(mask).tolist() == [6, 4]


# ---- the loops, end to end ----------------------------------------------------------------------------------
def run_scripts(runs, tmp_path, jobs=2, steps=2):
    """Run {name: [script, flags...]} for `steps` steps as subprocesses, `jobs` at a time; return {name: (stdout,
    metrics rows)}."""
    import subprocess
    import sys

    from conftest import ROOT
    from support.run import read_metrics

    out, todo, running = {}, list(runs.items()), []
    while todo or running:
        while todo and len(running) < jobs:
            name, (script, *flags) = todo.pop(0)
            cmd = [sys.executable, script, "--num_steps", str(steps), "--eval_every", str(steps), "--log_rollouts", "0",
                   "--save_model", "False", "--output_dir", str(tmp_path / name), *flags]
            running.append((name, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                   text=True)))
        name, proc = running.pop(0)
        stdout, stderr = proc.communicate()
        assert proc.returncode == 0, f"{name}: {stderr[-3000:]}"
        out[name] = (stdout, read_metrics(tmp_path / name / "metrics.jsonl"))
    return out


def test_a_run_of_one_turn_episodes_is_todays_run(tmp_path):
    """The arithmetic model never writes a call: with a tool and --max_turns 1 every episode is the single
    completion of today's run, and every metric the two runs share is the same."""
    runs = run_scripts({"single": ["lab/grpo.py"], "episodes": ["lab/grpo.py", "--tools", "examples/agents.py:calculate",
                                                            "--max_turns", "1"]}, tmp_path, steps=1)
    (_, single), (_, episodes) = runs["single"], runs["episodes"]
    assert len(single) == len(episodes) == 2
    for a, b in zip(single, episodes):
        shared = [k for k in a if not k.startswith("time/")]
        assert all(abs(a[k] - b[k]) <= 1e-6 for k in shared), [(k, a[k], b[k]) for k in shared if a[k] != b[k]]
    assert episodes[1]["train/turns"] == 1 and episodes[1]["train/env_token_frac"] == 0


def test_every_loop_trains_on_calculator_episodes_and_trls_shapes_train_unchanged(tmp_path):
    """All five loops on the agent model: three with --environment calculator, GRPO with a TRL-style class and a
    reward reading its instances and with TRL's documented IncrementEnv (its get_reward a reward), RLOO with a plain
    tool function, the last three with the default budget (examples/agents.py's commands). Each runs, its episodes
    call the tool and read its replies, the logs show them."""
    from test_environments import TRL_INCREMENT_ENV

    (tmp_path / "increment.py").write_text(TRL_INCREMENT_ENV)
    agent = ["--model_name_or_path", "embedded_model/agent", "--dataset", "tool_arithmetic"]
    small, group = ["--batch_size", "16"], ["--num_generations", "4"]
    runs = {"dapo": ["lab/dapo.py", "--environment", "calculator", *small, *group],
            "remax": ["lab/remax.py", "--environment", "calculator", *small],
            "ppo": ["lab/ppo.py", "--environment", "calculator", *small, "--num_epochs", "1", "--num_mini_batches", "1"],
            "trl_class": ["lab/grpo.py", "--environment", "examples/agents.py:Calculator", "--reward_fn",
                          "examples/agents.py:call_cost", *agent, *small, *group],
            "trl_tools": ["lab/rloo.py", "--tools", "examples/agents.py:calculate", *agent, *small, *group],
            "trl_increment": ["lab/grpo.py", "--environment", f"{tmp_path}/increment.py:IncrementEnv", *agent,
                              "--batch_size", "8", *group, "--eval_size", "8"]}
    outputs = run_scripts(runs, tmp_path, steps=1)
    # the printed samples show the whole episode (two random ones per run: some of them called the calculator)
    assert any("<result>" in stdout for stdout, _ in outputs.values())
    for name, (stdout, rows) in outputs.items():
        train = [row for row in rows if "train/turns" in row]
        assert len(train) == 1, name
        if name == "trl_increment":  # its task is not the agent model's: it trains, rewarded by get_reward too
            assert 0 <= train[0]["train/reward/IncrementEnv"] <= 1
            continue
        assert train[0]["train/tool_calls"] > 0 and 0 < train[0]["train/env_token_frac"] < 1, name
        assert train[0]["train/turns"] > 1 and train[0]["train/truncated_frac"] < 1, name
        assert "eval/tool_calls_add_mul" in rows[0] and "eval/tool_calls_add_mul" in rows[-1], name
        if name == "trl_class":
            assert "train/reward/call_cost" in train[0]


def test_the_sampler_process_plays_the_episodes_and_rewards_them_with_their_environments(tmp_path):
    """--async_rollouts: the sampler process loads the environment, plays the episodes (a scoring pass gives their
    behaviour log-probs), rewards them with functions that read the environments' instances there, and sends their
    records. Step 1 is the synchronous run's; ReMax's greedy episodes and their rewards come from it too."""
    agent = ["--model_name_or_path", "embedded_model/agent", "--dataset", "tool_arithmetic", "--max_new_tokens", "40",
             "--batch_size", "16"]
    trl = ["lab/grpo.py", "--environment", "examples/agents.py:Calculator", "--reward_fn", "examples/agents.py:call_cost",
           *agent, "--num_generations", "4"]
    outputs = run_scripts({"sync": trl, "async": [*trl, "--async_rollouts", "1", "--num_steps", "3"],
                           "remax": ["lab/remax.py", "--environment", "calculator", "--async_rollouts", "1",
                                     "--batch_size", "16"]}, tmp_path, steps=1)
    sync, run, remax_run = ([row for row in outputs[name][1] if "train/turns" in row]
                            for name in ("sync", "async", "remax"))
    assert [row["train/staleness_max"] for row in run] == [0, 1, 1]
    for key in ("train/reward", "train/reward/call_cost", "train/loss", "train/grad_norm", "train/tool_calls",
                "train/turns", "train/env_token_frac"):
        assert run[0][key] == sync[0][key], key
    assert run[0]["train/mismatch_k3"] < 1e-10 < run[1]["train/mismatch_k3"]
    assert all(row["train/tool_calls"] > 0 for row in run)
    assert "train/greedy_reward" in remax_run[0] and remax_run[0]["train/tool_calls"] > 0


def test_two_processes_play_episodes_of_their_own_lengths_and_step_together(tmp_path):
    """Each rank's episodes end at their own turns and lengths: the ranks still agree (the same number of
    micro-batches and collectives), the rollout viewer gathers their rows, and the replicas stay identical."""
    import json
    import os
    import subprocess
    import sys

    from conftest import ROOT, free_port

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), "lab/grpo.py", "--environment", "calculator", "--num_steps", "2",
           "--eval_every", "2", "--batch_size", "16", "--num_generations", "4", "--log_rollouts", "4",
           "--output_dir", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_processes"] == 2
    a, b = summary["replica_weight_checksums"]
    assert a == b
    assert (tmp_path / "rollouts.html").exists()


def test_a_chat_models_episode_is_the_template_rendering_of_its_conversation(tmp_path):
    """With a chat template: the prompt rendered with the tools, a turn ending at the template's end of turn, its
    <tool_call> blocks run, the tool messages' tokens appended. The ids of the played episode, prompt and completion
    region, are the tokens of apply_chat_template over the whole conversation; the action mask marks the two turns."""
    from test_environments import QWEN_LIKE, char_tokenizer

    from lab import environments

    tools = tmp_path / "tools.py"
    tools.write_text('def add(a: int, b: int) -> int:\n    """Add.\n\n    Args:\n        a: One.\n        b: Two.\n    '
                     '"""\n    return a + b\n')
    tokenizer = char_tokenizer(chat_template=QWEN_LIKE)
    cfg = type("Flags", (), {"environment": "", "tools": f"{tools}:add", "tool_timeout": 5.0, "system_prompt": "",
                             "use_chat_template": True})()
    spec = environments.load(cfg, tokenizer)
    turns = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', "It is 5."]
    script = iter([tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in turns])

    def sample_turn(rows, histories, appended, max_new_tokens):  # the "model": the scripted turns
        return [next(script) for _ in rows]

    prompt_ids, prompt_mask, ids, mask, token_mask, (episode,) = agents.play_episodes(
        sample_turn, spec, tokenizer, [{"prompt": "What is 2+3?"}], 200, 4)
    conversation = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": turns[0]},
                    {"role": "tool", "content": "5"}, {"role": "assistant", "content": turns[1]}]
    whole = tokenizer.apply_chat_template(conversation, tools=spec.schemas, tokenize=False)
    played = prompt_ids[0].tolist() + ids[0][token_mask[0].bool()].tolist()
    assert played == tokenizer(whole.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    actions = [t for t, m in zip(ids[0].tolist(), mask[0].tolist()) if m]
    assert tokenizer.decode(actions) == turns[0] + "<|im_end|>" + turns[1] + "<|im_end|>"
    assert episode.num_turns == 2 and episode.tool_calls[0]["result"] == "5" and not episode.truncated


def test_a_reset_that_raises_during_the_run_stops_it_with_one_line(tmp_path):
    """The trial episode passes; a later episode's reset raises: the run stops with the environment's one line."""
    import subprocess
    import sys

    from conftest import ROOT

    (tmp_path / "env.py").write_text(
        "class Flaky:\n    made = 0\n\n    def reset(self, **row):\n        Flaky.made += 1\n"
        "        if Flaky.made > 3:\n            raise KeyError('level')\n\n"
        "    def calculate(self, expression: str) -> str:\n        \"\"\"Calculate.\n\n        Args:\n"
        "            expression: a+b\n        \"\"\"\n        return expression\n")
    out = subprocess.run([sys.executable, "lab/grpo.py", "--environment", f"{tmp_path / 'env.py'}:Flaky",
                          "--model_name_or_path", "embedded_model/agent", "--dataset", "tool_arithmetic",
                          "--num_steps", "2", "--output_dir", str(tmp_path / "run")],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --environment '{tmp_path / 'env.py'}:Flaky': reset raised KeyError: 'level'")
    assert "Traceback" not in out.stderr


def test_dapos_overlong_shaping_counts_an_episodes_environment_tokens_against_its_budget():
    """L_max = 40 (the episode's budget), L_cache = 3. An episode of 20 actions, 10 environment tokens and 10 actions
    is cut at the budget: -1, as a single-turn completion cut at 40; counting its 30 actions alone would say 0. An
    episode of 25 + 10 + 3 tokens ends at 38, one token into the last three: -1/3."""
    from dapo import overlong_penalty
    from lab.rollout import LabRollout
    lengths, is_action = torch.tensor([[20, 10, 10], [25, 10, 3]]), torch.tensor([[True, False, True]] * 2)
    mask, token_mask = agents.episode_masks(lengths, is_action, 40)
    episodes = LabRollout([{}] * 2, None, None, None, mask, [], token_mask=token_mask)
    single_turn = LabRollout([{}], None, None, None, torch.ones(1, 40), [])
    assert overlong_penalty(episodes.budget_used, 40, 3).tolist() == pytest.approx([-1.0, -1 / 3])
    assert overlong_penalty(single_turn.budget_used, 40, 3).tolist() == [-1.0]
    assert overlong_penalty(mask.sum(1), 40, 3).tolist() == [0.0, 0.0]  # the actions alone
