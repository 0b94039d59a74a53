"""The component catalogue: one dict per kind, name -> class. Print it to see everything.

Each component lives in `components/<kind>/<name>.py` (installed as `miras.components`).
"""

from miras.components.base import Bias, FeatureMap, Memory, Optimizer, Retention
from miras.components.bias.custom import CustomBias
from miras.components.bias.dot import DotBias
from miras.components.bias.huber import HuberBias
from miras.components.bias.l2 import L2Bias
from miras.components.bias.layer_norm import LayerNormBias
from miras.components.bias.lp import LpBias
from miras.components.bias.robust import RobustBias
from miras.components.feature_map.custom import CustomMap
from miras.components.feature_map.exp_kernel import ExpKernelMap
from miras.components.feature_map.identity import IdentityMap
from miras.components.feature_map.polynomial import PolynomialMap
from miras.components.feature_map.taylor import TaylorMap
from miras.components.memory.gated_mlp import GatedMLPMemory
from miras.components.memory.matrix import MatrixMemory
from miras.components.memory.mlp import MLPMemory
from miras.components.memory.nonparametric import NonparametricMemory
from miras.components.optimizer.exact import Exact
from miras.components.optimizer.gd import GD
from miras.components.optimizer.momentum import Momentum
from miras.components.optimizer.muon import Muon
from miras.components.optimizer.nesterov import Nesterov
from miras.components.optimizer.preconditioned import Preconditioned
from miras.components.optimizer.proximal import Proximal
from miras.components.retention.bregman import BregmanRetention
from miras.components.retention.elastic_net import ElasticNetRetention
from miras.components.retention.f_divergence import FDivergenceRetention
from miras.components.retention.kl import KLRetention
from miras.components.retention.l2 import L2Retention
from miras.components.retention.lq import LqRetention
from miras.components.retention.none import NoRetention

BIASES: dict[str, type[Bias]] = {
    "dot": DotBias,
    "l2": L2Bias,
    "lp": LpBias,
    "huber": HuberBias,
    "robust": RobustBias,
    "layer_norm": LayerNormBias,
    "custom": CustomBias,
}
RETENTIONS: dict[str, type[Retention]] = {
    "none": NoRetention,
    "l2": L2Retention,
    "lq": LqRetention,
    "kl": KLRetention,
    "elastic_net": ElasticNetRetention,
    "bregman": BregmanRetention,
    "f_divergence": FDivergenceRetention,
}
OPTIMIZERS: dict[str, type[Optimizer]] = {
    "gd": GD,
    "momentum": Momentum,
    "muon": Muon,
    "nesterov": Nesterov,
    "proximal": Proximal,
    "preconditioned": Preconditioned,
    "exact": Exact,
}
FEATURE_MAPS: dict[str, type[FeatureMap]] = {
    "identity": IdentityMap,
    "polynomial": PolynomialMap,
    "taylor": TaylorMap,
    "exp_kernel": ExpKernelMap,
    "custom": CustomMap,
}
MEMORIES: dict[str, type[Memory]] = {
    "matrix": MatrixMemory,
    "mlp": MLPMemory,
    "gated_mlp": GatedMLPMemory,
    "nonparametric": NonparametricMemory,
}

# Spec field -> the kinds it accepts.
CATALOGUE: dict[str, dict[str, type]] = {
    "memory": MEMORIES,
    "feature_map": FEATURE_MAPS,
    "bias": BIASES,
    "retention": RETENTIONS,
    "optimizer": OPTIMIZERS,
}
