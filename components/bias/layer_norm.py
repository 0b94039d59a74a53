"""The l2 bias through a LayerNorm of the prediction over the value channels (TTT-linear)."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from miras.components.base import POSITIVE, Bias, GateDefaults, Range, gate_or, number

if TYPE_CHECKING:  # annotations only: sympy and torch are imported where used (components/base.py)
    import sympy as sp
    import torch

# Any real number: a LayerNorm's weight and bias.
REAL = Range()


class LayerNormBias(Bias):
    """The l2 loss of the prediction's LayerNorm over the value channels, with its affine weight
    and bias: TTT-linear's inner loss (Sun et al. 2024, arXiv:2407.04620, section 2.7).

    Equation: L = 1/2 ||LN(y) * w + b - v||^2,  LN(y)_j = (y_j - mu) / sqrt(sigma^2 + eps), mu and sigma^2 the mean and (biased) variance of y over its Dv channels

    Not elementwise: mu and sigma^2 are channel sums of y, so dL/dy couples the channels; the
    compiler derives it by the chain rule through those sums, nested as they are (the mean
    inside the variance, both inside the loss). The weight w and bias b sit inside the loss's
    sum, one per value channel: as gates they may come per channel, [B, T, H, Dv].
    """

    kind: Literal["layer_norm"] = "layer_norm"
    ln_weight: gate_or(REAL) = "gate"
    ln_bias: gate_or(REAL) = "gate"
    # eps inside sqrt(sigma^2 + eps): a constant prediction (sigma = 0) stays finite.
    ln_eps: number(POSITIVE) = 1e-6
    gateable: ClassVar[dict[str, Range]] = {"ln_weight": REAL, "ln_bias": REAL}
    gate_defaults: ClassVar[dict[str, GateDefaults]] = {
        "ln_weight": GateDefaults(start=1.0),
        "ln_bias": GateDefaults(start=0.0),
    }

    def expression(self) -> sp.Expr:
        """L = 1/2 sum_j (w_j (y_j - mu) / sqrt(sigma^2 + eps) + b_j - v_j)^2 with
        mu = sum_j y_j / Dv and sigma^2 = sum_j (y_j - mu)^2 / Dv: channel sums inside a
        channel sum (channel statistics, `miras.derive.symbols.channel_gradient`), the variance in two
        passes as torch's layer_norm takes it (E[y^2] - mu^2 would cancel where |mu| is far above
        sigma)."""
        import sympy as sp

        from miras.derive.symbols import ChannelSum, channels, gate_symbol, v, y

        w, b = gate_symbol("ln_weight"), gate_symbol("ln_bias")
        mean = ChannelSum(y) / channels
        variance = ChannelSum((y - mean) ** 2) / channels
        normed = (y - mean) / sp.sqrt(variance + sp.nsimplify(self.ln_eps))
        return ChannelSum((w * normed + b - v) ** 2) / 2

    def reference_loss(self, y, v, ln_weight=None, ln_bias=None, **scalars) -> torch.Tensor:
        """torch's layer_norm over the last axis (two-pass variance), then 1/2 ||. - v||^2:
        [..., Dv] -> [...]. The weight and bias: [..., 1] or [..., Dv] (or the fixed values)."""
        import torch

        w = self.ln_weight if ln_weight is None else ln_weight
        b = self.ln_bias if ln_bias is None else ln_bias
        normed = torch.nn.functional.layer_norm(y, y.shape[-1:], eps=self.ln_eps)
        return 0.5 * ((normed * w + b - v) ** 2).sum(-1)
