"""GPT-2-style decoder-only transformer (nanoGPT layout).

Pre-LayerNorm blocks (causal self-attention, then a 4x GELU MLP), learned
position embeddings, a final LayerNorm and an LM head tied to the token
embedding. At the defaults (GPT-2 small: 12 layers, width 768, 12 heads,
context 1024, vocabulary 50257) it has 124,439,808 parameters, counting the
tied embedding once.

Traceable by :func:`torch.fx.symbolic_trace`: the causal mask is a registered
(non-persistent) ``tril`` buffer cut to ``[:, :, :T, :T]`` with ``narrow`` (a
plain slice of a buffer by a traced length fails under fx, which does not
proxy buffers), so no tensor is built from a runtime shape. ``sdpa=True`` uses
:func:`torch.nn.functional.scaled_dot_product_attention` with
``is_causal=True`` instead of the explicit softmax(QK^T) path (the explicit
path, the default, materialises the T x T attention matrix, which is what a
memory model of the un-fused computation should see).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "gpt", "Block", "CausalSelfAttention", "MLP"]


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, seq_len: int, dropout: float = 0.0,
                 bias: bool = True, sdpa: bool = False):
        super().__init__()
        if width % heads != 0:
            raise ValueError(f"width ({width}) must be divisible by heads ({heads})")
        self.c_attn = nn.Linear(width, 3 * width, bias=bias)
        self.c_proj = nn.Linear(width, width, bias=bias)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = heads
        self.n_embd = width
        self.dropout = float(dropout)
        self.sdpa = bool(sdpa)
        self.scale = 1.0 / math.sqrt(width // heads)
        if not self.sdpa:
            mask = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
            self.register_buffer("bias", mask.view(1, 1, seq_len, seq_len), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        hs = C // self.n_head
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None,
                dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * self.scale
            # = self.bias[:, :, :T, :T]; narrow() rather than slicing because fx
            # does not proxy buffers, and a real tensor cannot be sliced by a Proxy.
            mask = self.bias.narrow(2, 0, T).narrow(3, 0, T)
            att = att.masked_fill(mask.logical_not(), float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, seq_len: int, dropout: float = 0.0,
                 bias: bool = True, sdpa: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, bias=bias)
        self.attn = CausalSelfAttention(width, heads, seq_len, dropout, bias, sdpa)
        self.ln_2 = nn.LayerNorm(width, bias=bias)
        self.mlp = MLP(width, dropout, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, depth: int = 12, width: int = 768, heads: int = 12, seq_len: int = 1024,
                 vocab: int = 50257, dropout: float = 0.0, bias: bool = True, sdpa: bool = False):
        super().__init__()
        self.depth = depth
        self.width = width
        self.heads = heads
        self.seq_len = seq_len
        self.vocab = vocab
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width),
            wpe=nn.Embedding(seq_len, width),
            drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(width, heads, seq_len, dropout, bias, sdpa) for _ in range(depth)]),
            ln_f=nn.LayerNorm(width, bias=bias),
        ))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):  # GPT-2 scaled residual init
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """``idx``: (B, T) int64 token ids, T <= seq_len. Returns (B, T, vocab) logits."""
        T = idx.size(1)
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def gpt(depth: int = 12, width: int = 768, heads: int = 12, seq_len: int = 1024,
        vocab: int = 50257, dropout: float = 0.0, bias: bool = True, sdpa: bool = False) -> GPT:
    """GPT decoder; 124,439,808 parameters at the (GPT-2 small) defaults."""
    return GPT(depth=depth, width=width, heads=heads, seq_len=seq_len, vocab=vocab,
               dropout=dropout, bias=bias, sdpa=sdpa)
