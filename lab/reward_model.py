"""The reward model of --reward_model: a sequence classifier scoring each (prompt, completion), frozen."""
import torch

from support.models import check_model_path, prepare_frozen
from support.helpers import micro_batches


class RewardModel:
    """Scores (prompt, completion) with an AutoModelForSequenceClassification, its own
    tokenizer and chat template; frozen, no grad, optionally in its own dtype, under the policy's
    mixed precision, micro_batch_size completions per forward pass (0 = all)."""

    def __init__(self, name, dtype, accelerator, micro_batch_size=0):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_model_path(name, flag="--reward_model")
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(name, dtype=getattr(torch, dtype))
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = prepare_frozen(accelerator, model.eval().requires_grad_(False))
        self.device, self.micro_batch_size = accelerator.device, micro_batch_size

    @torch.no_grad()
    def __call__(self, prompts, completions):
        """Scores of (prompt, completion) pairs; a prompt is text or a conversation's messages."""
        if self.tokenizer.chat_template:
            turns = [p if isinstance(p, list) else [{"role": "user", "content": p}] for p in prompts]
            texts = [self.tokenizer.apply_chat_template(t + [{"role": "assistant", "content": c}], tokenize=False)
                     for t, c in zip(turns, completions)]
        else:
            texts = [("\n\n".join(m["content"] for m in p) if isinstance(p, list) else p) + c
                     for p, c in zip(prompts, completions)]
        scores = []
        for mb in micro_batches(len(texts), self.micro_batch_size):
            enc = self.tokenizer(texts[mb], return_tensors="pt", padding=True, truncation=True,
                                 add_special_tokens=not self.tokenizer.chat_template)
            scores.append(self.model(**enc.to(self.device)).logits[:, 0].float())
        return torch.cat(scores)
