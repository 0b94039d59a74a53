"""bf16 and fp16 through the bridge, each against float32 (docs/hf.md, "Dtypes").

A model cast to bf16 or fp16 runs its projections, norms, MLPs and head in that dtype and its
memory in float32 (gates, the rule's inputs, the memory state). Tolerance of a half model's
logits against the float32 model's with the same weights: 2 eps(dtype) times the largest
float32 logit (eps 2^-7 for bf16, 2^-10 for fp16); the largest measured was 1.07 eps times it
(atlas in fp16, its generated sequence scored by the float32 model). Mixed-precision training (bf16 autocast through the Trainer; fp16
autocast with a gradient scaler, which accelerate does not apply on a CPU) ends within 0.05
nats of float32 training on the same batches.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")

from tests.hf.hf_models import build, tokens

pytestmark = pytest.mark.usefixtures("one_thread")

HALF = [torch.bfloat16, torch.float16]
HALF_IDS = ["bf16", "fp16"]
# The dual form, the chunk-start form, the exact chunk form.
SPECS = ["specs/titans.yaml", "specs/atlas.yaml", "specs/gated_deltanet.yaml"]
LENGTH = 11  # chunk size 4: two chunks and a partial one


def assert_near_float32(got: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype):
    """|got - reference| <= 2 eps(dtype) max|reference| everywhere."""
    bound = 2 * torch.finfo(dtype).eps * reference.abs().max().item()
    error = (got.float() - reference.float()).abs().max().item()
    assert error <= bound, f"{dtype}: max error {error:.3g} above {bound:.3g}"


def tensors(state) -> list[tuple[str, torch.Tensor]]:
    if isinstance(state, dict):
        return [(f"{k}.{n}", t) for k, v in state.items() for n, t in tensors(v)]
    return [("", state)]


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("path", SPECS)
def test_a_half_model_forward_is_near_float32_with_its_memory_in_float32(path, dtype):
    reference = build(path, {}, torch.float32)
    model = build(path, {}, dtype)  # the same weights (the same seed), cast
    ids = tokens(2, LENGTH, seed=3)
    with torch.no_grad():
        expected = reference(ids).logits
        out = model(ids, use_cache=True)
    assert out.logits.dtype == dtype
    assert_near_float32(out.logits, expected, dtype)
    layer = model.model.lm.blocks[0].mixer
    for name, t in tensors(out.past_key_values.layers[0].state["memory"]):
        assert t.dtype == torch.float32, name  # the state after two whole chunks
    if layer.chunk_follows_boundaries:
        assert out.past_key_values.layers[0].state["pending"]["q"].dtype == torch.float32
    x = torch.randn(1, 3, layer.d_model).to(dtype)
    assert {g.dtype for g in layer.gates(x).values()} <= {torch.float32}


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("path", SPECS)
def test_half_greedy_generate_is_its_uncached_run_and_near_float32(path, dtype):
    """Cached and uncached greedy generate pick the same tokens, their logits within the
    tolerance of each other; the float32 model scores the generated sequence within it."""
    reference = build(path, {}, torch.float32)
    model = build(path, {}, dtype)  # the same weights (the same seed), cast
    ids = tokens(2, 6, seed=4)
    runs = [
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            use_cache=use_cache,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        for use_cache in (True, False)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    # [B, 8, V]; generate hands its logits back in float32 (cast from the model's dtype).
    cached, uncached = (torch.stack(run.logits, dim=1) for run in runs)
    assert_near_float32(cached, uncached, dtype)
    with torch.no_grad():
        scored = reference(runs[0].sequences[:, :-1]).logits[:, ids.shape[1] - 1 :]
    assert_near_float32(cached, scored, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_a_half_model_saves_and_reloads_in_its_dtype(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = build("specs/atlas.yaml", {}, dtype)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert {p.dtype for p in [*loaded.parameters(), *loaded.buffers()]} == {dtype}
    as_float = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = tokens(2, LENGTH, seed=5)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        assert torch.equal(as_float(ids).logits, model.float()(ids).logits)


# Mixed-precision training -------------------------------------------------------------------

STEPS = 40


def text_model(task):
    from miras.hf import MirasForCausalLM

    torch.manual_seed(0)
    return MirasForCausalLM.from_spec(
        "specs/titans.yaml", task.vocab_size, d_model=32, n_heads=2, n_layers=1
    )


def valid_loss(model, held_out) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(held_out, labels=held_out, use_cache=False).loss)


def projection_dtypes(model) -> set[torch.dtype]:
    """Records the output dtype of the first memory layer's q, k, v projection."""
    seen: set[torch.dtype] = set()
    layer = model.model.lm.blocks[0].mixer
    layer.qkv.register_forward_hook(lambda module, args, out: seen.add(out.dtype))
    return seen


def test_trainer_in_bf16_mixed_precision_tracks_float32(tmp_path):
    from transformers import Trainer, TrainingArguments

    from miras.tasks import make_task
    from tests.hf.test_trainer_miras import TaskWindows

    task = make_task("text", seq_len=32)
    held_out = task.batch("valid", 0, 8).inputs
    losses, seen = {}, {}
    for bf16 in (False, True):
        model = text_model(task)
        before = valid_loss(model, held_out)
        seen[bf16] = projection_dtypes(model)
        args = TrainingArguments(
            output_dir=str(tmp_path / f"bf16-{bf16}"), max_steps=STEPS,
            per_device_train_batch_size=8, learning_rate=3e-3, warmup_steps=0,
            save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0, seed=0,
            bf16=bf16, disable_tqdm=True,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=TaskWindows(task, 8 * STEPS)).train()
        losses[bf16] = valid_loss(model, held_out)
        assert next(model.parameters()).dtype == torch.float32  # master weights
    assert seen[True] >= {torch.bfloat16} and seen[False] == {torch.float32}
    print(f"valid loss {before:.3f} -> float32 {losses[False]:.4f}, bf16 {losses[True]:.4f}")
    assert losses[True] < before - 0.5
    assert abs(losses[True] - losses[False]) < 0.05


def test_fp16_mixed_precision_training_with_a_scaler_tracks_float32():
    """accelerate applies fp16 mixed precision only on an accelerator (on a CPU the Trainer's
    fp16=True runs float32), so this runs what it would: fp16 autocast and a gradient
    scaler, with the Trainer's defaults (gradients clipped to norm 1 after unscaling, the
    learning rate decaying linearly to 0), on the CPU, against the same loop in float32.
    (Without the clipping and the decay this short run is chaotic: float32 and fp16 ended
    0.19 nats apart, float32 and bf16 0.035.)"""
    from miras.tasks import make_task

    task = make_task("text", seq_len=32)
    held_out = task.batch("valid", 0, 8).inputs
    losses, seen = {}, {}
    for fp16 in (False, True):
        model = text_model(task)
        before = valid_loss(model, held_out)
        seen[fp16] = projection_dtypes(model)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / STEPS)
        scaler = torch.amp.GradScaler("cpu", enabled=fp16)
        for step in range(STEPS):
            batch = task.batch("train", step, 8).inputs
            with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
                loss = model(batch, labels=batch, use_cache=False).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            schedule.step()
        losses[fp16] = valid_loss(model, held_out)
    assert seen[True] >= {torch.float16} and seen[False] == {torch.float32}
    print(f"valid loss {before:.3f} -> float32 {losses[False]:.4f}, fp16 {losses[True]:.4f}")
    assert losses[True] < before - 0.5
    assert abs(losses[True] - losses[False]) < 0.05
