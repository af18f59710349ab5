"""Tiny random-weight Hugging Face models, one per transformers family, built from the family's own config.

A family is one ``(registry, model_type)`` entry of transformers' auto mappings. Its model is the
registered class built from the family's own default config (``CONFIG_MAPPING[model_type]()``) with the
sizes shrunk by one generic rule (:func:`shrink`), applied recursively to sub-configs; :data:`OVERRIDES`
holds the few per-family settings the generic rule cannot reach. Weights are random (fixed seed), float32,
CPU, eval mode, the default attention implementation.

The registry sweep (``python -m attncomp zoo``, ``tests/zoo``) builds every family this way, and
``python -m attncomp report MODEL_TYPE`` builds one (:func:`find` picks its registry).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["REGISTRIES", "VOCAB", "TOKEN_LOW", "TOKEN_HIGH", "HIDDEN", "INTER", "MOE_INTER", "LAYERS", "HEADS",
           "HEAD_DIM", "POSITIONS", "WINDOW", "IMAGE", "PATCH", "IMAGE_WINDOW", "OVERRIDES", "registry", "families",
           "find", "shrink", "config_dict", "build", "forward_params", "padding_mask", "make_inputs"]

#: registry -> (mapping in transformers.models.auto.modeling_auto, the Auto class that builds its models)
REGISTRIES = {
    "causal-lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    "masked-lm": ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    "seq2seq": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    "image": ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
}

VOCAB = 128
#: input ids are drawn from [TOKEN_LOW, TOKEN_HIGH); special token ids at or above TOKEN_HIGH are moved to
#: the top of the shrunk vocabulary, so random text never contains image or other placeholder tokens
TOKEN_LOW, TOKEN_HIGH = 3, 96
HIDDEN, INTER, MOE_INTER, LAYERS, HEADS, HEAD_DIM = 64, 128, 32, 2, 4, 16
POSITIONS, WINDOW, IMAGE, PATCH, IMAGE_WINDOW = 128, 8, 32, 8, 4

_HIDDEN = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "word_embed_proj_dim", "model_dim", "d_embed",
           "embedding_size", "out_hidden_size", "hidden_dim", "attention_hidden_size", "emb_dim", "d_latents", "embedding_dim"}
_INTER = {"d_ff", "n_inner", "ffn_hidden_size", "ff_dim", "dim_feedforward", "intermediate_dim", "ffn_dim",
          "encoder_ffn_dim", "decoder_ffn_dim"}
_LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
           "num_decoder_layers", "num_encoder_layers", "depth", "num_hidden_blocks", "num_self_attends_per_block"}
_HEADS = {"num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads",
          "decoder_attention_heads"}
_KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv"}
_POSITIONS = {"n_positions", "n_ctx", "max_target_positions", "max_source_positions", "max_seq_len",
              "max_sequence_length"}
_WINDOWS = {"sliding_window", "attention_window", "local_attention", "sliding_window_size", "attention_chunk_size"}
_EXPERTS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
_EXPERTS_PER_TOKEN = {"num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k",
                      "num_experts_per_token"}
#: state-space layers: heads * head size must equal expand (2) * HIDDEN
_MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128, "mamba_d_state": 16, "mamba_chunk_size": 16,
          "mamba_dt_rank": 8, "time_step_rank": 8, "state_size": 16, "ssm_state_size": 16, "d_state": 16}


def registry(name: str) -> Dict[str, str]:
    """``model_type -> class name`` of one registry."""
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, REGISTRIES[name][0]))


def families(registries=tuple(REGISTRIES)) -> List[Tuple[str, str, str]]:
    """Every ``(registry, model_type, class name)`` of the given registries."""
    out = []
    for reg in registries:
        for mt, cls in registry(reg).items():
            out.append((reg, mt, cls if isinstance(cls, str) else cls[0]))
    return out


def find(model_type: str) -> Tuple[str, str]:
    """``(registry, class name)`` of a model type: sequence-to-sequence first, then masked LM (an encoder such as
    BERT is also registered as a causal LM), causal LM, image classification. ``KeyError`` when none lists it."""
    for reg in ("seq2seq", "masked-lm", "causal-lm", "image"):
        cls = registry(reg).get(model_type)
        if cls is not None:
            return reg, cls if isinstance(cls, str) else cls[0]
    raise KeyError(model_type)


def _is_config_dict(v) -> bool:
    return isinstance(v, dict) and "model_type" in v


_NOISE = ("_name_or_path", "transformers_version", "architectures", "output_attentions")


def _layer_index(i, n) -> bool:
    return (isinstance(i, int) or (isinstance(i, str) and i.isdigit())) and 0 <= int(i) < n


def _pick_layers(types: List[Any], n: int) -> List[int]:
    """Indices of ``n`` layers (at least one of every kind the list names, in order, first kinds first)."""
    seen, picked = set(), []
    for i, t in enumerate(types):
        key = repr(t)
        if key not in seen:
            seen.add(key)
            picked.append(i)
    for i in range(len(types)):
        if len(picked) >= n:
            break
        if i not in picked:
            picked.append(i)
    return sorted(picked[:max(n, len(seen))])


def shrink(d: Dict[str, Any]) -> Dict[str, Any]:
    """A config dict (``config.to_dict()``) with every size made small; sub-configs shrunk recursively."""
    d = dict(d)
    heads_are_lists = isinstance(d.get("num_heads"), (list, tuple)) or \
        isinstance(d.get("num_attention_heads"), (list, tuple))
    # per-layer lists (layer types, per-layer windows) keep one layer of every kind
    old_layers = next((d[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
                       if isinstance(d.get(k), int)), None)
    keep_idx = None
    if old_layers and old_layers > LAYERS:
        kinds = [v for k, v in sorted(d.items(), key=lambda kv: kv[0] != "layer_types")
                 if isinstance(v, list) and len(v) == old_layers and k.endswith(("types", "block_type"))]
        keep_idx = _pick_layers(kinds[0], LAYERS) if kinds else list(range(LAYERS))
    new_layers = len(keep_idx) if keep_idx else None
    old_heads = next((d[k] for k in _HEADS if isinstance(d.get(k), int)), None)
    # hierarchical vision models (widths and per-stage heads consistent as they are) and convolutional
    # networks (no heads) keep their widths
    keep_widths = heads_are_lists or (old_heads is None and ("num_channels" in d or "image_size" in d))
    for k in ("out_features", "out_indices", "stage_names"):
        d.pop(k, None)  # backbone stage lists: derived again from the shrunk depth
    for k, v in list(d.items()):
        if v is None and (k == "head_dim" or k in _KV_HEADS) and old_heads:
            # None means "derived" (hidden size / heads, as many KV heads as heads); some models read it as is
            d[k] = HEAD_DIM if k == "head_dim" else HEADS
            continue
        if _is_config_dict(v):
            d[k] = shrink(v)
            for noise in _NOISE:  # to_dict() of a sub-config has keys its class does not take back
                d[k].pop(noise, None)
            continue
        if k in ("id2label", "label2id", "rope_parameters", "rope_scaling"):
            continue
        if isinstance(v, list) and keep_idx is not None and len(v) == old_layers:
            d[k] = [v[i] for i in keep_idx]
            continue
        if isinstance(v, dict) and keep_idx is not None and v and all(_layer_index(i, old_layers) for i in v):
            # settings per layer index: those of the kept layers, renumbered
            d[k] = {type(i)(keep_idx.index(int(i))): s for i, s in v.items() if int(i) in keep_idx}
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            continue
        if k == "num_layers" and isinstance(d.get("depths"), (list, tuple)):
            continue  # the number of stages (len(depths)), not of layers
        if k in _LAYERS and v > LAYERS:
            d[k] = new_layers if (new_layers and k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers")) \
                else LAYERS
        elif keep_widths and (k in _HIDDEN or k in _INTER or k.endswith("intermediate_size") or k in _HEADS):
            continue
        elif k in _HIDDEN and v > HIDDEN:
            d[k] = HIDDEN
        elif (k in _INTER or k.endswith("intermediate_size")) and v > INTER:
            d[k] = MOE_INTER if ("moe" in k or "expert" in k) else INTER
        elif k in _HEADS and v > HEADS:
            d[k] = HEADS
        elif k in _MAMBA:
            d[k] = _MAMBA[k]
        elif k in _KV_HEADS and old_heads:
            d[k] = 1 if v == 1 else HEADS if v >= old_heads else 2
        elif k == "rotary_dim" and v > HEAD_DIM // 2:
            d[k] = HEAD_DIM // 2
        elif (k.endswith("head_dim") or k in ("d_kv", "kv_channels", "d_head")) and v > HEAD_DIM:
            d[k] = HEAD_DIM
        elif "shared_layers" in k and v > 0:
            d[k] = 0  # layers that reuse another layer's keys and values: none among 2 layers
        elif k.endswith("lora_rank") and v > 32:
            d[k] = 32
        elif k.endswith("vocab_size") and v > VOCAB:
            d[k] = VOCAB
        elif (k.endswith("max_position_embeddings") and not k.startswith("original")) or k in _POSITIONS:
            d[k] = min(v, POSITIONS) if v > 0 else v
        elif k in _WINDOWS and v > WINDOW:
            d[k] = WINDOW
        elif k == "window_size" and v > IMAGE_WINDOW:
            d[k] = IMAGE_WINDOW
        elif k == "image_size" and v > IMAGE:
            d[k] = IMAGE
        elif k == "patch_size" and v > PATCH:
            d[k] = PATCH
        elif k in _EXPERTS and v > 4:
            d[k] = 4
        elif k in _EXPERTS_PER_TOKEN and v > 2:
            d[k] = 2
        elif k == "num_latents" and v > 16:
            d[k] = 16
        elif k in ("n_group", "topk_group", "num_expert_group") and v > 1:
            d[k] = 1
        elif k == "query_pre_attn_scalar" and v > HEAD_DIM:
            d[k] = HEAD_DIM
    if isinstance(d.get("qk_nope_head_dim"), int) and isinstance(d.get("qk_rope_head_dim"), int) \
            and "qk_head_dim" in d:
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]  # multi-head latent attention
    if "depths" in d and isinstance(d["depths"], (list, tuple)):
        d["depths"] = [1] * len(d["depths"])
    for k in ("rope_parameters", "rope_scaling"):
        rp = d.get(k)
        if isinstance(rp, dict):
            d[k] = _shrink_rope(rp)
    return d


def _shrink_rope(rp: Dict[str, Any]) -> Dict[str, Any]:
    rp = dict(rp)
    for k, v in list(rp.items()):
        if isinstance(v, dict):
            rp[k] = _shrink_rope(v)
        elif k == "mrope_section" and isinstance(v, list):
            # the sections split the rotary half of a head: they must sum to HEAD_DIM // 2
            total, half = sum(v), HEAD_DIM // 2
            new = [max(1, math.floor(x * half / total)) for x in v]
            new[0] += half - sum(new)
            rp[k] = new
    return rp


def _remap_token_ids(d: Dict[str, Any], mapping: Dict[int, int]) -> Dict[str, Any]:
    """Special token ids at or above TOKEN_HIGH moved into [TOKEN_HIGH, VOCAB) (the same old id, the
    same new id); sub-configs too."""
    d = dict(d)

    def new_id(i):
        if not isinstance(i, int) or isinstance(i, bool) or i < TOKEN_HIGH:
            return i
        if i not in mapping:
            mapping[i] = VOCAB - 1 - len(mapping)
        return mapping[i]

    for k, v in list(d.items()):
        if _is_config_dict(v):
            d[k] = _remap_token_ids(v, mapping)
        elif k.endswith(("token_id", "token_index", "token_ids", "_token")) or k in ("pad_idx", "padding_idx"):
            d[k] = [new_id(i) for i in v] if isinstance(v, list) else new_id(v)
    return d


#: per-family config settings where the generic shrink cannot work (each says why); keyed by model type, or
#: by "registry/model_type" for one registry only
OVERRIDES: Dict[str, Dict[str, Any]] = {
    # the default configs leave the experts unset (None): no MoE layer can be built
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1),
    "deepseek_v2": dict(num_experts_per_tok=2, n_group=1, topk_group=1),
    # the default leaves layer_types unset and the model indexes it
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    # the defaults have no attention layer at all (every layer a Mamba layer): one attention layer of two
    "bamba": dict(attn_layer_indices=[1]),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # attention every 8th layer from layer 4 by default: none among 2 layers
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    # block types cycle recurrent, recurrent, attention: none among the first 2 layers
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # Mamba-2 heads: num_heads * head_dim must equal expand * hidden_size (2 * 64)
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    # the LM-head class asserts is_decoder (the masked-LM class asserts the opposite, the default)
    "causal-lm/reformer": dict(is_decoder=True),
    # axial position embeddings: their dims must sum to hidden_size, their shape multiply to the positions
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[8, 16]),
    # the stem is four stride-2 convolutions (16-pixel patches) whatever patch_size says
    "levit": dict(image_size=64, patch_size=16),
    # four stride-2 stages and a 2x2 unfold need more than 32 pixels
    "mobilevitv2": dict(image_size=64),
}


def config_dict(model_type: str, registry_name: str = "") -> Dict[str, Any]:
    """The family's default config as a dict, shrunk, with its overrides."""
    from transformers import CONFIG_MAPPING

    d = shrink(CONFIG_MAPPING[model_type]().to_dict())
    d = _remap_token_ids(d, {})
    d.update(OVERRIDES.get(model_type, {}))
    if registry_name:
        d.update(OVERRIDES.get(f"{registry_name}/{model_type}", {}))
    return d


def build(registry_name: str, model_type: str, class_name: Optional[str] = None):
    """The tiny model of a family, built as ``AutoModelFor...from_config`` builds it (a composite config
    gives its text config to a text-only class): ``(model, config)``, float32, eval mode, seed 0."""
    import transformers
    from transformers import CONFIG_MAPPING

    d = config_dict(model_type, registry_name)
    if class_name:
        d["architectures"] = [class_name]  # where the registry names several classes, the Auto class picks by it
    cfg = CONFIG_MAPPING[model_type].from_dict(d)
    auto = getattr(transformers, REGISTRIES[registry_name][1])
    torch.manual_seed(0)
    model = auto.from_config(cfg).float().eval()
    if hasattr(model, "set_default_language") and getattr(model.config, "languages", None):
        model.set_default_language(model.config.languages[0])  # X-MOD: one adapter per language, none by default
    if class_name and type(model).__name__ != class_name:
        raise TypeError(f"the registry names {class_name}, {auto.__name__} built {type(model).__name__}")
    return model, model.config


# ---------------------------------------------------------------------------------------------- inputs


def forward_params(model) -> List[str]:
    return list(inspect.signature(model.forward).parameters)


def padding_mask(b: int, n: int, side: str) -> torch.Tensor:
    """Row 0 full; rows 1.. shorter (lengths n - 5, n - 3, ...), padded on ``side``."""
    am = torch.ones(b, n, dtype=torch.long)
    for row in range(1, b):
        pad = min(n - 2, 5 - 2 * (row - 1) if row < 3 else row)
        pad = max(pad, 1)
        if side == "right":
            am[row, n - pad:] = 0
        else:
            am[row, :pad] = 0
    return am


def _image_size(cfg) -> Tuple[int, int]:
    """(channels, size) of the images the model takes."""
    for c in (cfg, getattr(cfg, "vision_config", None), getattr(cfg, "backbone_config", None)):
        if c is None:
            continue
        size = getattr(c, "image_size", None)
        if size is not None:
            size = size if isinstance(size, int) else (size[0] if isinstance(size, (list, tuple)) else
                                                        size.get("height", IMAGE))
            return getattr(c, "num_channels", 3), int(size)
    return getattr(cfg, "num_channels", 3), IMAGE


def make_inputs(registry_name: str, model, cfg, b: int, n: int, side: str, seed: int = 0):
    """``(kwargs, valid)``: the forward's inputs at batch ``b``, length ``n``, and a ``(b, n)`` bool
    tensor of the positions that attend to something (None for images)."""
    g = torch.Generator().manual_seed(seed)
    params = forward_params(model)
    if registry_name == "image" and "pixel_values" in params:
        c, s = _image_size(cfg)
        return dict(pixel_values=torch.randn(b, c, s, s, generator=g)), None
    ids = torch.randint(TOKEN_LOW, TOKEN_HIGH, (b, n), generator=g)
    key = "input_ids" if "input_ids" in params else "inputs" if "inputs" in params else "input_ids"
    x = {key: ids}
    valid = torch.ones(b, n, dtype=torch.bool)
    if "attention_mask" in params:
        am = padding_mask(b, n, side)
        x["attention_mask"] = am
        valid = am.bool()
    if "decoder_input_ids" in params and getattr(cfg, "is_encoder_decoder", False):
        x["decoder_input_ids"] = torch.randint(TOKEN_LOW, TOKEN_HIGH, (b, max(2, n - 3)), generator=g)
    return x, valid
