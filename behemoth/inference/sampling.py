"""Choosing the next token: greedy, temperature, top-k, top-p (nucleus), repetition, presence and frequency penalties,
logit bias, per-request seeds, and the log-probabilities a request asks for.

Every request carries its own `SamplingParams` and its own random generator, so a request's tokens
depend on its prompt, its parameters and its seed only, never on which other requests share its
batch. The logits processors follow the definitions transformers uses (its `TopKLogitsWarper`,
`TopPLogitsWarper`, `RepetitionPenaltyLogitsProcessor`), applied in that library's order:
repetition penalty, temperature, top-k, top-p. Before them come OpenAI's logit bias and its presence and
frequency penalties (`logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)`, counted
over the generated tokens, as vLLM does). Greedy rows take the argmax of the penalized logits.
Log-probabilities are those of the model's own distribution (log-softmax of the raw logits, before any
penalty or temperature), vLLM's default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request's tokens are chosen, and when it stops."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="tokens to generate at most")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0: greedy (argmax); otherwise the softmax temperature")
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: all)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="keep the smallest set of tokens whose probability reaches p")
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0, description="divide (multiply, if negative) the logit of every token seen so far")
    stop: list[str] = Field(default_factory=list, description="strings that end the generation (not included in the text)")
    stop_token_ids: list[int] = Field(default_factory=list, description="token ids that end the generation (not included)")
    seed: int | None = Field(None, ge=0, lt=2**63, description="random seed of this request (default: drawn)")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from the logit of every token generated so far")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once per time a token was generated so far")
    logit_bias: dict[int, float] = Field(default_factory=dict, description="added to the logits of these token ids (-100 to 100)")
    logprobs: int | None = Field(None, ge=0, le=20, description="report each token's log-probability and this many most likely ones")
    adapter: int = Field(0, ge=0, description="the served LoRA adapter's slot this request runs with (0: the base model)")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("a stop string must not be empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass(frozen=True)
class TokenChoice:
    """One chosen token, its log-probability and (when asked) the most likely tokens' log-probabilities."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def apply_repetition_penalty(logits: torch.Tensor, seen: list[list[int]], penalty: torch.Tensor) -> torch.Tensor:
    """Divide positive (multiply negative) logits of tokens already seen in each row by that row's penalty."""
    if bool((penalty == 1.0).all()):
        return logits
    out = logits.clone()
    for b, tokens in enumerate(seen):
        if penalty[b] == 1.0 or not tokens:
            continue
        idx = torch.tensor(sorted(set(tokens)), dtype=torch.long, device=logits.device)
        picked = out[b, idx]
        out[b, idx] = torch.where(picked < 0, picked * penalty[b], picked / penalty[b])
    return out


def top_k_filter(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Set every logit below each row's k-th largest to -inf (k = 0 keeps the row)."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose probabilities sum to at least p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= (1 - p).unsqueeze(-1)
    remove[:, -1] = False
    return logits.masked_fill(remove.scatter(-1, order, remove), float("-inf"))


def apply_openai_penalties(logits: torch.Tensor, params: list[SamplingParams], generated: list[list[int]]) -> torch.Tensor:
    """Logit bias, then `logit[j] -= frequency_penalty * count[j] + presence_penalty * (count[j] > 0)` over each row's
    generated tokens (OpenAI's definitions)."""
    if not any(p.penalized for p in params):
        return logits
    out = logits.clone()
    biased = [(b, int(token), bias) for b, p in enumerate(params) if p.logit_bias for token, bias in p.logit_bias.items()]
    if biased:  # every row's bias in one indexing
        rows, ids, values = zip(*biased)
        index = (torch.tensor(rows, device=out.device), torch.tensor(ids, device=out.device))
        out.index_put_(index, torch.tensor(values, dtype=out.dtype, device=out.device), accumulate=True)
    for b, p in enumerate(params):
        if (p.presence_penalty or p.frequency_penalty) and generated[b]:
            counts = torch.bincount(torch.tensor(generated[b], dtype=torch.long), minlength=out.shape[-1]).to(out.device, out.dtype)
            out[b] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(out.dtype)
    return out


def processed_logits(
    raw: torch.Tensor, params: list[SamplingParams], seen: list[list[int]], generated: list[list[int]] | None = None
) -> torch.Tensor:
    """The logits after logit bias, presence/frequency penalties (over `generated`) and repetition penalty (over `seen`):
    what greedy rows take the argmax of."""
    logits = apply_openai_penalties(raw.float(), params, generated if generated is not None else [[] for _ in params])
    penalty = torch.tensor([p.repetition_penalty for p in params], device=logits.device)
    return apply_repetition_penalty(logits, seen, penalty)


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, V] on the CPU: the distribution sampled rows draw from (temperature, then top-k, then top-p, of processed logits)."""
    rows = logits / torch.tensor([p.temperature for p in params], device=logits.device).unsqueeze(-1)
    if any(p.top_k > 0 for p in params):  # else every row keeps all (each filter sorts the vocabulary: skipped)
        rows = top_k_filter(rows, torch.tensor([p.top_k for p in params], device=logits.device))
    if any(p.top_p < 1.0 for p in params):
        rows = top_p_filter(rows, torch.tensor([p.top_p for p in params], device=logits.device))
    return rows.softmax(dim=-1).cpu()


def choose_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    seen: list[list[int]],
    generators: list[torch.Generator | None],
    generated: list[list[int]] | None = None,
) -> list[TokenChoice]:
    """The next token of each row (argmax for greedy rows, a draw from the processed distribution otherwise), with its
    log-probability under the model's raw distribution and, when asked, the most likely tokens'."""
    raw = logits.float()
    logits = processed_logits(raw, params, seen, generated)
    out = logits.argmax(dim=-1).tolist()
    sampled = [b for b, p in enumerate(params) if not p.greedy]
    if sampled:
        probs = sampling_probs(logits[sampled], [params[b] for b in sampled])
        for i, b in enumerate(sampled):
            out[b] = int(torch.multinomial(probs[i], 1, generator=generators[b]))
    return token_choices(raw, params, out)


def token_choices(raw: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[TokenChoice]:
    """Each row's chosen token with its log-probability under log_softmax(raw) and its top `params.logprobs` tokens."""
    logprobs = raw.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=raw.device).unsqueeze(-1))[:, 0].tolist()
    choices = []
    for b, (p, token) in enumerate(zip(params, tokens)):
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logprobs[b].topk(p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist()))
        choices.append(TokenChoice(token, chosen[b], top))
    return choices


def request_generator(seed: int | None) -> torch.Generator:
    """The CPU generator one request draws from: its seed, or a fresh one."""
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
