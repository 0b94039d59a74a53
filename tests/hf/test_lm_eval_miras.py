"""lm-evaluation-harness on a saved MirasForCausalLM: `lm_eval.simple_evaluate` with
`model="hf"`, `pretrained=DIR` (after `import miras.hf`, which registers model_type "miras"),
on a multiple-choice task written here (a local JSONL, no download). The harness's
loglikelihoods equal the model's own log-probabilities of each continuation."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("tokenizers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("lm_eval", reason="the hf extra: pip install -e '.[hf]'")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import miras.hf  # noqa: F401  registers the Auto classes the harness loads through
from miras.hf import MirasForCausalLM

pytestmark = pytest.mark.usefixtures("one_thread")

DOCS = [
    {"question": "The cat sat on the", "choices": [" mat", " moon"], "gold": 0},
    {"question": "One, two,", "choices": [" three", " banana", " four"], "gold": 0},
]
TASK = """\
task: miras_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
metric_list:
  - metric: acc
"""


def byte_level_tokenizer(text: str) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def own_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the tokens split as the harness splits them."""
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    n = len(tokenizer(context, add_special_tokens=False).input_ids)
    ids = torch.tensor([whole])
    with torch.no_grad():
        logp = model(ids, use_cache=False).logits.log_softmax(-1)[0]
    return sum(float(logp[t - 1, whole[t]]) for t in range(n, len(whole)))


@pytest.mark.slow  # 13 to 24 s on a 2-core CPU, most of it importing the harness
def test_lm_eval_loglikelihoods_equal_the_models_own(tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    text = " ".join(d["question"] + c for d in DOCS for c in d["choices"]) * 4
    tokenizer = byte_level_tokenizer(text)
    torch.manual_seed(0)
    model = MirasForCausalLM.from_spec(
        "specs/gated_deltanet.yaml", len(tokenizer), d_model=16, n_heads=2, n_layers=1
    ).double()
    out = tmp_path / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out},dtype=float64,backend=causal",
        tasks=["miras_tiny_choice"],
        task_manager=TaskManager(include_path=str(tasks)),
        batch_size=1,
        device="cpu",
        log_samples=True,
    )
    samples = results["samples"]["miras_tiny_choice"]
    assert len(samples) == len(DOCS)
    loaded = MirasForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    for sample in samples:
        doc = sample["doc"]
        harness = [float(r[0][0]) for r in sample["resps"]]
        own = [own_loglikelihood(loaded, tokenizer, doc["question"], c) for c in doc["choices"]]
        assert harness == pytest.approx(own, rel=1e-9, abs=1e-9)
    assert "acc,none" in results["results"]["miras_tiny_choice"]


@pytest.mark.slow  # a fresh interpreter imports the harness: 15 to 40 s
def test_the_plain_lm_eval_command_loads_a_saved_model_with_trust_remote_code(tmp_path):
    """No `import miras.hf` in the harness's process: config.json's auto_map names
    miras_hf.py, which imports the classes from the installed miras."""
    import os
    import subprocess
    import sys

    text = " ".join(d["question"] + c for d in DOCS for c in d["choices"]) * 4
    tokenizer = byte_level_tokenizer(text)
    torch.manual_seed(0)
    model = MirasForCausalLM.from_spec(
        "specs/deltanet.yaml", len(tokenizer), d_model=16, n_heads=2, n_layers=1
    )
    out = tmp_path / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK.format(data=data))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
            f"pretrained={out},trust_remote_code=True,backend=causal", "--tasks",
            "miras_tiny_choice", "--include_path", str(tmp_path / "tasks"), "--device", "cpu",
            "--batch_size", "1",
        ],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "miras_tiny_choice" in done.stdout and "acc" in done.stdout
