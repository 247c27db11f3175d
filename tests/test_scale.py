"""From the laptop to the cluster, offline: real-data loading and the math reward, reward
models, LoRA, mixed precision, checkpoints and resume."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from lab import config as lab_config
from lab import tasks
from lab.checkpointer import Checkpointer
from lab.reward_model import RewardModel
from support import config, models
from support.run import read_metrics
from conftest import ROOT, run_together

CPU = Accelerator(cpu=True)

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "A box holds 12 eggs. How many in 2 boxes?", "answer": "12 * 2 = 24\n#### 24"},
    {"question": "Sara had 1,000 coins and spent 1. How many left?", "answer": "#### 999"},
    {"question": "What is 10 - 3?", "answer": "#### 7"},
]


def command(args, tmp_path, script="lab/remax.py"):
    return [sys.executable, script, "--num_steps", "2", "--eval_every", "2", "--batch_size", "8", "--output_dir",
            str(tmp_path / "run"), *args]


def run(args, tmp_path, env=None, script="lab/remax.py"):
    return subprocess.run(command(args, tmp_path, script), cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def run_all(runs, tmp_path):
    """Independent runs of lab/remax.py at once, one thread each."""
    return run_together([command(args, tmp_path) for args in runs], env={**os.environ, "OMP_NUM_THREADS": "1"})


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("text, number", [
    ("so the total is 7.\n#### 7", "7"), ("#### 1,234", "1234"), ("the answer is \\boxed{42}.", "42"),
    ("first 3, then 5, finally 8", "8"), ("price 7.50 dollars", "7.5"), ("-3 degrees", "-3"), ("no number", None),
    ("1,2,3", "123"), ("a ,,,5 b", "5"), ("#### ,5", "5"), ("it is ,.5", ".5"), ("1,234.", "1234"),
])
def test_extract_final_number(text, number):
    assert tasks.extract_final_number(text) == number


def test_the_final_number_of_a_run_of_commas_is_found_in_linear_time():
    """A degenerate policy's run of commas: the number pattern once tried each run from each of its commas (16,000
    commas: 16.8 s to read one answer on a loaded 2-core machine, quadratic in the run); 200,000 end well within the
    limit."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from support import tasks; "
            "print(tasks.extract_final_number(',' * 200_000 + '7'), tasks.extract_final_number('1' + ',' * 200_000))")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["7", "1"], out.stderr[-2000:]


def test_math_reward_compares_final_numbers_exactly():
    ex = {"prompt": "q", "answer": "24", "family": "all", "check": "number"}
    rewards, correct = tasks.compute_rewards([ex] * 3, ["so #### 24", "24.0", "about 25"])
    assert rewards.tolist() == [1.0, 1.0, 0.0] and correct.tolist() == [1.0, 1.0, 0.0]


def test_local_gsm8k_file_loads_with_answers_and_held_out_rows(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    cfg = lab_config.LabConfig(dataset=path, eval_size=1)
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)
    train, held_out = tasks.load_task(cfg, tok)
    assert [ex["answer"] for ex in train] == ["7", "24", "999"] and [ex["answer"] for ex in held_out] == ["7"]
    assert train[0]["raw_prompt"] == GSM8K_ROWS[0]["question"]


def test_dataset_missing_column_names_the_flag_and_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"problem": "1+1", "solution": "2"}] * 4)
    out = run(["--dataset", path], tmp_path)
    assert out.returncode != 0
    assert "--prompt_column 'question'" in out.stderr and "problem" in out.stderr and "Traceback" not in out.stderr


def test_remax_trains_on_a_local_gsm8k_file(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    out = run(["--dataset", path, "--eval_size", "2", "--max_prompt_length", "64"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "dropped" not in out.stdout  # every prompt fits in 64 characters-tokens
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert rows[-1]["step"] == 2 and "eval/acc_all" in rows[-1]


def test_prompts_longer_than_max_prompt_length_are_dropped_with_a_warning(tmp_path, capsys):
    rows = [{"question": "1+2=", "answer": "3"}, {"question": "1+2+3+4+5=", "answer": "15"}, {"question": "2+2=", "answer": "4"}]
    cfg = lab_config.LabConfig(dataset=write_jsonl(tmp_path / "d.jsonl", rows), eval_size=1, max_prompt_length=4)
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)  # one token per character
    train, held_out = tasks.load_task(cfg, tok)
    assert [ex["answer"] for ex in train] == ["3"] and [ex["answer"] for ex in held_out] == ["4"]
    assert "dropped 1 train prompts longer than --max_prompt_length 4" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--max_prompt_length"):
        tasks.load_task(lab_config.LabConfig(dataset=cfg.dataset, eval_size=1, max_prompt_length=2), tok)


def make_reward_model(path):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)
    torch.manual_seed(0)
    rm_config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    AutoModelForSequenceClassification.from_config(rm_config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_reward_model_score_is_combined_with_the_rule_reward(tmp_path):
    rm_path = make_reward_model(tmp_path / "rm")
    cfg = lab_config.LabConfig(reward_model=rm_path, rule_reward_weight=0.5, reward_model_weight=2.0)
    reward_fn = tasks.make_reward_fn(cfg, CPU)
    examples = [{"prompt": "12+3=", "answer": "15", "family": "add_2x1"}] * 2
    rewards, correct, _ = reward_fn(examples, ["15", "16"])
    reward_model = RewardModel(rm_path, "float32", CPU)
    scores = reward_model(["12+3="] * 2, ["15", "16"])
    assert torch.allclose(rewards, 0.5 * torch.tensor([1.0, 0.0]) + 2.0 * scores)
    assert correct.tolist() == [1.0, 0.0]
    assert not any(p.requires_grad for p in reward_model.model.parameters())


def test_reward_model_scores_in_micro_batches_equal_one_pass(tmp_path):
    rm_path = make_reward_model(tmp_path / "rm")
    prompts, completions = ["12+3=", "4+5=", "99+1=", "7*8="], ["15", "9", "1000", "56123"]  # different lengths
    one_pass = RewardModel(rm_path, "float32", CPU)(prompts, completions)
    chunked = RewardModel(rm_path, "float32", CPU, micro_batch_size=3)(prompts, completions)
    assert one_pass.std() > 0
    torch.testing.assert_close(chunked, one_pass, rtol=0, atol=1e-5)


def test_remax_runs_with_a_reward_model(tmp_path):
    out = run(["--reward_model", make_reward_model(tmp_path / "rm"), "--rule_reward_weight", "0"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_non_finite_reward_is_reported_with_prompt_and_completion():
    cfg = lab_config.LabConfig(rule_reward_weight=float("nan"))
    reward_fn = tasks.make_reward_fn(cfg, CPU)
    with pytest.raises(SystemExit, match="12\\+3="):
        reward_fn([{"prompt": "12+3=", "answer": "15", "family": "add_2x1"}], ["15"])


def test_lora_reference_is_the_base_model_with_adapter_disabled():
    cfg = lab_config.LabConfig(lora_r=4)
    policy = models.load_model(cfg)
    for name, p in policy.named_parameters():  # make the adapter non-trivial
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    ref = models.load_reference(cfg, policy)
    base = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    ids = torch.tensor([[4, 5, 13, 6, 16]])
    with torch.no_grad():
        assert torch.allclose(ref(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-6)
        assert not torch.allclose(policy(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-3)
    assert sum(p.numel() for p in ref.parameters()) == 0  # no second copy of the weights


def test_lora_run_saves_the_adapter_and_merges_on_request(tmp_path):
    runs = run_all([["--lora_r", "4", "--learning_rate", "1e-2"],
                    ["--lora_r", "4", "--learning_rate", "1e-2", "--merge_lora", "--output_dir", str(tmp_path / "merged")]],
                   tmp_path)
    assert all(out.returncode == 0 for out in runs), [out.stderr[-2000:] for out in runs]
    assert (tmp_path / "run" / "final" / "adapter_config.json").exists()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged" / "final")
    base = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    assert max((a - b).abs().max().item() for a, b in zip(merged.parameters(), base.parameters())) > 0


@pytest.mark.parametrize("path", [common, models], ids=["common", "fast"])
def test_logprobs_are_fp32_under_bf16_autocast(path, monkeypatch):
    """Under bf16 autocast the logits come out in bfloat16; the log-softmax must then be taken in
    float32. A dtype check alone passes for a bf16 log-softmax cast at the end (`.float()` last),
    so compare the values: they match the fp32 log-softmax of the same bf16 logits to 1e-6, while
    a bf16 log-softmax is off by more than 1e-3 (bf16 keeps 8 bits of mantissa). The definition
    (common.py) and the fast path (support/models.py) alike, each against the logits it computed itself:
    the fast path runs a group's prompt once, and its bf16 logits need not be a separate full forward's
    (they are not on a processor without AVX-512, or under ATEN_CPU_CAPABILITY=avx2)."""
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    ids, mask = torch.tensor([[4, 5, 13, 6, 16, 7, 9, 12]]), torch.ones(1, 8, dtype=torch.long)
    seen = []  # the (1, 5, V) logits the path scores
    if path is models:
        completion_logits = models.completion_logits
        monkeypatch.setattr(models, "completion_logits", lambda *args: seen.append(completion_logits(*args)) or seen[-1])
    else:
        model.register_forward_hook(lambda module, args, out: seen.append(out.logits[:, -6:-1]))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp = path.token_logprobs(model, ids, mask, 5, temperature=0.7)
    (logits,) = seen
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert logits.dtype == torch.bfloat16 and logp.dtype == torch.float32
    targets = ids[:, -5:, None]
    fp32 = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, targets).squeeze(-1)
    bf16 = torch.log_softmax(logits / 0.7, -1).gather(-1, targets).squeeze(-1).float()
    torch.testing.assert_close(logp, fp32, rtol=0, atol=1e-6)
    assert (bf16 - fp32).abs().max() > 1e-3


def test_bf16_mixed_precision_run_starts_at_exactly_zero_kl(tmp_path):
    """The reference runs under the policy's autocast: with the same weights at step 1 (before the first
    update) their log-probs are identical, so the KL is exactly 0 (fp32 reference: ~6e-3 per sequence)."""
    out = run([], tmp_path, env={"ACCELERATE_MIXED_PRECISION": "bf16"})
    assert out.returncode == 0, out.stderr[-2000:]
    first = next(r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["step"] == 1)
    assert first["train/kl_seq"] == 0.0


def comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def test_resume_reproduces_an_uninterrupted_run(tmp_path):
    full, half = run_all([["--num_steps", "4", "--output_dir", str(tmp_path / "full")],
                          ["--num_steps", "2", "--save_steps", "2", "--output_dir", str(tmp_path / "half")]], tmp_path)
    assert full.returncode == 0 and half.returncode == 0, full.stderr[-2000:] + half.stderr[-2000:]
    ckpt = tmp_path / "half" / "checkpoint-2"
    for f in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "sampler_rank0.json", "trainer_state.json", "model/config.json"):
        assert (ckpt / f).exists(), f
    AutoModelForCausalLM.from_pretrained(ckpt / "model")  # the saved policy loads with from_pretrained
    (resumed,) = run_all([["--num_steps", "4", "--output_dir", str(tmp_path / "half"), "--resume_from", str(ckpt)]],
                         tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a = comparable(read_metrics(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(read_metrics(tmp_path / "half" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    assert a == b


def test_sigterm_saves_a_checkpoint_before_exiting(tmp_path):
    out_dir = tmp_path / "run"
    cmd = [sys.executable, "lab/remax.py", "--num_steps", "100000", "--eval_every", "100000", "--batch_size", "4", "--output_dir", str(out_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out_dir / "metrics.jsonl").exists() or len(read_metrics(out_dir / "metrics.jsonl")) < 2:
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    ckpts = list(out_dir.glob("checkpoint-*"))
    assert len(ckpts) == 1 and (ckpts[0] / "model" / "config.json").exists()


def test_non_finite_loss_saves_last_good_state_and_stops(tmp_path):
    from accelerate import Accelerator

    cfg = lab_config.LabConfig(output_dir=str(tmp_path))
    accelerator = Accelerator(cpu=True)
    policy = accelerator.prepare(models.load_model(cfg))
    tokenizer = models.load_tokenizer(cfg)
    ckpt = Checkpointer(cfg, accelerator, tasks.PromptSampler([{"prompt": "1"}], 1, 0))
    ckpt.check_finite(5, torch.tensor(1.0), torch.tensor(2.0), policy, tokenizer)  # finite: nothing happens
    assert not list(tmp_path.glob("checkpoint-*"))
    with pytest.raises(SystemExit, match="non-finite loss"):
        ckpt.check_finite(5, torch.tensor(float("nan")), torch.tensor(2.0), policy, tokenizer)
    with pytest.raises(SystemExit, match="gradient norm"):
        ckpt.check_finite(7, torch.tensor(1.0), torch.tensor(float("inf")), policy, tokenizer)
    assert (tmp_path / "checkpoint-4" / "model" / "config.json").exists()
    assert (tmp_path / "checkpoint-6" / "trainer_state.json").exists()


def test_same_seed_gives_identical_metrics(tmp_path):
    runs = run_all([["--output_dir", str(tmp_path / "a")], ["--output_dir", str(tmp_path / "b")],
                    ["--output_dir", str(tmp_path / "c"), "--seed", "1"]], tmp_path)
    assert all(out.returncode == 0 for out in runs), [out.stderr[-2000:] for out in runs]
    rows_a = comparable(read_metrics(tmp_path / "a" / "metrics.jsonl"))
    assert rows_a == comparable(read_metrics(tmp_path / "b" / "metrics.jsonl"))
    assert comparable(read_metrics(tmp_path / "c" / "metrics.jsonl"))[1:] != rows_a[1:]


def test_gradient_checkpointing_run(tmp_path):
    out = run(["--gradient_checkpointing"], tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]


def test_a_reward_that_raises_is_reported_and_nothing_is_applied(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("answer")

    monkeypatch.setattr(tasks, "compute_rewards", broken)
    reward_fn = tasks.make_reward_fn(lab_config.LabConfig(), CPU)
    with pytest.raises(SystemExit, match="reward raised KeyError.*12\\+3="):
        reward_fn([{"prompt": "12+3=", "answer": "15", "family": "add_2x1"}], ["15"])


@pytest.mark.parametrize("name", ["cpu_2proc", "ddp_8gpu", "multi_node", "zero2", "zero3"])
def test_accelerate_configs_parse(name):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(ROOT / "configs" / f"{name}.yaml"))
    assert config.num_processes >= 2
    if name.startswith("zero"):
        assert config.deepspeed_config["zero_stage"] == int(name[-1])


def fraction_changed_by_ten_small_steps(dtype):
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL, dtype=dtype)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    ids = torch.tensor([[4, 5, 13, 6, 16, 7]])
    for _ in range(10):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return sum((p != s).sum().item() for p, s in zip(model.parameters(), start)) / sum(s.numel() for s in start)


def test_low_precision_weights_without_lora_warn_that_small_updates_round_away(capsys):
    """10 AdamW steps at lr 1e-6 change most float32 weights and almost no bfloat16 weight: each step moves a
    weight by about lr, far below half the bfloat16 spacing near it (0.2-0.4% of the weight)."""
    assert fraction_changed_by_ten_small_steps(torch.float32) > 0.5
    assert fraction_changed_by_ten_small_steps(torch.bfloat16) < 0.05
    lab_config.LabConfig(torch_dtype="bfloat16")
    assert "--torch_dtype bfloat16 without --lora_r" in capsys.readouterr().err
    lab_config.LabConfig(torch_dtype="bfloat16", lora_r=8)
    assert capsys.readouterr().err == ""
