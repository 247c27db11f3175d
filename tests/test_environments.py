"""Tools and environments of multi-turn episodes (lab/environments.py): the schemas of typed tools, one error line
for every bad --environment / --tools, tool calls that never raise, the text and chat formats (calls parsed,
observation tokens as the policy reads them), one environment instance per episode, the built-in calculator, and
reward functions that read the episodes."""
import os
import string
import threading
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from accelerate import Accelerator

from lab import config as lab_config
from lab import environments, tasks
from lab.environments import ToolCall, ToolResult
from support import config

TOOLS = '''
import os
import re
import subprocess
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def fail(text: str) -> str:
    """Always raises.

    Args:
        text: Anything.
    """
    raise RuntimeError("broken " + text)


def slow(seconds: float) -> str:
    """Sleeps.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def untyped(a):
    """No type hint.

    Args:
        a: Anything.
    """


def undocumented(a: int) -> int:
    return a


class Counter:
    def reset(self, start=0, **kwargs):
        self.count = int(start)
        return f" (from {start})"

    def increment(self, by: int) -> int:
        """Add to the count.

        Args:
            by: How much.
        """
        self.count += by
        return self.count


class NoReset:
    def increment(self, by: int) -> int:
        """Add.

        Args:
            by: How much.
        """


class NoTools:
    def reset(self, **kwargs):
        pass


class BadReset:
    def reset(self, **kwargs):
        raise KeyError("level")

    def look(self) -> str:
        """Look around."""


def leave(how: str) -> str:
    """Leaves as it is told.

    Args:
        how: exit, interrupt, base or os_exit.
    """
    if how == "exit":
        raise SystemExit(3)
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "base":
        raise BaseException("out")
    os._exit(0)


def backtrack(n: int) -> str:
    """A regular expression that backtracks about 1.6 ** n times, holding the interpreter.

    Args:
        n: How many characters.
    """
    return str(re.match(r"(a|aa)+$", "a" * n + "!"))


def spin(n: int) -> str:
    """Never returns.

    Args:
        n: Anything.
    """
    while True:
        pass


def fork(session: bool) -> str:
    """Starts two processes that sleep, the second in a session of its own if asked, and returns their ids.

    Args:
        session: Whether the second makes a session of its own.
    """
    first = subprocess.Popen(["sleep", "60"])
    second = subprocess.Popen(["sleep", "60"], start_new_session=session)
    return f"{first.pid} {second.pid}"


def huge(n: int) -> str:
    """n characters.

    Args:
        n: How many.
    """
    return "x" * n


class Hangs:
    def reset(self, **kwargs):
        time.sleep(5)

    def look(self) -> str:
        """Look around."""


class Verbose:
    def reset(self, **kwargs):
        return "y" * 1_000_000

    def look(self) -> str:
        """Look around."""
'''


def char_tokenizer(extra_tokens=(), chat_template=None):
    """A character-level tokenizer over printable ASCII, with extra whole tokens, built here (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<pad>", "<|im_end|>", "<unk>", "<|im_start|>"]
    vocab = {token: i for i, token in enumerate(special + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>",
                                        unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.add_tokens(list(extra_tokens))
    tokenizer.chat_template = chat_template
    return tokenizer


# Qwen2.5's shape, shortened: the tools in a system turn, consecutive tool messages in one user turn
QWEN_LIKE = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools:' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TEXT_TOKENIZER = char_tokenizer(["<tool>", "</tool>", "<result>", "</result>"])


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(TOOLS)
    return str(path)


def flags(environment="", tools="", tool_timeout=5.0, use_chat_template=True, **more):
    return SimpleNamespace(**{"environment": environment, "tools": tools, "tool_timeout": tool_timeout,
                              "system_prompt": "", "use_chat_template": use_chat_template,
                              "model_name_or_path": config.EMBEDDED_MODEL, "async_rollouts": 0, "reward_model": "",
                              **more})


def load(tokenizer=TEXT_TOKENIZER, examples=({"prompt": "1+2=", "answer": "3"},), **kw):
    return environments.load(flags(**kw), tokenizer, list(examples))


def test_schema_of_a_typed_function_names_its_parameters_types_and_descriptions(tools_file):
    spec = load(tools=f"{tools_file}:add")
    assert spec.schemas == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "The first."},
                                                        "b": {"type": "integer", "description": "The second."}},
                       "required": ["a", "b"]}, "return": {"type": "integer"}}}]
    # an environment's tools are its public methods other than reset, without self
    assert [s["function"]["name"] for s in load(environment=f"{tools_file}:Counter").schemas] == ["increment"]


@pytest.mark.parametrize("flag, value, said", [
    ("tools", "missing.py:add", "no such file"),
    ("tools", "{file}:subtract", "defines no function 'subtract'"),
    ("tools", "{file}:add,untyped", "missing a type hint"),
    ("tools", "{file}:undocumented", "no docstring"),
    ("tools", "{file}:add,add", "two tools named 'add'"),
    ("environment", "{file}:Missing", "defines no class 'Missing'"),
    ("environment", "{file}:NoReset", "no reset method"),
    ("environment", "{file}:NoTools", "no public method other than reset"),
    ("environment", "{file}:BadReset", "reset raised KeyError"),
    ("environment", "calc", "give 'calculator' or FILE.py:Class"),
    ("tools", "{file}", "give FILE.py:fn1,fn2"),
])
def test_each_bad_flag_is_one_error_line_naming_it(tools_file, flag, value, said):
    value = value.format(file=tools_file)
    with pytest.raises(SystemExit) as stopped:
        load(**{flag: value})
    message = str(stopped.value.code)
    assert message.startswith(f"error: --{flag} {value!r}: ") and "\n" not in message
    assert said in message


@dataclass
class AgentTrainConfig(environments.AgentConfig, lab_config.LabConfig):
    pass


def test_agent_flags_are_checked_with_the_config_and_calculator_switches_to_the_agent_model_and_task(tools_file):
    for bad, said in [({"max_turns": 0}, "--max_turns must be >= 1"), ({"tool_timeout": 0.0}, "--tool_timeout must"),
                      ({"tools": f"{tools_file}:untyped"}, "--tools")]:
        with pytest.raises(ValueError, match=said):
            AgentTrainConfig(**bad)
    cfg = AgentTrainConfig(environment="calculator")
    assert (cfg.model_name_or_path, cfg.dataset) == (environments.AGENT_MODEL, "tool_arithmetic")
    assert AgentTrainConfig(environment="calculator", model_name_or_path="my_model").dataset == "arithmetic"
    assert AgentTrainConfig().model_name_or_path == config.EMBEDDED_MODEL  # no environment: nothing switches


def test_failed_calls_are_error_results_and_the_next_call_still_works(tools_file):
    spec = load(tools=f"{tools_file}:add,fail,slow", tool_timeout=0.3)
    env = spec.episode({"prompt": "1+2="})
    good = ToolCall("add", {"a": 2, "b": 3})
    for bad, said in [(ToolCall("fail", {"text": "x"}), "error: broken x"),
                      (ToolCall("slow", {"seconds": 3.0}), "error: slow ran past 0.3 s"),
                      (ToolCall("add", {"a": 1}), "error: add: missing a required argument: 'b'"),
                      (ToolCall("add", {"a": 1, "b": 2, "c": 3}), "error: add: got an unexpected keyword"),
                      (ToolCall("multiply", {"a": 1}), "error: unknown tool 'multiply'"),
                      (ToolCall(None, None, "malformed JSON"), "error: malformed JSON")]:
        result = env.call(bad)
        assert result.error and result.text.startswith(said), result
        assert env.call(good) == ToolResult("5", False, "add")
    assert env.call(ToolCall("slow", {"seconds": 0.0})) == ToolResult("awake", False, "slow")


def test_text_format_parses_the_shorthand_and_json_calls(tools_file):
    spec = load(environment="calculator")
    assert spec.parse("12+34=46") == [] and spec.parse("<tool>1+2") == []  # no call; an unclosed call is none
    assert spec.parse("<tool>34*5</tool>") == [ToolCall("calculate", {"expression": "34*5"})]
    assert spec.parse('a<tool>{"name": "calculate", "arguments": {"expression": "1+2"}}</tool>b<tool>7-2</tool>') == \
        [ToolCall("calculate", {"expression": "1+2"}), ToolCall("calculate", {"expression": "7-2"})]
    assert spec.parse('<tool>{"name": "calculate", "arguments": </tool>') == [ToolCall(None, None, "malformed JSON")]
    # no shorthand with two tools: the text must be a JSON call
    two = load(tools=f"{tools_file}:add,slow")
    assert two.parse('<tool>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool>') == [ToolCall("add", {"a": 1,
                                                                                                        "b": 2})]
    assert two.parse("<tool>1, 2</tool>")[0].error is not None
    # a one-parameter tool whose parameter is not text reads the shorthand as JSON
    one = load(tools=f"{tools_file}:slow")
    assert one.parse("<tool>0.5</tool>") == [ToolCall("slow", {"seconds": 0.5})]


def test_text_format_observation_ids_round_trip_and_stop_at_the_closing_tool_token():
    spec = load(environment="calculator")
    results = [ToolResult("170", False), ToolResult("error: need a+b, a-b or a*b", True)]
    ids = spec.observation_ids(results)
    assert TEXT_TOKENIZER.decode(ids) == "<result>170</result><result>error: need a+b, a-b or a*b</result>"
    assert spec.stop_ids == [TEXT_TOKENIZER.convert_tokens_to_ids("</tool>")]
    assert load(char_tokenizer(), environment="calculator").stop_ids == []  # </tool> is 7 tokens: turns end at EOS
    env = spec.episode({"prompt": "12*5="})
    assert spec.prompt_text({"prompt": "12*5="}, env) == "12*5="


def test_chat_format_sequence_equals_the_template_rendering_of_the_whole_conversation(tools_file):
    tokenizer = char_tokenizer(chat_template=QWEN_LIKE)
    spec = load(tokenizer, tools=f"{tools_file}:add,fail")
    assert spec.stop_ids == []
    example = {"prompt": "What is 2+3?"}
    env = spec.episode(example)
    turn = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' \
           '<tool_call>{"name": "fail", "arguments": {"text": "x"}}</tool_call>'
    calls = spec.parse(turn)
    assert calls == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("fail", {"text": "x"})]
    results = [env.call(call) for call in calls]
    # what the policy reads: the prompt, its sampled turn up to and including EOS, the observation
    ids = tokenizer(spec.prompt_text(example, env), add_special_tokens=False)["input_ids"] + \
        tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] + \
        spec.observation_ids(results)
    conversation = [{"role": "user", "content": example["prompt"]}, {"role": "assistant", "content": turn}] + \
        [{"role": "tool", "content": r.text} for r in results]
    whole = tokenizer.apply_chat_template(conversation, tools=spec.schemas, add_generation_prompt=True,
                                          tokenize=False)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert whole.endswith("<tool_response>\n5\n</tool_response>\n<tool_response>\nerror: broken x\n"
                          "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert spec.parse('<tool_call>{"name": add}</tool_call>') == [ToolCall(None, None, "malformed JSON")]
    assert spec.parse("<tool>1+2</tool>") == []  # the text format's calls are not the chat format's


def test_each_episode_has_its_own_instance_reset_with_its_row(tools_file):
    spec = load(environment=f"{tools_file}:Counter")
    first, second = spec.episode({"prompt": "count", "start": "10"}), spec.episode({"prompt": "count"})
    assert first.instance is not second.instance
    assert first.call(ToolCall("increment", {"by": 5})).text == "15"
    assert first.call(ToolCall("increment", {"by": 1})).text == "16"
    assert second.call(ToolCall("increment", {"by": 1})).text == "1"  # the first episode's count does not leak
    assert spec.prompt_text({"prompt": "count"}, first) == "count (from 10)"  # reset's observation, appended
    # a real dataset's example: reset receives the row's columns
    third = spec.episode({"prompt": "rendered", "row": {"question": "count", "start": 3}})
    assert third.call(ToolCall("increment", {"by": 1})).text == "4"


def test_calculator_does_one_binary_integer_operation():
    calculator = environments.Calculator()
    assert calculator.reset(prompt="2+3*4=", answer="14") is None
    assert [calculator.calculate(e) for e in ("34*5", " 12 + 30 ", "3-10", "0*7")] == ["170", "42", "-7", "0"]
    for bad in ("3+4*5", "-3+1", "2/1", "", "abc", "1234567890+1"):
        with pytest.raises(ValueError):
            calculator.calculate(bad)
    assert calculator.history[0] == ("34*5", "170")
    env = load(environment="calculator").episode({"prompt": "1+2="})
    assert env.call(ToolCall("calculate", {"expression": "3+4*5"})) == \
        ToolResult("error: need a+b, a-b or a*b", True, "calculate")


REWARD = '''
def counted(completions, environments, episodes, **kwargs):
    return [float(env.count) + len(episode.turns) for env, episode in zip(environments, episodes)]
'''


def test_reward_functions_receive_the_episodes_and_their_environments(tools_file, tmp_path):
    (tmp_path / "count_reward.py").write_text(REWARD)
    cfg = AgentTrainConfig(environment=f"{tools_file}:Counter", reward_fn=[f"{tmp_path}/count_reward.py:counted"])
    examples = [{"prompt": "count", "answer": "1", "family": "add_2x1", "start": 2},
                {"prompt": "count", "answer": "2", "family": "add_2x1", "start": 7}]
    tasks.check_reward_functions(cfg, examples, tokenizer=None)  # trial episodes: it can be called
    spec = environments.load(cfg, TEXT_TOKENIZER)
    episodes = [SimpleNamespace(env=spec.episode(ex), turns=["t"] * 3, tool_calls=[]) for ex in examples]
    episodes[1].env.call(ToolCall("increment", {"by": 1}))
    rewards, _, stats = tasks.make_reward_fn(cfg, Accelerator(cpu=True))(examples, ["1", "x"], episodes=episodes)
    assert rewards.tolist() == [1.0 + 5.0, 0.0 + 11.0]  # the rule reward plus count + turns
    assert stats["train/reward/counted"] == 8.0
    # without episodes the keywords are as before
    kwargs = tasks.reward_kwargs(cfg, examples, ["1", "x"])
    assert "episodes" not in kwargs and "environments" not in kwargs


@pytest.mark.parametrize("more, what", [({"async_rollouts": 1, "reward_model": "rm"},
                                         "--async_rollouts and --reward_model"),
                                        ({"sampler": "tree"}, "--sampler tree"),
                                        ({"model_name_or_path": "embedded_model/moe"}, "a mixture-of-experts policy")])
def test_what_episodes_do_not_run_with_is_one_line_before_any_model_loads(more, what):
    with pytest.raises(SystemExit) as exit_info:
        load(environment="calculator", **more)
    message = str(exit_info.value)
    assert message.startswith(f"error: --environment 'calculator' does not run with {what}") and "\n" not in message


def children_of(pid):
    """The ids of the running (not zombie) children of a process."""
    found = [int(child) for task in os.listdir(f"/proc/{pid}/task")
             for child in open(f"/proc/{pid}/task/{task}/children").read().split()]
    return [c for c in found if running(c)]


def running(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def test_a_tool_that_raises_anything_or_ends_its_process_is_an_error_reply_and_the_episode_goes_on(tools_file):
    """SystemExit, KeyboardInterrupt, any BaseException and os._exit(0) inside a tool are a failed call the model
    reads, like an Exception: not the end of the run (nor a run that ends with status 0)."""
    env = load(tools=f"{tools_file}:add,leave").episode({"prompt": "1+2="})
    for how, said in [("exit", "error: leave raised SystemExit: 3"),
                      ("interrupt", "error: leave raised KeyboardInterrupt"),
                      ("base", "error: leave raised BaseException: out"),
                      ("os_exit", "error: leave ended its process (exit status 0) before returning")]:
        result = env.call(ToolCall("leave", {"how": how}))
        assert result.error and result.text == said, result
        assert env.call(ToolCall("add", {"a": 2, "b": 3})) == ToolResult("5", False, "add")


def test_a_call_past_the_timeout_stops_at_it_and_takes_its_cpu_with_it(tools_file):
    """A regular expression that backtracks holds the interpreter: no thread can stop it, the call's process is
    killed at --tool_timeout. A call that never returns leaves nothing running after it."""
    env = load(tools=f"{tools_file}:backtrack,spin,add", tool_timeout=0.3).episode({"prompt": "1+2="})
    threads, start = threading.active_count(), time.monotonic()
    assert env.call(ToolCall("backtrack", {"n": 36})) == \
        ToolResult("error: backtrack ran past 0.3 s", True, "backtrack")  # about 6 s of backtracking
    assert time.monotonic() - start < 3.0  # the limit, and a margin for a busy machine
    assert env.call(ToolCall("spin", {"n": 1})).text == "error: spin ran past 0.3 s"
    assert threading.active_count() == threads and children_of(env.process.process.pid) == []
    assert env.call(ToolCall("add", {"a": 2, "b": 3})).text == "5"


def test_a_tool_leaves_no_process_behind(tools_file):
    """What a tool starts ends with its call: its process group is killed, and a process that made a session of its
    own is killed once the tool process adopts it."""
    env = load(tools=f"{tools_file}:fork").episode({"prompt": "1+2="})
    pids = [int(pid) for session in (False, True)
            for pid in env.call(ToolCall("fork", {"session": session})).text.split()]
    deadline = time.monotonic() + 5
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(running, pids))


def test_reset_runs_under_the_timeout_and_fails_with_the_environments_one_line(tools_file):
    start = time.monotonic()
    with pytest.raises(SystemExit) as stopped:
        load(environment=f"{tools_file}:Hangs", tool_timeout=0.3)
    assert str(stopped.value.code).startswith(f"error: --environment '{tools_file}:Hangs': reset ran past 0.3 s on "
                                              "the row ")
    assert time.monotonic() - start < 3.0


def test_an_observation_is_cut_to_what_it_may_add_and_its_episode_counts_as_truncated(tools_file, capsys):
    """A reply is cut to CHARS_PER_TOKEN characters per token of --max_new_tokens before it is tokenised; what reset
    returns, to --max_prompt_length tokens. Each says so once."""
    env = load(tools=f"{tools_file}:huge", max_new_tokens=40).episode({"prompt": "1+2="})
    for _ in range(2):
        result = env.call(ToolCall("huge", {"n": 10_000_000}))
        assert result == ToolResult("x" * 40 * environments.CHARS_PER_TOKEN, False, "huge", True)
    env = load(environment=f"{tools_file}:Verbose", max_prompt_length=64).episode({"prompt": "1+2="})
    assert env.cut and env.observation == "y" * 64  # one character a token
    out = capsys.readouterr().out
    assert out.count("warning: a reply of huge was cut to 1280 characters") == 1
    assert "reset returned more than --max_prompt_length 64 tokens" in out


# TRL's documented environment (GRPOTrainer's environment_factory), as its documentation writes it
TRL_INCREMENT_ENV = '''import random


class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter
'''


def test_trls_increment_env_loads_unchanged_and_its_get_reward_is_a_reward_not_a_tool(tmp_path):
    """get_reward is reserved as TRL reserves it: not a tool, an extra reward of weight 1 logged under the class's
    name. reset's random draws differ between episodes (each call's process is seeded from the run's random)."""
    (tmp_path / "increment.py").write_text(TRL_INCREMENT_ENV)
    cfg = AgentTrainConfig(environment=f"{tmp_path}/increment.py:IncrementEnv")
    spec = environments.load(cfg, TEXT_TOKENIZER)
    assert [s["function"]["name"] for s in spec.schemas] == ["increment"]
    examples = [{"prompt": "1+2=", "answer": "3", "family": "add_2x1"} for _ in range(8)]
    episodes = [SimpleNamespace(env=spec.episode(ex), turns=[], tool_calls=[]) for ex in examples]
    targets = [episode.env.instance.target for episode in episodes]
    assert len(set(targets)) > 1
    assert [e.env.observation for e in episodes] == [f"Increment the counter by {t}." for t in targets]
    assert episodes[0].env.call(ToolCall("increment", {"step": targets[0]})).text == str(targets[0])
    rewards, _, stats = tasks.make_reward_fn(cfg, Accelerator(cpu=True))(examples, ["3"] + ["x"] * 7,
                                                                         episodes=episodes)
    assert rewards.tolist() == [2.0] + [0.0] * 7  # the rule reward and get_reward's
    assert stats["train/reward/IncrementEnv"] == 1 / 8


def test_the_default_budget_of_episodes_holds_a_reply_or_one_line_says_why_not(tools_file):
    """With an environment or tools, the default --max_new_tokens (a single answer's 8) becomes an episode's; a
    budget that cannot hold the shortest call and its reply is one error line."""
    for flags_given in ({"tools": "examples/agents.py:calculate"}, {"environment": "examples/agents.py:Calculator"}):
        assert AgentTrainConfig(**flags_given).max_new_tokens == environments.AGENT_BUDGET
    assert AgentTrainConfig(tools="examples/agents.py:calculate", max_new_tokens=12).max_new_tokens == 12
    with pytest.raises(SystemExit) as stopped:
        load(char_tokenizer(chat_template=QWEN_LIKE), tools=f"{tools_file}:add", max_new_tokens=40)
    assert str(stopped.value.code).startswith(f"error: --tools '{tools_file}:add': --max_new_tokens 40 cannot hold a "
                                              "tool call and its reply (the shortest take ")


def test_a_run_whose_episodes_are_mostly_cut_says_so_once(capsys):
    import torch

    from lab import step_metrics

    environments.WARNED.discard("episodes cut")
    mask = torch.ones(4, 3)
    rollout = SimpleNamespace(mask=mask, token_mask=mask, live_routing=None, episodes=[
        SimpleNamespace(num_turns=1, tool_calls=[], tool_errors=0, truncated=cut) for cut in (True, True, True, False)])
    for _ in range(2):
        assert step_metrics.rollout_metrics(rollout, 1.0)["train/truncated_frac"] == 0.75
    assert capsys.readouterr().out.count("warning: 75% of this step's episodes were cut before they ended") == 1


def test_the_sampler_process_dies_with_the_learner_even_while_it_plays():
    """The sampler process (lab/async_sampling.serve) calls tool_process.die_with_parent first: a learner killed
    with SIGKILL takes it along at once, not at its next wait (an episode's play can be long)."""
    import signal
    import subprocess
    import sys

    from conftest import ROOT

    child = ("from lab import tool_process; tool_process.die_with_parent(); print('ready', flush=True); "
             "import time; time.sleep(60)")
    parent = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
              "print(p.pid, flush=True); p.wait()")
    learner = subprocess.Popen([sys.executable, "-c", parent], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    sampler = int(learner.stdout.readline())
    assert learner.stdout.readline() == "ready\n"
    os.kill(learner.pid, signal.SIGKILL)
    learner.wait()
    deadline = time.monotonic() + 5
    while running(sampler) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(sampler)
    assert "tool_process.die_with_parent()" in open(f"{ROOT}/lab/async_sampling.py").read()


# An environment's own code that must not run in the training process: pickling hooks slow or fatal outside the
# process that made the instance (the training process, before), a str subclass returned by a tool, a helper started
# with clone(CLONE_PARENT) in a session of its own, an instance of 100 MB.
MISBEHAVING = '''
import ctypes
import os
import time


class Hooked:
    def reset(self, mode="", **kwargs):
        self.mode, self.home = mode, os.getpid()

    def look(self) -> str:
        """Look around."""
        return "seen"

    def __getstate__(self):
        if self.mode == "slow_get" and os.getpid() != self.home:  # a flush to a server that never answers
            time.sleep(30)
        return {"mode": self.mode, "home": self.home}

    def __setstate__(self, state):
        self.mode, self.home = state["mode"], state["home"]
        if self.mode in ("slow_set", "exit_set") and os.getpid() != self.home or self.mode == "always_slow_set":
            if self.mode == "exit_set":
                raise SystemExit(0)
            time.sleep(30)  # a reconnection that never ends


class Exits:
    def reset(self, **kwargs):
        pass

    def look(self) -> str:
        """Look around."""
        return "seen"

    def __reduce__(self):
        return os._exit, (0,)


class Hoards:
    def reset(self, megabytes=0, **kwargs):
        self.blob = bytes(int(megabytes) << 20)

    def hoard(self, megabytes: int) -> str:
        """Hold that many MiB.

        Args:
            megabytes: How many.
        """
        self.blob = bytes(megabytes << 20)
        return "held"

    def size(self) -> int:
        """The bytes held."""
        return len(self.blob)


class Marked(str):
    """A str whose methods say which process ran them."""

    def __format__(self, spec):
        with open(os.environ["MARKS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        return str.__format__(self, spec)

    __str__ = __add__ = __radd__ = __format__


class Shown:
    def __str__(self):
        return Marked("shown")


def show() -> Shown:
    """An object whose str() is a str subclass."""
    return Shown()


def helper() -> str:
    """Starts a helper that sleeps, as a sibling of this process (clone with CLONE_PARENT) in a session of its own."""
    number = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
    pid = ctypes.CDLL(None, use_errno=True).syscall(number, 0x00008000 | 17, 0, 0, 0, 0)  # CLONE_PARENT | SIGCHLD
    if pid == 0:
        os.setsid()
        time.sleep(60)
        os._exit(0)
    return str(pid)
'''
# Each case in a process of its own: an instance unpickled in the training process ended it (os._exit(0)).
HOOK_CASE = """
import json, sys, time
sys.path[:0] = [{root!r}, {root!r} + "/tests"]
from test_environments import load
from lab.environments import ToolCall
mode, started = sys.argv[2], time.monotonic()
try:
    env = load(environment=sys.argv[1], tool_timeout=2.0, examples=({{"prompt": "1+2=", "mode": mode}},))
    env = env.episode({{"prompt": "1+2=", "mode": mode}})
    said = env.call(ToolCall("look", {{}})).text
except SystemExit as e:
    said = f"SystemExit: {{e.code}}"
print(json.dumps([said, time.monotonic() - started]))
"""


@pytest.fixture
def misbehaving(tmp_path):
    path = tmp_path / "misbehaving.py"
    path.write_text(MISBEHAVING)
    return str(path)


def test_an_instances_pickling_hooks_run_in_the_tool_process_under_the_timeout(misbehaving):
    """The instance stays pickled between calls: its __getstate__, __setstate__ and what its __reduce__ names run in
    the tool process, under --tool_timeout, never in the training process (where a slow hook ran past the limit,
    SystemExit ended the run and os._exit(0) ended it with status 0)."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    said = {}
    for cls, mode in [("Hooked", "slow_get"), ("Hooked", "slow_set"), ("Hooked", "exit_set"), ("Exits", ""),
                      ("Hooked", "always_slow_set")]:
        proc = subprocess.run([sys.executable, "-c", HOOK_CASE.format(root=str(ROOT)), f"{misbehaving}:{cls}", mode],
                              capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0 and proc.stdout, (mode or cls, proc.stdout, proc.stderr[-2000:])
        text, seconds = json.loads(proc.stdout)
        said[mode or cls] = text
        assert seconds < 20, (mode or cls, seconds)  # 2 s of limit; a slow hook sleeps 30 s
    assert said == {"slow_get": "seen", "slow_set": "seen", "exit_set": "seen",
                    "Exits": "error: look ended its process (exit status 0) before returning",
                    "always_slow_set": "error: look ran past 2 s"}, said


def test_a_reply_is_an_exact_str_and_a_helper_made_a_sibling_of_the_worker_ends_with_its_call(misbehaving, tmp_path,
                                                                                             monkeypatch):
    """A tool whose value's str() is a str subclass: the training process gets a str (the subclass's methods ran in
    it when the observation was formatted). A helper started with clone(CLONE_PARENT) becomes a child of the tool
    process, not of the worker, in a session of its own: it is killed before the call replies."""
    marks = tmp_path / "marks"
    monkeypatch.setenv("MARKS", str(marks))
    spec = load(tools=f"{misbehaving}:show,helper")
    env = spec.episode({"prompt": "1+2="})
    result = env.call(ToolCall("show", {}))
    assert result == ToolResult("shown", False, "show") and type(result.text) is str
    assert spec.observation_text([result]) == "<result>shown</result>"
    assert str(os.getpid()) not in (marks.read_text().split() if marks.exists() else [])
    helper = env.call(ToolCall("helper", {}))
    assert not helper.error, helper
    assert not running(int(helper.text))


def test_an_instance_is_capped_and_the_load_of_the_tool_process_has_a_time_limit(misbehaving, tmp_path):
    """An instance that pickles to more than INSTANCE_BYTES fails its call (reset: the environment's one line; a tool:
    an error reply, the instance kept as it was): the training process keeps one per episode. A file whose import
    waits (a lock the training process's own load holds) stops the run with one line, leaving no process."""
    import subprocess
    import sys

    from conftest import ROOT

    with pytest.raises(SystemExit) as stopped:
        load(environment=f"{misbehaving}:Hoards", examples=({"prompt": "1+2=", "megabytes": 100},))
    assert "reset raised ValueError: the instance pickles to 100.0 MiB, more than the 8 MiB" in str(stopped.value.code)
    env = load(environment=f"{misbehaving}:Hoards").episode({"prompt": "1+2="})
    assert env.call(ToolCall("hoard", {"megabytes": 100})).text.startswith("error: the instance pickles to 100.0 MiB")
    assert env.call(ToolCall("size", {})).text == "0"
    locked = tmp_path / "locked.py"
    locked.write_text("import fcntl\n_lock = open(__file__ + '.lock', 'w')\nfcntl.flock(_lock, fcntl.LOCK_EX)\n"
                      + MISBEHAVING)
    script = (f"import os, sys, time\nsys.path[:0] = [{str(ROOT)!r}, {str(ROOT)!r} + '/tests']\n"
              "from test_environments import load, children_of\nfrom lab import tool_process\n"
              "tool_process.LOAD_SECONDS = 1.0\nstarted = time.monotonic()\ntry:\n"
              f"    load(environment={str(locked)!r} + ':Hooked', tool_timeout=0.5)\nexcept SystemExit as e:\n"
              "    print(e.code)\nprint(round(time.monotonic() - started), children_of(os.getpid()))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    said, left = proc.stdout.splitlines()
    assert said == f"error: --environment '{locked}:Hooked': loading the file in the process that runs its calls " \
        "took more than 1 s (an import that waits for a lock or the network?).", proc.stdout + proc.stderr
    seconds, children = left.split(" ", 1)
    assert int(seconds) < 30 and children == "[]", left


@pytest.mark.parametrize("seconds", [float("inf"), 1e14, float("nan")])
def test_a_tool_timeout_past_a_day_is_one_error_line(seconds):
    with pytest.raises(ValueError, match=r"--tool_timeout must be > 0 and at most 86400 \(a day\)"):
        AgentTrainConfig(environment="calculator", tool_timeout=seconds)
