"""--keep_routing in the training loops, on the embedded mixture-of-experts policy (lab/routing.py holds
the record and replay themselves, tests/test_routing.py their tests): which experts each pass of the trainer
uses, train/routing_mismatch, and the sampler's routing carried through DAPO's rounds of sampling."""
import json
import os
import sys

import pytest
import torch

from lab import dapo, grpo  # the lab's loops: --keep_routing is theirs
from lab import engine, routing
from support import config
from support.run import read_metrics

MOE = os.path.join(config.ROOT, "embedded_model", "moe")
# a bfloat16 sampler: about 1% of the (completion token, layer) pairs route otherwise than in the fp32 trainer
FLAGS = ["--model_name_or_path", MOE, "--rollout_dtype", "bfloat16", "--batch_size", "32", "--num_generations", "4",
         "--eval_every", "100", "--save_model", "False", "--learning_rate", "1e-3"]


def run(module, out_dir, *flags, steps=1):
    """Run `module`; returns its metrics and, per pass of the policy, (rollout, rows, experts used, is pi_old)."""
    passes, original = [], routing.Pass.close

    def close(self):
        closed = original(self)
        passes.append((self.rollout, self.rows, closed.used(),
                       len(self.rows) == len(self.rollout) and self.rollout.old_routing is None))
        return closed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "argv", [module.__name__.replace(".", "/") + ".py", "--num_steps", str(steps), *FLAGS, *flags,
                                 "--output_dir", str(out_dir)])
        mp.setattr(routing.Pass, "close", close)
        module.main()
    return read_metrics(out_dir / "metrics.jsonl")[1:], passes


def predicted(rollout, rows=None):
    """(b, S) bool: the positions whose routing the sampler recorded (those that predict a completion token)."""
    indices = rollout.routing[0] if rows is None else rollout.routing[0][rows]
    return indices[..., 0, 0] >= 0


@pytest.mark.parametrize("keep", ["none", "r3", "r2"])
def test_each_pass_of_the_trainer_uses_the_experts_keep_routing_names(keep, tmp_path):
    """none: the trainer's routers choose, and differ from the sampler's somewhere (the mismatch is logged);
    r3: pi_old and every update use the sampler's experts; r2: the updates use those of the pi_old pass."""
    rows, passes = run(grpo, tmp_path, "--num_epochs", "2", "--keep_routing", keep)
    old = [p for p in passes if p[3]]
    updates = [p for p in passes if not p[3]]
    assert len(old) == 1 and len(updates) == 2 * 1  # one pi_old pass; two epochs of one micro-batch
    rollout = old[0][0]
    sampler, seen = rollout.routing[0], predicted(rollout)
    assert 0 < rows[0]["train/routing_mismatch"] < 0.1  # measured before any replay, whatever keep is
    for _, mb_rows, (used, token_ids), _ in passes:
        same = (used[seen[mb_rows]] == sampler[mb_rows][seen[mb_rows]]).all()
        if keep == "r3":
            assert same
            assert torch.equal(token_ids[seen[mb_rows]], rollout.routing[1][mb_rows][seen[mb_rows]])
    if keep == "none":
        assert not (old[0][2][0][seen] == sampler[seen]).all()
    if keep == "r2":
        for _, mb_rows, (used, _), _ in updates:
            assert torch.equal(used[seen[mb_rows]], rollout.old_routing[0][mb_rows][seen[mb_rows]])


def test_routing_mismatch_is_the_mean_of_the_layers_that_disagree_per_completion_token(tmp_path, capsys):
    rows, passes = run(grpo, tmp_path)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 1 |")]
    assert len(printed) == 1 and f"routing_mismatch {rows[0]['train/routing_mismatch']:.4g} |" in printed[0]
    rollout = passes[0][0]
    layers = rollout.routing[0].shape[2]
    disagree = routing.disagreement(rollout)  # (B, T): what the rollout viewer shows per token
    assert disagree.shape == rollout.mask.shape and disagree.max() <= layers
    expected = (disagree * rollout.mask).sum() / (rollout.mask.sum() * layers)
    assert rows[0]["train/routing_mismatch"] == pytest.approx(expected.item(), rel=1e-6)
    assert expected > 0


def test_dapo_replays_the_samplers_routing_across_its_rounds_of_sampling(tmp_path):
    """DAPO joins the groups it keeps from several generate calls (Rollout.cat re-pads their prompts and
    completions): the routing is laid out with them, or the replay refuses the batch."""
    rows, passes = run(dapo, tmp_path, "--keep_routing", "r3", "--max_sampling_rounds", "4", "--batch_size", "32",
                       steps=2)
    assert max(r["train/sampling_rounds"] for r in rows) > 1
    for rollout, mb_rows, (used, _), _ in passes:
        seen = predicted(rollout, mb_rows)
        assert torch.equal(used[seen], rollout.routing[0][mb_rows][seen])


def test_a_rollout_whose_rows_were_shuffled_is_refused(tmp_path):
    """The replay checks every forward's token ids against the recorded ones: a wrong layout fails loudly."""
    original = engine.Trainer.generate

    def shuffled(self, *args, **kwargs):
        rollout = original(self, *args, **kwargs)
        rollout.routing = tuple(x.roll(1, dims=0) for x in rollout.routing)
        return rollout

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.Trainer, "generate", shuffled)
        with pytest.raises(RuntimeError, match="not laid out as they were recorded"):
            run(grpo, tmp_path, "--keep_routing", "r3")


def test_keep_routing_on_a_dense_policy_is_one_error_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lab/grpo.py", "--keep_routing", "r3", "--output_dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--keep_routing needs a mixture-of-experts policy"):
        grpo.main()


def test_replay_runs_under_zero3_and_under_lora_on_two_processes(tmp_path):
    """R3 with pi_old and two updates per batch: under ZeRO-3 (weights sharded, gathered once per generate call)
    and under LoRA with a bfloat16 sampler (DDP); a layout wrong on either rank would stop the run."""
    from conftest import free_port, run_together

    common_args = ["lab/grpo.py", "--model_name_or_path", MOE, "--keep_routing", "r3", "--num_epochs", "2",
                   "--num_steps", "2", "--batch_size", "8", "--num_generations", "4", "--eval_every", "100"]
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--mixed_precision", "no"]
    runs = {"lora": [*launch, "--multi_gpu", "--main_process_port", str(free_port()), *common_args, "--lora_r", "4",
                     "--rollout_dtype", "bfloat16", "--output_dir", str(tmp_path / "lora")]}
    try:
        import deepspeed  # noqa: F401
        runs["zero3"] = [*launch, "--config_file", "configs/zero3.yaml", "--main_process_port", str(free_port()),
                         *common_args, "--output_dir", str(tmp_path / "zero3")]
    except ImportError:
        pass
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for name, out in zip(runs, run_together(list(runs.values()), env)):
        if out.returncode != 0:  # the whole log of both ranks, in the failure's captured output
            print(name, out.stdout, out.stderr, sep="\n")
        assert out.returncode == 0, (name, out.stderr[-3000:])
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        assert summary["num_processes"] == 2 and len(set(summary["replica_weight_checksums"])) == 1
        rows = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if r["step"] > 0]
        assert len(rows) == 2 and all(0 <= r["train/routing_mismatch"] < 0.1 for r in rows)
    if "zero3" in runs:  # the weights really were sharded
        shards = json.loads((tmp_path / "zero3" / "summary.json").read_text())["sharding"]
        assert shards["zero_stage"] == 3 and all(k < 0.51 * shards["params"] for k in shards["params_per_rank"])
