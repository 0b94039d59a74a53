"""The training step of Zoology's small MQAR models: miras against the same model in plain torch.

    .venv/bin/python benchmarks/train_step.py                     # the default grid, 1 thread
    .venv/bin/python benchmarks/train_step.py --models deltanet --d-model 64 --seq-len 64 \
        --batch 64 --repeats 7

Zoology trains small models (d_model 64 to 128, 2 layers, T 64 to 256, batch 64 to 256) many
times over (a learning-rate sweep per model and state size), so the step time decides how many
runs a protocol affords on a CPU. For each model and shape this times one AdamW step (forward,
backward, update) of

- **miras**: `build_model(spec)`, the spec's layer with its compiled rule (chunk backend,
  execution form "auto": exact for these affine rules), and
- **plain**: the same architecture written directly in torch (`PlainLM` below): the same
  parameters, copied from the miras model, with the memory written out by hand: causal
  linear attention as one masked product, the delta rule in its chunked UT form (one batched
  triangular solve per chunk, the state carried across chunks).

Before timing, both models run the same batch and their losses must agree to 1e-5 (relative):
the plain model is the same model, not a look-alike. The two are timed interleaved (plain,
miras, plain, miras, ...), each figure the median of `--repeats` steps, with the load average
printed at the start and the end; a ratio measured while the load average exceeded the threads
in use is marked `shared`. Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from miras.models import build_model
from miras.tasks import make_task
from miras.training.recipe import loss_of

ROOT = Path(__file__).resolve().parents[1]
SPECS = {
    "linear_attention": "specs/linear_attention.yaml",
    "deltanet": "specs/deltanet.yaml",
}


# The plain model ------------------------------------------------------------------------------


def linear_attention_core(q, k, v, lr, w0):
    """W_t = W_{t-1} + v_t k_t^T, o_t = W_t q_t: o = tril(Q K^T) V + Q W0^T.
    q, k [B, H, T, Dk], v [B, H, T, Dv], w0 [B, H, Dv, Dk] -> o [B, H, T, Dv]."""
    scores = (q @ k.transpose(-1, -2)).tril()  # [B, H, T, T], the read after the write
    return scores @ v + q @ w0.transpose(-1, -2)


def delta_rule_core(q, k, v, lr, w0, chunk: int = 64):
    """W_t = W_{t-1} - b_t (W_{t-1} k_t - v_t) k_t^T, o_t = W_t q_t, in the chunked UT form:
    per chunk U = (I + tril(diag(b) K K^T, -1))^{-1} diag(b) (V - K S), S <- S + K^T U, with
    S = W^T [B, H, Dk, Dv]. q, k [B, H, T, Dk], v [B, H, T, Dv], lr [B, H, T]."""
    t = k.shape[2]
    n = -(-t // chunk)
    pad = n * chunk - t
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        lr = F.pad(lr, (0, pad))
    q, k, v = (x.unflatten(2, (n, chunk)) for x in (q, k, v))  # [B, H, N, C, D]
    lr = lr.unflatten(2, (n, chunk)).unsqueeze(-1)  # [B, H, N, C, 1]
    kk = (lr * k) @ k.transpose(-1, -2)  # [B, H, N, C, C]
    system = torch.eye(chunk, dtype=k.dtype) + kk.tril(-1)
    inverse = torch.linalg.solve_triangular(
        system, torch.eye(chunk, dtype=k.dtype).expand_as(system), upper=False, unitriangular=True
    )
    w = inverse @ (lr * k)  # U = w_v - w S per chunk: [B, H, N, C, Dk]
    u0 = inverse @ (lr * v)  # [B, H, N, C, Dv]
    qk = (q @ k.transpose(-1, -2)).tril()  # [B, H, N, C, C], inclusive
    s = w0.transpose(-1, -2)  # [B, H, Dk, Dv]
    out = []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ s
        out.append(q[:, :, i] @ s + qk[:, :, i] @ u)
        s = s + k[:, :, i].transpose(-1, -2) @ u
    return torch.stack(out, 2).flatten(2, 3)[:, :, :t]


CORES = {"linear_attention": linear_attention_core, "deltanet": delta_rule_core}


class PlainMixer(nn.Module):
    """MirasLayer's layout written out: qkv projection, short causal conv + SiLU, l2-normalized
    q and k, the low-rank learning-rate gate (sigmoid), the memory, per-head RMSNorm, SiLU output
    gate, output projection. Parameter names equal MirasLayer's, so its weights load as they are."""

    def __init__(self, core, d_model: int, n_heads: int, conv: int, rank: int, gated: bool):
        super().__init__()
        self.core, self.h, self.dh, self.size = core, n_heads, d_model // n_heads, conv
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.conv = nn.Module()
        self.conv.weight = nn.Parameter(torch.empty(3 * d_model, 1, conv))
        self.conv.bias = nn.Parameter(torch.zeros(3 * d_model))
        if gated:
            self.gates = nn.Module()
            self.gates.down = nn.Linear(d_model, rank, bias=False)
            self.gates.up = nn.Linear(rank, n_heads)
        self.gated = gated
        self.out_norm = nn.RMSNorm(self.dh, eps=1e-6)
        self.out_gate = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.state0 = nn.Module()
        self.state0.learned = nn.ParameterDict(
            {"W": nn.Parameter(torch.zeros(1, n_heads, self.dh, self.dh))}
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        y = F.conv1d(
            F.pad(self.qkv(x).transpose(1, 2), (self.size - 1, 0)),
            self.conv.weight,
            self.conv.bias,
            groups=self.conv.weight.shape[0],
        )
        q, k, v = F.silu(y).unflatten(1, (3, self.h, self.dh)).unbind(1)  # [B, H, Dh, T]
        q, k, v = (z.transpose(-1, -2) for z in (q, k, v))  # [B, H, T, Dh]
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        lr = torch.sigmoid(self.gates.up(self.gates.down(x))).transpose(1, 2) if self.gated else 1
        w0 = self.state0.learned["W"].expand(b, -1, -1, -1)
        o = self.core(q, k, v, lr, w0)  # [B, H, T, Dh]
        o = self.out_norm(o).transpose(1, 2).flatten(-2)
        return self.out_proj(o * F.silu(self.out_gate(x)))


class PlainLM(nn.Module):
    """The LanguageModel's layout (pre-norm blocks, SwiGLU, tied head) around PlainMixer."""

    def __init__(self, name: str, reference: nn.Module):
        super().__init__()
        config = reference.spec.model
        d, h = config.d_model, config.n_heads
        gated = bool(reference.blocks[0].mixer.rule.plan.gates)
        self.embed = nn.Embedding(reference.vocab_size, d)
        self.blocks = nn.ModuleList()
        for ref in reference.blocks:
            block = nn.Module()
            block.mixer_norm, block.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
            block.mixer = PlainMixer(CORES[name], d, h, config.conv_size, config.gate_rank, gated)
            block.mlp = type(ref.mlp)(d, config.mlp_expansion)
            self.blocks.append(block)
        self.norm = nn.RMSNorm(d)
        self.load_state_dict(reference.state_dict())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block.mixer(block.mixer_norm(x))
            x = x + block.mlp(block.mlp_norm(x))
        return self.norm(x) @ self.embed.weight.T


# Timing ---------------------------------------------------------------------------------------


def make_models(name: str, d_model: int, vocab: int, seed: int):
    raw = yaml.safe_load((ROOT / SPECS[name]).read_text())
    raw.setdefault("model", {}).update(d_model=d_model, n_layers=2, n_heads=d_model // 16)
    torch.manual_seed(seed)
    miras_model = build_model(raw, vocab)
    return miras_model, PlainLM(name, miras_model)


def stepper(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        loss = loss_of(model(inputs), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    return step


def agree(miras_model, plain_model, inputs, labels) -> float:
    with torch.no_grad():
        a = loss_of(miras_model(inputs), labels).item()
        b = loss_of(plain_model(inputs), labels).item()
    error = abs(a - b) / abs(a)
    if error > 1e-5:
        raise SystemExit(f"the plain model is not the same model: loss {a} vs {b}")
    return error


def measure(name: str, d_model: int, seq_len: int, batch: int, repeats: int, vocab: int) -> dict:
    task = make_task("mqar", vocab_size=vocab, seq_len=seq_len, num_pairs=seq_len // 4, seed=0)
    data = task.batch("train", 0, batch)
    miras_model, plain_model = make_models(name, d_model, vocab, seed=0)
    error = agree(miras_model, plain_model, data.inputs, data.labels)
    steps = {
        "plain": stepper(plain_model, data.inputs, data.labels),
        "miras": stepper(miras_model, data.inputs, data.labels),
    }
    for step in steps.values():  # warm-up: allocator, first-call work
        step()
        step()
    times: dict[str, list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            times[key].append(step())
    median = {key: statistics.median(value) for key, value in times.items()}
    tokens = batch * seq_len
    return {
        "model": name,
        "d_model": d_model,
        "T": seq_len,
        "batch": batch,
        "loss_agreement": error,
        "plain_tok_s": tokens / median["plain"],
        "miras_tok_s": tokens / median["miras"],
        "ratio": median["plain"] / median["miras"],  # > 1: miras is faster
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(SPECS), choices=list(SPECS))
    p.add_argument("--d-model", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-len", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batch", type=int, nargs="+", default=[64])
    p.add_argument("--vocab", type=int, default=8192, help="Zoology's 8192 by default")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    start_load = os.getloadavg()[0]
    print(f"load average at start {start_load:.2f}; {args.threads} torch thread(s)")
    header = f"{'model':17} {'d':>4} {'T':>4} {'B':>4} {'plain tok/s':>12} {'miras tok/s':>12} {'miras/plain':>11}"
    print(header)
    rows = []
    for name, d, t, b in itertools.product(args.models, args.d_model, args.seq_len, args.batch):
        before = os.getloadavg()[0]
        row = measure(name, d, t, b, args.repeats, args.vocab)
        shared = max(before, os.getloadavg()[0]) > args.threads + 1
        rows.append(row)
        print(
            f"{name:17} {d:>4} {t:>4} {b:>4} {row['plain_tok_s']:>12,.0f} "
            f"{row['miras_tok_s']:>12,.0f} {row['ratio']:>10.2f}x" + ("  shared" if shared else "")
        )
    geo = math.exp(statistics.fmean(math.log(r["ratio"]) for r in rows))
    print(f"geometric mean miras/plain tokens/s: {geo:.2f}x")
    print(f"load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
