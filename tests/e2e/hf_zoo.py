"""Tiny Hugging Face models of many families, built as users build them: the shipped config classes
with their defaults (``use_cache`` on, the default attention implementation), only sizes made small,
random weights (no download).

``ZOO[name] = Family(build, inputs, sites, causal_lm, note)``: ``build()`` returns the model in eval
mode, ``inputs(batch, length)`` a dict of keyword arguments with padding where the model takes an
attention mask, ``sites`` the number of attention sites, ``causal_lm`` whether ``generate()`` applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

import transformers as T

VOCAB = 96
H = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB)


@dataclass
class Family:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[int, int], Dict[str, torch.Tensor]]
    sites: int
    causal_lm: bool = False
    note: str = ""
    #: why the family does not work yet (its tests are expected to fail, strictly)
    gap: Optional[str] = None


def padding_mask(b: int, n: int, side: str = "right") -> torch.Tensor:
    """Rows 1.. of the batch are shorter than n (random lengths >= n/2), padded on ``side``."""
    am = torch.ones(b, n, dtype=torch.long)
    for row in range(1, b):
        keep = int(torch.randint(max(1, n // 2), n, (1,)))
        if side == "right":
            am[row, keep:] = 0
        else:
            am[row, :n - keep] = 0
    return am


def text(b, n, side="right"):
    return dict(input_ids=torch.randint(3, VOCAB, (b, n)), attention_mask=padding_mask(b, n, side))


def text_nomask(b, n):
    return dict(input_ids=torch.randint(3, VOCAB, (b, n)))


def seq2seq(b, n):
    d = text(b, n)
    d["decoder_input_ids"] = torch.randint(3, VOCAB, (b, max(2, n - 3)))
    return d


def image(b, n):
    return dict(pixel_values=torch.randn(b, 3, 16, 16))


def clip_inputs(b, n):
    d = text(b, n)
    d["pixel_values"] = torch.randn(b, 3, 16, 16)
    return d


def audio(b, n):
    return dict(input_features=torch.randn(b, 16, 32), decoder_input_ids=torch.randint(3, VOCAB, (b, max(2, n // 2))))


def _eval(m):
    return m.eval()


def _causal(cfg_cls, model_cls, **kw):
    def build():
        return _eval(model_cls(cfg_cls(**kw)))
    return build


_DEC = dict(H, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_GQA = dict(_DEC, num_key_value_heads=2)

ZOO: Dict[str, Family] = {
    "gpt2": Family(_causal(T.GPT2Config, T.GPT2LMHeadModel, n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB,
                           n_positions=128, bos_token_id=1, eos_token_id=2), text, 2, True),
    "llama": Family(_causal(T.LlamaConfig, T.LlamaForCausalLM, **_GQA), text, 2, True),
    "mistral": Family(_causal(T.MistralConfig, T.MistralForCausalLM, **_GQA, sliding_window=8), text, 2, True),
    "qwen2": Family(_causal(T.Qwen2Config, T.Qwen2ForCausalLM, **_GQA), text, 2, True),
    "qwen3": Family(_causal(T.Qwen3Config, T.Qwen3ForCausalLM, **_GQA, head_dim=16), text, 2, True),
    "gemma2": Family(_causal(T.Gemma2Config, T.Gemma2ForCausalLM, **_GQA, head_dim=16, sliding_window=8),
                     text, 2, True, "alternating sliding-window and global layers, logit soft-capping"),
    "gemma": Family(_causal(T.GemmaConfig, T.GemmaForCausalLM, **_GQA, head_dim=16), text, 2, True),
    "phi3": Family(_causal(T.Phi3Config, T.Phi3ForCausalLM, **_GQA), text, 2, True),
    "opt": Family(_causal(T.OPTConfig, T.OPTForCausalLM, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=128, word_embed_proj_dim=64,
                          pad_token_id=0, bos_token_id=1, eos_token_id=2), text, 2, True),
    "falcon": Family(_causal(T.FalconConfig, T.FalconForCausalLM, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2), text, 2, True),
    "gpt_neox": Family(_causal(T.GPTNeoXConfig, T.GPTNeoXForCausalLM, **_DEC), text, 2, True),
    "bloom": Family(_causal(T.BloomConfig, T.BloomForCausalLM, hidden_size=64, n_layer=2, n_head=4,
                            vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2), text, 2, True,
                    "alibi position bias added to the logits (baddbmm on (B*H, Nq, Nk) logits, softmax in 4-D)"),
    "bert": Family(lambda: _eval(T.BertModel(T.BertConfig(**H, max_position_embeddings=128))), text, 2),
    "roberta": Family(lambda: _eval(T.RobertaModel(T.RobertaConfig(**H, max_position_embeddings=130, pad_token_id=1))),
                      text, 2),
    "electra": Family(lambda: _eval(T.ElectraModel(T.ElectraConfig(
        embedding_size=32, **H, max_position_embeddings=128))), text, 2),
    "distilbert": Family(lambda: _eval(T.DistilBertModel(T.DistilBertConfig(
        dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB, max_position_embeddings=128))), text, 2),
    "modernbert": Family(lambda: _eval(T.ModernBertModel(T.ModernBertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=VOCAB,
        max_position_embeddings=128, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2))), text, 2,
        note="alternating local (window) and global layers"),
    "t5": Family(lambda: _eval(T.T5Model(T.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                                  vocab_size=VOCAB, decoder_start_token_id=0))), seq2seq, 6,
                 note="relative position bias added to the logits"),
    "bart": Family(lambda: _eval(T.BartModel(T.BartConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=128))), seq2seq, 6),
    "whisper": Family(lambda: _eval(T.WhisperModel(T.WhisperConfig(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16,
        max_target_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))),
        audio, 6),
    "vit": Family(lambda: _eval(T.ViTModel(T.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                     intermediate_size=128, image_size=16, patch_size=4))),
                  image, 2),
    "clip": Family(lambda: _eval(T.CLIPModel(T.CLIPConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                         vocab_size=VOCAB, max_position_embeddings=64),
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=16, patch_size=4), projection_dim=32))), clip_inputs, 4,
        note="causal text encoder with padding, vision encoder"),
}
