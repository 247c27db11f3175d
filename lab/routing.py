"""Keep routing on a mixture-of-experts policy: record the experts each router picks, and replay them.

A mixture-of-experts layer sends each token to the top k of its E experts by its router's scores, so log pi is
discontinuous in theta: a change of the weights too small to matter elsewhere (a bf16 sampler, a stale one, one
update) can swap an expert and move a log-prob by far more. Keeping the routing (Rollout Routing Replay, Ma et
al. 2025, arXiv 2510.11370; docs/stability.md) makes the trainer use the experts that another pass chose:
R3 replays the sampler's, R2 those of the trainer's own pi_old pass.

    with routing.record(sampler) as rec:                  # around any forwards: a generation, a scoring pass
        completion_ids = decode.generate(sampler, tokenizer, prompt_ids, prompt_mask, cfg, num_samples=K)
    indices, token_ids = rec.layout(attention_mask)       # (B, S, L, k), (B, S) in the trainer's layout
    with routing.replay(policy, indices, token_ids):      # around the forward AND the backward
        logp = decode.token_logprobs(policy, input_ids, attention_mask, C)
        loss.backward()
    routing.mismatch(indices, other_indices, mask)        # fraction of (token, layer) pairs whose sets differ

Layout. Row b, column s of `indices` is the token input_ids[b, s] of the trainer's (B, S) batch (left-padded
prompts, completions padded after EOS; attention_mask is the prompt mask and the completion mask side by side);
[b, s, l] holds the k experts of the l-th MoE layer, sorted, so that sets compare. -1 marks a position that no
recorded forward ran, or whose routing cannot change a completion's log-prob: padding, and each row's last token
(it predicts nothing; the sampler never runs it). `token_ids` holds the ids the recorded forwards saw there
(-1 likewise): replay checks every forward's ids against them and raises at the first difference (rows shuffled,
another batch), so wrong experts are never used silently. In a replayed forward a -1 lets the live router choose.

Rows and columns. A forward of w tokens with an attention mask of width m runs columns m - w .. m - 1. A forward
without a cache (a full pass, a group's prompt pass, a generate call's prefill) starts the next block of rows,
after those of the previous block in the same context, so generate calls in chunks and micro-batches line up;
a forward that continues a cache runs the same block. Code whose forward runs other rows than the block's says
which with `routing.rows`: lab/decode.py, support/models.py's scoring and sampling as the lab runs them, does for a
group's shared prompt pass and for the rows still going in its decode loop (support/models.py
itself knows nothing of the routing). In a replay the blocks wrap around to row 0 after the last of the B rows:
one context can hold the whole batch's indices around epochs of micro-batches taken in order, or a micro-batch's,
indices[mb].
Every forward through the model's weights inside a context counts, a LoRA reference (the policy, adapter off)
included: run the reference outside.

Replay. Each router still computes its logits; the experts are the recorded ones, weighted by the live router's
softmax probabilities gathered at them (renormalised over the k when the router renormalises its top k): the
block's output for those experts, with the router's gradient. Under gradient checkpointing a layer runs again
in the backward; it replays there what it replayed in the forward. The hooks exist only inside the contexts:
outside them nothing runs and nothing is paid.

Supported: the softmax top-k routers of transformers 5 (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE), modules named
*TopKRouter that return (logits, weights, indices); replay checks at each call that the weights are that formula.
"""
import dataclasses
from contextlib import ExitStack, contextmanager

import torch

_OPEN = {}  # id(a model's decoder) -> its _Hooks, while a record or replay context is open on the model


def is_open(model):
    """Whether a record or replay context is open on `model`."""
    return bool(_OPEN) and id(_decoder(model)) in _OPEN


def routers(model):
    """The top-k routers of a transformers mixture-of-experts model, in layer order ([] for a dense model)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def names_moe(model_name_or_path):
    """Whether the checkpoint's config is a mixture of experts: read before any model loads."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model_name_or_path)
    return any(getattr(model_config, name, 0) for name in ("num_experts", "num_local_experts"))


def is_moe(model):
    return len(routers(model)) > 0


def check_moe(model, flag="--keep_routing"):
    """One clear error line for a dense model."""
    if not is_moe(model):
        raise SystemExit(f"error: {flag} needs a mixture-of-experts policy (one whose layers route each token to "
                         f"experts, e.g. --model_name_or_path embedded_model/moe); this model is dense: use "
                         f"{flag} none.")


def positions(attention_mask):
    """(B, S) bool: the tokens whose routing can change a completion's log-prob, each valid token followed by
    another (all but each row's last; masks are contiguous: left padding, prompt, completion, padding)."""
    mask = attention_mask.bool()
    return mask & torch.nn.functional.pad(mask[:, 1:], (0, 1))


def mismatch(indices_a, indices_b, mask=None):
    """The fraction of (position, MoE layer) pairs whose top-k sets differ between two recordings of the same rows,
    (B, S, L, k) each as `layout` gives them, over the positions recorded in both and in `mask` (B, S).
    train/routing_mismatch counts the positions that predict completion tokens: with P prompt columns,
    mask = F.pad(completion_mask, (P - 1, 1)) (column P - 1 + t predicts completion token t)."""
    both = (indices_a[..., 0, 0] >= 0) & (indices_b[..., 0, 0] >= 0)  # (B, S)
    if mask is not None:
        both = both & mask.bool()
    differ = (indices_a != indices_b).any(-1) & both[..., None]  # (B, S, L)
    return differ.sum() / (both.sum() * indices_a.shape[2]).clamp(min=1)


def layers_differing(indices_a, indices_b):
    """(B, S): at each position recorded in both, how many MoE layers chose another set of experts (else 0)."""
    both = (indices_a[..., 0, 0] >= 0) & (indices_b[..., 0, 0] >= 0)
    return ((indices_a != indices_b).any(-1).sum(-1) * both).long()


def rollout_metrics(rollout):
    """A step's train/routing_mismatch, over the positions that predict a completion token, once the trainer's
    routers have chosen (rollout.live_routing; else {})."""
    if rollout.live_routing is None:
        return {}
    predicting = torch.nn.functional.pad(rollout.mask, (rollout.prompt_ids.shape[1] - 1, 1))
    return {"train/routing_mismatch": mismatch(rollout.routing[0], rollout.live_routing, predicting)}


def disagreement(rollout):
    """(B, T): how many MoE layers routed the position that predicts each completion token to other experts in the
    trainer than in the sampler (None before both are known)."""
    if rollout is None or rollout.routing is None or rollout.live_routing is None:
        return None
    P, T = rollout.prompt_ids.shape[1], rollout.mask.shape[1]
    return layers_differing(rollout.routing[0], rollout.live_routing)[:, P - 1:P - 1 + T]


def viewed(rollout):
    """The rollout viewer's per-token values of the routing: {"routing_disagree": disagreement} once known, else {}."""
    disagree = disagreement(rollout)
    return {} if disagree is None else {"routing_disagree": disagree}


@contextmanager
def record(model):
    """Record the experts of every router for each forward of `model` inside the context; `layout` then gives them
    in the trainer's layout. Also records, as `layout(..., live=True)`, each router's own choice where a replay
    inside the context put other experts in its place."""
    recording = Recording()
    with _opened(model, recording):
        yield recording


@contextmanager
def replay(model, indices, token_ids):
    """Replay `indices` (B, S, L, k), recorded with `token_ids` (B, S) (`Recording.layout`), in every forward of
    `model` inside the context, and in the backward's recomputation of checkpointed layers."""
    replaying = Replay(indices, token_ids)
    with _opened(model, replaying):
        yield replaying


@contextmanager
def rows(model, block_rows=None, batch_rows=None):
    """For the forwards of `model` inside: row block_rows[i] of the current block of rows is computed by row
    batch_rows[i] of the forward's batch. Either defaults to 0, 1, ... as long as the other. Costs nothing when
    no record or replay context is open."""
    hooks = _OPEN.get(id(_decoder(model))) if _OPEN else None
    if hooks is None:
        yield
        return
    given = block_rows if block_rows is not None else batch_rows
    arange = torch.arange(len(given), device=given.device)
    saved, hooks.rows = hooks.rows, (arange if batch_rows is None else batch_rows,
                                     arange if block_rows is None else block_rows)
    try:
        yield
    finally:
        hooks.rows = saved


class Pass:
    """The routing of one pass of a trainer's model over `rows` of a rollout, held open from the forward to the end
    of the backward: a replay of the experts `keep` names (r3: the sampler's, rollout.routing; r2: those of the
    pi_old pass, rollout.old_routing, once it ran; none: nothing) and a recording. One pass at a time per model: a
    second one would record the first one's rows. close() ends it and keeps its routers' own choices of the rows
    not seen before in rollout.live_routing (the trainer's side of train/routing_mismatch: under r3 the choices of
    routers whose inputs come from replayed earlier layers); used() then gives the experts the pass used with their
    token ids, (b, S, L, k) in the layout of the rows' input_ids."""

    def __init__(self, model, rollout, rows, keep="none"):
        hooks = _OPEN.get(id(_decoder(model)))
        if hooks is not None and any(isinstance(r, _PassRecording) for r in hooks.recordings):
            raise RuntimeError("a forward of the policy over other rows is still open: back-propagate each "
                               "micro-batch's loss (trainer.backward) before scoring the next one")
        self.rollout, self.rows, self.attention_mask = rollout, rows, rollout.attention_mask[rows]
        replayed = rollout.routing if keep == "r3" else rollout.old_routing if keep == "r2" else None
        self.stack = ExitStack()
        if replayed is not None:
            self.stack.enter_context(replay(model, replayed[0][rows], replayed[1][rows]))
        self.recording = _PassRecording()
        self.stack.enter_context(_opened(model, self.recording))

    def close(self):
        self.stack.close()
        rollout, rows = self.rollout, self.rows
        if rollout.live_routing is None:
            rollout.live_routing = torch.full_like(rollout.routing[0], -1)
        new = (rollout.live_routing[rows, :, 0, 0] < 0).all(1)
        if new.any():  # laid out only for the first pass over a row: later passes' updates need none of it
            rollout.live_routing[rows[new]] = self.recording.layout(self.attention_mask, live=True)[0][new]
        return self

    def used(self):
        return self.recording.layout(self.attention_mask)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------------------
# What record and replay keep
# ----------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Forward:
    """One forward of the model: its input ids (b, w), the columns they run, which rows of the current block its
    batch rows compute, and what each open context made of it."""
    input_ids: torch.Tensor
    cols: torch.Tensor  # (w,)
    batch_rows: torch.Tensor  # (n,): block row block_rows[i] is batch row batch_rows[i]
    block_rows: torch.Tensor  # (n,)
    slab: torch.Tensor = None  # (b * w, L, k) the experts to replay, -1: the live choice
    entries: list = dataclasses.field(default_factory=list)  # a Recording's entry each
    recomputing: bool = False  # a checkpointed layer run again in the backward


class _Blocks:
    """The trainer rows of each forward: a forward without cache starts the next block of rows."""

    def __init__(self):
        self.base, self.size = 0, 0

    def trainer_rows(self, forward, new_block, num_rows=None):
        """num_rows: the blocks wrap around to row 0 past it."""
        if new_block:
            self.base, self.size = self.base + self.size, int(forward.block_rows.max()) + 1
            self.base = self.base % num_rows if num_rows else self.base
        return self.base + forward.block_rows


class Recording(_Blocks):
    def __init__(self):
        super().__init__()
        self.entries = []  # per forward: trainer rows, batch rows, columns, ids, experts per layer (used, live)

    def _on_forward(self, forward, new_block, num_layers):
        entry = {"rows": self.trainer_rows(forward, new_block), "batch_rows": forward.batch_rows,
                 "cols": forward.cols, "ids": forward.input_ids, "used": [None] * num_layers,
                 "live": [None] * num_layers}
        self.entries.append(entry)
        forward.entries.append(entry)

    def layout(self, attention_mask, live=False):
        """(indices (B, S, L, k), token_ids (B, S)), long, in the layout of `attention_mask` (B, S), the trainer's
        mask of the recorded rows; -1 where nothing was recorded or outside `positions(attention_mask)`.
        live: each router's own choice, not the experts a replay made it use."""
        B, S = attention_mask.shape
        if not self.entries:
            raise ValueError("routing: nothing was recorded (no forward of the model ran inside the context).")
        if self.base + self.size != B:
            raise ValueError(f"routing: {self.base + self.size} rows were recorded; the mask has {B}.")
        first = self.entries[0]["used"][0]
        L, k = len(self.entries[0]["used"]), first.shape[-1]
        indices = torch.full((B, S, L, k), -1, dtype=torch.long, device=first.device)
        token_ids = torch.full((B, S), -1, dtype=torch.long, device=first.device)
        for entry in self.entries:
            if int(entry["cols"][-1]) >= S:
                raise ValueError(f"routing: a recorded forward ran column {int(entry['cols'][-1])}; the mask has {S}.")
            b, w = entry["ids"].shape
            experts = torch.stack(entry["live" if live else "used"], dim=1).view(b, w, L, k)
            rows, cols = entry["rows"][:, None], entry["cols"][None, :]
            indices[rows, cols] = experts[entry["batch_rows"]]
            token_ids[rows, cols] = entry["ids"][entry["batch_rows"]]
        keep = positions(attention_mask)
        return indices.masked_fill(~keep[..., None, None], -1), token_ids.masked_fill(~keep, -1)


class _PassRecording(Recording):
    """A Pass's recording (one open per model at a time)."""


class Replay(_Blocks):
    def __init__(self, indices, token_ids):
        super().__init__()
        if indices.dim() != 4 or token_ids.shape != indices.shape[:2]:
            raise ValueError(f"routing replay: indices must be (B, S, L, k) and token_ids (B, S); got "
                             f"{tuple(indices.shape)} and {tuple(token_ids.shape)}.")
        self.indices, self.token_ids = indices, token_ids

    def _on_forward(self, forward, new_block, num_layers, top_k):
        B, S, L, k = self.indices.shape
        if (L, k) != (num_layers, top_k):
            raise RuntimeError(f"routing replay: the indices hold {L} layers of {k} experts; the model has "
                               f"{num_layers} MoE layers of top {top_k}.")
        rows = self.trainer_rows(forward, new_block, num_rows=B)
        if int(rows.max()) >= B or int(forward.cols[-1]) >= S:
            raise RuntimeError(f"routing replay: a forward runs rows up to {int(rows.max())} and columns up to "
                               f"{int(forward.cols[-1])}, outside the recorded (B, S) = ({B}, {S}): open one "
                               f"replay context per batch of rows, with that batch's indices.")
        indices, token_ids = self.indices.to(rows.device), self.token_ids.to(rows.device)
        recorded = token_ids[rows[:, None], forward.cols[None, :]]  # (n, w)
        seen = forward.input_ids[forward.batch_rows]
        wrong = (recorded >= 0) & (recorded != seen)
        if wrong.any():
            row, col = (int(x) for x in wrong.nonzero()[0])
            raise RuntimeError(f"routing replay: the forward's token ids differ from those recorded with the routing "
                               f"(row {int(rows[row])}, column {int(forward.cols[col])}): the rows are not laid out "
                               f"as they were recorded (shuffled, or another batch).")
        b, w = forward.input_ids.shape
        source = torch.full((b,), B, device=rows.device).scatter_reduce(0, forward.batch_rows, rows, "amin")
        slab = indices[source.clamp(max=B - 1)[:, None], forward.cols[None, :]]  # (b, w, L, k)
        forward.slab = slab.masked_fill((source == B)[:, None, None, None], -1).view(b * w, L, k)


# ----------------------------------------------------------------------------------------
# The hooks
# ----------------------------------------------------------------------------------------
def _decoder(model):
    """The transformers decoder (the model without its head) inside a bare, DDP, DeepSpeed or peft model."""
    from transformers import PreTrainedModel

    hf = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if hf is None:
        raise ValueError("routing: not a transformers model")
    return hf.base_model


@contextmanager
def _opened(model, context):
    decoder = _decoder(model)
    hooks = _OPEN.get(id(decoder))
    if hooks is None:
        hooks = _OPEN[id(decoder)] = _Hooks(decoder)
    if isinstance(context, Replay):
        if hooks.replay is not None:
            raise RuntimeError("routing: a replay context is already open on this model")
        hooks.replay = context
    else:
        hooks.recordings.append(context)
    try:
        yield
    finally:
        if context is hooks.replay:
            hooks.replay = None
        else:
            hooks.recordings.remove(context)
        if hooks.replay is None and not hooks.recordings:
            hooks.remove()
            del _OPEN[id(decoder)]


class _Hooks:
    """While contexts are open on a model: a hook on the decoder's forward (its rows and columns), one on each
    router (replace, record), and each checkpointed layer's checkpoint function pinned to its first run's forward."""

    def __init__(self, decoder):
        from transformers.modeling_layers import GradientCheckpointingLayer

        self.routers = routers(decoder)
        if not self.routers:
            check_moe(decoder)
        self.recordings, self.replay, self.rows, self.forward, self.closed = [], None, None, None, False
        self.handles = [decoder.register_forward_pre_hook(self._on_forward, with_kwargs=True)]
        for layer, router in enumerate(self.routers):
            self.handles.append(router.register_forward_hook(
                lambda module, args, output, layer=layer: self._on_route(module, layer, output)))
        self.checkpointed = [(m, m._gradient_checkpointing_func) for m in decoder.modules()
                             if isinstance(m, GradientCheckpointingLayer) and "_gradient_checkpointing_func" in vars(m)
                             and any(r in self.routers for r in m.modules())]
        for module, checkpoint in self.checkpointed:
            module._gradient_checkpointing_func = self._pinned(checkpoint)

    def remove(self):
        for handle in self.handles:
            handle.remove()
        for module, checkpoint in self.checkpointed:
            module._gradient_checkpointing_func = checkpoint
        self.closed = True

    def _on_forward(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("routing: record and replay need the forward's input_ids (not inputs_embeds)")
        b, w = input_ids.shape
        mask, cache = kwargs.get("attention_mask"), kwargs.get("cache", kwargs.get("past_key_values"))
        past = mask.shape[1] - w if mask is not None else cache.get_seq_length() if cache is not None else 0
        batch_rows, block_rows = self.rows or (None, None)
        if batch_rows is None:
            batch_rows = block_rows = torch.arange(b, device=input_ids.device)
        forward = _Forward(input_ids, torch.arange(past, past + w, device=input_ids.device), batch_rows, block_rows)
        for recording in self.recordings:
            recording._on_forward(forward, past == 0, len(self.routers))
        if self.replay is not None:
            self.replay._on_forward(forward, past == 0, len(self.routers), self.routers[0].top_k)
        self.forward = forward

    def _on_route(self, router, layer, output):
        forward = self.forward
        if forward is None:
            raise RuntimeError("routing: a router ran outside a forward of the model the context was opened on")
        logits, weights, experts = output
        live = experts
        if forward.slab is not None:
            experts, weights = _replayed(router, logits, weights, experts, forward.slab[:, layer])
        if not forward.recomputing:
            for entry in forward.entries:
                entry["used"][layer], entry["live"][layer] = experts.sort(-1).values, live.sort(-1).values
        return logits, weights, experts

    def _pinned(self, checkpoint):
        """The layer's checkpoint function, its layer rerun in the backward with the forward it first ran in."""
        def pinned_checkpoint(function, *args, **kwargs):
            forward, runs = self.forward, []

            def run(*a, **k):
                if forward.slab is not None and self.closed:
                    raise RuntimeError("routing replay: a checkpointed layer ran again after the replay context "
                                       "closed: keep the backward inside the context.")
                saved = self.forward
                self.forward = dataclasses.replace(forward, recomputing=True) if runs else forward
                runs.append(1)
                try:
                    return function(*a, **k)
                finally:
                    self.forward = saved
            return checkpoint(run, *args, **kwargs)
        return pinned_checkpoint


def _replayed(router, logits, weights, live, replayed):
    """The experts `replayed` ((T, k), a row of -1: the live choice `live`) in the router's own order (descending
    weight) and their weights: the softmax of the live logits gathered there, renormalised over the k when the
    router renormalises its top k (a Mixtral router always does). Checks the live weights are that formula."""
    renormalise = getattr(router, "norm_topk_prob", True)
    probs = torch.softmax(logits.float(), dim=-1)  # (T, E)

    def weigh(experts):
        w = probs.gather(-1, experts)
        return w / w.sum(-1, keepdim=True) if renormalise else w

    if not torch.allclose(weigh(live).to(weights.dtype), weights):
        raise RuntimeError(f"routing replay: {type(router).__name__} does not weigh its experts by softmax top-k; "
                           f"replay supports routers that do.")
    experts = torch.where(replayed[:, :1] >= 0, replayed, live)
    experts = experts.gather(-1, probs.gather(-1, experts).argsort(-1, descending=True))
    return experts, weigh(experts).to(weights.dtype)
