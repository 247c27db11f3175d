import importlib
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Under pytest-xdist each worker, and every run it starts, gets its share of the cores: two workers on two cores
# with two OpenMP threads each oversubscribe them (the suite took 9.8 minutes instead of 7 on 2 cores).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))


def assert_params_changed(final_dir):
    """The model saved in final_dir differs from the embedded model it started from."""
    from transformers import AutoModelForCausalLM

    from support import config

    trained = AutoModelForCausalLM.from_pretrained(final_dir)
    start = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    assert max((a - b).abs().max().item() for a, b in zip(trained.parameters(), start.parameters())) > 0


def free_port():
    """A port no process listens on now, for a launch that runs beside another."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(cmds, env):
    """Start independent runs at once, so that single-threaded runs use every core, and wait for all.
    Returns their CompletedProcess objects in the order given."""
    import subprocess

    procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    outputs = [proc.communicate() for proc in procs]
    return [subprocess.CompletedProcess(proc.args, proc.returncode, *out) for proc, out in zip(procs, outputs)]


def launch_two_processes(script, args, out_dir):
    """`accelerate launch --multi_gpu --num_processes 2 script args` on CPU (gloo): asserts the run
    succeeds with 2 ranks whose final weights are identical and changed. Returns the process.
    (`launch --cpu --num_processes 2` starts ONE process in accelerate 1.x; --multi_gpu starts two
    torchrun ranks, which config.make_accelerator puts on CPU when there is no GPU.)"""
    import json
    import subprocess

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--main_process_port", str(free_port()), script, *args, "--output_dir", str(out_dir)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((Path(out_dir) / "summary.json").read_text())
    assert summary["num_processes"] == 2
    a, b = summary["replica_weight_checksums"]
    assert a == b
    assert_params_changed(Path(out_dir) / "final")
    return out


def run_main(argv):
    """`python *argv` as this process's call of the script's main() (sys.argv patched; in the main thread): a run that
    needs no process of its own, whose start-up (the imports, the tokenizer) cost ~13 s against ~2 s of run."""
    module = importlib.import_module(argv[0][:-len(".py")].replace("/", "."))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [str(a) for a in argv])
        module.main()
