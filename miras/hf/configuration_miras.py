"""MirasConfig: a transformers config that holds a miras spec, so a saved directory is
self-contained.

    config.json: {"model_type": "miras", "spec": "<the spec's YAML text, without model:>",
                  "model": {<the resolved model section: d_model, n_layers, variant, ...>},
                  "vocab_size": V, ...}

The spec text is parsed by `miras.spec.load_spec` (YAML data, never Python) when the model is
built; `model` is the spec's `model:` section with every field filled in (docs/models.md).
"""

from __future__ import annotations

from typing import Any

import yaml
from transformers import PretrainedConfig

from miras.spec import Spec, load_spec


class MirasConfig(PretrainedConfig):
    """The spec (`spec`: YAML text of everything but its `model:` section), the model section
    (`model`: a dict) and the vocabulary size. `hidden_size`, `num_hidden_layers` and
    `num_attention_heads` mirror the model section for tools that read them."""

    model_type = "miras"
    keys_to_ignore_at_inference = ["past_key_values"]

    spec: str = ""
    model: dict | None = None
    vocab_size: int = 256
    tie_word_embeddings: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if self.spec:
            resolved = self.miras_spec()  # a bad spec fails here, naming its field
            self.model = resolved.model.model_dump()
            self.hidden_size = resolved.model.d_model
            self.num_hidden_layers = resolved.model.n_layers
            self.num_attention_heads = resolved.model.n_heads
        super().__post_init__(**kwargs)

    @classmethod
    def from_spec(cls, spec: Spec | str | dict, vocab_size: int, **model_overrides) -> MirasConfig:
        """The config of `spec` (a path, YAML text, a dict or a Spec) for `vocab_size` tokens,
        with `model_overrides` (fields of the `model:` section: d_model=32, n_layers=1, ...)
        on top of the spec's own model section."""
        data = yaml.safe_load(load_spec(spec).to_yaml())
        model = {**data.pop("model", {}), **model_overrides}
        return cls(spec=yaml.safe_dump(data, sort_keys=False), model=model, vocab_size=vocab_size)

    def miras_spec(self) -> Spec:
        """The spec with this config's model section: validated, a `SpecError` naming any bad
        field (of the spec text or of `model`)."""
        if not isinstance(self.spec, str) or not self.spec.strip():
            raise ValueError("MirasConfig.spec: expected the spec's YAML text, got nothing")
        data: Any = yaml.safe_load(self.spec)
        if not isinstance(data, dict):
            raise ValueError(
                f"MirasConfig.spec: expected a YAML mapping, got {type(data).__name__}"
            )
        if self.model is not None:
            if not isinstance(self.model, dict):
                raise ValueError(
                    f"MirasConfig.model: expected a mapping of model fields, got "
                    f"{type(self.model).__name__}"
                )
            data = {**data, "model": {**data.get("model", {}), **self.model}}
        return load_spec(data)
