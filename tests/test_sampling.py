"""What is sampled is what is scored: generate samples from exactly the distribution that
token_logprobs scores (temperature, top-k, top-p), whatever the checkpoint's own
generation_config.json says, and in generate calls of any size. Each property holds for the
definitions (common.py) and for the fast paths the loops run (support/models.py)."""
from dataclasses import dataclass

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import common
from lab import decode
from support import config, models, tasks


@dataclass
class Sampling:
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 6
    generation_batch_size: int = 0


PROMPTS = ["12+3=", "5*7=", "99-45=", "123+456="]


def load():
    tokenizer = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, PROMPTS, "cpu")
    return model, tokenizer, prompt_ids, prompt_mask


PATHS = pytest.mark.parametrize("path", [common, models], ids=["common", "fast"])


def sample(path, model, tokenizer, prompt_ids, prompt_mask, cfg, seed=0, num_samples=4):
    torch.manual_seed(seed)
    return path.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=num_samples)


def make_hostile(model):
    """What instruct checkpoints ship in generation_config.json, and more."""
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 2
    model.generation_config.min_p = 0.2
    model.generation_config.top_k = 3
    model.generation_config.temperature = 0.3


@PATHS
def test_the_checkpoints_generation_config_does_not_change_the_samples(path):
    model, tokenizer, prompt_ids, prompt_mask = load()
    cfg = Sampling()
    clean = sample(path, model, tokenizer, prompt_ids, prompt_mask, cfg)
    make_hostile(model)
    torch.manual_seed(0)  # the hostile settings do change samples when generate() is left to read them
    leaked = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, do_sample=True, max_new_tokens=6,
                            num_return_sequences=4, pad_token_id=tokenizer.pad_token_id)[:, prompt_ids.shape[1]:]
    assert leaked.shape != clean.shape or not torch.equal(leaked, clean)
    assert torch.equal(sample(path, model, tokenizer, prompt_ids, prompt_mask, cfg), clean)
    assert model.generation_config.repetition_penalty == 1.3  # set aside for the call, then restored


@PATHS
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (6, 0.9)])
def test_the_samplers_processed_scores_are_the_scored_logprobs(path, top_k, top_p):
    """The sampler's own processed scores (logits after temperature, top-k and top-p: generate's output_scores,
    or the decode loop's, kept by lab/decode.py's), as log-probs of the sampled tokens, equal token_logprobs at the sampling temperature with
    the same truncation, to 1e-5 in fp32, with a hostile checkpoint generation config on the model."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    make_hostile(model)
    cfg = Sampling(top_k=top_k, top_p=top_p)
    captured = {}
    hf_generate = model.generate

    def generate_with_scores(**kwargs):  # the call common.generate makes, asked for its scores too
        kwargs["generation_config"].output_scores = True
        kwargs["generation_config"].return_dict_in_generate = True
        out = hf_generate(**kwargs)
        captured["scores"] = torch.stack(out.scores, dim=1)  # (B, C, V)
        return out.sequences

    model.generate = generate_with_scores
    if path is models:  # its decode loop, as the lab runs it, hands out its scores: (step, rows still going, scores)
        steps = []
        torch.manual_seed(0)
        completion_ids = decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4, scores=steps)
        captured["scores"] = torch.zeros(*completion_ids.shape, steps[0][2].shape[-1])  # ended rows: never read
        for step, rows, scores in steps:
            captured["scores"][rows, step] = scores
    else:
        completion_ids = sample(path, model, tokenizer, prompt_ids, prompt_mask, cfg)
    mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
    sampler_logp = torch.log_softmax(captured["scores"].float(), -1).gather(-1, completion_ids[..., None])[..., 0]
    prompt_ids, prompt_mask = prompt_ids.repeat_interleave(4, 0), prompt_mask.repeat_interleave(4, 0)
    scored = path.token_logprobs(model, torch.cat([prompt_ids, completion_ids], 1),
                                 torch.cat([prompt_mask, mask], 1), completion_ids.shape[1], cfg.temperature,
                                 top_k=top_k, top_p=top_p)
    assert mask.sum() > 20
    torch.testing.assert_close(scored[mask.bool()], sampler_logp[mask.bool()], rtol=0, atol=1e-5)


@PATHS
def test_generation_in_calls_of_any_size_returns_the_same_completions(path):
    """Greedy decoding is deterministic, so chunked calls (3 sequences a call here, 2 prompts of 1 sample:
    widths differ where a call's completions all end early) must give exactly the one-call result."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    whole = path.generate(model, tokenizer, prompt_ids, prompt_mask, Sampling(), greedy=True)
    chunked = path.generate(model, tokenizer, prompt_ids, prompt_mask, Sampling(generation_batch_size=3),
                            greedy=True)
    mask = common.completion_mask(whole, tokenizer.eos_token_id)
    assert torch.equal(common.completion_mask(chunked, tokenizer.eos_token_id), mask)
    assert torch.equal(chunked[mask.bool()], whole[mask.bool()])


@PATHS
def test_sampled_groups_stay_adjacent_in_chunked_generation(path):
    """num_samples per prompt, 2 prompts per call of 8 sequences: each prompt's 4 samples are adjacent
    and drawn for that prompt (an answer to 12+3 never follows 99-45's prompt)."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    completion_ids = sample(path, model, tokenizer, prompt_ids, prompt_mask, Sampling(temperature=0.01,
                                                                                     generation_batch_size=8))
    greedy = path.generate(model, tokenizer, prompt_ids, prompt_mask, Sampling(), greedy=True)
    assert completion_ids.shape[0] == 16
    for i in range(len(PROMPTS)):  # at temperature 0.01 every sample of prompt i is its greedy completion
        group = completion_ids[4 * i:4 * (i + 1)]
        mask = common.completion_mask(greedy[i:i + 1], tokenizer.eos_token_id)[0].bool()
        n = int(mask.sum())
        assert torch.equal(group[:, :n], greedy[i, :n].expand(4, n))
