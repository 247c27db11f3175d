"""A clean first run: a short run of the scripts raises no Python warning, deprecations of the
transformers API included, so a newcomer's first output holds no warning of ours.

Every warning is an error here (python -W error), not only those attributed to the project's
modules: a library warns from its own frame about an argument our call passed (transformers'
deprecation of `past_key_values` for a model's forward is attributed to torch's Module.__call__,
printed with its line `return forward_call(*args, **kwargs)`), so a filter on our modules alone
would miss it. The three scripts cover the three ways the models are called: one sample and a greedy
one per prompt (ReMax), several samples continuing one prompt's keys and values (GRPO), and a value
model beside the policy (PPO)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.parametrize("script, args", [("remax.py", []), ("grpo.py", ["--num_generations", "4"]), ("ppo.py", []),
                                          ("lab/grpo.py", ["--num_generations", "4"])])  # the lessons and the lab
def test_a_short_run_raises_no_warning(tmp_path, script, args):
    cmd = [sys.executable, "-W", "error", script, "--num_steps", "2", "--batch_size", "8", "--max_new_tokens", "4",
           "--eval_every", "2", "--output_dir", str(tmp_path / "run"), *args]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error"})
    assert out.returncode == 0, out.stderr[-3000:]
    output = out.stdout + out.stderr
    for line in ("Warning", "deprecated", "return forward_call"):  # a library's logged notice is no Python warning
        assert line not in output, output[-3000:]
    assert (tmp_path / "run" / "final" / "config.json").exists()


def test_the_quick_starts_launch_prints_no_notice_of_defaults(tmp_path):
    """`accelerate launch --config_file configs/one_process.yaml` (the README's demo without the notice) sets every
    value accelerate would otherwise fill in and list in a six-line notice before the run's first line."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "configs/one_process.yaml", "lab/remax.py",
           "--num_steps", "1", "--batch_size", "8", "--max_new_tokens", "4", "--eval_every", "100",
           "--save_model", "False", "--output_dir", str(tmp_path / "run")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "were not passed to `accelerate launch`" not in out.stdout + out.stderr, out.stderr[:2000]
    assert (out.stdout + out.stderr).count("eval 0 | accuracy 0.416") == 1
