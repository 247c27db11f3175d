"""Side by side with TRL: grpo.py and rloo.py against TRL's GRPOTrainer and RLOOTrainer on the same
model, prompt stream, reward, held-out evaluation and config, runs alternated.

The same work on both sides: the prompts come from this project's PromptSampler (TRL reads them in
that order, shuffle_dataset off, each repeated K times as generate() does here), the reward is
tasks.compute_rewards, the held-out accuracy is tasks.evaluate on the trained policy, and the config is
64 completions per step (K = 8 per prompt), 8 new tokens, temperature 1, lr 1e-4 constant, fused AdamW
(TRL's default and this project's) without weight decay, gradient clip 1, fp32, no gradient
checkpointing, a metrics row every step. GRPO: beta 0.04 with k3 in the loss, sequence-mean of
token-means (TRL loss_type "grpo"), group std scaling, TRL's KL bias correction off. RLOO: the k1
penalty beta 0.05 summed into the reward.

Each run is a subprocess (our script with this project's python, TRL's trainer with --trl_python);
the order of the two sides alternates from seed to seed. Per run it records the wall time between
consecutive step ends (everything in the loop: generation, scoring, update, metrics and logging),
a phase split (generation; scoring: reward, reference and old log-probs; forward_backward;
the rest: optimizer step, clipping, metrics, logging), the peak resident set size (VmHWM) beside the
runtime after imports, the mean completion length, and the held-out greedy accuracy after the run.
Two settings: the embedded model (time, memory and accuracy over --seeds) and a randomly initialised
75M-parameter Qwen2 with 64-token completions (time and memory only, one seed, few steps).

TRL is not a requirement of this project. Install it in a virtual environment of its own, with the
project's requirements, and name its python:

    python -m venv venv-trl && venv-trl/bin/pip install -r requirements.txt trl==1.16.0
    python bench/peer_trl.py --trl_python venv-trl/bin/python      # -> runs/bench_peer_trl/peer_trl.md
    python bench/peer_trl.py --trl_python '' --settings embedded --seeds 0 --steps 5   # our side only
"""
import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.cost import LARGE_CONFIG, child_env, make_large_model  # noqa: E402

SIDES = ("ours", "trl")
PHASES = ("generation", "scoring", "forward_backward", "rest")
# the 75M Qwen2 of bench/cost.py, with room for a prompt and 64 new tokens
LARGE_SHAPE = {**LARGE_CONFIG, "max_position_embeddings": 128}
MiB = 2 ** 20


def proc_status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024  # kB
    return None


# ----------------------------------------------------------------------------------------
# children: one training run, ours or TRL's, writing a result JSON
# ----------------------------------------------------------------------------------------
def run_ours(spec):
    """Run grpo.py / rloo.py in this process; the step clock is MetricLogger.log, called once per step. The
    lesson logs no phases: they are timed here by wrapping its calls (helpers.sample: generation; helpers.score
    and the reward function: scoring; the log-probs with gradient and accelerator.backward: forward_backward)."""
    sys.path.insert(0, str(ROOT))
    import importlib

    import torch
    from accelerate import Accelerator

    from support import helpers, run, tasks

    module = importlib.import_module(spec["algorithm"])  # importing must not train
    steps, log, timed = [], run.MetricLogger.log, dict.fromkeys(PHASES[:-1], 0.0)

    def timing(phase, function):
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                timed[phase] += time.perf_counter() - start
        return timed_call

    make_reward_fn = helpers.make_reward_fn
    helpers.sample, helpers.score = timing("generation", helpers.sample), timing("scoring", helpers.score)
    helpers.make_reward_fn = lambda *args: timing("scoring", make_reward_fn(*args))
    module.token_logprobs = timing("forward_backward", module.token_logprobs)
    Accelerator.backward = timing("forward_backward", Accelerator.backward)

    def clocked_log(self, step, metrics, samples=()):
        if step > 0:
            steps.append({"t": time.perf_counter(), "cpu": time.process_time(),
                          "completion_len": metrics["train/completion_len"], **timed})
        timed.update(dict.fromkeys(timed, 0.0))
        return log(self, step, metrics, samples)

    run.MetricLogger.log = clocked_log
    if not spec["evaluate"]:  # the 75M model learns nothing here: no held-out generation at start and end
        tasks.evaluate = lambda *args, **kwargs: {"eval/accuracy": float("nan")}
    sys.argv = [f"{spec['algorithm']}.py", *script_args(spec)]
    baseline = proc_status_bytes("VmRSS")
    module.main()
    summary = json.loads((Path(spec["output_dir"]) / "summary.json").read_text())
    return {"steps": steps, "accuracy": summary["eval_accuracy_after"], "baseline_rss": baseline,
            "threads": torch.get_num_threads()}


def script_args(spec):
    n = spec["steps"]
    return ["--model_name_or_path", spec["model"], "--seed", str(spec["seed"]), "--num_steps", str(n),
            "--batch_size", str(spec["batch_size"]), "--num_generations", "8", "--max_new_tokens",
            str(spec["max_new_tokens"]), "--learning_rate", "1e-4", "--max_grad_norm", "1.0",
            "--beta", "0.04" if spec["algorithm"] == "grpo" else "0.05", "--eval_every", str(n), "--log_every", str(n),
            "--output_dir", spec["output_dir"]]


def trl_reward(cfg):
    """The project's rule reward with TRL's signature (the dataset's columns arrive as lists)."""
    from support import tasks

    def reward(prompts, completions, answer, family, **kwargs):
        examples = [{"answer": a, "family": f} for a, f in zip(answer, family)]
        return tasks.compute_rewards(examples, completions, cfg.reward_scales)[0].tolist()

    return reward


def run_trl(spec):
    """TRL's trainer on the same model, prompt stream, reward and config; phases timed by wrapping
    its methods, the step clock a callback at each step end."""
    sys.path.insert(0, str(ROOT))
    import importlib

    import torch
    import trl
    from accelerate.utils import set_seed
    from datasets import Dataset
    from transformers import TrainerCallback

    from support import config, models, tasks

    baseline = proc_status_bytes("VmRSS")
    cfg = config.parse_config(importlib.import_module(f"lab.{spec['algorithm']}").Config, script_args(spec))
    tokenizer = models.load_tokenizer(cfg)
    train_data, eval_data = tasks.load_task(cfg, tokenizer)
    sampler = tasks.PromptSampler(train_data, cfg.batch_size // cfg.num_generations, cfg.seed)
    dataset = Dataset.from_list([ex for _ in range(cfg.num_steps) for ex in sampler.next()])
    set_seed(cfg.seed)
    policy = models.load_model(cfg)
    shared = dict(output_dir=cfg.output_dir, max_steps=cfg.num_steps, per_device_train_batch_size=cfg.batch_size,
                  gradient_accumulation_steps=1, num_generations=cfg.num_generations,
                  max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                  top_k=cfg.top_k, learning_rate=cfg.learning_rate, lr_scheduler_type="constant", warmup_steps=0,
                  optim="adamw_torch_fused", weight_decay=0.0, max_grad_norm=cfg.max_grad_norm, beta=cfg.beta,
                  shuffle_dataset=False, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
                  logging_steps=1, save_strategy="no", report_to="none", seed=cfg.seed, disable_tqdm=True)
    if spec["algorithm"] == "grpo":
        Trainer, args = trl.GRPOTrainer, trl.GRPOConfig(**shared, loss_type="grpo", scale_rewards=cfg.scale_rewards,
                                                        epsilon=cfg.epsilon, use_bias_correction_kl=False)
    else:
        Trainer, args = trl.RLOOTrainer, trl.RLOOConfig(**shared)

    phases, steps = {}, []

    def timed(name, method):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - start
        return wrapper

    for name in ("_generate", "_generate_and_score_completions", "training_step"):
        setattr(Trainer, name, timed(name, getattr(Trainer, name)))

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            generation = phases.get("_generate", 0.0)
            scoring = phases.get("_generate_and_score_completions", 0.0) - generation
            steps.append({"t": time.perf_counter(), "cpu": time.process_time(), "generation": generation,
                          "scoring": scoring,
                          "forward_backward": phases.get("training_step", 0.0) - generation - scoring})
            phases.clear()

    trainer = Trainer(model=policy, args=args, reward_funcs=trl_reward(cfg), train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    for row, length in zip(steps, lengths):
        row["completion_len"] = length
    accuracy = float("nan")
    if spec["evaluate"]:
        accuracy = tasks.evaluate(trainer.model, tokenizer, eval_data, cfg, trainer.accelerator)["eval/accuracy"]
    return {"steps": steps, "accuracy": accuracy, "baseline_rss": baseline, "trl_version": trl.__version__,
            "threads": torch.get_num_threads()}


def child(side, spec_path, result_path):
    spec = json.loads(Path(spec_path).read_text())
    result = (run_ours if side == "ours" else run_trl)(spec)
    result["peak_rss"] = proc_status_bytes("VmHWM")
    Path(result_path).write_text(json.dumps(result))


# ----------------------------------------------------------------------------------------
# parent: alternate the runs, then the tables
# ----------------------------------------------------------------------------------------
def run_side(side, spec, python, threads, workdir):
    name = f"{spec['algorithm']}_{side}_seed{spec['seed']}"
    spec = {**spec, "output_dir": str(workdir / name)}
    spec_path, result_path = workdir / f"{name}.spec.json", workdir / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [python, str(Path(__file__).resolve()), "--child", side, str(spec_path), str(result_path)]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {side} run {name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  {name}: {time.time() - start:.0f}s", file=sys.stderr, flush=True)
    return json.loads(result_path.read_text())


def step_rows(result, warmup):
    """Per timed step: its wall time and the process's CPU time (from the previous step end) and
    phases. The first `warmup` steps and the last (ours evaluates inside it) are left out."""
    steps = result["steps"]
    rows = []
    for before, row in zip(steps[warmup:-2], steps[warmup + 1:-1]):
        wall = row["t"] - before["t"]
        phases = {p: row[p] for p in PHASES[:-1]}
        rows.append({"step": wall, "cpu": row["cpu"] - before["cpu"], **phases, "rest": wall - sum(phases.values())})
    return rows


def summarise(results, warmup):
    """results[side] = list of runs -> medians over all timed steps of all runs, per side."""
    out = {}
    for side, runs in results.items():
        rows = [row for r in runs for row in step_rows(r, warmup)]
        out[side] = {key: statistics.median(row[key] for row in rows) for key in ("step", "cpu", *PHASES)}
        out[side].update(steps=len(rows), accuracy=[r["accuracy"] for r in runs],
                         peak_rss=max(r["peak_rss"] for r in runs),
                         runtime_rss=statistics.median(r["baseline_rss"] for r in runs),
                         completion_len=statistics.mean(s["completion_len"] for r in runs for s in r["steps"]),
                         seed_ratios={"step": [], "cpu": []})
    if len(out) == 2:
        for ours, trl in zip(results["ours"], results["trl"]):  # per seed, the same prompts on both sides
            for key in ("step", "cpu"):
                ratio = statistics.median(r[key] for r in step_rows(ours, warmup)) / \
                    statistics.median(r[key] for r in step_rows(trl, warmup))
                out["ours"]["seed_ratios"][key].append(ratio)
    return out


def table(setting, summaries, with_accuracy):
    lines = ["| algorithm | side | median s/step | ratio to TRL (per seed) | CPU s/step | CPU ratio (per seed) "
             "| generation | scoring | forward_backward | rest | completion len | peak RSS (MiB) | runtime RSS (MiB) "
             "| held-out accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for algorithm, s in summaries.items():
        for side in s:
            x = s[side]
            ratio = {key: "" if side != "ours" or "trl" not in s else
                     f"**{statistics.median(x['seed_ratios'][key]):.2f}** "
                     f"({', '.join(f'{r:.2f}' for r in x['seed_ratios'][key])})"
                     for key in ("step", "cpu")}
            acc = " ".join(f"{a:.3f}" for a in x["accuracy"])
            acc = f"{statistics.mean(x['accuracy']):.3f} ({acc})" if with_accuracy else "–"
            name = f"{algorithm}.py" if side == "ours" else f"TRL {'GRPO' if algorithm == 'grpo' else 'RLOO'}Trainer"
            lines.append(f"| {algorithm} | {name} | {x['step']:.4f} | {ratio['step']} | {x['cpu']:.4f} "
                         f"| {ratio['cpu']} | "
                         + " | ".join(f"{x[p]:.4f}" for p in PHASES)
                         + f" | {x['completion_len']:.1f} | {x['peak_rss'] / MiB:,.0f} | {x['runtime_rss'] / MiB:,.0f} "
                         f"| {acc} |")
    return f"### {setting}\n\n" + "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl_python", required=True, help="Python of a venv with TRL installed ('' = our side only).")
    parser.add_argument("--settings", default="embedded,large", help="Comma list: embedded and/or large (75M, random).")
    parser.add_argument("--algorithms", default="grpo,rloo", help="Comma list: grpo and/or rloo.")
    parser.add_argument("--seeds", default="0,1,2", help="Comma list of seeds for the embedded model.")
    parser.add_argument("--steps", type=int, default=100, help="Steps per run on the embedded model.")
    parser.add_argument("--batch_size", type=int, default=64, help="Completions per step on the embedded model.")
    parser.add_argument("--large_steps", type=int, default=6, help="Steps per run on the 75M model (one seed).")
    parser.add_argument("--large_batch_size", type=int, default=16, help="Completions per step on the 75M model.")
    parser.add_argument("--large_max_new_tokens", type=int, default=64, help="Completion length on the 75M model.")
    parser.add_argument("--warmup", type=int, default=1, help="Leading steps left out of the medians.")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (runs are sequential).")
    parser.add_argument("--out", default=str(ROOT / "runs/bench_peer_trl/peer_trl.md"),
                        help="Markdown file for the tables, the raw numbers next to it as .json ('' = stdout only).")
    args = parser.parse_args()
    sides = SIDES if args.trl_python else SIDES[:1]
    settings = args.settings.split(",")
    for setting in settings:
        if setting not in ("embedded", "large"):
            raise SystemExit(f"error: --settings: unknown {setting!r} (embedded, large)")
        steps = args.steps if setting == "embedded" else args.large_steps
        if steps < args.warmup + 3:
            raise SystemExit(f"error: {setting}: --steps / --large_steps must be at least --warmup + 3 (got {steps}).")
    for algorithm in args.algorithms.split(","):
        if algorithm not in ("grpo", "rloo"):
            raise SystemExit(f"error: --algorithms: unknown {algorithm!r} (grpo, rloo)")

    import torch

    header = [f"Machine: CPU only ({os.cpu_count()} cores, {platform.processor() or platform.machine()}); torch "
              f"{torch.__version__}; {args.threads} thread(s) per run, runs one after another, the two sides "
              "alternated.",
              f"Command: `{shlex.join(['python', 'bench/peer_trl.py', *sys.argv[1:]])}`",
              f"Times are medians over every timed step of every run (first {args.warmup} and last step of each run "
              "left out); per seed (a pair: the two sides back to back on the same prompts) the ratio of ours to "
              "TRL's median, in brackets; in bold the median of those ratios. CPU s/step is the process's CPU "
              "time per step: with one thread per run it is the work done, which other processes on the machine do "
              "not inflate as they inflate the wall time."]
    sections, raw = [], {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="peer_trl_") as tmp:
        for setting in settings:
            workdir = Path(tmp) / setting
            workdir.mkdir()
            if setting == "embedded":
                sys.path.insert(0, str(ROOT))
                from support.config import EMBEDDED_MODEL
                model, seeds, steps = EMBEDDED_MODEL, [int(s) for s in args.seeds.split(",")], args.steps
                batch_size, max_new_tokens = args.batch_size, 8
            else:
                model = make_large_model(os.path.join(tmp, "large_model"), LARGE_SHAPE)
                seeds, steps = [0], args.large_steps
                batch_size, max_new_tokens = args.large_batch_size, args.large_max_new_tokens
            summaries = {}
            for algorithm in args.algorithms.split(","):
                results = {side: [] for side in sides}
                for i, seed in enumerate(seeds):
                    spec = dict(algorithm=algorithm, model=model, seed=seed, steps=steps, batch_size=batch_size,
                                max_new_tokens=max_new_tokens, evaluate=setting == "embedded")
                    for side in (sides if i % 2 == 0 else sides[::-1]):
                        python = sys.executable if side == "ours" else args.trl_python
                        results[side].append(run_side(side, spec, python, args.threads, workdir))
                summaries[algorithm] = summarise(results, args.warmup)
                raw[f"{setting}/{algorithm}"] = results
            what = (f"embedded model: {batch_size} completions per step (K = 8), {max_new_tokens} new tokens, {steps} "
                    f"steps, seeds {', '.join(map(str, seeds))}") if setting == "embedded" else \
                (f"75M-parameter random Qwen2: {batch_size} completions per step (K = 8), up to {max_new_tokens} new "
                 f"tokens, {steps} steps, seed 0 (time and memory; it learns nothing)")
            sections.append(table(what, summaries, with_accuracy=setting == "embedded"))
    header.append(f"Load average (1 min) before / after: {load_before:.2f} / {os.getloadavg()[0]:.2f}.")
    if "trl" in sides:
        version = next(r for runs in raw.values() for r in runs["trl"])["trl_version"]
        header.append(f"TRL {version} ({args.trl_python}).")
    text = "\n".join(header) + "\n\n" + "\n\n".join(sections) + "\n"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(raw))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
    else:
        main()
