"""GSPO (docs/algorithms.md): grpo_loss with importance_sampling_level="sequence". One ratio per
completion, the geometric mean of its token ratios; one clipped term per sequence; the same gradient
as GRPO's seq-mean-token-mean with one update per batch. Hand values and exact gradients in fp64."""
import math

import pytest
import torch

import common
from grpo import grpo_loss
from lab import losses as lab_losses
from lab.grpo import Config  # the lab's: GSPO's clip defaults at sequence level

F64 = torch.float64
NAN = float("nan")


def sequence_loss(log_ratio, adv, mask, epsilon=3e-4, epsilon_high=4e-4, loss_fn=grpo_loss, **kwargs):
    """grpo_loss (the lab's: loss_fn=lab_losses.grpo_loss, its dual_c and pg_weight in kwargs) at sequence level,
    beta 0, with logp - old_logp = log_ratio; returns (loss, d loss / d logp, stats)."""
    logp = torch.tensor(log_ratio, dtype=F64, requires_grad=True)
    loss, stats = loss_fn(logp, torch.zeros_like(logp), None, torch.tensor(adv, dtype=F64), torch.tensor(mask),
                          common.Clip(epsilon, epsilon_high, "sequence"), 0.0, **kwargs)
    loss.backward()
    return loss, logp.grad, stats


def test_sequence_ratio_is_the_geometric_mean_of_the_valid_token_ratios():
    """Token ratios (2, 8) give s = exp((log 2 + log 8) / 2) = 4, not their product 16 (the log-ratio summed)
    nor a mean that counts the padding; the padding holds NaN and garbage. Unclipped (wide clip), B = 2:
    loss = -(s_1 A_1 + s_2 A_2) / 2 and each valid token of sequence i gets -A_i s_i / (|y_i| B)."""
    log_ratio = [[math.log(2), math.log(8), NAN], [math.log(0.5), 100.0, NAN]]
    mask = [[1, 1, 0], [1, 0, 0]]
    loss, grad, _ = sequence_loss(log_ratio, [1.0, 1.0], mask, epsilon=0.99, epsilon_high=100.0)
    assert loss.item() == pytest.approx(-(4 + 0.5) / 2, rel=1e-12)
    expected = torch.tensor([[-4 / 4, -4 / 4, 0.0], [-0.5 / 2, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=0)
    # token level, the contrast (unclipped): each token its own ratio, -A rho_t / (|y_i| B)
    logp = torch.tensor([[math.log(2), math.log(8)]], dtype=F64, requires_grad=True)
    grpo_loss(logp, torch.zeros_like(logp), None, torch.ones(1, dtype=F64), torch.ones(1, 2), common.Clip(10.0, 10.0),
              0.0)[0].backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -4.0]], dtype=F64))


@pytest.mark.parametrize("adv, s, clipped", [
    (1.0, 1.00039, False), (1.0, 1.00041, True),     # A > 0: clipped above 1 + 4e-4 ...
    (1.0, 0.9, False),                                # ... and never below
    (-1.0, 0.99971, False), (-1.0, 0.99969, True),   # A < 0: clipped below 1 - 3e-4 ...
    (-1.0, 1.1, False),                               # ... and never above
])
def test_sequence_clip_zeroes_the_whole_sequences_gradient_exactly_where_it_binds(adv, s, clipped):
    """Sequence 1 has token log-ratios log s + (0.1, -0.1, 0): every token's own ratio is far outside
    [1 - 3e-4, 1 + 4e-4], so a per-token clip would zero some of them and not the others. Sequence 2
    (s = 1.0001, A = 0.5, inside the range) keeps its gradient -A s / (|y| B) whatever sequence 1 does."""
    a = math.log(s)
    log_ratio = [[a + 0.1, a - 0.1, a], [math.log(1.0001), math.log(1.0001), NAN]]
    loss, grad, stats = sequence_loss(log_ratio, [adv, 0.5], [[1, 1, 1], [1, 1, 0]])
    other = -0.5 * 1.0001 / (2 * 2)
    torch.testing.assert_close(grad[1], torch.tensor([other, other, 0.0], dtype=F64), rtol=1e-12, atol=0)
    if clipped:
        assert grad[0].tolist() == [0.0, 0.0, 0.0]
        bound = 1 + 4e-4 if adv > 0 else 1 - 3e-4
        assert loss.item() == pytest.approx(-(bound * adv + 0.5 * 1.0001) / 2, rel=1e-12)
    else:
        torch.testing.assert_close(grad[0], torch.full((3,), -adv * s / (3 * 2), dtype=F64), rtol=1e-9, atol=0)
        assert loss.item() == pytest.approx(-(s * adv + 0.5 * 1.0001) / 2, rel=1e-9)
    # 3 of 5 tokens, a float32 fraction
    assert stats["clip_frac_high"].item() == pytest.approx(0.6 if clipped and adv > 0 else 0.0, rel=1e-6)
    assert stats["clip_frac_low"].item() == pytest.approx(0.6 if clipped and adv < 0 else 0.0, rel=1e-6)


def test_clip_fractions_count_the_tokens_of_the_clipped_sequences():
    """A 5-token sequence clipped above and two 1-token sequences inside the range: 5 of 7 tokens carry a clipped
    ratio (1 of 3 sequences). A mean over tokens, like every token statistic, so that the update's value is the
    same in micro-batches (docs/metrics.md); the rollout viewer colours the same tokens."""
    up, inside = math.log(1.01), 0.0
    log_ratio = [[up] * 5, [inside] + [NAN] * 4, [inside] + [NAN] * 4]
    mask = [[1] * 5, [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    _, _, stats = sequence_loss(log_ratio, [1.0, 1.0, -1.0], mask)
    assert stats["clip_frac_high"].item() == pytest.approx(5 / 7, rel=1e-6)  # a float32 fraction
    assert stats["clip_frac_low"].item() == 0.0


def seqs():
    """Three completions of 3, 1 and 2 tokens, log-probs from random logits; padding log-probs are real numbers."""
    torch.manual_seed(0)
    logits = torch.randn(3, 3, 5, dtype=F64, requires_grad=True)
    tokens = torch.tensor([[1, 2, 3], [4, 0, 0], [2, 2, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    return logits, logp, mask


def test_with_one_update_the_gradient_is_grpos_with_seq_mean_token_mean():
    """old_logp = logp.detach(): s_i = 1 in value and grad s_i = (1/|y_i|) sum_t grad logp_t, so the gradient
    is -(1/B) sum_i A_i (1/|y_i|) sum_t grad logp_{i,t}, GRPO's token level under seq-mean-token-mean, KL
    term (beta k3, per token) included."""
    logits, logp, mask = seqs()
    adv = torch.tensor([1.5, -0.5, 0.7], dtype=F64)
    ref_logp = logp.detach() + torch.tensor([[0.3, -0.2, 0.5], [0.1, 0.0, 0.0], [-0.4, 0.2, 0.0]], dtype=F64)
    loss, _ = grpo_loss(logp, logp.detach(), ref_logp, adv, mask, common.Clip(3e-4, 4e-4, level="sequence"), 0.04)
    (grad,) = torch.autograd.grad(loss, logits, retain_graph=True)
    lengths = mask.sum(1)
    pg = -(adv * common.masked_sum(logp, mask, dim=1) / lengths).mean()
    kl = 0.04 * (common.masked_sum(common.kl_k3(logp, ref_logp), mask, dim=1) / lengths).mean()
    (expected,) = torch.autograd.grad(pg + kl, logits, retain_graph=True)
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)
    token_level, _ = grpo_loss(logp, logp.detach(), ref_logp, adv, mask, common.Clip(0.2, 0.2), 0.04)
    (token_grad,) = torch.autograd.grad(token_level, logits)
    torch.testing.assert_close(grad, token_grad, rtol=1e-12, atol=1e-15)
    assert loss.item() == pytest.approx(-adv.mean().item() + kl.item(), rel=1e-12)


@pytest.mark.parametrize("loss_agg", common.LOSS_AGG_MODES)
def test_a_long_sequence_counts_once_not_once_per_token(loss_agg):
    """Lengths 5 and 1, A = 1 each, on-policy, beta 0: each sequence's tokens share -A / B = -0.5 of gradient,
    whatever loss_agg says (it aggregates the KL term only). One term per token under token-mean would give
    the long sequence -5/6 and the short one -1/6."""
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.5, -0.3], [-0.7, NAN, NAN, NAN, NAN]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    loss, _ = grpo_loss(logp, logp.detach(), None, torch.ones(2, dtype=F64), mask,
                        common.Clip(3e-4, 3e-4, level="sequence"), 0.0, common.Aggregation(loss_agg, 8))
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.1] * 5, [-0.5, 0, 0, 0, 0]], dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_agg, norm", [("seq-mean-token-mean", 2), ("seq-mean-token-sum-norm", 4)])
def test_the_kl_term_stays_per_token(loss_agg, norm):
    """beta k3 per token, gradient through logp, aggregated by loss_agg (max_len 4), as at token level:
    k3 = r - log r - 1 with r = pi_ref / pi = 0.5 and 2, sum 0.5; d/dlogp = beta (1 - r) / norm."""
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=F64)).requires_grad_()
    ref_logp = torch.log(torch.tensor([[0.25, 0.4]], dtype=F64))
    loss, stats = grpo_loss(logp, logp.detach(), ref_logp, torch.zeros(1, dtype=F64), torch.ones(1, 2),
                            common.Clip(3e-4, 3e-4, level="sequence"), 0.04, common.Aggregation(loss_agg, 4))
    loss.backward()
    assert loss.item() == pytest.approx(0.04 * 0.5 / norm, rel=1e-12)
    assert stats["kl_k3"].item() == pytest.approx(0.25, rel=1e-12)
    torch.testing.assert_close(logp.grad, 0.04 * torch.tensor([[0.5, -1.0]], dtype=F64) / norm)


def test_pg_weight_enters_as_its_mean_over_the_sequences_valid_tokens():
    """A geometric mask (one value per sequence, here 0 on sequence 2) drops that sequence's policy term;
    TIS weights (2, 1) on sequence 1 (NaN on its padding) multiply its term by 1.5."""
    weight = torch.tensor([[2.0, 1.0, NAN], [0.0, 0.0, NAN]], dtype=F64)
    loss, grad, _ = sequence_loss([[0.0, 0.0, NAN], [0.0, 0.0, NAN]], [1.0, -1.0], [[1, 1, 0], [1, 1, 0]],
                                  loss_fn=lab_losses.grpo_loss, pg_weight=weight)
    assert loss.item() == pytest.approx(-1.5 / 2, rel=1e-12)
    torch.testing.assert_close(grad, torch.tensor([[-1.5 / 4, -1.5 / 4, 0], [0, 0, 0]], dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("adv, s, loss_value, grad", [
    (-1.0, 5.0, 3.0, 0.0),          # A < 0, s past c = 3: the loss stops at c |A|, no gradient
    (-1.0, 2.0, 2.0, 2.0 / 2),      # below c: -s A, each of the 2 tokens d/dlogp = -A s / 2
    (1.0, 5.0, -1.0004, 0.0),       # A > 0: the ordinary clip at 1 + epsilon_high
])
def test_dual_clip_bounds_a_negative_advantage_sequence(adv, s, loss_value, grad):
    loss, g, _ = sequence_loss([[math.log(s), math.log(s)]], [adv], [[1, 1]], loss_fn=lab_losses.grpo_loss, dual_c=3.0)
    assert loss.item() == pytest.approx(loss_value, rel=1e-12)
    torch.testing.assert_close(g, torch.full((1, 2), grad, dtype=F64), rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_weighed_by_their_sequences_add_up_to_the_whole_batch(loss_agg):
    """The loop weighs a micro-batch's loss by common.micro_batch_weight. At sequence level, with the
    modes Config allows, the weighted micro-batch gradients add up to the whole batch's, off-policy
    with clipping, KL and TIS; token-mean weights (by token count) would not, which is why Config refuses it."""
    logits, logp, mask = seqs()
    old_logp = logp.detach() + torch.tensor([[0.2, -0.3, 0.1], [0.0, 0.0, 0.0], [0.001, -0.002, 0.0]], dtype=F64)
    ref_logp = old_logp + 0.3
    adv, weight = torch.tensor([1.5, -0.5, 0.7], dtype=F64), torch.tensor([[1.0, 2.0, 0.5]] * 3, dtype=F64)

    def loss(rows):
        return lab_losses.grpo_loss(logp[rows], old_logp[rows], ref_logp[rows], adv[rows], mask[rows],
                                    common.Clip(3e-4, 4e-4, level="sequence"), 0.04, common.Aggregation(loss_agg, 4),
                                    pg_weight=weight[rows])[0]

    (whole,) = torch.autograd.grad(loss(slice(0, 3)), logits, retain_graph=True)
    parts = [slice(0, 1), slice(1, 3)]
    split = sum(common.micro_batch_weight(mask[mb], loss_agg, mask.sum(), 3) * loss(mb) for mb in parts)
    (micro,) = torch.autograd.grad(split, logits, retain_graph=True)
    torch.testing.assert_close(micro, whole, rtol=1e-12, atol=1e-15)
    by_tokens = sum(common.micro_batch_weight(mask[mb], "token-mean", mask.sum(), 3) * loss(mb) for mb in parts)
    (wrong,) = torch.autograd.grad(by_tokens, logits)
    assert (wrong - whole).abs().max() > 1e-3


# ---------------------------------------------------------------- config

def test_clip_defaults_are_grpos_at_token_level_and_gspos_at_sequence_level():
    token, sequence = Config(), Config(importance_sampling_level="sequence")
    assert (token.epsilon, token.epsilon_high) == (0.2, None)
    assert (sequence.epsilon, sequence.epsilon_high) == (3e-4, 4e-4)  # Zheng et al. (2025), v2 section 5.1
    given = Config(importance_sampling_level="sequence", epsilon=0.01)  # --epsilon given: symmetric
    assert (given.epsilon, given.epsilon_high) == (0.01, 0.01)
    assert Config(importance_sampling_level="sequence", epsilon_high=1e-3).epsilon == 3e-4


@pytest.mark.parametrize("kwargs, flags", [
    ({"importance_sampling_level": "seq"}, ["--importance_sampling_level"]),
    ({"epsilon_high": 0.28}, ["--epsilon_high", "--importance_sampling_level"]),
    ({"importance_sampling_level": "sequence", "epsilon_high": 0.0}, ["--epsilon_high"]),
    ({"importance_sampling_level": "sequence", "epsilon": 1.0}, ["--epsilon"]),
    ({"importance_sampling_level": "sequence", "loss_agg": "token-mean"},
     ["--importance_sampling_level", "--loss_agg"]),
])
def test_bad_config_raises_a_value_error_naming_the_flag(kwargs, flags):
    with pytest.raises(ValueError) as e:
        Config(**kwargs)
    for flag in flags:
        assert flag in str(e.value)
