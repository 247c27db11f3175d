"""Keep routing on a mixture-of-experts policy (lab/routing.py): the experts recorded at sampling (R3) or in the
trainer's pi_old pass (R2) are laid out as the trainer's batch and replayed exactly in its forwards and in the
recomputation of checkpointed layers; the router keeps its gradient; a batch laid out otherwise than recorded
raises. The lab's fast path, telling the routing its rows (lab/decode.py), draws and scores what support/models.py does.
Tiny random models of the transformers MoE families whose routers return (logits, weights, indices)."""
import copy
from contextlib import nullcontext

import pytest
import torch
from transformers import (AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3MoeConfig)

import common
from lab import config as lab_config
from lab import decode, routing
from support import config, models

VOCAB, PAD, EOS = 18, 0, 1  # the embedded tokenizer's ids
K = 2  # samples per prompt
PROMPTS = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12], [0, 3, 4, 5, 6]])  # left-padded


class Tokenizer:
    pad_token_id, eos_token_id = PAD, EOS


def tiny_moe(kind="qwen3_moe"):
    """2 layers, 4 experts, top 2, random weights. The routers' weights are drawn at scale 1, so their choices are
    far from ties: a cached decode and a full pass, which add in another order, pick the same experts."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=64, pad_token_id=PAD, eos_token_id=EOS, num_experts_per_tok=2)
    cfg = {"qwen3_moe": lambda: Qwen3MoeConfig(moe_intermediate_size=32, num_experts=4, norm_topk_prob=True, **shape),
           "qwen2_moe": lambda: Qwen2MoeConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                               num_experts=4, **shape),
           "mixtral": lambda: MixtralConfig(intermediate_size=32, num_local_experts=4, **shape),
           "olmoe": lambda: OlmoeConfig(intermediate_size=32, num_experts=4, **shape)}[kind]()
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for router in routing.routers(model):
            router.weight.normal_(0, 1.0)
    return model


def moved(model, scale=1.0, seed=1):
    """A copy whose routers moved enough to change many of their choices."""
    other = copy.deepcopy(model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for router in routing.routers(other):
            router.weight.add_(scale * torch.randn_like(router.weight))
    return other


def sample(model, generate=decode.generate, greedy=False, seed=3):
    """K completions of each prompt, in generate calls of 2 prompts (two blocks of rows), recorded. Returns the
    trainer's (input_ids, attention_mask, C) and the recorded (indices, token_ids)."""
    cfg = lab_config.LabConfig(max_new_tokens=6, generation_batch_size=2 * K)
    torch.manual_seed(seed)
    with routing.record(model) as rec:
        completion_ids = generate(model, Tokenizer, PROMPTS, (PROMPTS != PAD).long(), cfg, num_samples=K, greedy=greedy)
    n = 1 if greedy else K
    completion_mask = common.completion_mask(completion_ids, EOS)
    input_ids = torch.cat([PROMPTS.repeat_interleave(n, 0), completion_ids], 1)
    attention_mask = torch.cat([(PROMPTS != PAD).long().repeat_interleave(n, 0), completion_mask], 1)
    return (input_ids, attention_mask, completion_ids.shape[1]), rec.layout(attention_mask)


def recorded(model, batch, logprobs=common.token_logprobs, replay=None, live=False):
    """The experts of a forward of `model` over the batch (replaying `replay`, an (indices, token_ids) pair)."""
    input_ids, attention_mask, c = batch
    with torch.no_grad(), routing.record(model) as rec:
        if replay is None:
            logprobs(model, input_ids, attention_mask, c)
        else:
            with routing.replay(model, *replay):
                logprobs(model, input_ids, attention_mask, c)
    return rec.layout(attention_mask, live=live)[0]


@pytest.mark.parametrize("greedy", [False, True])
def test_the_labs_fast_path_draws_and_scores_what_support_fast_does(greedy):
    """lab/decode.py is support/models.py's generate and token_logprobs with each forward's rows told to the routing:
    outside any context and inside a record, the lesson's own draws, scores and gradients, bit for bit, and the
    same log-probs of the draws inside a record as outside."""
    model = tiny_moe()
    cfg = lab_config.LabConfig(max_new_tokens=6, generation_batch_size=2 * K, temperature=0.8, top_k=12)
    prompt_mask = (PROMPTS != PAD).long()

    def drawn(generate, context):
        torch.manual_seed(5)
        with context:
            return generate(model, Tokenizer, PROMPTS, prompt_mask, cfg, num_samples=K, greedy=greedy, logprobs=True)
    ids, logp = drawn(decode.generate, nullcontext())
    torch.manual_seed(5)
    assert torch.equal(models.generate(model, Tokenizer, PROMPTS, prompt_mask, cfg, num_samples=K, greedy=greedy), ids)
    assert len(set(common.completion_mask(ids, EOS).sum(1).tolist())) > 1  # rows leave the decode loop
    assert all(map(torch.equal, drawn(decode.generate, routing.record(model)), (ids, logp)))
    n = 1 if greedy else K
    input_ids = torch.cat([PROMPTS.repeat_interleave(n, 0), ids], 1)
    attention_mask = torch.cat([prompt_mask.repeat_interleave(n, 0), common.completion_mask(ids, EOS)], 1)

    def scored(logprobs, context):
        model.zero_grad()
        with context:
            out = logprobs(model, input_ids, attention_mask, ids.shape[1], cfg.temperature, with_entropy=True,
                           top_k=cfg.top_k)
            out[0].sum().backward()
        return [*out, *(p.grad for p in model.parameters() if p.grad is not None)]
    lesson = scored(models.token_logprobs, nullcontext())
    for context in (nullcontext(), routing.record(model)):
        assert all(map(torch.equal, scored(decode.token_logprobs, context), lesson))
    with routing.record(model), pytest.raises(ValueError, match="growing attention mask"):
        decode.generate(model, Tokenizer, PROMPTS, prompt_mask, cfg, num_samples=K, fixed_shape=True)


@pytest.fixture(scope="module")
def sampled():
    model = tiny_moe()
    return model, *sample(model)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_routing_recorded_at_sampling_is_laid_out_as_the_trainers_batch(kind):
    model = tiny_moe(kind)
    batch, (indices, token_ids) = sample(model)
    input_ids, attention_mask, c = batch
    lengths = attention_mask[:, -c:].sum(1)
    assert len(set(lengths.tolist())) > 2 and lengths.min() < c  # rows leave the decode loop at different steps
    keep = routing.positions(attention_mask)
    assert torch.equal(token_ids[keep], input_ids[keep]) and (token_ids[~keep] == -1).all()
    assert ((indices >= 0).all(-1).all(-1) == keep).all()
    assert indices.shape == (*input_ids.shape, 2, 2) and torch.equal(indices, indices.sort(-1).values)
    # the same experts as a full pass over the finished rows, and as transformers' generate from the same seed
    assert torch.equal(indices, recorded(model, batch))
    common_batch, (common_indices, _) = sample(model, common.generate)
    assert torch.equal(common_batch[0], input_ids) and torch.equal(common_indices, indices)
    greedy_batch, (greedy_indices, _) = sample(model, greedy=True)
    assert torch.equal(greedy_indices, recorded(model, greedy_batch))


@pytest.mark.parametrize("logprobs", [decode.token_logprobs, common.token_logprobs])
def test_r3_replay_uses_the_samplers_experts_after_the_weights_moved(sampled, logprobs):
    model, batch, replay = sampled
    trainer = moved(model)
    live = recorded(trainer, batch, logprobs)
    assert routing.mismatch(live, replay[0]).item() > 0.2  # the trainer alone routes otherwise
    assert torch.equal(recorded(trainer, batch, logprobs, replay=replay), replay[0])  # shared prompt pass included
    assert torch.equal(recorded(trainer, batch, logprobs, replay=replay, live=True), live)  # the routers still score


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_replaying_a_models_own_routing_gives_its_own_logprobs(kind):
    model = tiny_moe(kind)
    input_ids, attention_mask = PROMPTS, (PROMPTS != PAD).long()
    with torch.no_grad(), routing.record(model) as rec:
        logp = decode.token_logprobs(model, input_ids, attention_mask, 3)
    with torch.no_grad(), routing.replay(model, *rec.layout(attention_mask)):
        replayed = decode.token_logprobs(model, input_ids, attention_mask, 3)
    assert torch.equal(replayed, logp)  # the experts' weights are each router's own formula, bit for bit


def update_gradients(model, batch, replay, checkpointing):
    """The gradients of a loss over two micro-batches whose forwards both run before the one backward."""
    model = copy.deepcopy(model).train()
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    input_ids, attention_mask, c = batch
    with routing.replay(model, *replay), routing.record(model) as rec:
        loss = sum(decode.token_logprobs(model, input_ids[mb], attention_mask[mb], c).sum()
                   for mb in (slice(0, 3), slice(3, 6)))
        loss.backward()
    assert torch.equal(rec.layout(attention_mask)[0], replay[0])
    return {name: p.grad for name, p in model.named_parameters()}


def test_router_learns_under_replay_and_checkpointed_layers_replay_their_recomputation(sampled):
    model, batch, replay = sampled
    trainer = moved(model)
    plain = update_gradients(trainer, batch, replay, checkpointing=False)
    checkpointed = update_gradients(trainer, batch, replay, checkpointing=True)
    routers = [name for name in plain if name.endswith("gate.weight")]
    assert len(routers) == 2 and all(plain[name].abs().sum() > 0 for name in routers)
    # the recomputation in the backward runs after both forwards: it must replay its own micro-batch's experts.
    # Checkpointing takes one full pass instead of a shared prompt pass: the sums run in another order, so each
    # gradient agrees to 1e-5 of its largest element, as in tests/test_fast.py (observed: 3e-7 of it); a
    # recomputation that replays the other micro-batch's experts is off by 0.8 of it
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item())


def test_r2_routing_of_the_scoring_pass_is_replayed_in_the_update(sampled):
    model, batch, _ = sampled
    input_ids, attention_mask, c = batch
    policy = copy.deepcopy(model).train()
    with torch.no_grad(), routing.record(policy) as rec:  # the pi_old pass
        old_logp = decode.token_logprobs(policy, input_ids, attention_mask, c)
    old_routing = rec.layout(attention_mask)
    optimizer = torch.optim.SGD(policy.parameters(), lr=30.0)
    with routing.replay(policy, *old_routing):
        (-decode.token_logprobs(policy, input_ids, attention_mask, c).sum()).backward()
    optimizer.step()
    assert routing.mismatch(recorded(policy, batch, decode.token_logprobs), old_routing[0]).item() > 0.05
    assert torch.equal(recorded(policy, batch, decode.token_logprobs, replay=old_routing), old_routing[0])
    assert old_logp.shape == (len(input_ids), c)


def test_replay_refuses_a_batch_laid_out_otherwise_than_recorded(sampled):
    model, batch, (indices, token_ids) = sampled
    input_ids, attention_mask, c = batch
    shuffled = torch.tensor([2, 3, 0, 1, 4, 5])  # two groups swapped
    with pytest.raises(RuntimeError, match="token ids differ"):
        recorded(model, batch, decode.token_logprobs, replay=(indices[shuffled], token_ids[shuffled]))
    within_group = torch.tensor([1, 0, 2, 3, 4, 5])  # the samples of one prompt swapped: caught at the completion
    with pytest.raises(RuntimeError, match="token ids differ"):
        recorded(model, batch, common.token_logprobs, replay=(indices[within_group], token_ids[within_group]))
    with pytest.raises(RuntimeError, match="outside the recorded"):
        recorded(model, batch, replay=(indices[:, :-1], token_ids[:, :-1]))
    with pytest.raises(RuntimeError, match="MoE layers"):
        recorded(model, batch, replay=(indices[:, :, :1], token_ids))
    dense = AutoModelForCausalLM.from_config(Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    assert routing.is_moe(model) and not routing.is_moe(dense)
    with pytest.raises(SystemExit, match="--keep_routing needs a mixture-of-experts policy"):
        routing.check_moe(dense)


def test_hooks_exist_only_inside_the_contexts(sampled):
    model, batch, replay = sampled
    model = copy.deepcopy(model)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    checkpoint = model.model.layers[0]._gradient_checkpointing_func
    hooks = [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()]
    with routing.replay(model, *replay), routing.record(model):
        assert model.model._forward_pre_hooks and model.model.layers[0]._gradient_checkpointing_func is not checkpoint
    assert [(dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()] == hooks
    assert not routing._OPEN
    assert model.model.layers[0]._gradient_checkpointing_func is checkpoint


def test_mismatch_counts_the_token_layer_pairs_whose_sets_differ():
    a = torch.tensor([[[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[-1, -1], [-1, -1]]]])  # (1, 3, L=2, k=2), sorted
    b = torch.tensor([[[[0, 1], [1, 3]], [[0, 2], [1, 3]], [[0, 1], [0, 1]]]])
    # position 0: layer 1 differs; position 1: none; position 2: not recorded in a, not counted
    assert routing.mismatch(a, b).item() == pytest.approx(1 / 4)
    assert routing.mismatch(a, b, mask=torch.tensor([[0, 1, 1]])).item() == 0.0
    assert routing.layers_differing(a, b).tolist() == [[1, 0, 0]]


def test_the_embedded_moe_model_loads_from_the_repository_root(monkeypatch):
    monkeypatch.chdir(config.ROOT)
    cfg = lab_config.LabConfig(model_name_or_path="embedded_model/moe")
    model, tokenizer = models.load_model(cfg), models.load_tokenizer(cfg)
    assert routing.is_moe(model) and len(routing.routers(model)) == model.config.num_hidden_layers
    assert model.config.num_experts_per_tok == 2 and tokenizer.pad_token_id == PAD


def test_replay_reaches_the_routers_under_a_lora_adapter(sampled):
    from peft import LoraConfig

    model, batch, replay = sampled
    policy = models.add_lora(moved(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert routing.is_moe(policy)
    assert torch.equal(recorded(policy, batch, decode.token_logprobs, replay=replay), replay[0])
