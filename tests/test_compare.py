"""bench/compare.py: the bookkeeping behind docs/results.md (budget axes, seed statistics),
checked on hand-made metrics, and one smoke run of the real runner on a tiny budget."""
import json
import statistics
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import compare  # noqa: E402


def test_moving_average_is_trailing_with_a_short_start():
    assert compare.moving_average([1, 2, 3, 4, 5], 2) == [1, 1.5, 2.5, 3.5, 4.5]
    assert compare.moving_average([4, 0, 2], 10) == [4, 2, 2]


def test_mean_std_is_the_sample_std():
    values = [0.70, 0.74, 0.66, 0.75]
    mean, std = compare.mean_std(values)
    assert mean == pytest.approx(statistics.mean(values))
    assert std == pytest.approx(statistics.stdev(values))  # n - 1, not n
    assert compare.mean_std([0.5]) == (0.5, 0.0)


def test_optimizer_steps_per_batch():
    assert compare.optimizer_steps_per_batch({"num_epochs": 4, "num_mini_batches": 4}) == 16
    assert compare.optimizer_steps_per_batch({"num_epochs": 2}) == 2
    assert compare.optimizer_steps_per_batch({"baseline": "greedy"}) == 1


def rows_for(steps, generated, extra=lambda step: {}):
    rows = [{"step": 0, "time/elapsed_s": 0.5, "eval/accuracy": 0.4, "eval/acc_a": 0.2, "eval/acc_b": 0.6}]
    for s in range(1, steps + 1):
        rows.append({"step": s, "time/elapsed_s": 0.5 + s, "time/step_s": 1.0 if s % 2 else 0.5,
                     "train/reward": 0.1 * s, "train/generated": generated, **extra(s)})
    rows[-1].update({"eval/accuracy": 0.7, "eval/acc_a": 0.5, "eval/acc_b": 0.9})
    return rows


def test_summarize_run_remax_budget():
    """ReMax: 64 trained and 128 generated (sampled + greedy) per step; one optimizer step each."""
    summary = compare.summarize_run(rows_for(4, 128), {"batch_size": 64}, peak_rss_mib=500.0)
    assert summary["trained"] == [64, 128, 192, 256]
    assert summary["generated"] == [128, 256, 384, 512]
    assert summary["completions_trained"] == 256 and summary["sequences_generated"] == 512
    assert summary["optimizer_steps"] == 4
    assert summary["accuracy_start"] == 0.4 and summary["accuracy_final"] == 0.7
    assert summary["family_accuracy"] == {"a": 0.5, "b": 0.9}
    assert summary["eval_step"] == [0, 4] and summary["eval_elapsed_s"] == [0.5, 4.5]
    assert summary["reward_final"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 4)  # window 25 > 4 steps
    assert summary["step_s"] == pytest.approx(0.75)
    assert summary["wall_s"] == 4.5


def test_summarize_run_dapo_counts_kept_groups_and_sampled_reward():
    """DAPO: trained = groups kept x G (a short batch, a skipped step trains nothing); the reward
    is the one of every sampled completion, not of the kept (mixed) groups only."""
    def extra(s):
        if s == 2:  # a skipped step: no mixed group in 8 rounds
            return {"train/skipped_step": 1.0, "train/reward_sampled": 1.0}
        return {"train/groups_kept": 8 if s != 3 else 5, "train/reward_sampled": 0.0, "train/skipped_step": 0.0}
    rows = rows_for(3, 192, extra)
    del rows[2]["train/reward"]  # skipped steps log no train/reward
    summary = compare.summarize_run(rows, {"batch_size": 64, "num_generations": 8}, peak_rss_mib=1.0)
    assert summary["trained"] == [64, 64, 104]
    assert summary["generated"] == [192, 384, 576]
    assert summary["reward"] == [0.0, 1.0, 0.0]


def test_summarize_run_ppo_optimizer_steps():
    summary = compare.summarize_run(rows_for(3, 64), {"batch_size": 64, "num_epochs": 4, "num_mini_batches": 2}, 1.0)
    assert summary["optimizer_steps"] == 24 and summary["completions_trained"] == 192


def test_aggregate_over_seeds():
    a = compare.summarize_run(rows_for(2, 64), {"batch_size": 64}, 100.0)
    b = dict(a, accuracy_final=0.8, peak_rss_mib=300.0, family_accuracy={"a": 0.7, "b": 0.9})
    agg = compare.aggregate([a, b])
    assert agg["seeds"] == 2
    assert agg["accuracy_final"] == pytest.approx((0.75, statistics.stdev([0.7, 0.8])))
    assert agg["peak_rss_mib"] == pytest.approx((200.0, statistics.stdev([100.0, 300.0])))
    assert agg["family_accuracy"]["a"] == pytest.approx((0.6, statistics.stdev([0.5, 0.7])))
    lines = compare.markdown_tables("uniform", {"remax": agg})
    assert any(l.startswith("| remax | 0.400 → **0.750 ± 0.071**") for l in lines)


@pytest.mark.parametrize("argv, message", [(["--steps", "0"], "--steps"), (["--batch_size", "60"], "--batch_size"),
                                           (["--seeds", "1", "1"], "--seeds"), (["--algorithms", "sac"], "--algorithms")])
def test_bad_arguments_fail_before_any_run(argv, message, tmp_path):
    out = subprocess.run([sys.executable, "bench/compare.py", *argv, "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode != 0 and message in out.stderr
    assert not any(tmp_path.iterdir())


def test_runner_smoke(tmp_path):
    """All six algorithms, one seed, the hetero task, 2 steps each: the files docs/results.md shows
    are written, the budget bookkeeping matches each algorithm's design, and a second call
    reuses the finished runs instead of training again."""
    cmd = [sys.executable, "bench/compare.py", "--steps", "2", "--eval_every", "1", "--seeds", "0",
           "--tasks", "hetero", "--out", str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    agg = results["aggregate"]["hetero"]
    assert list(agg) == ["reinforce", "remax", "grpo", "rloo", "dapo", "ppo"]
    for algo, a in agg.items():
        assert a["seeds"] == 1 and a["completions_trained"][0] == 2 * 64, algo
        assert 0 <= a["accuracy_final"][0] <= 1 and a["peak_rss_mib"][0] > 0
    assert agg["reinforce"]["sequences_generated"][0] == 128
    assert agg["remax"]["sequences_generated"][0] == 256  # + one greedy response per prompt
    assert agg["dapo"]["sequences_generated"][0] >= 128  # dynamic sampling may add rounds
    assert agg["ppo"]["optimizer_steps"][0] == 2 * 16 and agg["grpo"]["optimizer_steps"][0] == 2
    md = (tmp_path / "results.md").read_text()
    assert "| ppo |" in md and "`sub_2x2` (-5/-4)" in md and "![hetero](compare_hetero.png)" in md
    assert (tmp_path / "compare_hetero.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert again.returncode == 0 and "6 runs (6 already done)" in again.stdout
    assert json.loads((tmp_path / "results.json").read_text())["aggregate"] == results["aggregate"]


def test_results_docs_page_tables_are_the_runners_output():
    """The tables of docs/results.md are docs/results/results.md, which `python bench/compare.py`
    wrote (default budget: all six algorithms, both tasks, three seeds), row for row."""
    committed = (ROOT / "docs" / "results" / "results.md").read_text()
    results = json.loads((ROOT / "docs" / "results" / "results.json").read_text())
    assert results["command"] == "python bench/compare.py" and results["steps"] == 150
    assert set(results["aggregate"]) == {"uniform", "hetero"}
    assert all(list(a) == list(compare.ALGORITHMS) and all(x["seeds"] == 3 for x in a.values())
               for a in results["aggregate"].values())
    rows = [line for line in committed.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 * (1 + 6 + 1 + 1 + 6)  # per task: header + 6 algorithms, header + start + 6
    page = (ROOT / "docs" / "results.md").read_text()
    missing = [row for row in rows if row not in page]
    assert not missing, missing
    for task in ("uniform", "hetero"):
        assert (ROOT / "docs" / "results" / f"compare_{task}.png").stat().st_size > 10_000
        remax = results["aggregate"][task]["remax"]["accuracy_final"]
        assert f"| remax | 0.416 → **{remax[0]:.3f} ± {remax[1]:.3f}**" in committed
