"""One place for each fact of the update: the aggregation the loop names in its trainer.micro_batches call is the
one the loss aggregates with, the one the micro-batches are weighted by and the one the rollout viewer divides by;
what a micro-batch's forward keeps for its backward lives on the micro-batch, so scoring it twice, a backward
without its forward, or a second forward while a mixture of experts' routing is open is one error line."""
import os
import sys

import pytest
import torch

import common
from lab import grpo, remax  # the lab's loops (engine.Trainer)
from lab import engine, losses, routing, view
from support import config
from support.run import read_metrics

MOE = os.path.join(config.ROOT, "embedded_model", "moe")


def run(module, args, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [module.__name__.replace(".", "/") + ".py", *args, "--save_model", "False", "--eval_every", "100",
                                      "--output_dir", str(tmp_path)])
    module.main()
    return read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_the_aggregation_the_loop_names_is_the_losss_the_weights_and_the_viewers(mode, tmp_path, monkeypatch):
    """GRPO, on-policy with beta 0, in micro-batches of 16 rows: the loop's aggregation is changed where it is said
    (the micro_batches call) to `mode`. Every loss call then aggregates with it, each micro-batch is weighted for it
    (common.micro_batch_weight, the weights summing to 1 over the update), the update's logged loss is the whole
    batch's loss in that mode, and the viewer's push (the gradient at each log-prob over the aggregation's
    normaliser) is the advantage itself, A_i on every token: had the viewer divided by another normaliser than the
    loss's, it would not be."""
    calls, micro_batches, loss_fn = [], engine.Trainer.micro_batches, losses.grpo_loss

    def named_here(trainer, rollout, loss_agg, rows=None):  # the loop's one statement, said otherwise
        out = micro_batches(trainer, rollout, common.Aggregation(mode, 8), rows)
        calls.append({"rollout": rollout, "weights": [float(mb.agg.weight) for mb in out], "losses": []})
        return out

    def recording_loss(logp, old_logp, ref_logp, adv, mask, clip, beta, loss_agg, *args):
        loss, stats = loss_fn(logp, old_logp, ref_logp, adv, mask, clip, beta, loss_agg, *args)
        calls[-1]["losses"].append((loss_agg, -(adv[:, None] * logp).detach(), mask, loss.detach()))
        return loss, stats

    seen = {}

    def keep_step(trainer, step, metrics, rollout=None, rewards=None, adv=None, tokens=None):
        seen.update(adv=adv, kept=dict(trainer.viewer.kept))
        return end_step(trainer, step, metrics, rollout, rewards, adv, tokens)

    end_step = engine.Trainer.end_step
    monkeypatch.setattr(engine.Trainer, "micro_batches", named_here)
    monkeypatch.setattr(losses, "grpo_loss", recording_loss)
    monkeypatch.setattr(engine.Trainer, "end_step", keep_step)
    rows = run(grpo, ["--num_steps", "1", "--beta", "0", "--batch_size", "32", "--micro_batch_size", "16"], tmp_path,
               monkeypatch)
    [update] = calls
    assert len(update["losses"]) == 2 and sum(update["weights"]) == pytest.approx(1.0, rel=1e-6)
    for (loss_agg, _, mask, _), weight in zip(update["losses"], update["weights"]):
        assert loss_agg.mode == mode and float(loss_agg.weight) == weight
        assert weight == pytest.approx(float(mask.sum() / update["rollout"].mask.sum()) if mode == "token-mean"
                                       else len(mask) / 32, rel=1e-6)
    terms = torch.cat([t for _, t, _, _ in update["losses"]])
    whole = common.aggregate_loss(terms, update["rollout"].mask, mode, 8)  # on-policy: the surrogate is -A logp
    assert rows[1]["train/loss"] == pytest.approx(whole.item(), rel=1e-5)
    push, mask, adv = seen["kept"]["push"], update["rollout"].mask.bool(), seen["adv"]
    recorded = ~torch.isnan(push[:, 0])
    assert recorded.sum() >= 4
    expected = adv[:, None].expand_as(push)
    torch.testing.assert_close(push[recorded][mask[recorded]], expected[recorded][mask[recorded]].float(),
                               rtol=1e-4, atol=1e-6)


def test_scoring_a_micro_batch_twice_is_one_error_line(tmp_path, monkeypatch):
    policy_logprobs = engine.Trainer.policy_logprobs

    def twice(trainer, rollout, mb):  # a student's second look at the same rows, before their backward
        policy_logprobs(trainer, rollout, mb)
        return policy_logprobs(trainer, rollout, mb)

    monkeypatch.setattr(engine.Trainer, "policy_logprobs", twice)
    with pytest.raises(SystemExit) as e:
        run(remax, ["--num_steps", "1", "--batch_size", "8"], tmp_path, monkeypatch)
    message = str(e.value)
    assert message.startswith("error: trainer.policy_logprobs") and "already scored" in message
    assert "\n" not in message


@pytest.mark.parametrize("misuse", ["without its forward", "twice"])
def test_a_backward_without_its_forward_or_twice_is_one_error_line(misuse, tmp_path, monkeypatch):
    backward = engine.Trainer.backward

    def misused(trainer, loss, mb, *args):
        if misuse == "twice":
            backward(trainer, loss, mb, *args)
            return backward(trainer, loss, mb, *args)
        fresh = type(mb)(mb.rows, mb.mask, mb.agg, mb.share, mb.last)  # rows no forward has scored
        return backward(trainer, loss, fresh, *args)

    monkeypatch.setattr(engine.Trainer, "backward", misused)
    with pytest.raises(SystemExit) as e:
        run(remax, ["--num_steps", "1", "--batch_size", "8"], tmp_path, monkeypatch)
    message = str(e.value)
    assert message.startswith("error: trainer.backward") and "\n" not in message
    assert ("already back-propagated" if misuse == "twice" else "call trainer.policy_logprobs") in message


def test_a_second_forward_while_a_routing_pass_is_open_is_refused():
    """A mixture of experts' forward records its routing until its backward: a second pass over other rows opened
    meanwhile would record into the first one's, so it is refused; once the first closes, the next opens."""
    from transformers import AutoModelForCausalLM

    from lab.rollout import LabRollout

    model = AutoModelForCausalLM.from_pretrained(MOE)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    layers, top_k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    rollout = LabRollout([{}, {}], ids[:, :2], torch.ones(2, 2, dtype=torch.long), ids[:, 2:],
                         torch.ones(2, 2, dtype=torch.long), ["", ""], (torch.full((2, 4, layers, top_k), -1), ids))
    first = routing.Pass(model, rollout, torch.tensor([0]))
    model(input_ids=ids[:1])
    with pytest.raises(RuntimeError, match="still open"):
        routing.Pass(model, rollout, torch.tensor([1]))
    first.close()
    second = routing.Pass(model, rollout, torch.tensor([1]))
    model(input_ids=ids[1:])
    second.close()
    assert rollout.live_routing[0, 0, 0, 0] >= 0 and rollout.live_routing[1, 0, 0, 0] >= 0


def test_the_viewer_watches_from_outside_the_trainer():
    """The viewer's state lives in view.Watcher, not in the Trainer: the Trainer keeps a reference to it and no
    recorded tensors of its own."""
    import inspect

    source = inspect.getsource(engine.Trainer)
    assert "retain_grad" not in source and "self.kept" not in source and "self.scored" not in source
    assert "retain_grad" in inspect.getsource(view.Watcher)
