"""The command line as a newcomer meets it: a flag that is not one (misspelt, abbreviated, a stray value) stops
the script with one line naming the flag meant, before any model loads, and --help opens with what the script
does and gives each flag, and its default, once."""
import ast
import dataclasses
import importlib
import re
import subprocess
import sys

import pytest

from support import config
from conftest import ROOT

SCRIPTS = ["lab/remax", "lab/grpo", "lab/rloo", "lab/dapo", "lab/ppo", "lab/reinforce_pp"]  # the lab's: --fast and the rest
MISTAKES = {  # arguments: the one line they must print
    # argparse took an abbreviation as the flag it starts: --num_step 4 ran as --num_steps 4, silently
    "abbreviation": (["--num_step", "4"], "error: unknown flag --num_step; did you mean --num_steps?"),
    "typo": (["--num_stpes", "4"], "error: unknown flag --num_stpes; did you mean --num_steps?"),
    "typo_with_dashes": (["--num-stpes=4"], "error: unknown flag --num-stpes; did you mean --num_steps?"),
    "bad_value": (["--num_steps", "abc"], "error: --num_steps: invalid int value: 'abc'"),
    "stray_value": (["4"], "error: unexpected value '4': every setting is a flag with its value, e.g. --num_steps 4 "
                           "(remax.py --help lists the flags)"),
}


def script(name, *args, timeout=120):
    return subprocess.run([sys.executable, f"{name}.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("mistake", ["abbreviation", "typo"])
def test_a_misspelt_or_abbreviated_flag_stops_the_script_with_one_line_before_any_model_loads(tmp_path, mistake):
    args, line = MISTAKES[mistake]
    out = script("lab/remax", *args, "--output_dir", str(tmp_path / "run"))
    assert out.returncode != 0 and out.stdout == "", out.stdout[-2000:]
    assert out.stderr.strip() == line, out.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # nothing was loaded or written


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_flag_that_is_not_one_is_one_line_naming_the_flag(tmp_path, mistake, monkeypatch):
    args, line = MISTAKES[mistake]
    monkeypatch.setattr(sys, "argv", ["remax.py"])
    with pytest.raises(SystemExit) as e:
        config.parse_config(importlib.import_module("lab.remax").Config, [*args, "--output_dir", str(tmp_path / "run")])
    assert str(e.value) == line


def help_entries(text):
    """--help's option entries as {first flag: the entry's text on one line}."""
    entries, current = {}, None
    for line in text.splitlines():
        if re.match(r"  -", line):
            current = line.split()[0].rstrip(",")
            entries[current] = line.strip()
        elif current and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def purpose(name):
    """The first paragraph of the script's docstring, on one line."""
    doc = ast.get_docstring(ast.parse((ROOT / f"{name}.py").read_text()))
    return " ".join(doc.split("\n\n")[0].split())


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_opens_with_the_scripts_purpose_and_gives_each_flag_and_its_default_once(name):
    out = script(name, "--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == purpose(name)
    entries = help_entries(out.stdout)
    fields = [f.name for f in dataclasses.fields(importlib.import_module(name.replace("/", ".")).Config)]
    assert sorted(entries) == sorted(["-h", *(f"--{f}" for f in fields)])  # no --no_fast beside --fast
    for flag in fields:
        assert len(config.DEFAULT_SAID.findall(entries[f"--{flag}"])) == 1, entries[f"--{flag}"]
    assert "(default: the embedded model)" in entries["--model_name_or_path"]
    assert "--no_fast is --fast False" in entries["--fast"]


def test_the_spellings_that_work_still_work(tmp_path):
    Config = importlib.import_module("lab.remax").Config
    cfg = config.parse_config(Config, ["--num-steps=4", "--no_fast", "--save_model", "False",
                                       "--gradient_checkpointing", "--output_dir", str(tmp_path)])
    assert (cfg.num_steps, cfg.fast, cfg.save_model, cfg.gradient_checkpointing) == (4, False, False, True)
    assert config.parse_config(Config, ["--fast", "--output_dir", str(tmp_path)]).fast is True
