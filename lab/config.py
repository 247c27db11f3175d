"""The lab's flags: LabConfig (every lab loop's, after the lesson's support/config.TrainConfig), CorrectionConfig
(the corrections of a sampler that is not the trainer) and GroupConfig (the group methods' shared fields and
defaults). Each lab/<script>.py subclasses one of them with what its algorithm adds."""
import importlib.util
from dataclasses import dataclass, field

from support.config import FRACTION, NON_NEGATIVE, POSITIVE, Rule, TrainConfig, arg, check, check_rules, one_of, say

DTYPES = ("float32", "bfloat16", "float16")  # the precisions a flag may name, each a torch dtype's name
DUAL_CLIP = Rule(lambda v: v == 0 or v > 1, "0 (off) or > 1")


@dataclass
class LabConfig(TrainConfig):
    """The lab's flags (lab/*.py), after TrainConfig's (the lesson's)."""
    prompt_column: str = arg("question", "Prompt column of --dataset gsm8k or a local file.")
    answer_column: str = arg("answer", "Answer column ('' for prompts without answers, scored by --reward_fn or "
                             "--reward_model).")
    answer_check: str = arg("number", "How the rule reward checks a completion of gsm8k or a file against its answer: "
                            "'number' (equal final numbers), 'exact' (equal text once stripped) or 'math' (equal "
                            "values by math-verify: requirements-math.txt).")
    prompt_template: str = arg("chat", "A real dataset's prompt: 'chat' (the tokenizer's chat template, where it "
                               "has one and --use_chat_template) or 'r1_zero' (DeepSeek-R1-Zero's, for a base model).")
    format_reward_weight: float = arg(0.0, "Weight of R1's format reward: 1 for '<think>...</think><answer>..."
                                      "</answer>', else 0 (0 = off).")
    system_prompt: str = arg("", "System message for each prompt of gsm8k or a file (its own turn in the chat "
                             "template; without one, text and a blank line before the prompt).")
    eval_size: int = arg(200, "Held-out prompts of a real dataset (its test split, else the file's last rows).")
    eval_samples: int = arg(0, "Also sample k completions of each held-out prompt: eval/pass@k and eval/mean@k "
                            "(0 = off).")
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
    fast: bool = arg(True, "Sample and score with the fast paths (lab/decode.py; False: the plain common.generate and "
                     "common.token_logprobs, the same draws and values, to read or step through).")
    keep_routing: str = arg("none", "Mixture-of-experts policy: the experts of the trainer's forwards. none: its "
                            "router's | r3: the sampler's, replayed | r2: the pi_old pass's, replayed in the updates "
                            "(docs/stability.md).")
    sampler: str = arg("independent", "What draws the completions: independent (this repository's decode loop) | "
                       "vllm (a vLLM engine in a process of its own: docs/vllm.md) | tree (the group methods' TreePO).")
    vllm_python: str = arg("", "--sampler vllm: the Python of the engine's environment (default: .venv-vllm/bin/python "
                           "in this repository, which `bash lab/install_vllm.sh` makes).")
    vllm_memory: float = arg(None, "--sampler vllm: the share of the GPU's memory the engine takes for its weights "
                             "and cache; on a CPU, of the machine's (default 0.3 on a GPU, 0.1 on a CPU).")
    # the samplers a script offers (lab/budget.py's ExplorationConfig adds TreePO's trees)
    SAMPLERS = ("independent", "vllm")

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
        check_rules(self, keep_routing=one_of("none", "r2", "r3"), sampler=one_of(*self.SAMPLERS),
                    vllm_memory=FRACTION)
        check(self.sampler == "vllm" or not (self.vllm_python or self.vllm_memory), "--vllm_python and "
              "--vllm_memory set up --sampler vllm's engine: give --sampler vllm too.")
        check(self.keep_routing != "r2" or self.reuses_batch,
              "--keep_routing r2 replays the routing of the pi_old pass in the updates that follow it, and this run "
              "makes one update per batch (no pi_old pass): give --num_epochs > 1, or --keep_routing r3.")
        check_rules(self, report_to=one_of("none", "tensorboard", "wandb"),
                    answer_check=one_of("number", "exact", "math"), async_rollouts=NON_NEGATIVE)
        check_rules(self, prompt_template=one_of("chat", "r1_zero"), format_reward_weight=NON_NEGATIVE,
                    eval_samples=NON_NEGATIVE)
        check(self.answer_check != "math" or importlib.util.find_spec("math_verify"), "--answer_check math checks "
              "answers with math-verify, which is not installed: pip install -r requirements-math.txt")
        real = self.dataset not in ("arithmetic", "tool_arithmetic")
        check(real or self.prompt_template == "chat", "--prompt_template r1_zero is for --dataset gsm8k or a file; "
              "the arithmetic task's prompts are bare sums.")
        check(real or self.answer_check != "math", "--answer_check math is for --dataset gsm8k or a file; the "
              "arithmetic task's answers are checked exactly.")
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
class CorrectionConfig(LabConfig):
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
        """Whether the samples come from another model than the trainer's (other weights, or another engine's
        kernels), and the flags that make them so."""
        return self.async_rollouts > 0 or self.sampler == "vllm", "--async_rollouts > 0 or --sampler vllm"

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
                             "(the same as --torch_dtype: no copy, the trainer samples); --sampler vllm: the engine's.")
    rollout_lag: int = arg(0, "Sample with the policy of k optimizer steps ago, as an asynchronous trainer does "
                           "(0 = this step's weights).")

    def sampler_differs(self):
        differs = self.rollout_dtype != self.torch_dtype or self.rollout_lag > 0 or self.async_rollouts > 0 or \
            self.sampler == "vllm"
        return differs, f"--rollout_dtype other than --torch_dtype ({self.torch_dtype}), --rollout_lag > 0, " \
            "--async_rollouts > 0 or --sampler vllm"

    def __post_init__(self):
        check_rules(self, rollout_dtype=one_of(*DTYPES), rollout_lag=NON_NEGATIVE)
        super().__post_init__()
        if self.num_generations < 2:
            raise ValueError(f"--num_generations must be >= 2: the group is the baseline (got {self.num_generations}).")
        if self.batch_size % self.num_generations:
            raise ValueError(f"--batch_size ({self.batch_size}) must be divisible by --num_generations "
                             f"({self.num_generations}): batch_size counts completions, batch_size / num_generations "
                             "prompts are sampled per step.")
