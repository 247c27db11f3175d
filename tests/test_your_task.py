"""docs/your_task.md does what it says: its example rows load in each of the three formats, its
reward function runs, and its five lines after training load the saved model, or the saved LoRA
adapter, and generate what the trained weights generate."""
import re
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab import config as lab_config
from lab import tasks
from support import config
from conftest import ROOT, run_main

PAGE = (ROOT / "docs" / "your_task.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", PAGE, re.S)  # (language, code) in page order
AFTER_TRAINING = re.search(r"<!-- after-training -->\n```python\n(.*?)```\n<!-- /after-training -->", PAGE, re.S)[1]


def test_the_example_rows_load_in_each_format(tmp_path):
    (_, jsonl), (_, json_list), (_, parquet) = BLOCKS[:3]
    (tmp_path / "my_data.jsonl").write_text(jsonl)
    (tmp_path / "my_data.json").write_text(json_list)
    subprocess.run([sys.executable, "-c", parquet], cwd=tmp_path, check=True)
    tokenizer = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL)
    for name in ("my_data.jsonl", "my_data.json", "my_data.parquet"):
        train, held_out = tasks.load_task(lab_config.LabConfig(dataset=str(tmp_path / name), eval_size=1), tokenizer)
        assert [ex["answer"] for ex in train + held_out] == ["7", "24"], name
        assert train[0]["raw_prompt"].startswith("Tom has 3 apples"), name


def test_the_pages_reward_function_runs_as_a_flag_would_call_it(tmp_path):
    from accelerate import Accelerator

    code = next(code for lang, code in BLOCKS if lang == "python" and "def my_reward" in code)
    (tmp_path / "mine.py").write_text(code)
    cfg = lab_config.LabConfig(reward_fn=[f"{tmp_path / 'mine.py'}:my_reward"], rule_reward_weight=0.0)
    reward_fn = tasks.make_reward_fn(cfg, Accelerator(cpu=True))
    examples = [{"prompt": "1+1=", "answer": "2", "family": "add_2x1"}] * 2
    rewards, _, stats = reward_fn(examples, ["2 because 1+1", "2"])
    assert rewards.tolist() == [1.0, 0.0] and stats == {"train/reward/my_reward": 0.5}


def train(out_dir, *args):
    """Two steps whose advantages are never all 0 (rewards with per-family offsets, no baseline), so the
    weights move."""
    run_main(["lab/remax.py", "--num_steps", "2", "--batch_size", "8", "--max_new_tokens", "4", "--eval_every", "100",
              "--reward_scales", "hetero", "--baseline", "none", "--learning_rate", "1e-2", "--output_dir", out_dir,
              *args])  # in this process (conftest.run_main): the run needs no process of its own
    return out_dir / "final"


def five_lines(final):
    code = AFTER_TRAINING.replace("runs/remax/final", str(final))
    assert len(code.strip().splitlines()) == 5
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def greedy_completion(model, tokenizer):
    prompt = re.search(r'tokenizer\(\["(.*?)"\]', AFTER_TRAINING)[1]  # the five lines' prompt
    ids = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)["input_ids"]
    n = ids.shape[1]
    with torch.no_grad():
        for _ in range(8):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            if next_id == tokenizer.eos_token_id:
                break
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return tokenizer.decode(ids[0, n:], skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["model", "lora adapter"])
def test_the_five_lines_after_training_generate_with_the_trained_weights(tmp_path, kind):
    final = train(tmp_path / "run", *(["--lora_r", "4"] if kind == "lora adapter" else []))
    assert (final / "adapter_config.json").exists() == (kind == "lora adapter")
    printed = five_lines(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    if kind == "lora adapter":  # the adapter put into its base by peft's functions, not by the five lines' path
        # (not PeftModel.from_pretrained: peft 0.21's PeftModel reads transformers' deprecated is_gradient_checkpointing)
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        lora = LoraConfig.from_pretrained(final)
        model = inject_adapter_in_model(lora, AutoModelForCausalLM.from_pretrained(lora.base_model_name_or_path))
        assert not set_peft_model_state_dict(model, load_file(final / "adapter_model.safetensors")).unexpected_keys
        model.eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(final).eval()
    start = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    ids = torch.tensor([[4, 5, 13, 6, 16]])
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids).logits, start(input_ids=ids).logits)  # trained weights
    assert printed == greedy_completion(model, tokenizer) and re.fullmatch(r"-?\d+", printed), printed
