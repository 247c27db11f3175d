"""The flags every script shares: TrainConfig (each lesson file subclasses it with what its algorithm adds; the lab's
LabConfig, lab/config.py, adds the lab's), their checks, and the command line's parsing; and the user's own files
the flags name: a FILE.py of --reward_fn (the lab's --tools, --environment) run once as a module, a --dataset .jsonl
file's lines checked. No torch: the lab's tool process imports it."""
import fcntl
import functools
import importlib.util
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED_MODEL = os.path.join(ROOT, "embedded_model")
EMBEDDED_TEACHER = os.path.join(EMBEDDED_MODEL, "teacher")  # opd.py's (embedded_model/build.py --teacher)
# Flags a resumed run may change: they decide how long to run, what to write and how much memory a step
# takes (the steps stay the same up to rounding), not the steps themselves. Any other difference from the
# checkpoint's flags is refused (the optimizer state would also silently restore its --learning_rate).
RESUMABLE_CHANGES = ("num_steps", "eval_every", "log_every", "log_rollouts", "save_steps", "save_total_limit",
                     "save_model", "merge_lora", "report_to", "output_dir", "resume_from", "gradient_checkpointing",
                     "micro_batch_size", "generation_batch_size", "fast", "vllm_python", "vllm_memory")


def arg(default, help):
    """A config field with its --help text."""
    return field(default=default, metadata={"help": help})


class Rule(NamedTuple):
    """What a flag's value must be: ok(value), said as "--name must be <text>" (check_rules)."""
    ok: object
    text: str


def one_of(*choices):
    return Rule(lambda v: v in choices, " or ".join([", ".join(choices[:-1]), choices[-1]] if choices[1:] else choices))


POSITIVE = Rule(lambda v: v > 0, "> 0")
NON_NEGATIVE = Rule(lambda v: v >= 0, ">= 0")
FRACTION = Rule(lambda v: 0 < v < 1, "in (0, 1)")
PROBABILITY = Rule(lambda v: 0 <= v <= 1, "in [0, 1]")
AT_LEAST_ONE = Rule(lambda v: v >= 1, ">= 1")


@dataclass
class TrainConfig:
    """The flags every training script has: the lesson files' (helpers.TrainConfig) and the lab's (lab/config.py's
    LabConfig adds the rest). A lesson file keeps each lab flag at its default: the class attributes after the fields."""
    model_name_or_path: str = arg(EMBEDDED_MODEL, "Causal LM: Hub name or local folder (default: the embedded model).")
    dataset: str = arg("arithmetic", "'arithmetic' (built-in), 'gsm8k' (Hub) or a local .json/.jsonl/.parquet file.")
    # action "extend": the flag can be repeated, each time with one or more values
    reward_fn: list[str] = field(default_factory=list, metadata={"action": "extend", "help": (
        "A reward function FILE.py:NAME, f(completions, **kwargs) -> list of float or None as in TRL, added "
        "to the answer's reward (repeatable; lab/<script> --rule_reward_weight 0: the whole reward).")})
    reward_scales: str = arg("uniform", "The arithmetic task's rewards: 'uniform' (1/0 for right/wrong) or 'hetero' "
                             "(each family on its own offset: docs/baselines.md).")
    lora_r: int = arg(0, "LoRA rank (0 = full fine-tuning); the reference is then the policy with its adapter off.")
    output_dir: str = arg("", "Where metrics, plots, checkpoints and the final model go (default: runs/<script name>).")
    seed: int = arg(0, "Random seed; rank r samples with seed + r.")
    num_steps: int = arg(200, "Optimizer steps (one rollout batch each).")
    batch_size: int = arg(64, "Sampled completions per step per process (the ones the loss trains on).")
    learning_rate: float = arg(1e-4, "Policy learning rate (AdamW); papers use ~1e-6 for 7B models.")
    max_grad_norm: float = arg(1.0, "Clip the global gradient norm to this value (0 = off).")
    micro_batch_size: int = arg(0, "Sequences per forward/backward pass on each process; gradients add up to the "
                                "whole batch's (0 = the whole batch in one pass).")
    max_new_tokens: int = arg(8, "Maximum completion length in tokens.")
    temperature: float = arg(1.0, "Sampling temperature; log-probs are computed at the same temperature.")
    top_p: float = arg(1.0, "Nucleus sampling; log-probs are scored on the same truncated, renormalised distribution.")
    top_k: int = arg(0, "Top-k sampling (0 = off); log-probs are scored on the same truncated distribution.")
    eval_every: int = arg(25, "Held-out greedy accuracy every N steps (and at start and end).")
    log_every: int = arg(10, "Print a metrics line and two samples every N steps (every step goes to metrics.jsonl).")
    save_steps: int = arg(0, "Write a resumable checkpoint every N steps (0 = none; the lab also saves on Ctrl-C or SIGTERM).")
    resume_from: str = arg("", "A checkpoint folder (output_dir/checkpoint-N) to continue from, or 'latest': "
                           "the newest checkpoint in --output_dir whose files verify (none: start at step 0).")

    # the lab's flags that the shared code reads (LabConfig's fields), at their defaults
    prompt_column, answer_column, answer_check, system_prompt = "question", "answer", "number", ""
    eval_size, train_size, use_chat_template, max_prompt_length = 200, 0, True, 512
    torch_dtype, gradient_checkpointing, lora_alpha, lora_target_modules = "float32", False, 16, "all-linear"
    warmup_steps, generation_batch_size, report_to, save_total_limit = 0, 0, "none", 2

    def __post_init__(self):
        check_rules(self, **{name: POSITIVE for name in ("num_steps", "batch_size", "learning_rate", "max_new_tokens",
                                                        "temperature", "eval_every", "log_every")})
        check_rules(self, **{name: NON_NEGATIVE for name in ("lora_r", "save_steps", "max_grad_norm", "top_k",
                                                            "micro_batch_size")})
        check_rules(self, top_p=Rule(lambda v: 0 < v <= 1, "in (0, 1]"), reward_scales=one_of("uniform", "hetero"))
        check(self.micro_batch_size <= self.batch_size, f"--micro_batch_size ({self.micro_batch_size}) is larger than "
              f"--batch_size ({self.batch_size}), whose rows it splits: give at most {self.batch_size} (0 = the whole "
              "batch in one pass).")
        if self.dataset not in ("arithmetic", "tool_arithmetic", "gsm8k"):
            if not self.dataset.endswith((".json", ".jsonl", ".parquet")):
                raise ValueError("--dataset must be 'arithmetic', 'tool_arithmetic', 'gsm8k' or a .json/.jsonl/"
                                 f".parquet file (got {self.dataset!r}).")
            if not os.path.isfile(self.dataset):
                raise ValueError(f"--dataset {self.dataset!r}: no such file.")
        if self.resume_from not in ("", "latest"):
            if not os.path.isdir(self.resume_from):
                raise ValueError(f"--resume_from {self.resume_from!r}: no such folder (give output_dir/checkpoint-N "
                                 "or 'latest').")
            if not os.path.isfile(os.path.join(self.resume_from, "trainer_state.json")):
                raise ValueError(f"--resume_from {self.resume_from!r} is not a complete checkpoint (no "
                                 "trainer_state.json: a run stopped while writing it, or it is not a checkpoint); "
                                 "--resume_from latest picks the newest one whose files verify.")
        for spec in self.reward_fn:
            reward_function(spec)  # runs its file: a missing file or name is an error before any model loads
        names = [spec.rpartition(":")[2] for spec in self.reward_fn]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"--reward_fn: two functions named {twice[0]!r}; their metric train/reward/{twice[0]} "
                             "would mix them: rename one.")


def script_name():
    """The running script as runs name it: grpo.py (the lesson) or lab/grpo.py (the lab's)."""
    path = os.path.abspath(sys.argv[0])
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else os.path.basename(path)


def parse_config(config_class, args=None):
    """Parse the command line into `config_class`; a bad value exits with one clear line. (What needs a
    checkpoint's files, --resume_from latest among them, is checked by support/run.py load_checkpoint.)"""
    script = script_name()
    parser = command_line(config_class)
    args = negative_values_joined(sys.argv[1:] if args is None else list(args))
    try:
        cfg, unknown = parser.parse_args_into_dataclasses(args=args, return_remaining_strings=True)
        if unknown:
            raise ValueError(unknown_flag(unknown, parser))
        if not cfg.output_dir:
            cfg.output_dir = os.path.join("runs", os.path.splitext(script)[0])
        check_output_dir(cfg, script)
    except ValueError as e:
        sys.exit(f"error: {e}")
    return cfg


def negative_values_joined(args):
    """["--learning_rate", "-1e-4"] -> ["--learning_rate=-1e-4"]: argparse takes a value that starts with "-" and
    is not a plain decimal (-1e-4, -inf) for a flag, and says the flag "expected one argument"."""
    out = []
    for a in args:
        joined = out and out[-1].startswith("--") and "=" not in out[-1] and NEGATIVE.fullmatch(a)
        out[-1:] = [f"{out[-1]}={a}"] if joined else [*out[-1:], a]
    return out


NEGATIVE = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|-inf")  # a negative number, as a flag's value
DEFAULT_SAID = re.compile(r"\(default[: ]")  # a help text that says its default: "(default 0.2; ...)"


def command_line(config_class):
    """The parser of a script's flags: its --help opens with the first paragraph of the script's docstring and
    gives each flag once, with its default once; a flag must be spelled whole (argparse would otherwise take
    --num_step as --num_steps), and a value it cannot read is one error line, without the usage."""
    import argparse

    from transformers import HfArgumentParser

    class Formatter(argparse.HelpFormatter):
        def _get_help_string(self, action):
            # the help texts that name their default in words ("(default: the embedded model)") keep only that
            said = DEFAULT_SAID.search(action.help or "")
            if said or action.default is argparse.SUPPRESS or not action.option_strings:
                return action.help
            default = {"": "''", "[]": "none"}.get(str(action.default), action.default)
            return f"{action.help} (default: {default})"

        def _format_action_invocation(self, action):
            # --num_steps NUM_STEPS, without HfArgumentParser's dashed twin --num-steps (which works too)
            flags = ", ".join(s for s in action.option_strings if "-" not in s.lstrip("-"))
            return flags if action.nargs == 0 else f"{flags} {self._format_args(action, action.dest.upper())}"

    class Parser(HfArgumentParser):
        def format_help(self):
            return f"{purpose}\n\n{super().format_help()}"

        def error(self, message):  # argparse's error prints the whole usage first
            # "argument --num_steps/--num-steps: invalid int value: 'abc'" -> "--num_steps: invalid ..."
            raise SystemExit("error: " + re.sub(r"^argument (--\w+)(/--[\w-]+)?", r"\1", message))

    module = sys.modules.get(config_class.__module__)
    purpose = " ".join(((module and module.__doc__) or "").strip().split("\n\n")[0].split())
    parser = Parser(config_class, prog=os.path.basename(sys.argv[0]), allow_abbrev=False, formatter_class=Formatter,
                    usage="%(prog)s [--flag value ...]   (--flag-name works as --flag_name)")
    for action in parser._actions:
        if action.const is True and action.nargs == "?":  # a boolean: --fast, --fast True, --fast False
            action.metavar = "True|False"
        if action.option_strings and action.option_strings[0].startswith("--no_") and action.const is False:
            # HfArgumentParser's --no_fast repeats --fast's help: --fast says it once
            positive = next(a for a in parser._actions if a.dest == action.dest and a is not action)
            positive.help = f"{positive.help} {action.option_strings[0]} is {positive.option_strings[0]} False."
            action.help = argparse.SUPPRESS
    return parser


def unknown_flag(unknown, parser):
    """The error for arguments no flag took: the first unknown flag and the flag closest to it, or the stray value."""
    import argparse
    import difflib

    flag = next((a for a in unknown if a.startswith("-")), None)
    if flag is None:
        return (f"unexpected value {unknown[0]!r}: every setting is a flag with its value, e.g. --num_steps 4 "
                f"({parser.prog} --help lists the flags)")
    name = "--" + flag.lstrip("-").split("=")[0].replace("-", "_")
    lab = lab_script(name[2:])
    if lab:  # a flag of the lab's script of the same name (what docs/your_task.md and docs/scaling.md use)
        return (f"{flag.split('=')[0]} is a flag of {lab} (the lab), not of {parser.prog} (the lesson): python "
                f"{lab} {flag.split('=')[0]} ... takes every flag of {parser.prog} and more")
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    close = difflib.get_close_matches(name, flags, n=1)
    return f"unknown flag {flag.split('=')[0]}; " + (f"did you mean {close[0]}?" if close else
                                                       f"{parser.prog} --help lists the flags.")


def lab_script(flag):
    """lab/<script>.py when the running script is a lesson without the flag and that lab script has it (a field of
    the lab's config classes, lab/config.py, of its own Config or of environments.AgentConfig), else None."""
    from dataclasses import fields

    def flags(*path):
        with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
            return set(re.findall(r"^    (\w+): .*= arg\(", f.read(), re.M))
    script = script_name()
    if script.startswith("lab" + os.sep) or not os.path.isfile(os.path.join(ROOT, "lab", script)) or \
            flag in {f.name for f in fields(TrainConfig)} | flags(script):  # the lesson's own
        return None
    lab = flags("lab", "config.py") | flags("lab", script) | flags("lab", "environments.py")
    return f"lab/{script}" if flag in lab else None


def where_the_flags_are(message):
    """An error message, and in a lesson script the lab script that has the flags it names which this one lacks."""
    lab_only = [flag for flag in dict.fromkeys(re.findall(r"--\w+", message)) if lab_script(flag[2:])]
    kind = "a flag" if len(lab_only) == 1 else "flags"
    return f"{message} ({', '.join(lab_only)}: {kind} of lab/{script_name()} (the lab), not of {script_name()})" \
        if lab_only else message


def say(message):
    """A warning or note on stderr, once per launch (before the Accelerator exists)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


HELD_FOLDERS = {}  # the --output_dir folders this process holds the lock of: path -> the open folder


def lock_output_dir(output_dir):
    """Hold the lock of output_dir (flock on the folder, made if need be) while this process lives: a second run
    given the same --output_dir stops here with one line, instead of interleaving metrics.jsonl and deleting the
    other's checkpoint in the middle of its save. The kernel releases it when the process ends, however it ends."""
    path = os.path.realpath(output_dir)
    if path in HELD_FOLDERS:
        return
    os.makedirs(path, exist_ok=True)
    folder = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(folder)
        raise SystemExit(f"error: --output_dir {output_dir!r} is in use by another run (it holds the folder's lock): "
                         "wait for it to end, or give another --output_dir.") from None
    HELD_FOLDERS[path] = folder


def check_output_dir(cfg, script):
    """--output_dir must be (or become) a writable folder that holds no other script's run."""
    existing = os.path.abspath(cfg.output_dir)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"--output_dir {cfg.output_dir!r}: {existing} is a file, not a folder.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--output_dir {cfg.output_dir!r}: {existing} is not writable.")
    earlier = read_json(os.path.join(cfg.output_dir, "config.json")).get("script")
    if earlier and earlier != script:
        raise ValueError(f"--output_dir {cfg.output_dir!r} holds a run of {earlier}: give {script} another "
                         "--output_dir.")


@functools.cache
def reward_function(spec):
    """The callable of --reward_fn FILE.py:NAME; its file is run once per process (the first call). A missing file or
    name, or a file that fails to import, is a ValueError naming the flag."""
    path, _, name = spec.rpartition(":")
    if not path.endswith(".py") or not name.isidentifier():
        raise ValueError(f"--reward_fn {spec!r}: give FILE.py:NAME, e.g. examples/rewards.py:format_reward.")
    module = load_file("--reward_fn", spec, path)
    function = vars(module).get(name)
    if not callable(function):
        defined = [k for k, v in vars(module).items()
                   if isinstance(v, types.FunctionType) and v.__module__ == module.__name__]
        raise ValueError(f"--reward_fn {spec!r}: {path} defines no function {name!r} (it defines {defined}).")
    return function


def read_json(path):
    """The JSON object in path, or {} when there is none (or a killed run left it unfinished)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def check_rules(cfg, **rules):
    """Check the flags named, each against its Rule: --name must be <text> (got value). A flag left unset (None)
    passes."""
    for name, rule in rules.items():
        value = vars(cfg)[name]
        check(value is None or rule.ok(value), f"--{name} must be {rule.text} (got {value!r}).")


def check(ok, message):
    """One check of a Config's flags: unless ok, the message (which names the flag to change) as a
    ValueError, which parse_config prints as one line."""
    if not ok:
        raise ValueError(message)


# ---- the user's files ----
def load_file(flag, spec, path):
    """The module of the FILE.py given to flag (spec, the flag's value); a missing file or one that fails to import is
    a ValueError naming the flag."""
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {spec!r}: no such file {path!r}.")
    found = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(found)
    try:
        found.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{flag} {spec!r}: importing {path} raised {type(e).__name__}: {' '.join(str(e).split())}") \
            from e
    return module


def check_json_lines(path):
    """SystemExit with one line naming the file and the line for the first line of a JSON Lines file that is not
    UTF-8 or not a JSON object, or for a file without one (the datasets library says neither, in a traceback)."""
    rows = 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            where = f"error: --dataset {path!r} line {number}"
            try:
                row = json.loads(line.decode("utf-8")) if line.strip() else None
            except UnicodeDecodeError as e:
                raise SystemExit(f"{where}: not UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line; "
                                 "latin-1?): save the file as UTF-8.") from None
            except (ValueError, RecursionError) as e:  # (an int of 5,000 digits, nesting past the stack)
                why = f"{e.msg} at character {e.pos + 1}" if isinstance(e, json.JSONDecodeError) else e
                raise SystemExit(f"{where}: not JSON ({why}).") from None
            if row is not None and not isinstance(row, dict):
                raise SystemExit(f"{where}: a JSON {type(row).__name__}, not an object of columns.")
            rows += row is not None
    if not rows:
        raise SystemExit(f"error: --dataset {path!r} holds no rows: each line of a .jsonl file is one JSON object.")
