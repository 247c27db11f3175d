"""The cost of the critic, measured: memory and time per step of each algorithm on the same
model and batch shape (the ReMax paper's claim: ~46% less GPU memory and 1.6-2x
faster than PPO on 7B models).

Each algorithm script (remax, grpo, rloo, dapo, ppo: whichever exist) runs in its own
subprocess for --steps steps with evaluation and saving off. The child imports the script,
runs its main() and records, per algorithm:

- model state accounted exactly: every model the script loads (transformers
  `from_pretrained` is wrapped to record them) counted from its parameters and their dtype.
  A trainable model holds parameters + gradients + two AdamW moments (4 x its bytes), a frozen
  one its parameters only. The AdamW state actually allocated is measured too, as a check.
- peak memory: on CPU the peak resident set size of the child (VmHWM in /proc/self/status,
  the same number as getrusage(RUSAGE_SELF).ru_maxrss). It includes the Python/torch runtime
  and every activation, so the runtime baseline (VmRSS after imports, before main()) is
  reported next to it. On a GPU: torch.cuda.max_memory_allocated().
- wall time per step, split into generation / scoring (with the reward) / forward_backward / optimizer (with the
  finiteness checks), from
  the time/*_s columns that lab.step_metrics.StepTimer writes to metrics.jsonl, averaged over the steps
  after --warmup. CPU/wall (process CPU time over wall time of the whole run) shows contention:
  with --threads 1 it is ~1.0 on an idle machine and drops when other processes compete.

Held-out evaluation is stubbed out in the child (tasks.evaluate returns NaN): it is the same
for every algorithm, outside the timed phases, and would otherwise add its own generation
batch to the peak.

    python bench/cost.py                                    # embedded + random ~75M Qwen2 -> runs/bench_cost/cost.md
    python bench/cost.py --models embedded --steps 3 --warmup 1 --out /tmp/cost.md
"""
import argparse
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ("remax", "grpo", "rloo", "dapo", "ppo")
PHASES = ("generation", "scoring", "gae", "forward_backward", "optimizer")
# the columns that hold more than one of the scripts' timer phases (lab/step_metrics.py StepTimer)
FOLDED = {"scoring": ("reward", "scoring"), "optimizer": ("optimizer", "checks")}
# a Qwen2 of ~75M parameters with the embedded tokenizer (vocab 18), randomly initialised
LARGE_CONFIG = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=8, num_attention_heads=12,
                    num_key_value_heads=12, max_position_embeddings=64, tie_word_embeddings=True)
MiB = 2 ** 20


# ----------------------------------------------------------------------------------------
# child: run one algorithm script in this process and record what it held
# ----------------------------------------------------------------------------------------
def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    return None


def model_state(models):
    """Bytes of every loaded model: params; + grads and 2 AdamW moments for trainable params."""
    rows, seen = [], set()
    for model in models:
        params = [p for p in model.parameters() if id(p) not in seen]  # tied weights count once
        seen.update(id(p) for p in params)
        total = sum(p.numel() * p.element_size() for p in params)
        trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        rows.append({"class": type(model).__name__, "params": sum(p.numel() for p in params),
                     "trainable_params": sum(p.numel() for p in params if p.requires_grad),
                     "param_bytes": total, "trainable_bytes": trainable,
                     "state_bytes": total + 3 * trainable})  # param + (grad + exp_avg + exp_avg_sq)
    return rows


def record_models_and_optimizers():
    """From here on every model loaded with from_pretrained and every optimizer created lands in the
    two lists returned: (models, optimizers)."""
    import torch
    from transformers import PreTrainedModel

    loaded, optimizers = [], []
    from_pretrained = PreTrainedModel.from_pretrained.__func__

    def recording_from_pretrained(cls, *args, **kwargs):
        model = from_pretrained(cls, *args, **kwargs)
        loaded.append(model[0] if isinstance(model, tuple) else model)  # output_loading_info=True: (model, info)
        return model

    optimizer_init = torch.optim.Optimizer.__init__

    def recording_optimizer_init(self, *args, **kwargs):
        optimizer_init(self, *args, **kwargs)
        optimizers.append(self)

    PreTrainedModel.from_pretrained = classmethod(recording_from_pretrained)
    torch.optim.Optimizer.__init__ = recording_optimizer_init
    return loaded, optimizers


def module_name(script):
    """The name `script` imports under: lab.grpo for lab/grpo.py (whose `from grpo import ...` is the lesson's),
    the stem for a file outside the repository."""
    path = Path(script).resolve()
    return ".".join(path.relative_to(ROOT).with_suffix("").parts) if path.is_relative_to(ROOT) else path.stem


def run_child(script, result_path, script_args):
    import torch

    sys.path.insert(0, str(ROOT))
    from lab import tasks as lab_tasks
    from support import tasks

    loaded, optimizers = record_models_and_optimizers()
    tasks.evaluate = lab_tasks.evaluate = lambda *args, **kwargs: {"eval/accuracy": float("nan")}  # lesson's, lab's

    spec = importlib.util.spec_from_file_location(module_name(script), script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module.__name__] = module  # its Config pickles by name (--async_rollouts sends it to the sampler)
    spec.loader.exec_module(module)  # importing must not train
    sys.argv = [script, *script_args]
    baseline_rss = proc_status_bytes("VmRSS")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    module.main()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start

    adam_bytes = sum(t.numel() * t.element_size() for opt in optimizers for state in opt.state.values()
                     for name, t in state.items() if torch.is_tensor(t) and name != "step")
    result = {"models": model_state(loaded), "adam_state_bytes_measured": adam_bytes,
              "baseline_rss_bytes": baseline_rss, "peak_rss_bytes": proc_status_bytes("VmHWM"), "wall_s": wall, "cpu_s": cpu,
              "cuda_peak_bytes": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch_threads": torch.get_num_threads()}
    Path(result_path).write_text(json.dumps(result, indent=2))


# ----------------------------------------------------------------------------------------
# parent: one subprocess per (model, algorithm), then the tables
# ----------------------------------------------------------------------------------------
def make_large_model(folder, shape=LARGE_CONFIG, tokenizer=None):
    """A randomly initialised Qwen2 of `shape` (LARGE_CONFIG unless given) with `tokenizer` (default: the embedded
    one), saved to `folder`. The vocabulary is the tokenizer's unless `shape` sets vocab_size."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(ROOT))
    from support.config import EMBEDDED_MODEL

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    config = Qwen2Config(bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **{"vocab_size": len(tokenizer), **shape})
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def child_env(threads=None):
    """The environment of a benchmark's child run: offline, no progress bars, and `threads` torch
    threads (None: torch's own choice)."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def launch_child(bench_file, name, script, result_path, script_args, threads):
    """`python bench_file --child script result_path -- script_args` in a subprocess (the child runs the
    script's main() and writes result_path); the child's result, or None after printing its error."""
    cmd = [sys.executable, str(bench_file), "--child", str(ROOT / script), str(result_path), "--", *script_args]
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"[{name}] failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(Path(result_path).read_text())


def run_algorithm(name, model_path, args, workdir):
    sys.path.insert(0, str(ROOT))
    from support.run import read_metrics

    out_dir = Path(workdir) / name
    result_path = Path(workdir) / f"{name}.json"
    script, extra = VARIANTS[name]
    script_args = ["--model_name_or_path", model_path, "--num_steps", str(args.steps), "--batch_size", str(args.batch_size),
                   "--max_new_tokens", str(args.max_new_tokens), "--eval_every", "1000000", "--log_every", "1000000",
                   "--save_model", "False", "--seed", "0", "--output_dir", str(out_dir), *extra]
    result = launch_child(Path(__file__).resolve(), name, script, result_path, script_args, args.threads)
    if result is None:
        return None
    rows = read_metrics(out_dir / "metrics.jsonl")
    # steps that trained (DAPO skips a step when dynamic sampling keeps no group)
    timed = [r for r in rows if r["step"] > args.warmup and "time/step_s" in r and not r.get("train/skipped_step")]
    result["time"] = {k: sum(r.get(f"time/{phase}_s", 0.0) for r in timed for phase in FOLDED.get(k, (k,))) / len(timed)
                      for k in (*PHASES, "step")} if timed else None
    result["timed_steps"] = len(timed)
    result["skipped_steps"] = sum(1 for r in rows if r.get("train/skipped_step"))
    rounds = [r["train/sampling_rounds"] for r in rows if r["step"] > 0 and "train/sampling_rounds" in r]
    result["sampling_rounds"] = sum(rounds) / len(rounds) if rounds else None
    return result


# name: (script, extra flags). ppo-1x1 isolates the critic from PPO's batch reuse.
VARIANTS = {name: (f"lab/{name}.py", []) for name in ALGORITHMS}
VARIANTS["ppo-1x1"] = ("lab/ppo.py", ["--num_epochs", "1", "--num_mini_batches", "1"])


def mib(x):
    return f"{x / MiB:,.1f}"


def write_report(out, text, results):
    """The markdown report to `out` and the raw results beside it as .json ('' = stdout only)."""
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
        Path(out).with_suffix(".json").write_text(json.dumps(results, indent=1))


def table(results, on_gpu):
    peak = "peak GPU alloc (MiB)" if on_gpu else "peak RSS (MiB)"
    lines = [f"| algorithm | models: trainable + frozen | params held | model state accounted (MiB) | AdamW state measured (MiB) "
             f"| {peak} | peak − runtime (MiB) | step (s) | generation | scoring | gae | fwd+bwd | optimizer | CPU/wall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        trainable = sum(m["trainable_params"] > 0 for m in r["models"])
        held = f"{trainable} + {len(r['models']) - trainable}"
        state = sum(m["state_bytes"] for m in r["models"])
        params = sum(m["params"] for m in r["models"])
        peak_bytes = r["cuda_peak_bytes"] if on_gpu else r["peak_rss_bytes"]
        above = peak_bytes if on_gpu else r["peak_rss_bytes"] - r["baseline_rss_bytes"]
        t = r["time"]
        times = " | ".join(f"{t[k]:.3f}" for k in ("step", *PHASES)) if t else " | ".join(["no step trained"] + ["–"] * len(PHASES))
        lines.append(f"| {name} | {held} | {params / 1e6:,.2f}M | {mib(state)} | {mib(r['adam_state_bytes_measured'])} | {mib(peak_bytes)} "
                     f"| {mib(above)} | {times} | {r['cpu_s'] / r['wall_s']:.2f} |")
    for name, r in results.items():
        if r.get("sampling_rounds") is not None:
            lines.append(f"\n{name}: {r['sampling_rounds']:.1f} generation rounds per step on average (dynamic sampling), "
                         f"{r['skipped_steps']} of the steps skipped (no group with mixed correctness).")
    return "\n".join(lines)


def ratio_table(results, on_gpu, base="remax"):
    others = [n for n in results if n.startswith("ppo")]
    if base not in results or not others:
        return "(ReMax/PPO ratios need both remax.py and ppo.py)"
    lines = ["| ReMax / " + " | ReMax / ".join(others) + " | quantity |", "|" + "---|" * (len(others) + 1)]

    def metrics(r):
        if r["time"] is None:
            return {}
        state = sum(m["state_bytes"] for m in r["models"])
        peak = r["cuda_peak_bytes"] if on_gpu else r["peak_rss_bytes"]
        above = peak if on_gpu else r["peak_rss_bytes"] - r["baseline_rss_bytes"]
        return {"model state accounted": state, ("peak GPU memory" if on_gpu else "peak RSS"): peak,
                **({} if on_gpu else {"peak RSS − runtime baseline": above}),
                "time per step": r["time"]["step"], **{f"time: {p}": r["time"][p] for p in PHASES}}

    b = metrics(results[base])
    for key in b:
        cells = [f"{b[key] / metrics(results[o])[key]:.2f}" if metrics(results[o]).get(key, 0) > 0 else "n/a" for o in others]
        lines.append("| " + " | ".join(cells) + f" | {key} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="embedded,large", help="Comma list: embedded (the tiny model) and/or large (random ~75M Qwen2).")
    parser.add_argument("--algorithms", default=",".join(VARIANTS), help="Comma list of variants; missing scripts are skipped.")
    parser.add_argument("--steps", type=int, default=5, help="Training steps per run.")
    parser.add_argument("--warmup", type=int, default=1, help="Leading steps left out of the time averages.")
    parser.add_argument("--batch_size", type=int, default=16, help="Sampled completions per step (the same for every algorithm).")
    parser.add_argument("--max_new_tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each child (runs are sequential).")
    parser.add_argument("--out", default=str(ROOT / "runs" / "bench_cost" / "cost.md"), help="Markdown file for the tables, and the raw numbers next to it as .json ('' = stdout only).")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must be larger than --warmup")

    import torch

    on_gpu = torch.cuda.is_available()
    machine = (torch.cuda.get_device_name() if on_gpu else f"CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()})")
    header = [f"Machine: {machine}; torch {torch.__version__}; {args.threads} thread(s) per run, runs one after another.",
              f"Per run: {args.steps} steps, first {args.warmup} left out of the times; batch {args.batch_size} sampled "
              f"completions, max_new_tokens {args.max_new_tokens}; each script's own defaults otherwise.",
              f"Command: `{shlex.join(['python', 'bench/cost.py', *sys.argv[1:]])}`"]
    sections, all_results = ["\n".join(header)], {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="cost_") as tmp:
        for model_name in args.models.split(","):
            if model_name == "embedded":
                sys.path.insert(0, str(ROOT))
                from support.config import EMBEDDED_MODEL
                model_path = EMBEDDED_MODEL
            elif model_name == "large":
                model_path = make_large_model(os.path.join(tmp, "large_model"))
            else:
                raise SystemExit(f"error: --models: unknown model {model_name!r} (embedded, large)")
            results = all_results[model_name] = {}
            for name in args.algorithms.split(","):
                if name not in VARIANTS:
                    raise SystemExit(f"error: --algorithms: unknown {name!r} (one of {', '.join(VARIANTS)})")
                if not (ROOT / VARIANTS[name][0]).exists():
                    print(f"[{model_name}] skip {name}: {VARIANTS[name][0]} does not exist", file=sys.stderr)
                    continue
                print(f"[{model_name}] {name} ...", file=sys.stderr, flush=True)
                workdir = Path(tmp) / model_name
                workdir.mkdir(exist_ok=True)
                start = time.time()
                result = run_algorithm(name, model_path, args, workdir)
                if result is not None:
                    results[name] = result
                    print(f"[{model_name}] {name} done in {time.time() - start:.0f}s", file=sys.stderr, flush=True)
            if not results:
                continue
            params = next(iter(results.values()))["models"][0]["params"]
            sections.append(f"### {model_name} model ({params / 1e6:.2f}M parameters per copy)\n\n"
                            f"{table(results, on_gpu)}\n\nRatios (below 1: ReMax needs less):\n\n{ratio_table(results, on_gpu)}")
    sections[0] += (f"\nLoad average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f} "
                    "(other processes on the machine inflate the times, not the memory).")
    write_report(args.out, "\n\n".join(sections) + "\n", all_results)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        separator = sys.argv.index("--")
        run_child(sys.argv[2], sys.argv[3], sys.argv[separator + 1:])
    else:
        main()
