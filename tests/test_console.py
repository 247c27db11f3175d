"""What a run shows a newcomer: the console's metric line and samples, the note when a run replaces a finished one,
and the threads a plain `python X.py` runs with (those `accelerate launch` gives)."""
import importlib
import os
import subprocess
import sys
from types import SimpleNamespace

from conftest import ROOT
from support import config, run


def lesson_config(script, tmp_path, *flags, monkeypatch):
    monkeypatch.setattr(sys, "argv", [f"{script}.py"])
    return config.parse_config(importlib.import_module(script).Config, ["--output_dir", str(tmp_path), *flags])


def console(cfg, metrics, samples, capsys):
    """What MetricLogger prints for a logged step (the main process's)."""
    run.MetricLogger(cfg, SimpleNamespace(is_main_process=True)).log(cfg.log_every, metrics, samples)
    return capsys.readouterr().out.splitlines()


def test_the_console_samples_two_prompts_not_one_group_twice(tmp_path, monkeypatch, capsys):
    cfg = lesson_config("grpo", tmp_path, "--num_generations", "4", "--log_every", "1", monkeypatch=monkeypatch)
    group = [("12+3=", "15", 1.0), ("12+3=", "14", 0.0), ("12+3=", "16", 0.0), ("12+3=", "15", 1.0)]
    lines = console(cfg, {"train/reward": 0.5}, group + [("7*8=", "56", 1.0)] + group, capsys)
    assert lines[1:] == ["  sample '12+3=' -> '15' reward 1", "  sample '7*8=' -> '56' reward 1"]


def test_without_a_reference_the_console_prints_no_kl(tmp_path, monkeypatch, capsys):
    metrics = {"train/reward": 0.5, "train/kl_seq": 0.0, "train/kl_k3": 0.0, "train/entropy": 0.25}
    cfg = lesson_config("grpo", tmp_path, "--log_every", "1", monkeypatch=monkeypatch)
    assert console(cfg, metrics, (), capsys) == ["step 1 | reward 0.5 | kl_seq 0 | kl_k3 0 | entropy 0.25"]
    cfg = lesson_config("grpo", tmp_path, "--log_every", "1", "--beta", "0", monkeypatch=monkeypatch)
    assert console(cfg, metrics, (), capsys) == ["step 1 | reward 0.5 | entropy 0.25"]  # no reference loaded


def test_a_run_into_a_finished_runs_folder_says_it_replaces_it(tmp_path, monkeypatch, capsys):
    cfg = lesson_config("remax", tmp_path, monkeypatch=monkeypatch)
    assert run.find_checkpoint(cfg, world_size=1) == ("", None) and capsys.readouterr().err == ""
    (tmp_path / "summary.json").write_text("{}")  # what a finished run writes last
    assert run.find_checkpoint(cfg, world_size=1) == ("", None)
    assert capsys.readouterr().err == (f"note: --output_dir {str(tmp_path)!r} holds a finished run of remax.py: this "
                                       "run replaces it (give another --output_dir to keep it).\n")


def test_a_plain_python_run_takes_one_thread_per_process_as_accelerate_launch_gives(tmp_path):
    """helpers.launch starts the process again with OMP_NUM_THREADS=1 when nothing set it (torch then starts its
    pools with one thread, as under `accelerate launch`), with the same command; a choice made outside is kept."""
    script = tmp_path / "script.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(ROOT)!r})\nimport torch\nfrom support import helpers\n"
                      "helpers.launch(lambda: print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'], "
                      "sys.argv[1:]))\n")
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    for given, expected in ((None, "1 1 ['--a', 'b']"), ("2", "2 2 ['--a', 'b']")):
        out = subprocess.run([sys.executable, str(script), "--a", "b"], capture_output=True, text=True,
                             env=env if given is None else {**env, "OMP_NUM_THREADS": given})
        assert out.returncode == 0 and out.stdout.strip() == expected, out.stderr
