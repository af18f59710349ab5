"""Small models shared by the end-to-end tests."""

import pytest
import torch
import torch.nn as nn


class Stack(nn.Module):
    """Pre-norm residual stack of ``n`` attention layers built by ``layer()``; called as ``(x, keep)``."""

    def __init__(self, layer, n=2, d=32):
        super().__init__()
        self.layers = nn.ModuleList([layer() for _ in range(n)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x, keep):
        for layer in self.layers:
            x = x + layer(self.norm(x), keep)
        return x


def keep_mask(b, n):
    """Key padding: the first row keeps everything, the others a random prefix of at least n/2."""
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[1:, int(torch.randint(n // 2, n, (1,))):] = False
    return keep


def tiny_bert():
    T = pytest.importorskip("transformers")
    return T.BertModel(T.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    intermediate_size=128, vocab_size=100, max_position_embeddings=32,
                                    attn_implementation="eager"))
