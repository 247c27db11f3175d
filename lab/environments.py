"""Tools and environments for multi-turn episodes (agents.py): loading --tools FILE.py:fn1,fn2 and --environment
FILE.py:Class (or the built-in calculator), their JSON schemas, the per-episode environment whose tool calls never
raise, and the two formats a policy speaks them in: the text format of models without a chat template
(<tool>ARGS</tool>, answered by <result>TEXT</result>) and a chat template's own (Hermes <tool_call>{json}</tool_call>,
answered by `tool` messages).

An environment class has TRL's GRPOTrainer(environment_factory=...) shape, which this module follows:
  - `__init__(self)` takes no arguments; one instance is made per episode;
  - `reset(self, **kwargs)` starts the episode; it receives the dataset row's columns as keywords (the prompt's
    among them, as TRL passes the whole row) and returns None or an observation text, appended to the prompt
    (TRL appends it to the last message's content);
  - `get_reward(self)`, optional, returns a float: the environment scores its episode, an extra reward source of
    weight 1 logged as train/reward/<Class> (`reward_source`);
  - every public method (its name not starting with '_') of the class other than reset and get_reward is a tool,
    with type hints and a docstring whose Args section describes each parameter (get_json_schema reads them);
  - a tool that raises is not the end of the episode: its message is what the model reads (`error: ...`).
Reward functions receive the episodes' instances as `environments`, as TRL passes them (lab/tasks.py).
--tools functions are stateless (TRL's GRPOTrainer(tools=...)): the same checks, without reset.
The user's reset, tool calls and get_reward run in a process of their own, under --tool_timeout
(lab/tool_process.py); the training process loads the user's files once (their top level runs there, without a
limit) to read the tools' signatures and docstrings."""
import functools
import inspect
import json
import os
import re
import types
from dataclasses import dataclass
from typing import NamedTuple

from lab import routing, tool_process
from lab.calculator import Calculator
from support import config
from support.config import AT_LEAST_ONE, Rule, arg, check, check_rules

AGENT_MODEL = os.path.join(config.ROOT, "embedded_model", "agent")
AGENT_BUDGET = 40  # --max_new_tokens of episodes at the default: a+b*c's two calls and answer take about 28 tokens
CHARS_PER_TOKEN = 32  # an observation is cut to this many characters per token it may add, before it is tokenised
RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's)
SECONDS = Rule(lambda v: 0 < v <= 86400, "> 0 and at most 86400 (a day)")


@dataclass
class AgentConfig:
    """The flags of multi-turn episodes, before lab/config.py's LabConfig (or GroupConfig) in a Config's bases: its checks
    run after theirs. --environment calculator on the default model and task switches both to the agent ones; with
    an environment or tools the default --max_new_tokens (8, a single answer's) becomes AGENT_BUDGET, an episode's."""
    environment: str = arg("", "The environment of each episode: 'calculator' (built-in) or FILE.py:Class, TRL's "
                           "environment_factory shape (reset and one public method per tool).")
    tools: str = arg("", "Stateless tools FILE.py:fn1,fn2: typed functions with docstrings (TRL's tools).")
    max_turns: int = arg(4, "The most model turns in an episode (each may call tools).")
    tool_timeout: float = arg(5.0, "Seconds a tool call, reset or get_reward may run before its process is killed.")

    def __post_init__(self):
        super().__post_init__()
        check_rules(self, max_turns=AT_LEAST_ONE, tool_timeout=SECONDS)
        toolbox(self.environment, self.tools)  # a bad file, name or tool is an error before any model loads
        if self.environment == "calculator" and (self.model_name_or_path, self.dataset) == \
                (config.EMBEDDED_MODEL, "arithmetic"):  # the agent model and task
            self.model_name_or_path, self.dataset = AGENT_MODEL, "tool_arithmetic"
        if (self.environment or self.tools) and self.max_new_tokens == 8:  # an episode's budget, not a sum's
            self.max_new_tokens = AGENT_BUDGET


class ToolCall(NamedTuple):
    """A call parsed from a turn: arguments None and error set when the call could not be read."""
    name: str | None
    arguments: dict | None
    error: str | None = None


class ToolResult(NamedTuple):
    """What the model reads back: the tool's return value as str(), or `error: ...` (error True); cut: the text was
    cut to the characters an observation may add."""
    text: str
    error: bool
    name: str = ""
    cut: bool = False


# ----------------------------------------------------------------------------------------
# Loading and checking --environment and --tools
# ----------------------------------------------------------------------------------------
class Toolbox(NamedTuple):
    environment_class: type | None
    functions: dict  # name -> the --tools function
    schemas: list  # the JSON schema of every tool: the environment's methods, then --tools
    signatures: dict  # name -> the signature of every tool (the environment's methods without self)
    files: tuple  # (flag, value, path, module) of each user file: the tool process loads them too


def flag_of(cfg):
    """How an error names the flags: the environment's, else the tools'."""
    return f"--environment {cfg.environment!r}" if cfg.environment else f"--tools {cfg.tools!r}"


def one_line(error):
    return " ".join(str(error).split()) or type(error).__name__


def schema(flag, spec, name, function):
    """get_json_schema(function): it raises on a parameter without a type hint or a missing docstring / Args entry."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as e:
        raise ValueError(f"{flag} {spec!r}: tool {name!r}: {one_line(e)} (a tool needs type hints and a docstring "
                         "with an Args section).") from e


def public_methods(cls):
    """The tools of an environment class, as TRL finds them: the public functions of the class other than reset and
    get_reward, each bound to a placeholder (its signature and schema without self, as a bound method's; no instance
    is made in this process)."""
    return {name: function if isinstance(inspect.getattr_static(cls, name), staticmethod) else
            types.MethodType(function, object()) for name, function in inspect.getmembers(cls, inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED}


@functools.cache
def toolbox(environment, tools):
    """The Toolbox of --environment and --tools (both may be given). Every error is a ValueError naming the flag."""
    environment_class, schemas, functions, signatures, files = None, [], {}, {}, []
    if environment == "calculator":
        environment_class = Calculator
    elif environment:
        path, _, name = environment.rpartition(":")
        check(path.endswith(".py") and name.isidentifier(), f"--environment {environment!r}: give 'calculator' or "
              "FILE.py:Class.")
        module = config.load_file("--environment", environment, path)
        files.append(("--environment", environment, path, module))
        environment_class = vars(module).get(name)
        check(isinstance(environment_class, type), f"--environment {environment!r}: {path} defines no class {name!r}.")
    if environment_class is not None:
        check(callable(getattr(environment_class, "reset", None)), f"--environment {environment!r}: the class has "
              "no reset method: give it reset(self, **kwargs), which starts each episode.")
        methods = public_methods(environment_class)
        check(methods, f"--environment {environment!r}: the class has no public method other than reset: each "
              "tool is one (typed, with a docstring).")
        schemas = [schema("--environment", environment, name, method) for name, method in methods.items()]
        signatures = {name: inspect.signature(method) for name, method in methods.items()}
    if tools:
        path, _, names = tools.rpartition(":")
        names = names.split(",")
        check(path.endswith(".py") and all(n.isidentifier() for n in names), f"--tools {tools!r}: give "
              "FILE.py:fn1,fn2.")
        module = config.load_file("--tools", tools, path)
        files.append(("--tools", tools, path, module))
        for name in names:
            function = vars(module).get(name)
            check(isinstance(function, types.FunctionType), f"--tools {tools!r}: {path} defines no function "
                  f"{name!r}.")
            check(name not in functions and all(s["function"]["name"] != name for s in schemas),
                  f"--tools {tools!r}: two tools named {name!r}.")
            functions[name] = function
            schemas.append(schema("--tools", tools, name, function))
            signatures[name] = inspect.signature(function)
    return Toolbox(environment_class, functions, schemas, signatures, tuple(files))


@functools.cache
def process_of(environment, tools, timeout):
    """The process that runs the calls of --environment / --tools in this process (None: the built-in calculator
    alone, whose calls are bounded and run here: one linear regular expression and one operation on 9-digit
    numbers)."""
    files = toolbox(environment, tools).files
    return tool_process.ToolProcess(files, timeout) if files else None


WARNED = set()


def warn_once(key, line):
    """Print a warning line once per process."""
    if key not in WARNED:
        WARNED.add(key)
        print(f"warning: {line}", flush=True)


class Environment:
    """The environment of one episode: a new instance of the environment class (None for --tools alone) whose
    reset was called with the example's row, and its tools. call() never raises. cfg: the run's flags (its
    --environment, --tools, --tool_timeout, the budgets that cap observations). The user's reset, calls and get_reward
    run in the tool process (lab/tool_process.py), each under --tool_timeout; `state` is the instance as the last
    of them left it, pickled there, which this process keeps without reading (`instance` reads it)."""

    def __init__(self, cfg, example):
        box, flag = toolbox(cfg.environment, cfg.tools), flag_of(cfg)
        self.signatures, self.timeout, self.flag = box.signatures, cfg.tool_timeout, flag
        self.process = process_of(cfg.environment, cfg.tools, cfg.tool_timeout)
        self.functions, self.tools_path = box.functions, cfg.tools.rpartition(":")[0]
        self.path, _, self.class_name = cfg.environment.rpartition(":")
        self.reply_chars = CHARS_PER_TOKEN * getattr(cfg, "max_new_tokens", AGENT_BUDGET)
        self.local, self.state, self.unpickled, self.reward_outcome = None, b"", None, None
        self.observation, self.cut = None, False  # observation: reset's, appended to the prompt
        if box.environment_class is None:
            return
        row = example.get("row", example)
        try:
            if self.process is None:  # the built-in calculator
                self.local = box.environment_class()
                self.observation = self.local.reset(**row)
            else:
                chars = CHARS_PER_TOKEN * getattr(cfg, "max_prompt_length", 512)
                outcome, self.state = self.process.run("reset", self.path, self.class_name, "reset", row, self.timeout,
                                                       chars)
                self.observation, self.cut = outcome["text"], outcome["cut"]
        except Exception as e:
            reason = e.reason if isinstance(e, tool_process.CallFailed) else f"raised {type(e).__name__}: {one_line(e)}"
            raise SystemExit(f"error: {flag}: reset {reason} on the row {str(row)[:200]}.") from e
        if self.cut:
            warn_once("reset", f"{flag}: reset returned more than {chars} characters; the observation was cut to "
                      "--max_prompt_length tokens at most and its episode counts as truncated (train/truncated_frac).")

    @property
    def instance(self):
        """The environment as its last call left it, as an object of this process (None without an environment): the
        tool process's pickled bytes unpickled here, once, so the class's __setstate__ or __reduce__ runs in this
        process, without a limit. Only the reward functions' `environments` and tests read it."""
        if self.process is None or not self.state:
            return self.local
        if self.unpickled is None or self.unpickled[0] is not self.state:
            try:
                self.unpickled = self.state, tool_process.loads(self.state, self.process.modules)
            except BaseException as e:  # SystemExit too: one line, not the user's exit status
                raise SystemExit(f"error: {self.flag}: unpickling an instance in the training process (for the "
                                 f"reward functions' environments) raised {type(e).__name__}: {one_line(e)}") from e
        return self.unpickled[1]

    def reward(self):
        """get_reward() of the instance, run in the tool process under --tool_timeout: a float or None, once per
        episode (a failure is raised again, at once, when the reward functions retry row by row)."""
        if self.reward_outcome is None:
            try:
                outcome, _ = self.process.run("reward", self.path, self.class_name, "get_reward", {}, self.timeout, 0,
                                              self.state)
                self.reward_outcome = outcome["value"]
            except tool_process.CallFailed as e:
                self.reward_outcome = RuntimeError(f"get_reward {e.reason}")
        if isinstance(self.reward_outcome, Exception):
            raise self.reward_outcome
        return self.reward_outcome

    def call(self, call):
        """The ToolResult of a call: the tool's return value as str(), or `error: ...` for a call that could not be
        read, an unknown tool, wrong arguments, a tool that raised (whatever it raised), ended its process or ran
        past the timeout (its process killed)."""
        def error(text):
            return ToolResult(f"error: {text}", True, call.name or "")

        if call.error is not None:
            return error(call.error)
        signature = self.signatures.get(call.name)
        if signature is None:
            return error(f"unknown tool {call.name!r}")
        try:
            signature.bind(**call.arguments)
        except TypeError as e:
            return error(f"{call.name}: {one_line(e)}")
        try:
            if self.process is None:  # the built-in calculator, in this process
                return ToolResult(str(getattr(self.local, call.name)(**call.arguments)), False, call.name)
            if call.name in self.functions:
                outcome, _ = self.process.run("function", self.tools_path, call.name, call.name, call.arguments,
                                              self.timeout, self.reply_chars)
            else:
                outcome, self.state = self.process.run("method", self.path, self.class_name, call.name,
                                                       call.arguments, self.timeout, self.reply_chars, self.state)
        except tool_process.CallFailed as e:
            return error(e.message if e.message is not None else f"{call.name} {e.reason}")
        except Exception as e:  # the built-in calculator's
            return error(one_line(e))
        if outcome["cut"]:
            warn_once("reply", f"a reply of {call.name} was cut to {self.reply_chars} characters ({CHARS_PER_TOKEN} "
                      "per token of --max_new_tokens); its episode counts as truncated (train/truncated_frac).")
        return ToolResult(outcome["text"], False, call.name, outcome["cut"])


# ----------------------------------------------------------------------------------------
# The formats: prompts, tool calls and observations
# ----------------------------------------------------------------------------------------
TEXT_CALL = re.compile(r"<tool>(.*?)</tool>", re.S)
CHAT_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
# a conversation that ends with an assistant turn: the observation is what tool messages add after it
BEFORE_TOOLS = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "?"}]


def json_call(text):
    """A ToolCall from {"name": ..., "arguments": {...}} (arguments may be a JSON string, as some models write)."""
    try:
        call = json.loads(text)
        arguments = call.get("arguments", {}) if isinstance(call, dict) else None
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return ToolCall(None, None, "malformed JSON")
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return ToolCall(None, None, 'expected {"name": ..., "arguments": {...}}')
    return ToolCall(call["name"], arguments)


class Spec:
    """What agents.py needs of the tools and the format: prompts, a fresh environment per episode, the calls of a
    turn, the tokens of the observations. The chat format when the tokenizer has a chat template (and
    --use_chat_template), else the text format."""

    def __init__(self, cfg, tokenizer, box):
        self.cfg, self.box, self.tokenizer, self.flag = cfg, box, tokenizer, flag_of(cfg)
        self.schemas, self.system_prompt = box.schemas, cfg.system_prompt
        self.chat = cfg.use_chat_template and bool(getattr(tokenizer, "chat_template", None))
        end = tokenizer("</tool>", add_special_tokens=False)["input_ids"]
        self.stop_ids = end if not self.chat and len(end) == 1 and end[0] != tokenizer.unk_token_id else []
        # the text format's shorthand <tool>ARGS</tool>: one tool of one parameter, ARGS its value
        functions = [s["function"] for s in self.schemas]
        parameters = [(name, kind.get("type")) for name, kind in functions[0]["parameters"]["properties"].items()]
        self.shorthand = (functions[0]["name"], *parameters[0]) if len(functions) == len(parameters) == 1 else None
        if self.chat:
            before = tokenizer.apply_chat_template(BEFORE_TOOLS, tools=self.schemas, tokenize=False)
            eos = tokenizer.eos_token or ""
            # the assistant turn's tokens were sampled up to and including its EOS: the observation starts after it
            self.before_tools = before[:before.rfind(eos) + len(eos)] if eos in before else before

    def episode(self, example):
        """A fresh Environment for the example: a new instance (environment_factory's one per episode), reset; what
        reset returned cut to --max_prompt_length tokens (env.cut: it was cut)."""
        env, limit = Environment(self.cfg, example), getattr(self.cfg, "max_prompt_length", 512)
        if env.observation:
            ids = self.tokenizer(env.observation, add_special_tokens=False)["input_ids"]
            if len(ids) > limit:
                env.observation, env.cut = self.tokenizer.decode(ids[:limit]), True
                warn_once("reset tokens", f"{self.flag}: reset returned more than --max_prompt_length {limit} tokens; "
                          "the observation was cut to them and its episode counts as truncated (train/truncated_frac).")
        return env

    def prompt_text(self, example, env=None):
        """The prompt as the policy reads it, with the observation env's reset returned (if any) appended."""
        observation = env.observation if env is not None and env.observation else ""
        if not self.chat:
            return example["prompt"] + observation
        raw = example.get("raw_prompt", example["prompt"])
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = [dict(m) for m in raw] if isinstance(raw, list) else [{"role": "user", "content": raw}]
        messages = (system if messages[0]["role"] != "system" else []) + messages
        messages[-1]["content"] += observation
        return self.tokenizer.apply_chat_template(messages, tools=self.schemas, add_generation_prompt=True,
                                                  tokenize=False)

    def parse(self, turn_text):
        """The tool calls of a turn, in order ([] for none). Text format: each <tool>ARGS</tool>, ARGS a JSON call or
        the shorthand; chat format: each <tool_call>{json}</tool_call>. An unclosed call is no call."""
        if self.chat:
            return [json_call(inner) for inner in CHAT_CALL.findall(turn_text)]
        calls = []
        for inner in TEXT_CALL.findall(turn_text):
            if inner.strip().startswith("{") or self.shorthand is None:
                calls.append(json_call(inner))
                continue
            tool, parameter, kind = self.shorthand
            try:
                value = inner.strip() if kind == "string" else json.loads(inner)
                calls.append(ToolCall(tool, {parameter: value}))
            except ValueError:
                calls.append(ToolCall(tool, None, f"{parameter} must be JSON of type {kind}"))
        return calls

    def observation_text(self, results):
        """Text format: <result>TEXT</result> per result. Chat format: what the template adds after an assistant
        turn's EOS for the `tool` messages and the next generation prompt (rendered after a stand-in conversation:
        a template whose tool messages depend on the turns before them is not supported)."""
        if not self.chat:
            return "".join(f"<result>{r.text}</result>" for r in results)
        messages = BEFORE_TOOLS + [{"role": "tool", "name": r.name, "content": r.text} for r in results]
        after = self.tokenizer.apply_chat_template(messages, tools=self.schemas, add_generation_prompt=True,
                                                   tokenize=False)
        if not after.startswith(self.before_tools):
            raise ValueError("the chat template renders the turns before tool messages differently once they follow")
        return after[len(self.before_tools):]

    def observation_ids(self, results):
        return self.tokenizer(self.observation_text(results), add_special_tokens=False)["input_ids"]

    def shortest_reply(self):
        """The tokens of the shortest tool call (no arguments), its empty reply and one token of answer: the least
        --max_new_tokens an episode that calls a tool and reads its reply needs in this format."""
        name = self.schemas[0]["function"]["name"]
        call = f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' if self.chat else "<tool></tool>"
        return len(self.tokenizer(call, add_special_tokens=False)["input_ids"]) + int(self.chat) + \
            len(self.observation_ids([ToolResult("", False, name)])) + 1


def reward_source(cfg):
    """TRL's get_reward: (the class's name, a reward function that calls each episode's get_reward()) when the
    --environment class defines one, else None. It is called once per episode after the episode, in the tool process
    of the process that played it, under --tool_timeout (Environment.reward)."""
    box = toolbox(getattr(cfg, "environment", ""), getattr(cfg, "tools", ""))
    cls = box.environment_class
    if cls is None or not inspect.isfunction(getattr(cls, "get_reward", None)):
        return None

    def get_reward(episodes, **kwargs):  # (an `async def` get_reward is run to its end there)
        return [None if episode.env is None else episode.env.reward() for episode in episodes]
    return cls.__name__, get_reward


def load(cfg, tokenizer, examples=None):
    """The Spec of --environment / --tools, None when neither is given. Every problem is one `error: ...` line
    (SystemExit) before any model loads; with examples (the run's check, engine.load_data), also what episodes do not
    run with (`refuse`), and a trial episode starts on the first (reset is called)."""
    if not (cfg.environment or cfg.tools):
        return None
    if examples:
        refuse(cfg)
    try:
        spec = Spec(cfg, tokenizer, toolbox(cfg.environment, cfg.tools))
        if spec.chat:
            spec.observation_text([ToolResult("1", False, spec.schemas[0]["function"]["name"])])
    except ValueError as e:
        raise SystemExit(f"error: {e}" if str(e).startswith("--") else f"error: {flag_of(cfg)}: {one_line(e)}.") from e
    if examples:
        budget, needed = getattr(cfg, "max_new_tokens", None), spec.shortest_reply()
        if budget is not None and budget < needed:
            raise SystemExit(f"error: {flag_of(cfg)}: --max_new_tokens {budget} cannot hold a tool call and its reply "
                             f"(the shortest take {needed} tokens in this format; the budget counts the model's turns "
                             "and the environment's replies): raise it.")
        spec.episode(examples[0])
    return spec


def refuse(cfg):
    """What episodes do not run with yet, one line each."""
    moe = routing.names_moe(cfg.model_name_or_path)
    for refused, what in ((cfg.async_rollouts > 0 and cfg.reward_model, "--async_rollouts and --reward_model: the "
                           "learner would reward episodes whose environments live in the sampler process"),
                          (getattr(cfg, "sampler", "independent") != "independent",
                           "--sampler tree: a tree's segments are single turns"),
                          (moe, "a mixture-of-experts policy: an episode's routing is not recorded")):
        if refused:
            raise SystemExit(f"error: {flag_of(cfg)} does not run with {what}.")


def trial_episodes(cfg, examples):
    """Stand-ins of agents.Episode for the trial call of the --reward_fn functions before any model loads: a fresh
    environment per row (reset called), no turns yet. None without --environment or --tools."""
    if not (getattr(cfg, "environment", "") or getattr(cfg, "tools", "")):
        return None
    return [types.SimpleNamespace(env=Environment(cfg, ex), turns=[], tool_calls=[]) for ex in examples]
