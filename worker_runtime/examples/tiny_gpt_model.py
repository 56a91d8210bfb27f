"""The model and the synthetic corpus of the tiny_gpt example."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F

# Spreads the per-sample seeds of neighbouring samples over the generator's seed space.
_GOLDEN = 0x9E3779B97F4A7C15


class MarkovCorpus:
    """A first-order Markov chain over ``vocab`` tokens, drawn from ``seed``.

    Each token has a few likely successors (plus a little mass everywhere), so a model can push
    the loss from ln(vocab) down towards the chain's entropy. Sample ``i`` is a function of
    (seed, i) alone: any rank can produce any part of the stream, in any order.
    """

    def __init__(self, vocab: int, seed: int, successors: int = 4, smoothing: float = 0.02) -> None:
        generator = torch.Generator().manual_seed(seed)
        weights = torch.full((vocab, vocab), smoothing / vocab, dtype=torch.float64)
        for token in range(vocab):
            nexts = torch.randperm(vocab, generator=generator)[:successors]
            weights[token, nexts] += torch.rand(successors, generator=generator, dtype=torch.float64) + 0.1
        probs = weights / weights.sum(dim=1, keepdim=True)
        cdf = probs.cumsum(dim=1)
        cdf[:, -1] = 1.0  # no rounding gap at the top: every u in [0, 1) maps to a token
        self.vocab = vocab
        self.seed = seed
        self._cdf = cdf

    def sample(self, indices: Iterable[int], length: int) -> torch.Tensor:
        """Sequences ``indices`` of the stream, each ``length`` tokens, as a (n, length) LongTensor."""
        uniforms = []
        for index in indices:
            generator = torch.Generator().manual_seed((self.seed * _GOLDEN + index) % 2**63)
            uniforms.append(torch.rand(length, generator=generator, dtype=torch.float64))
        u = torch.stack(uniforms, dim=1)  # (length, n): each position's draws are contiguous
        tokens = torch.empty(u.shape, dtype=torch.long)
        tokens[0] = (u[0] * self.vocab).long().clamp_(max=self.vocab - 1)
        for t in range(1, length):
            rows = self._cdf[tokens[t - 1]]
            tokens[t] = torch.searchsorted(rows, u[t].unsqueeze(1)).squeeze(1).clamp_(max=self.vocab - 1)
        return tokens.t().contiguous()


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, max_len: int, d_model: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: fewer parameters, and it trains faster here
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
