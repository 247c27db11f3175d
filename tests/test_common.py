"""Masking, aggregation, log-probs, generation and the built-in task (common.py)."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from lab import config as lab_config
from support import config, models, tasks
from common import aggregate_loss, completion_mask, masked_mean, masked_sum, masked_whiten, reward_to_go

EOS = 1


def test_completion_mask_keeps_first_eos_and_drops_the_rest():
    ids = torch.tensor([[5, 6, EOS, 0, 0], [5, EOS, 7, EOS, 0], [5, 6, 7, 8, 9], [EOS, 0, 0, 0, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert torch.equal(completion_mask(ids, EOS), expected)


def test_masked_sum_and_mean_ignore_masked_values_even_nan():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert masked_sum(x, mask).item() == 13.0
    assert torch.equal(masked_sum(x, mask, dim=1), torch.tensor([3.0, 10.0]))
    assert masked_mean(x, mask).item() == 13.0 / 4
    assert torch.equal(masked_mean(x, mask, dim=1), torch.tensor([1.5, 5.0]))


def test_masked_mean_of_empty_row_is_zero():
    assert masked_mean(torch.ones(2, 3), torch.tensor([[0, 0, 0], [1, 1, 0]]), dim=1).tolist() == [0.0, 1.0]


def test_aggregate_loss_modes_hand_computed():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # token-mean: (1+2+3+4+10+20) / 6
    assert aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(40.0 / 6, rel=1e-6)  # float32
    # seq-mean-token-mean: ((10/4) + (30/2)) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.5 + 15.0) / 2, rel=1e-6)
    # seq-mean-token-sum: each sequence's sum, (10 + 30) / 2; the padding's values (set to 99) never count
    padded = torch.where(mask.bool(), loss, 99.0)
    assert aggregate_loss(padded, mask, "seq-mean-token-sum").item() == pytest.approx((10.0 + 30.0) / 2, rel=1e-6)
    # seq-mean-token-sum-norm with a constant max length 8: (10/8 + 30/8) / 2
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((10 / 8 + 30 / 8) / 2, rel=1e-6)
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((10 / 4 + 30 / 4) / 2, rel=1e-6)


def test_aggregate_loss_rejects_unknown_mode():
    try:
        aggregate_loss(torch.ones(1, 1), torch.ones(1, 1), "sum")
    except ValueError as e:
        assert "token-mean" in str(e)
    else:
        raise AssertionError("no error")


def test_masked_whiten_has_zero_mean_unit_std_on_mask_and_zero_off_it():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 7, generator=g, dtype=torch.float64) * 3 + 5
    mask = (torch.rand(4, 7, generator=g) > 0.3).long()
    w = masked_whiten(x, mask)
    values = w[mask.bool()]
    assert abs(values.mean().item()) < 1e-12
    assert abs(values.std().item() - 1) < 1e-6  # Bessel-corrected std, as TRL
    assert (w[~mask.bool()] == 0).all()
    kept = masked_whiten(x, mask, shift_mean=False)[mask.bool()]
    assert torch.allclose(kept.mean(), x[mask.bool()].mean())
    # by hand: 1, 2, 3 kept (100 and 7 are padding): mean 2, std (ddof 1) 1, so -1, 0, 1 (ddof 0: -+1.22)
    small = masked_whiten(torch.tensor([[1.0, 2.0, 100.0], [3.0, 7.0, 7.0]], dtype=torch.float64),
                          torch.tensor([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(small, torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64),
                               rtol=0, atol=1e-7)


@pytest.mark.parametrize("adv", [2.0, 0.0, -2.0])
def test_clipped_surrogate_is_the_pessimistic_bound_with_its_gradient_zero_exactly_where_the_clip_binds(adv):
    """clip (low 0.2, high 0.28), rho = e^logp from 0.5 to 1.5: with A > 0 the surrogate is A min(rho, 1.28) (the
    clip binds above 1.28 only), with A < 0 it is A max(rho, 0.8) (below 0.8 only); d/dlogp is rho A where it does
    not bind and 0 where it does. Never above rho A."""
    ratio = torch.linspace(0.5, 1.5, 21, dtype=torch.float64)
    logp = torch.log(ratio).requires_grad_()
    surrogate = common.clipped_surrogate(torch.exp(logp), torch.tensor(adv, dtype=torch.float64),
                                         common.Clip(0.2, 0.28))
    (grad,) = torch.autograd.grad(surrogate.sum(), logp)
    binds = ratio > 1.28 if adv > 0 else ratio < 0.8
    expected = adv * (ratio.clamp(max=1.28) if adv > 0 else ratio.clamp(min=0.8))
    torch.testing.assert_close(surrogate.detach(), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, torch.where(binds, 0.0, ratio * adv), rtol=1e-12, atol=0)
    assert (surrogate <= ratio * adv + 1e-12).all()


def test_clip_stats_count_the_clipped_valid_tokens_of_the_side_a_favours():
    """Row 0 (4 valid tokens, A = 1): rho 1.3 (above 1 + high 1.28: clipped), 1.25 (between 1 + low and 1 + high:
    not clipped), 0.5 (below 1 - low, but A > 0: not clipped), 1; row 1 (2 valid tokens, A = -1): rho 0.7 (clipped
    below), 1.5 (above, but A < 0: not clipped). The padding holds ratios past both clips. Fractions over the 6
    valid tokens (not the mean of the rows' means): 1/6 each; approx_kl the mean of rho - 1 - log rho over them."""
    ratio = torch.tensor([[1.3, 1.25, 0.5, 1.0], [0.7, 1.5, 0.01, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    stats = common.clip_stats(ratio, torch.log(ratio), adv, mask, common.Clip(0.2, 0.28))
    assert stats["clip_frac_high"].item() == pytest.approx(1 / 6)
    assert stats["clip_frac_low"].item() == pytest.approx(1 / 6)
    valid = torch.tensor([1.3, 1.25, 0.5, 1.0, 0.7, 1.5], dtype=torch.float64)
    assert stats["approx_kl"].item() == pytest.approx((valid - 1 - torch.log(valid)).mean().item(), rel=1e-12)


def test_reward_to_go_sums_future_masked_values():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert reward_to_go(x, mask).tolist() == [[6.0, 5.0, 3.0, 0.0]]


def tiny_model(seed=0, vocab=23):
    from transformers import Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=EOS)
    return AutoModelForCausalLM.from_config(config).eval()


def test_token_logprobs_equals_naive_full_log_softmax():
    model = tiny_model()
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, 23, (3, 9), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :3] = 0  # left padding
    attention_mask[1, :1] = 0
    temperature, c = 0.7, 4
    logp, entropy = common.token_logprobs(model, input_ids, attention_mask, c, temperature, with_entropy=True)
    logits = model(input_ids=input_ids, attention_mask=attention_mask,
                   position_ids=common.position_ids_from_mask(attention_mask)).logits / temperature
    full = torch.log_softmax(logits, -1)[:, -c - 1:-1]  # the (B, T, V) copy token_logprobs avoids
    naive = full.gather(-1, input_ids[:, -c:, None]).squeeze(-1)
    assert torch.allclose(logp, naive, atol=1e-5)
    assert torch.allclose(entropy, -(full.exp() * full).sum(-1), atol=1e-5)


def test_sampling_logprobs_match_training_logprobs_with_left_padding():
    """The log-probs the loop trains on are those common.generate sampled from: its temperature,
    top-k and top-p (from cfg), and positions that skip the left padding. The sampler's own
    processed scores are captured from inside common.generate."""
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    cfg = lab_config.LabConfig(max_new_tokens=5, temperature=0.7, top_k=8, top_p=0.9)
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tok, ["1+2=", "123+456=", "99*9="], "cpu")
    scores, generate = [], model.generate

    def generate_keeping_scores(**kwargs):
        out = generate(**kwargs, return_dict_in_generate=True, output_scores=True)
        scores.extend(out.scores)
        return out.sequences

    model.generate = generate_keeping_scores
    torch.manual_seed(0)
    completion = common.generate(model, tok, prompt_ids, prompt_mask, cfg, num_samples=2)
    mask = completion_mask(completion, tok.eos_token_id)
    sampled = torch.stack([torch.log_softmax(s.float(), -1) for s in scores], 1)[:, :completion.shape[1]]
    sampled = sampled.gather(-1, completion[..., None]).squeeze(-1)
    input_ids = torch.cat([prompt_ids.repeat_interleave(2, 0), completion], 1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(2, 0), mask], 1)
    logp = common.token_logprobs(model, input_ids, attention_mask, completion.shape[1], cfg.temperature,
                                 top_k=cfg.top_k, top_p=cfg.top_p)
    assert mask.sum() >= 6
    torch.testing.assert_close(logp[mask.bool()], sampled[mask.bool()], atol=1e-4, rtol=0)


def test_generate_returns_k_adjacent_samples_per_prompt_and_greedy_is_deterministic():
    """At a temperature of 1e-4 sampling is greedy, so each prompt's K samples are its greedy
    completion: rows 0..K-1 belong to the first prompt and K..2K-1 to the second (adjacent), not
    interleaved. The two prompts' answers differ, so the order is visible."""
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL)
    cfg = lab_config.LabConfig(max_new_tokens=6, temperature=1e-4)
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tok, ["12+3=", "45+67="], "cpu")
    samples = common.generate(model, tok, prompt_ids, prompt_mask, cfg, num_samples=4)
    assert samples.shape[0] == 8 and samples.shape[1] <= 6
    greedy = [common.generate(model, tok, prompt_ids, prompt_mask, cfg, greedy=True) for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1])
    n = greedy[0].shape[1]
    assert not torch.equal(greedy[0][0], greedy[0][1])
    for i in range(8):
        assert torch.equal(samples[i, :n], greedy[0][i // 4]), i
    # greedy decoding of a left-padded batch equals decoding each prompt alone
    alone = common.generate(model, tok, *tasks.tokenize_prompts(tok, ["12+3="], "cpu"), cfg, greedy=True)
    assert torch.equal(greedy[0][0, :alone.shape[1]], alone[0])


def test_held_out_split_is_disjoint_from_training_prompts():
    train, held_out = tasks.load_task(lab_config.LabConfig())
    assert {ex["prompt"] for ex in train}.isdisjoint({ex["prompt"] for ex in held_out})
    assert {ex["family"] for ex in held_out} == set(tasks.FAMILIES)
    for ex in held_out[:50]:
        assert str(eval(ex["prompt"].rstrip("="))) == ex["answer"]


def test_rewards_uniform_and_hetero_scales():
    examples = [{"prompt": "12+3=", "answer": "15", "family": "add_2x1"}, {"prompt": "123+456=", "answer": "579", "family": "add_3x3"}]
    rewards, correct = tasks.compute_rewards(examples, ["15", " 578"], "uniform")
    assert rewards.tolist() == [1.0, 0.0] and correct.tolist() == [1.0, 0.0]
    rewards, correct = tasks.compute_rewards(examples, ["15", "578"], "hetero")
    assert rewards.tolist() == [tasks.HETERO_SCALES["add_2x1"][1], tasks.HETERO_SCALES["add_3x3"][0]]
    assert correct.tolist() == [1.0, 0.0]


def test_prompt_sampler_shards_differ_across_ranks():
    examples = [{"prompt": str(i)} for i in range(100)]
    a = tasks.PromptSampler(examples, 10, seed=0, rank=0, world_size=2).next()
    b = tasks.PromptSampler(examples, 10, seed=0, rank=1, world_size=2).next()
    assert {e["prompt"] for e in a}.isdisjoint({e["prompt"] for e in b})


def test_decode_completions_keeps_the_tokens_up_to_eos():
    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    completion_ids = torch.tensor([[4, 5, EOS, 0], [15, 11, 12, 13], [EOS, 0, 0, 0]])  # "12", "*89+" (no EOS), ""
    texts = tasks.decode_completions(tok, completion_ids, completion_mask(completion_ids, EOS))
    assert texts == ["12", "*89+", ""]


def test_evaluate_counts_greedy_answers_per_family(monkeypatch):
    class OneProcess:
        process_index, num_processes, device = 0, 1, "cpu"
        unwrap_model = staticmethod(lambda model: model)
        reduce = staticmethod(lambda tensor, reduction: tensor)

    tok = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    examples = [{"prompt": "1+2=", "answer": "3", "family": "add"}, {"prompt": "2+2=", "answer": "4", "family": "add"},
                {"prompt": "3+2=", "answer": "5", "family": "add"}, {"prompt": "3*2=", "answer": "6", "family": "mul"}]
    answers = ["3", "4", "6", "7"]  # add: 2 of 3 right, mul: 0 of 1
    greedy = torch.tensor([tok(a + "<eos>", add_special_tokens=False)["input_ids"] for a in answers])
    monkeypatch.setattr(models, "generate", lambda *args, **kwargs: greedy)
    metrics = tasks.evaluate(None, tok, examples, lab_config.LabConfig(), OneProcess())
    assert metrics == {"eval/accuracy": 0.5, "eval/acc_add": 2 / 3, "eval/acc_mul": 0.0}


def test_reduce_metrics_of_floats_ints_and_tensors_on_one_process():
    from accelerate import Accelerator

    from support import run

    metrics = {"a": 0.25, "b": 3, "c": torch.tensor(1.5, dtype=torch.float64), "d": torch.tensor([2.0]),
               "e": torch.tensor(True).float().mean()}
    assert run.reduce_metrics(Accelerator(cpu=True), metrics) == {"a": 0.25, "b": 3.0, "c": 1.5, "d": 2.0, "e": 1.0}
