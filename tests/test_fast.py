"""The fast paths (support/models.py) equal their definitions (common.py): models.token_logprobs gives
common.token_logprobs' log-probs, entropies and parameter gradients, and models.generate gives
common.generate's draws from the same seed; so does the lab's loop on the same pieces (lab/decode.py), which also
keeps the sampler's processed scores and the draws' log-probs, and on a GPU decodes in steps of fixed shapes
(lab/static_decode.py, run here uncompiled).

Tolerances, fp32 throughout, where the two paths add the same terms in another order: log-probs and
entropies to 1e-5 absolute (observed: at most 2.1e-6, on log-probs as large as 20, about 1e-7
relative); each weight's gradient to 1e-5 of its largest element (observed: at most 1.6e-6); the
sampler's processed scores to 1e-5; the draws exactly. A bug in the sharing (cache rows tiled instead
of interleaved, positions that do not skip the left padding, the prompt's keys and values detached)
moves log-probs or gradients by far more, or changes the draws.
"""
import logging
import sys
import warnings
from dataclasses import dataclass

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

import common
from lab import decode, static_decode
from support import config, models, tasks

VOCAB = 18  # the embedded model's; the tiny random models use the same ids
C = 4  # completion tokens


def tiny_model(arch):
    """A 2-layer model from a config, random weights (no download)."""
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1)
    cfg = Qwen2Config(**shape) if arch == "qwen2" else LlamaConfig(**shape)
    return AutoModelForCausalLM.from_config(cfg).eval()


def load_model(name):
    if name == "embedded":
        return AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    return tiny_model(name)


def batch(shared):
    """7 rows of left-padded prompts (widths 5, 4, 3) and C completion tokens. shared: adjacent rows in
    groups of 3, 1, 2 and 1 with one prompt each (two groups with the same prompt, apart); else no two rows
    share a prompt. Row 1's completion ends early: padding after it."""
    g = torch.Generator().manual_seed(4)
    if shared:
        prompts = torch.tensor([[0, 0, 5, 6, 7], [0, 8, 9, 10, 11], [12, 13, 14, 15, 16], [0, 0, 5, 6, 7]])
        prompts = prompts[torch.tensor([0, 0, 0, 1, 2, 2, 3])]
    else:
        prompts = torch.randint(2, VOCAB, (7, 5), generator=g)
        prompts[[0, 3], :2] = 0
        prompts[[1, 5], :1] = 0
    completions = torch.randint(2, VOCAB, (7, C), generator=g)
    completions[1, 2:] = 0
    input_ids = torch.cat([prompts, completions], 1)
    return input_ids, (input_ids != 0).long()


def logprobs_and_gradients(token_logprobs, model, input_ids, attention_mask, **kwargs):
    logp, entropy = token_logprobs(model, input_ids, attention_mask, C, 0.7, with_entropy=True, **kwargs)
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((weights * logp).sum(), list(model.parameters()))
    return logp, entropy, grads


def assert_fast_equals_definition(model, input_ids, attention_mask, **kwargs):
    logp, entropy, grads = logprobs_and_gradients(models.token_logprobs, model, input_ids, attention_mask, **kwargs)
    spec_logp, spec_entropy, spec_grads = logprobs_and_gradients(common.token_logprobs, model, input_ids,
                                                                 attention_mask, **kwargs)
    assert logp.dtype == entropy.dtype == torch.float32 and logp.shape == (len(input_ids), C)
    torch.testing.assert_close(logp, spec_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, spec_entropy, rtol=0, atol=1e-5)
    for fast_grad, spec_grad in zip(grads, spec_grads):  # to 1e-5 of each weight's largest gradient
        torch.testing.assert_close(fast_grad, spec_grad, rtol=0, atol=1e-5 * spec_grad.abs().max().item())


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.8), (6, 0.9)])
@pytest.mark.parametrize("shared", [True, False], ids=["groups", "no_sharing"])
@pytest.mark.parametrize("name", ["embedded", "qwen2", "llama"])
def test_fast_logprobs_equal_the_definition_in_values_and_gradients(name, shared, top_k, top_p):
    model = load_model(name)
    assert_fast_equals_definition(model, *batch(shared), top_k=top_k, top_p=top_p)


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.8), (6, 0.9)])
def test_plain_scoring_is_the_definition_and_counts_the_fast_paths_kept_sets(top_k, top_p):
    """--fast False scores with decode.plain_token_logprobs: common.token_logprobs' values and gradients exactly,
    and the kept-set sizes the viewer records (lab/view.py) as decode.token_logprobs counts them."""
    model, (input_ids, attention_mask) = load_model("embedded"), batch(shared=True)
    plain_sizes, fast_sizes = [], []
    logp, entropy, grads = logprobs_and_gradients(decode.plain_token_logprobs, model, input_ids, attention_mask,
                                                  top_k=top_k, top_p=top_p, kept_sizes=plain_sizes)
    spec_logp, spec_entropy, spec_grads = logprobs_and_gradients(common.token_logprobs, model, input_ids,
                                                                 attention_mask, top_k=top_k, top_p=top_p)
    assert torch.equal(logp, spec_logp) and torch.equal(entropy, spec_entropy)
    assert all(torch.equal(g, spec_g) for g, spec_g in zip(grads, spec_grads))
    decode.token_logprobs(model, input_ids, attention_mask, C, 0.7, top_k=top_k, top_p=top_p, kept_sizes=fast_sizes)
    (sizes,), (fast,) = plain_sizes, fast_sizes
    assert sizes.shape == (len(input_ids), C) and torch.equal(sizes, fast) and (sizes > 1).any()
    if top_k > 0:  # the scored token counted in, kept or not (these completions were not drawn)
        assert (sizes <= top_k + 1).all()


@pytest.mark.parametrize("name", ["embedded", "qwen2"])
def test_fast_logprobs_in_row_chunks_equal_the_definition(name, monkeypatch):
    """Chunks of 2 rows (2, 2, 2, 1 for B = 7) give the whole batch's values and gradients."""
    model = load_model(name)
    monkeypatch.setattr(models, "LOGPROB_CHUNK_ELEMENTS", 2 * C * VOCAB)
    rows_per_mask, sampling_mask = [], common.sampling_mask

    def counting_sampling_mask(logits, top_k, top_p):
        rows_per_mask.append(len(logits))
        return sampling_mask(logits, top_k, top_p)

    monkeypatch.setattr(common, "sampling_mask", counting_sampling_mask)
    assert_fast_equals_definition(model, *batch(shared=True), top_k=6, top_p=0.9)
    assert rows_per_mask == [2, 2, 2, 1, 7]  # fast, by chunks, then the definition


@pytest.mark.parametrize("name", ["embedded", "llama"])
def test_fast_logprobs_under_gradient_checkpointing_equal_the_definition(name):
    """Gradient checkpointing keeps no keys and values: the fast path is then one pass over every row."""
    model = load_model(name)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing acts in training mode; these models have no dropout
    rows_per_pass = []
    model.register_forward_pre_hook(lambda module, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)
    input_ids, attention_mask = batch(shared=True)
    assert_fast_equals_definition(model, input_ids, attention_mask, top_k=5)
    assert rows_per_pass == [input_ids.shape, input_ids.shape]  # fast, then the definition


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("name", ["embedded", "llama"])
def test_fast_logprobs_without_gradients_share_the_prompt_under_gradient_checkpointing(name, mode):
    """Checkpointed layers keep the cache where no gradient is recorded (the scoring passes): the fast path
    then runs a group's prompt once, as without checkpointing, with the definition's values."""
    model = load_model(name)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    rows_per_pass = []
    model.register_forward_pre_hook(lambda module, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)
    input_ids, attention_mask = batch(shared=True)
    with mode():
        logp = models.token_logprobs(model, input_ids, attention_mask, C, 0.7, top_k=5)
        spec_logp = common.token_logprobs(model, input_ids, attention_mask, C, 0.7, top_k=5)
    assert rows_per_pass == [(4, 4), (7, C), input_ids.shape]  # fast (the prompts, then the rows), definition
    torch.testing.assert_close(logp, spec_logp, rtol=0, atol=1e-5)


def test_a_groups_prompt_runs_once_then_every_row_continues_it():
    """Groups of 3, 1, 2 and 1 rows: one pass over 4 prompts (all tokens but the last), then one over the
    7 rows' last prompt token and completion but its last token."""
    model = load_model("qwen2")
    rows_per_pass = []
    model.register_forward_pre_hook(lambda module, args, kwargs: rows_per_pass.append(kwargs["input_ids"].shape),
                                    with_kwargs=True)
    input_ids, attention_mask = batch(shared=True)
    models.token_logprobs(model, input_ids, attention_mask, C)
    assert rows_per_pass == [(4, 4), (7, C)]


# ----------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------
@dataclass
class Sampling:
    temperature: float = 0.7
    top_k: int = 6
    top_p: float = 0.9
    max_new_tokens: int = 6
    generation_batch_size: int = 0


PROMPTS = ["12+3=", "5*7=", "99-45=", "123+456="]


def load():
    tokenizer = AutoTokenizer.from_pretrained(config.EMBEDDED_MODEL, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(config.EMBEDDED_MODEL).eval()
    prompt_ids, prompt_mask = tasks.tokenize_prompts(tokenizer, PROMPTS, "cpu")
    return model, tokenizer, prompt_ids, prompt_mask


def capture_scores(model):
    """Make model.generate also keep the sampler's processed scores (after temperature, top-k, top-p)."""
    captured, hf_generate = [], model.generate

    def generate_with_scores(**kwargs):
        kwargs["generation_config"].output_scores = True
        kwargs["generation_config"].return_dict_in_generate = True
        out = hf_generate(**kwargs)
        captured.append(torch.stack(out.scores, dim=1))  # (B, C, V)
        return out.sequences

    model.generate = generate_with_scores
    return captured


@pytest.mark.parametrize("cfg", [Sampling(), Sampling(generation_batch_size=8), Sampling(top_k=0, top_p=1.0)],
                         ids=["one_call", "calls_of_8", "untruncated"])
def test_fast_generate_draws_what_the_definition_draws(cfg):
    """From the same seed, models.generate (each prompt once, its K samples continuing copies of its keys and
    values, the rows that have ended leaving the batch) gives common.generate's draws (num_return_sequences:
    the prompt K times, every row to the end) exactly, and uses up the same random stream; the lab's
    decode.generate, the same loop keeping each step's processed scores, draws the same and gives the same
    processed scores to 1e-5 for the rows still going: row i continues prompt i // K, at its positions."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    assert prompt_mask.sum(1).unique().numel() > 1  # left padding of more than one width
    torch.manual_seed(0)
    fast_scores = []  # (step, rows still going, their processed scores), call after call
    drawn = models.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4)
    after_fast = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4,
                                       scores=fast_scores), drawn)
    captured = capture_scores(model)
    torch.manual_seed(0)
    spec = common.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4)
    assert drawn.shape[0] == 16 and len(set(map(tuple, drawn.tolist()))) > 4  # samples differ within groups
    assert torch.equal(drawn, spec)
    assert torch.equal(after_fast, torch.rand(4))  # the same random stream used up: later draws agree too
    assert len(captured) == (2 if cfg.generation_batch_size else 1)
    calls = [[]]  # fast_scores split by generate call: a step number that does not grow starts the next call
    for step, rows, scores in fast_scores:
        if calls[-1] and step <= calls[-1][-1][0]:
            calls.append([])
        calls[-1].append((step, rows, scores))
    assert len(calls) == len(captured)
    # in some call, rows had ended and left the batch before its last step
    assert any(len(call[-1][1]) < len(spec_scores) for call, spec_scores in zip(calls, captured))
    for call, spec_scores in zip(calls, captured):  # spec_scores (rows, C, V)
        assert [step for step, _, _ in call] == list(range(spec_scores.shape[1]))
        for step, rows, scores in call:
            torch.testing.assert_close(scores, spec_scores[rows, step], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cfg", [Sampling(), Sampling(generation_batch_size=8), Sampling(top_k=0, top_p=1.0)],
                         ids=["one_call", "calls_of_8", "untruncated"])
def test_the_log_probs_of_the_draws_are_the_definitions_scoring_of_them(cfg):
    """decode.generate(logprobs=True), the sampler process's behaviour log-probs (lab/async_sampling.py): the
    same draws as models.generate's, and for every token up to EOS the log-prob that common.token_logprobs gives the
    completion under the same temperature, top-k and top-p, to 1e-5; 0 after EOS."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    torch.manual_seed(0)
    drawn, logp = decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4, logprobs=True)
    torch.manual_seed(0)
    assert torch.equal(drawn, models.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4))
    mask = common.completion_mask(drawn, tokenizer.eos_token_id)
    assert logp.shape == drawn.shape and (mask == 0).any() and (mask.sum(1) < mask.shape[1]).any()
    scored = common.token_logprobs(model, torch.cat([prompt_ids.repeat_interleave(4, 0), drawn], 1),
                                   torch.cat([prompt_mask.repeat_interleave(4, 0), mask], 1), drawn.shape[1],
                                   cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    torch.testing.assert_close(logp[mask.bool()], scored[mask.bool()], rtol=0, atol=1e-5)
    assert (logp[mask.bool()] < 0).any() and (logp[~mask.bool()] == 0).all()


def test_fast_generate_greedy_and_one_token_prompts_equal_the_definition():
    """Greedy decoding, and prompts of one token (nothing before the last token to share)."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    for ids, mask in ((prompt_ids, prompt_mask), (prompt_ids[:, -1:], prompt_mask[:, -1:])):
        greedy = models.generate(model, tokenizer, ids, mask, Sampling(), greedy=True)
        assert torch.equal(greedy, common.generate(model, tokenizer, ids, mask, Sampling(), greedy=True))
        torch.manual_seed(0)
        drawn = models.generate(model, tokenizer, ids, mask, Sampling(), num_samples=3)
        torch.manual_seed(0)
        assert torch.equal(drawn, common.generate(model, tokenizer, ids, mask, Sampling(), num_samples=3))


# ---- the fixed-shape decode loop (lab/static_decode.py): the lab's on a GPU, run here uncompiled ----
@pytest.mark.parametrize("cfg", [Sampling(), Sampling(generation_batch_size=8), Sampling(top_k=0, top_p=1.0)],
                         ids=["one_call", "calls_of_8", "untruncated"])
def test_fixed_shape_generate_draws_what_the_definition_draws_and_keeps_their_log_probs(cfg):
    """decode.generate(fixed_shape=True), the ended rows kept in the batch: common.generate's draws exactly from the
    same seed, the same random stream used up, the processed scores of every row at every step (the ended rows'
    too: both feed them their pad token) to 1e-5, and the drawn log-probs equal to common.token_logprobs' scoring."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    torch.manual_seed(0)
    fixed_scores = []
    drawn, logp = decode.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4, scores=fixed_scores,
                                  logprobs=True, fixed_shape=True)
    after_fixed = torch.rand(4)
    captured = capture_scores(model)
    torch.manual_seed(0)
    spec = common.generate(model, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=4)
    assert torch.equal(drawn, spec) and len(set(map(tuple, drawn.tolist()))) > 4
    assert torch.equal(after_fixed, torch.rand(4))
    spec_scores = [call[:, step] for call in captured for step in range(call.shape[1])]  # (rows, V) per step
    assert [len(rows) for _, rows, _ in fixed_scores] == [len(scores) for scores in spec_scores]
    for (_, _, scores), spec_step in zip(fixed_scores, spec_scores):
        torch.testing.assert_close(scores, spec_step, rtol=0, atol=1e-5)
    mask = common.completion_mask(drawn, tokenizer.eos_token_id)
    assert (mask.sum(1) < mask.shape[1]).any()  # some rows ended before others: they stayed in the batch
    scored = common.token_logprobs(model, torch.cat([prompt_ids.repeat_interleave(4, 0), drawn], 1),
                                   torch.cat([prompt_mask.repeat_interleave(4, 0), mask], 1), drawn.shape[1],
                                   cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    torch.testing.assert_close(logp[mask.bool()], scored[mask.bool()], rtol=0, atol=1e-5)
    assert (logp[~mask.bool()] == 0).all()


def test_fixed_shape_greedy_and_one_token_prompts_equal_the_definition():
    model, tokenizer, prompt_ids, prompt_mask = load()
    for ids, mask in ((prompt_ids, prompt_mask), (prompt_ids[:, -1:], prompt_mask[:, -1:])):
        greedy = decode.generate(model, tokenizer, ids, mask, Sampling(), greedy=True, fixed_shape=True)
        assert torch.equal(greedy, common.generate(model, tokenizer, ids, mask, Sampling(), greedy=True))
        torch.manual_seed(0)
        drawn = decode.generate(model, tokenizer, ids, mask, Sampling(), num_samples=3, fixed_shape=True)
        torch.manual_seed(0)
        assert torch.equal(drawn, common.generate(model, tokenizer, ids, mask, Sampling(), num_samples=3))


def test_fixed_shape_steps_have_one_shape_and_the_steps_past_the_end_draw_nothing_kept():
    """A 2-layer random model (EOS about 1 draw in 18): the end is checked every END_CHECK_EVERY steps, so steps run
    past the last row's EOS; their draws are discarded and the random generator set back, so the draws, their width
    and the random stream after are common.generate's. Every forward after a call's first has the same shapes, and
    two calls whose prompts differ in width by one token reuse one static cache."""
    from types import SimpleNamespace

    model, tokenizer = tiny_model("qwen2"), SimpleNamespace(pad_token_id=0, eos_token_id=1)
    cfg = Sampling(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=40)
    shapes = []

    def record_shapes(module, args, kwargs):  # the steps' masks are made as generate makes them: one per layer type
        masks = kwargs["attention_mask"]
        masks = masks.values() if isinstance(masks, dict) else [masks]
        shapes.append((kwargs["input_ids"].shape, *(mask.shape for mask in masks)))

    model.register_forward_pre_hook(record_shapes, with_kwargs=True)
    input_ids, attention_mask = batch(shared=False)
    for width in (9, 8):  # the prompt and completion of batch(), cut to widths 9 and 8
        ids, mask = input_ids[:, :width], attention_mask[:, :width]
        torch.manual_seed(1)
        drawn = decode.generate(model, tokenizer, ids, mask, cfg, num_samples=2, fixed_shape=True)
        after_fixed, steps = torch.rand(4), shapes[1:]  # after the shared prompts' pass: the decode steps
        assert len(steps) % static_decode.END_CHECK_EVERY == 0 and len(steps) > drawn.shape[1]  # run past the end
        assert drawn.shape[1] < 40 and len(set(steps[1:])) == 1 and steps[1] == ((14, 1), (14, 1, 1, 64))
        shapes.clear()
        torch.manual_seed(1)
        assert torch.equal(drawn, common.generate(model, tokenizer, ids, mask, cfg, num_samples=2))
        assert torch.equal(after_fixed, torch.rand(4))
        shapes.clear()
    assert len(static_decode._CACHES[model]) == 1


def test_fast_paths_print_no_deprecation_warning():
    """Both fast calls, with either decode loop, use the library's current names (a cache passed as `cache`, read
    as `.cache`):
    no Python warning and no transformers log warning."""
    model, tokenizer, prompt_ids, prompt_mask = load()
    logging.Logger.warning_once.cache_clear()  # a warning logged once before this test would hide
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            completion_ids = models.generate(model, tokenizer, prompt_ids, prompt_mask, Sampling(), num_samples=2)
            decode.generate(model, tokenizer, prompt_ids, prompt_mask, Sampling(), num_samples=2, fixed_shape=True)
            mask = common.completion_mask(completion_ids, tokenizer.eos_token_id)
            input_ids = torch.cat([prompt_ids.repeat_interleave(2, 0), completion_ids], 1)
            attention_mask = torch.cat([prompt_mask.repeat_interleave(2, 0), mask], 1)
            models.token_logprobs(model, input_ids, attention_mask, completion_ids.shape[1], 0.7, with_entropy=True)
    finally:
        logger.removeHandler(handler)
    assert [record.getMessage() for record in records] == []


@pytest.mark.parametrize("script, flags", [("remax", []), ("grpo", ["--num_epochs", "2"])])
def test_a_loop_with_fast_false_trains_as_the_default(script, flags, tmp_path, monkeypatch):
    """--fast False (common.generate and common.token_logprobs in the loop) against the default (support/models.py)
    over three steps: the same samples, so the same rewards and lengths, exactly, and the same losses, gradient
    norms and KL to float rounding (1e-5; observed at most 2.4e-7 on the loss over 4 steps of remax.py). A path
    that drew other tokens would change the rewards; one that scored other log-probs, the losses."""
    import importlib

    from support.run import read_metrics

    module = importlib.import_module(f"lab.{script}")  # --fast is the lab's
    rows = {}
    for fast_flag in ("True", "False"):
        out = tmp_path / fast_flag
        monkeypatch.setattr(sys, "argv", [f"lab/{script}.py", "--num_steps", "3", "--batch_size", "16", *flags,
                                          "--fast", fast_flag, "--log_rollouts", "0", "--save_model", "False",
                                          "--output_dir", str(out)])
        module.main()
        rows[fast_flag] = read_metrics(out / "metrics.jsonl")[1:]
    assert len(rows["True"]) == len(rows["False"]) == 3
    for fast_row, plain_row in zip(rows["True"], rows["False"]):
        for key in ("train/reward", "train/correct", "train/completion_len"):
            assert plain_row[key] == fast_row[key], key
        for key in ("train/loss", "train/grad_norm", "train/kl_seq"):
            assert plain_row[key] == pytest.approx(fast_row[key], abs=1e-5), key
