"""A small decoder-only GPT in the style of the paper's models: RMSNorm (pre-norm), grouped-query attention with
rotary position embeddings, a squared-ReLU MLP, no biases, untied input embedding and output head. Every linear
layer becomes an :class:`fp4sim.torch.QuantLinear` under :func:`build`, with the recipe's last blocks (and the
head) in BF16 as the paper keeps them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 96
    d_model: int = 128
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_mult: int = 4
    ctx: int = 128
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}: d_model "
                             "must divide into heads and heads into key/value groups")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("the head size must be even for rotary embeddings")


def _rope(x, cos, sin):
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Block(torch.nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        hd = c.d_model // c.n_heads
        self.c, self.hd = c, hd
        self.attn_norm = torch.nn.RMSNorm(c.d_model)
        self.q = torch.nn.Linear(c.d_model, c.n_heads * hd, bias=False)
        self.k = torch.nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.v = torch.nn.Linear(c.d_model, c.n_kv_heads * hd, bias=False)
        self.o = torch.nn.Linear(c.n_heads * hd, c.d_model, bias=False)
        self.mlp_norm = torch.nn.RMSNorm(c.d_model)
        self.up = torch.nn.Linear(c.d_model, c.ffn_mult * c.d_model, bias=False)
        self.down = torch.nn.Linear(c.ffn_mult * c.d_model, c.d_model, bias=False)

    def forward(self, h, cos, sin):
        B, T, _ = h.shape
        a = self.attn_norm(h)
        q = self.q(a).view(B, T, self.c.n_heads, self.hd).transpose(1, 2)
        k = self.k(a).view(B, T, self.c.n_kv_heads, self.hd).transpose(1, 2)
        v = self.v(a).view(B, T, self.c.n_kv_heads, self.hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + self.o(att.transpose(1, 2).reshape(B, T, -1))
        return h + self.down(F.relu(self.up(self.mlp_norm(h))) ** 2)


class GPT(torch.nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.c = c
        self.embed = torch.nn.Embedding(c.vocab, c.d_model)
        self.layers = torch.nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = torch.nn.RMSNorm(c.d_model)
        self.head = torch.nn.Linear(c.d_model, c.vocab, bias=False)
        hd = c.d_model // c.n_heads
        inv = 1.0 / (c.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = torch.outer(torch.arange(c.ctx, dtype=torch.float64), inv)
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)
        self.apply(self._init)
        for blk in self.layers:                  # residual projections scaled down with depth (GPT-2 style)
            for lin in (blk.o, blk.down):
                torch.nn.init.normal_(lin.weight, std=0.02 / (2 * c.n_layers) ** 0.5)

    @staticmethod
    def _init(m):
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        h = self.embed(idx)
        cos, sin = self.cos[:T], self.sin[:T]
        for blk in self.layers:
            h = blk(h, cos, sin)
        return self.head(self.norm(h))


def linear_names(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def build(c: GPTConfig, recipe, seed: int):
    """The model with initial weights from ``seed``, every linear layer a QuantLinear under ``recipe`` (a
    :class:`fp4sim.training.Recipe`, or ``"none"`` for plain float32)."""
    from fp4sim.torch import convert
    torch.manual_seed(seed)
    model = GPT(c)
    return convert(model, recipe)
