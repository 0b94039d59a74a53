"""Models built from specs: the memory layer, softmax mixers, hybrids and the language model.

model = build_model(spec, vocab_size)   # the spec's `model:` section picks sizes and variant
logits = model(tokens)                  # [B, T] -> [B, T, V]
"""

from miras.models.hybrid import MAC, MAG, MAL, GatedSum
from miras.models.layer import GateMaps, LearnedState, MirasLayer, ShortConv
from miras.models.mixers import Attention
from miras.models.model import Block, LanguageModel, SwiGLU, build_mixer, build_model

__all__ = [
    "MAC",
    "MAG",
    "MAL",
    "Attention",
    "Block",
    "GateMaps",
    "GatedSum",
    "LanguageModel",
    "LearnedState",
    "MirasLayer",
    "ShortConv",
    "SwiGLU",
    "build_mixer",
    "build_model",
]
