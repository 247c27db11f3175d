"""DeepSpeed ZeRO-2 and ZeRO-3 on CPU (DeepSpeed's CPU accelerator, gloo, 2 processes): the scripts run,
the weights and optimizer state really are sharded, the saved model is complete, ZeRO-3 generation gathers
the weights once, and a non-finite gradient leaves the weights as they were. Skipped without deepspeed.

Run as a script under torchrun, this file is the worker of the generation and non-finite tests."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}


def checksum(model):
    """The weight checksum summary.json records (run.MetricLogger.finish)."""
    return sum(p.detach().double().sum() + p.detach().double().abs().sum() for p in model.parameters()).item()


def test_deepspeed_settings_come_from_the_flags():
    from lab import config
    from support import helpers

    cfg = config.LabConfig(batch_size=16, max_grad_norm=0.5)
    ds = helpers.deepspeed_settings({"gradient_accumulation_steps": "auto", "gradient_clipping": 1.0}, cfg, 4)
    assert ds == {"gradient_accumulation_steps": 1, "train_micro_batch_size_per_gpu": 16, "train_batch_size": 64,
                  "gradient_clipping": 0.5}
    cfg = config.LabConfig(batch_size=16, micro_batch_size=3, max_grad_norm=0)
    ds = helpers.deepspeed_settings({}, cfg, 2)
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"], ds["gradient_clipping"]) == (3, 6, 0)
    with pytest.raises(SystemExit, match="gradient_accumulation_steps is 4"):
        helpers.deepspeed_settings({"gradient_accumulation_steps": 4}, cfg, 1)


def launch_zero(script, runs):
    """3 steps of `script` under configs/zero{stage}.yaml, 2 processes, fp32, for each (stage, args, out_dir) in
    runs, all at once (each on its own port); returns their summary.json."""
    from conftest import free_port, run_together

    cmds = [[sys.executable, "-m", "accelerate.commands.launch", "--config_file", f"configs/zero{stage}.yaml",
             "--num_processes", "2", "--main_process_port", str(free_port()), "--mixed_precision", "no", script,
             "--num_steps", "3", "--batch_size", "4", "--max_new_tokens", "4", "--learning_rate", "1e-3",
             "--eval_every", "100", "--output_dir", str(out_dir), *args] for stage, args, out_dir in runs]
    for out in run_together(cmds, env=ENV):
        assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads((out_dir / "summary.json").read_text()) for _, _, out_dir in runs]


@pytest.mark.parametrize("script,args", [("lab/remax.py", []), ("lab/grpo.py", ["--num_generations", "2"])])
def test_zero2_and_zero3_shard_save_complete_models_and_train_alike(script, args, tmp_path):
    """ZeRO-2 with 2 micro-batches per update and ZeRO-3 with one: each shards what it should, saves a model
    that loads and equals the gathered trained weights, and both compute the same losses and gradients."""
    pytest.importorskip("deepspeed")
    from transformers import AutoModelForCausalLM

    from support import config, run

    start = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    final = {}
    summaries = launch_zero(script, [(stage, args + ["--micro_batch_size", micro_batch_size], tmp_path / str(stage))
                                     for stage, micro_batch_size in ((2, "2"), (3, "0"))])
    for stage, summary in zip((2, 3), summaries):
        shards = summary["sharding"]
        assert summary["num_processes"] == 2 and shards["zero_stage"] == stage
        n = shards["params"]
        # each process holds half of the optimizer's fp32 master weights (padded to alignment) ...
        assert all(n / 2 <= k < 0.51 * n for k in shards["optimizer_state_per_rank"])
        if stage == 3:  # ... and under ZeRO-3 half of the weights too
            assert all(n / 2 <= k < 0.51 * n for k in shards["params_per_rank"])
        else:
            assert shards["params_per_rank"] == [n, n]
        # the saved model is complete: it loads, and it is the gathered trained weights
        final[stage] = AutoModelForCausalLM.from_pretrained(tmp_path / str(stage) / "final")
        assert sum(p.numel() for p in final[stage].parameters()) == n
        a, b = summary["replica_weight_checksums"]
        assert a == b and checksum(final[stage]) == pytest.approx(a, rel=1e-12)
        assert max((p - q).abs().max().item() for p, q in zip(final[stage].parameters(), start.parameters())) > 1e-4
    # the same samples at every step, the same loss and gradient norm at step 1 (the same weights): the
    # micro-batches add up to the batch. Later steps to 1e-4, not to rounding: Adam's step
    # lr * m / (sqrt(v) + eps) turns the rounding of gradients near 0, which differs between the two reductions,
    # into weight differences of up to lr; a lost or extra micro-batch would be off by far more.
    rows = {stage: [r for r in run.read_metrics(tmp_path / str(stage) / "metrics.jsonl") if r["step"] > 0]
            for stage in (2, 3)}
    assert [r["train/reward"] for r in rows[2]] == [r["train/reward"] for r in rows[3]]
    for key in ("train/loss", "train/grad_norm"):
        assert rows[2][0][key] == pytest.approx(rows[3][0][key], rel=1e-6, abs=1e-6)
        assert [r[key] for r in rows[2]] == pytest.approx([r[key] for r in rows[3]], rel=1e-4)
    assert any(r["train/grad_norm"] > 0.1 for r in rows[3])
    assert any(r["train/kl_seq"] != 0 for r in rows[3])  # the reference (an evaluation engine) takes part


def test_a_sampler_process_beside_zero2_and_zero3_learners_gets_whole_weights(tmp_path):
    """--async_rollouts 1 under ZeRO-2 and ZeRO-3 (2 processes): each rank's sampler process, a plain model, gets the
    learner's weights after each step, under ZeRO-3 gathered for the copy (models.gathered_parameters). The sampler
    draws the same completions under both stages at every step, so the ZeRO-3 ranks sent the whole weights, not
    their shards; the learners stay sharded and their replicas equal."""
    pytest.importorskip("deepspeed")
    from support import run

    summaries = launch_zero("lab/grpo.py", [(stage, ["--num_generations", "2", "--async_rollouts", "1"],
                                         tmp_path / str(stage)) for stage in (2, 3)])
    rows = {stage: [r for r in run.read_metrics(tmp_path / str(stage) / "metrics.jsonl") if r["step"] > 0]
            for stage in (2, 3)}
    for stage, summary in zip((2, 3), summaries):
        n, shards = summary["sharding"]["params"], summary["sharding"]["params_per_rank"]
        assert (shards == [n, n]) if stage == 2 else all(n / 2 <= k < 0.51 * n for k in shards)
        a, b = summary["replica_weight_checksums"]
        assert a == b
        assert [r["train/staleness_max"] for r in rows[stage]] == [0, 1, 1]
    for key in ("train/reward", "train/completion_len"):
        assert [r[key] for r in rows[2]] == [r[key] for r in rows[3]], key
    assert rows[3][-1]["train/mismatch_k3"] == pytest.approx(rows[2][-1]["train/mismatch_k3"], rel=1e-4)
    assert rows[3][-1]["train/kl_seq"] > 0  # the reference, in the sampler processes, sees the policy move


def test_zero3_generation_gathers_once_and_nonfinite_steps_are_skipped(tmp_path):
    pytest.importorskip("deepspeed")
    from conftest import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           __file__, str(tmp_path)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for r in results:
        # hooks kept: every module's weights are gathered again for every token
        assert r["hooks_kept"]["allgathers"] > 5 * r["num_weights"]
        # hooks off: one all-gather per weight tensor when entering, whatever the length, and the same samples
        assert r["hooks_off"]["allgathers"] == r["num_weights"]
        assert r["hooks_off"]["tokens"] == r["hooks_kept"]["tokens"]
        assert r["hooks_off"]["completion_len"] == r["hooks_kept"]["completion_len"] == 12
        assert r["train_step_allgathers"] > 0  # the hooks are back: training gathers shards again
        for stage in ("2", "3"):
            assert not r["nonfinite"][stage]["grad_norm_finite"]
            assert r["nonfinite"][stage]["weights_unchanged"]


def worker(out_dir):
    """Under torchrun, 2 processes: ZeRO-3 generation with DeepSpeed's hooks kept (a plain GatheredParameters)
    and taken off (models.gathered_parameters), counting all-gathers, with a reuse distance of 0 so that every
    module releases its weights after its forward, as in a model larger than DeepSpeed's reuse window. Then a
    NaN loss under ZeRO-2 and ZeRO-3: DeepSpeed's step must skip the update and report a non-finite norm."""
    from types import SimpleNamespace

    import deepspeed
    import deepspeed.comm as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT))
    from support import config, helpers, models, tasks

    deepspeed.init_distributed("gloo")
    allgathers = [0]
    for name in ("allgather_fn", "all_gather_into_tensor", "all_gather"):
        def counting(*args, _original=getattr(dist, name), **kwargs):
            allgathers[0] += 1
            return _original(*args, **kwargs)
        setattr(dist, name, counting)

    def engine(stage, **zero):
        model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
        ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                     "zero_optimization": {"stage": stage, **zero}}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)[0]

    result = {"nonfinite": {}}
    tokenizer = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, ["12+34=", "5*6="], "cpu")
    never_eos = SimpleNamespace(pad_token_id=tokenizer.pad_token_id, eos_token_id=-1)  # always 12 tokens
    cfg = SimpleNamespace(max_new_tokens=12, temperature=1.0, top_p=1.0, top_k=0, micro_batch_size=0,
                          generation_batch_size=0)
    zero3 = engine(3, stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0, stage3_param_persistence_threshold=0)
    result["num_weights"] = len(list(zero3.module.parameters()))
    gathered_parameters = models.gathered_parameters
    for name, gather in (("hooks_kept", lambda m: deepspeed.zero.GatheredParameters(list(m.parameters()))),
                         ("hooks_off", gathered_parameters)):
        models.gathered_parameters = gather
        torch.manual_seed(0)
        allgathers[0] = 0
        ids = models.generate(zero3.module, never_eos, prompt_ids, prompt_mask, cfg)
        result[name] = {"allgathers": allgathers[0], "tokens": ids.tolist(), "completion_len": ids.shape[1]}
    models.gathered_parameters = gathered_parameters
    allgathers[0] = 0
    zero3.backward(zero3(input_ids=prompt_ids, attention_mask=prompt_mask, labels=prompt_ids).loss)
    zero3.step()
    result["train_step_allgathers"] = allgathers[0]

    for stage, model in ((2, engine(2)), (3, zero3)):
        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            before = [p.detach().clone() for p in model.module.parameters()]
        loss = model(input_ids=prompt_ids, attention_mask=prompt_mask, labels=prompt_ids).loss
        model.backward(loss * float("nan"))
        model.step()
        with deepspeed.zero.GatheredParameters(list(model.module.parameters())):
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.module.parameters()))
        norm = model.get_global_grad_norm()
        result["nonfinite"][str(stage)] = {"grad_norm_finite": norm is not None and bool(torch.isfinite(
            torch.as_tensor(norm))), "weights_unchanged": unchanged}
    print(f"rank {dist.get_rank()}: {result['num_weights']} weight tensors; all-gathers for "
          f"{cfg.max_new_tokens} tokens with the hooks kept {result['hooks_kept']['allgathers']}, taken off "
          f"{result['hooks_off']['allgathers']}; a training step after {result['train_step_allgathers']}; "
          f"NaN loss: {result['nonfinite']}", flush=True)
    if out_dir:
        with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
    world_size = dist.get_world_size()
    dist.barrier()
    torch.distributed.destroy_process_group()
    helpers.leave_run(world_size)  # as a run ends: a gloo thread may still hold an all-gather's tensors


if __name__ == "__main__":
    worker(sys.argv[1] if len(sys.argv) > 1 else None)
