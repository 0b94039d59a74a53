"""miras models as transformers models (docs/hf.md).

    import miras.hf                    # registers model_type "miras" with the Auto classes
    model = miras.hf.MirasForCausalLM.from_spec("specs/deltanet.yaml", vocab_size=V)
    model.save_pretrained("out"); AutoModelForCausalLM.from_pretrained("out")

Needs the `hf` extra (`pip install miras[hf]`); `import miras` alone loads none of it.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from miras.hf.cache_miras import MirasCache, MirasLayerCache
from miras.hf.configuration_miras import MirasConfig
from miras.hf.modeling_miras import MirasForCausalLM, MirasModel, MirasPreTrainedModel

AutoConfig.register(MirasConfig.model_type, MirasConfig, exist_ok=True)
AutoModel.register(MirasConfig, MirasModel, exist_ok=True)
AutoModelForCausalLM.register(MirasConfig, MirasForCausalLM, exist_ok=True)

__all__ = [
    "MirasCache",
    "MirasConfig",
    "MirasForCausalLM",
    "MirasLayerCache",
    "MirasModel",
    "MirasPreTrainedModel",
]
