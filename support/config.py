"""Configuration every script shares: TrainConfig (each algorithm file subclasses it with
what it adds), GroupConfig (the group methods' shared fields and defaults), parsing and the
Accelerator."""
import functools
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from support import user_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMBEDDED_MODEL = os.path.join(ROOT, "embedded_model")
EMBEDDED_TEACHER = os.path.join(EMBEDDED_MODEL, "teacher")  # opd.py's (embedded_model/build.py --teacher)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Flags a resumed run may change: they decide how long to run, what to write and how much memory a step
# takes (the steps stay the same up to rounding), not the steps themselves. Any other difference from the
# checkpoint's flags is refused (the optimizer state would also silently restore its --learning_rate).
RESUMABLE_CHANGES = ("num_steps", "eval_every", "log_every", "log_rollouts", "save_steps", "save_total_limit",
                     "save_model", "merge_lora", "report_to", "output_dir", "resume_from", "gradient_checkpointing",
                     "micro_batch_size", "generation_batch_size", "fast")


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
DUAL_CLIP = Rule(lambda v: v == 0 or v > 1, "0 (off) or > 1")


@dataclass
class BaseConfig:
    """The flags every training script has: the lesson files' (helpers.TrainConfig) and the lab's (TrainConfig adds
    the rest). A lesson file keeps each lab flag at its default: the class attributes after the fields."""
    model_name_or_path: str = arg(EMBEDDED_MODEL, "Causal LM: Hub name or local folder (default: the embedded model).")
    dataset: str = arg("arithmetic", "'arithmetic' (built-in), 'gsm8k' (Hub) or a local .json/.jsonl/.parquet file.")
    # action "extend": the flag can be repeated, each time with one or more values
    reward_fn: list[str] = field(default_factory=list, metadata={"action": "extend", "help": (
        "A reward function FILE.py:NAME, f(completions, **kwargs) -> list of float or None as in TRL, "
        "added to the reward (repeatable).")})
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

    # the lab's flags (TrainConfig's fields), at their defaults
    prompt_column, answer_column, answer_check, system_prompt = "question", "answer", "number", ""
    eval_size, train_size, use_chat_template, max_prompt_length = 200, 0, True, 512
    torch_dtype, gradient_checkpointing, lora_alpha, lora_target_modules, merge_lora = "float32", False, 16, \
        "all-linear", False
    reward_model, reward_model_dtype, reward_model_weight, rule_reward_weight = "", "float32", 1.0, 1.0
    reward_weights = ()
    warmup_steps, generation_batch_size, log_rollouts, report_to = 0, 0, 0, "none"
    save_total_limit, save_model, async_rollouts, fast, keep_routing = 2, True, 0, True, "none"

    def __post_init__(self):
        check_rules(self, **{name: POSITIVE for name in ("num_steps", "batch_size", "learning_rate", "max_new_tokens",
                                                        "temperature", "eval_every", "log_every")})
        check_rules(self, **{name: NON_NEGATIVE for name in ("lora_r", "save_steps", "max_grad_norm", "top_k",
                                                            "micro_batch_size")})
        check_rules(self, top_p=Rule(lambda v: 0 < v <= 1, "in (0, 1]"), reward_scales=one_of("uniform", "hetero"))
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


@dataclass
class TrainConfig(BaseConfig):
    """The lab's flags (lab/*.py), after BaseConfig's."""
    prompt_column: str = arg("question", "Prompt column of --dataset gsm8k or a local file.")
    answer_column: str = arg("answer", "Answer column ('' for prompts without answers, scored by --reward_fn or "
                             "--reward_model).")
    answer_check: str = arg("number", "How the rule reward checks a completion of gsm8k or a file against its answer: "
                            "'number' (equal final numbers) or 'exact' (equal text once stripped).")
    system_prompt: str = arg("", "System message for each prompt of gsm8k or a file (its own turn in the chat "
                             "template; without one, text and a blank line before the prompt).")
    eval_size: int = arg(200, "Held-out prompts of a real dataset (its test split, else the file's last rows).")
    train_size: int = arg(0, "Train on the first N training prompts only (0 = all): a small pool, visited again.")
    use_chat_template: bool = arg(True, "Wrap prompts in the tokenizer's chat template when it has one.")
    max_prompt_length: int = arg(512, "Prompts longer than this many tokens are dropped (with a warning).")
    torch_dtype: str = arg("float32", "Weights dtype: float32 (for mixed precision), bfloat16 or float16.")
    gradient_checkpointing: bool = arg(False, "Recompute activations in backward: less memory, more time.")
    reward_model: str = arg("", "A sequence-classification reward model (Hub name or folder) scoring each completion.")
    reward_model_dtype: str = arg("float32", "dtype of the reward model (float32, bfloat16, float16).")
    reward_model_weight: float = arg(1.0, "Weight of the reward-model score in the reward.")
    rule_reward_weight: float = arg(1.0, "Weight of the rule (correctness) reward; 0 with --reward_model for RLHF.")
    reward_weights: list[float] = field(default_factory=list, metadata={"action": "extend", "help": (
        "One weight per --reward_fn, in order (default: 1 each).")})
    lora_alpha: int = arg(16, "LoRA alpha.")
    lora_target_modules: str = arg("all-linear", "Comma-separated module names for LoRA, or 'all-linear'.")
    merge_lora: bool = arg(False, "Save the final model with the LoRA adapter merged into the weights.")
    warmup_steps: int = arg(0, "Linear learning-rate warm-up steps, then constant.")
    generation_batch_size: int = arg(0, "Sequences per generate call on each process (0 = all at once).")
    log_rollouts: int = arg(4, "Show N completions of step 1, each evaluation and the last step, token by token, in "
                            "output_dir/rollouts.html (0 = off; docs/viewer.md).")
    report_to: str = arg("none", "Extra trackers: 'none', 'tensorboard' or 'wandb'.")
    save_total_limit: int = arg(2, "Keep the newest N complete checkpoints in --output_dir, delete older ones "
                                "(0 = keep all).")
    save_model: bool = arg(True, "Save the final policy with save_pretrained (+ tokenizer) in output_dir/final.")
    async_rollouts: int = arg(0, "Sample in a process of its own, up to K optimizer steps ahead of the learner (0 = "
                              "in turn with the updates; docs/async.md).")
    fast: bool = arg(True, "Sample and score with support/fast.py (False: the plain common.generate and "
                     "common.token_logprobs, the same draws and values, to read or step through).")
    keep_routing: str = arg("none", "Mixture-of-experts policy: the experts of the trainer's forwards. none: its "
                            "router's | r3: the sampler's, replayed | r2: the pi_old pass's, replayed in the updates "
                            "(docs/stability.md).")

    # Set by a script's __post_init__ where they apply: the clip of its loss (a common.Clip, which the rollout viewer
    # shows), and whether an update follows the first on the same batch (a pi_old pass, which --keep_routing r2
    # replays and which makes the samples off-policy for --geo_mask_delta). Not flags.
    clip = None
    reuses_batch = False

    def __post_init__(self):
        super().__post_init__()
        check_rules(self, max_prompt_length=POSITIVE, eval_size=POSITIVE)
        check_rules(self, **{name: NON_NEGATIVE for name in ("train_size", "save_total_limit", "generation_batch_size",
                                                            "log_rollouts")})
        check_rules(self, keep_routing=one_of("none", "r2", "r3"))
        check(self.keep_routing != "r2" or self.reuses_batch,
              "--keep_routing r2 replays the routing of the pi_old pass in the updates that follow it, and this run "
              "makes one update per batch (no pi_old pass): give --num_epochs > 1, or --keep_routing r3.")
        check_rules(self, report_to=one_of("none", "tensorboard", "wandb"),
                    answer_check=one_of("number", "exact"), async_rollouts=NON_NEGATIVE)
        check_rules(self, torch_dtype=one_of(*DTYPES), reward_model_dtype=one_of(*DTYPES))
        if self.torch_dtype != "float32" and self.lora_r == 0:
            say(f"warning: --torch_dtype {self.torch_dtype} without --lora_r trains the weights in "
                f"{self.torch_dtype} itself, where an update below about 0.3% (bfloat16) or 0.05% (float16) of "
                "a weight rounds away, as most do at --learning_rate 1e-6. Keep float32 weights with "
                "`accelerate launch --mixed_precision bf16`, or train a LoRA adapter (--lora_r).")
        if self.system_prompt and self.dataset in ("arithmetic", "tool_arithmetic"):
            raise ValueError("--system_prompt is for instruct models on --dataset gsm8k or a file; the arithmetic "
                             "task's prompts are bare sums.")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_fn):
            raise ValueError(f"--reward_weights has {len(self.reward_weights)} values for {len(self.reward_fn)} "
                             "--reward_fn: give one weight per function, in order.")
        if self.rule_reward_weight == 0 and not (self.reward_model or self.reward_fn):
            raise ValueError("--rule_reward_weight 0 leaves no reward: give --reward_fn or --reward_model too.")
        if not self.answer_column and not (self.reward_model or self.reward_fn) and self.dataset != "arithmetic":
            raise ValueError("--answer_column '' (no answers) needs a --reward_fn or --reward_model to score "
                             "completions.")


@dataclass
class CorrectionConfig(TrainConfig):
    """The corrections of a sampler with other weights than the trainer's (docs/stability.md; docs/async.md)."""
    tis_cap: float = arg(0.0, "Truncated importance sampling: weigh each token by min(pi_train / pi_rollout, C) "
                         "(0 = off; 2 is common).")
    geo_mask_delta: float = arg(0.0, "Mask a sequence with A < 0 whose mean log(pi_old / pi_theta) exceeds delta "
                                "(0 = off).")
    tis_level: str = arg("token", "The TIS weight: per token, or per sequence (the product of its tokens' ratios, "
                         "truncated at --tis_cap; unbiased for a sequence's gradient).")
    tis_veto: float = arg(0.0, "Drop a sequence any of whose tokens has pi_train / pi_rollout below this (0 = off).")
    m2po_tau: float = arg(0.0, "M2PO: mask the tokens of largest log(pi_theta / pi_rollout)^2 until their mean is "
                          "<= tau (0 = off; the paper: 0.04).")

    def sampler_differs(self):
        """Whether the samples come from other weights than the trainer's, and the flags that make them so."""
        return self.async_rollouts > 0, "--async_rollouts > 0"

    def __post_init__(self):
        super().__post_init__()
        check_rules(self, tis_level=one_of("token", "sequence"), tis_veto=Rule(lambda v: 0 <= v < 1, "in [0, 1)"),
                    m2po_tau=NON_NEGATIVE, geo_mask_delta=NON_NEGATIVE,
                    tis_cap=Rule(lambda v: v == 0 or v >= 1, "0 (off) or >= 1"))
        differs, give = self.sampler_differs()
        for name in ("tis_cap", "tis_veto", "m2po_tau"):  # with the same weights their ratio is 1
            check(vars(self)[name] == 0 or differs, f"--{name} corrects a sampler that differs from the trainer: give "
                  f"{give}.")
        check(self.tis_level == "token" or self.tis_cap > 0, "--tis_level sequence weighs by the truncated "
              "sequence ratio: give --tis_cap too (e.g. 2).")
        check(self.geo_mask_delta == 0 or differs or self.reuses_batch, "--geo_mask_delta masks off-policy samples, "
              f"and these are on-policy: give {give} or --num_epochs > 1.")


@dataclass
class GroupConfig(CorrectionConfig):
    """What GRPO, RLOO and DAPO share: a group of samples per prompt is the baseline."""
    num_generations: int = arg(8, "G (or K): sampled completions per prompt, >= 2; batch_size / G prompts per step.")
    # With G samples per prompt a step sees batch_size / G = 8 prompts: held-out accuracy on the
    # embedded task still rises at 200 steps and levels off near 600 (docs/group_family.md).
    num_steps: int = arg(600, "Optimizer steps (one rollout batch each).")
    eval_every: int = arg(50, "Held-out greedy accuracy every N steps (and at start and end).")
    rollout_dtype: str = arg("float32", "Sample with a copy of the policy in this dtype, synced every step "
                             "(the same as --torch_dtype: no copy, the trainer samples).")
    rollout_lag: int = arg(0, "Sample with the policy of k optimizer steps ago, as an asynchronous trainer does "
                           "(0 = this step's weights).")

    def sampler_differs(self):
        differs = self.rollout_dtype != self.torch_dtype or self.rollout_lag > 0 or self.async_rollouts > 0
        return differs, f"--rollout_dtype other than --torch_dtype ({self.torch_dtype}), --rollout_lag > 0 or " \
            "--async_rollouts > 0"

    def __post_init__(self):
        check_rules(self, rollout_dtype=one_of(*DTYPES), rollout_lag=NON_NEGATIVE)
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(f"--num_generations must be >= 2: the group is the baseline (got {self.num_generations}).")
        if self.batch_size % self.num_generations:
            raise ValueError(f"--batch_size ({self.batch_size}) must be divisible by --num_generations "
                             f"({self.num_generations}): batch_size counts completions, batch_size / num_generations "
                             "prompts are sampled per step.")


def script_name():
    """The running script as runs name it: grpo.py (the lesson) or lab/grpo.py (the lab's)."""
    path = os.path.abspath(sys.argv[0])
    return os.path.relpath(path, ROOT) if path.startswith(ROOT + os.sep) else os.path.basename(path)


def parse_config(config_class, args=None):
    """Parse the command line into `config_class`; a bad value exits with one clear line. (What needs a
    checkpoint's files, --resume_from latest among them, is checked by checkpoint.Checkpointer.resume.)"""
    script = script_name()
    parser = command_line(config_class)
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
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]
    close = difflib.get_close_matches(name, flags, n=1)
    return f"unknown flag {flag.split('=')[0]}; " + (f"did you mean {close[0]}?" if close else
                                                       f"{parser.prog} --help lists the flags.")


def say(message):
    """A warning or note on stderr, once per launch (before the Accelerator exists)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)


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
    module = user_files.load_file("--reward_fn", spec, path)
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
