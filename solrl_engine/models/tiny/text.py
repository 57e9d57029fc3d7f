"""The tiny model's text side: a closed-vocabulary word tokenizer and a small transformer encoder,
trained together with the image model (no download needed)."""

from __future__ import annotations

import torch
from torch import nn

from solrl_engine.data import shapes as world

PAD = 0


class WordTokenizer:
    """Whole-word tokens over the shapes vocabulary; id 0 pads. Unknown words are an error."""

    def __init__(self, vocab: tuple[str, ...] = world.VOCAB, max_len: int = 16) -> None:
        self.vocab = vocab
        self.max_len = max_len
        self.ids = {w: i + 1 for i, w in enumerate(vocab)}

    def __len__(self) -> int:
        return len(self.vocab) + 1

    def __call__(self, prompts: list[str]) -> torch.Tensor:
        out = torch.full((len(prompts), self.max_len), PAD, dtype=torch.long)
        for i, p in enumerate(prompts):
            words = p.strip().lower().rstrip(".").split()
            unknown = [w for w in words if w not in self.ids]
            if unknown:
                raise world.PromptError(
                    f"prompt {p!r} uses words the tiny model does not know: {unknown}; its vocabulary is "
                    f"{list(self.vocab)} (see solrl_engine.data.shapes for the grammar)"
                )
            if len(words) > self.max_len:
                raise world.PromptError(f"prompt {p!r} has {len(words)} words; the tiny model reads {self.max_len}")
            out[i, : len(words)] = torch.tensor([self.ids[w] for w in words], dtype=torch.long)
        return out


class TinyTextEncoder(nn.Module):
    """Token embeddings + a pre-norm transformer; returns per-token states and a pooled vector."""

    def __init__(self, vocab_size: int, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad = ids == PAD
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        # an all-padding row (the empty, unconditional prompt) attends to nothing: let it see itself
        key_mask = pad & ~pad.all(-1, keepdim=True)
        h = self.norm(self.encoder(h, src_key_padding_mask=key_mask))
        keep = (~pad).unsqueeze(-1).to(h.dtype)
        pooled = (h * keep).sum(1) / keep.sum(1).clamp(min=1)
        return h * keep, pooled
