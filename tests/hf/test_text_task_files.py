"""The text task on local files (plain text, JSONL, parquet, read by datasets with streaming)
with a byte-level BPE trained on the training split or a saved tokenizer directory;
perplexity and bits per byte; the run directory keeps the tokenizer and export-hf carries it.
The shipped pydoc corpus in bytes stays the default."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers", reason="the hf extra: pip install -e '.[hf]'")
pytest.importorskip("datasets", reason="the hf extra: pip install -e '.[hf]'")

import miras.hf
from miras.cli import app
from miras.tasks import make_task
from miras.tasks.text import BYTES

WORDS = "the quick brown fox jumps over the lazy dog while memory layers learn at test time"


def documents(n: int) -> list[str]:
    return [f"{i}: " + " ".join(WORDS.split()[i % 5 :] + WORDS.split()[: i % 5]) for i in range(n)]


@pytest.fixture
def corpus_files(tmp_path):
    docs = documents(60)
    (tmp_path / "a.txt").write_text("\n".join(docs[:20]))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[20:40]))
    pd.DataFrame({"body": docs[40:]}).to_parquet(tmp_path / "c.parquet")
    return [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet")], docs


def test_files_in_bytes_hold_every_documents_text(corpus_files):
    files, docs = corpus_files
    task = make_task("text", files=files, text_field="body", seq_len=16)
    assert task.vocab_size == BYTES
    source = task.source()
    text = bytes(source.train.astype("uint8")) + bytes(source.valid.astype("uint8"))
    for doc in docs:
        assert doc.encode() in text
    batch = task.batch("valid", 0, 4)
    for row in range(4):
        window = bytes(batch.inputs[row].tolist() + batch.labels[row, -1:].tolist())
        assert window in bytes(source.valid.astype("uint8"))


def test_a_bpe_trained_on_the_training_split_tokenizes_and_reports_bits_per_byte(corpus_files):
    files, _ = corpus_files
    task = make_task("text", files=files, text_field="body", tokenizer="bpe", bpe_vocab=300)
    source = task.source()
    assert task.vocab_size == len(source.tokenizer) <= 300
    assert source.tokens_per_byte < 1  # merges: fewer tokens than bytes
    decoded = source.tokenizer.decode(source.valid.tolist())
    assert WORDS.split()[3] in decoded
    labels = task.batch("valid", 0, 4).labels
    uniform = task.metrics(torch.zeros(*labels.shape, task.vocab_size), labels)
    assert uniform["perplexity"] == pytest.approx(task.vocab_size, rel=1e-5)
    expected = math.log2(task.vocab_size) * source.tokens_per_byte
    assert uniform["bits_per_byte"] == pytest.approx(expected, rel=1e-5)


def test_a_tokenizer_directory_gives_the_same_tokens(corpus_files, tmp_path):
    files, _ = corpus_files
    bpe = make_task("text", files=files, text_field="body", tokenizer="bpe", bpe_vocab=300)
    bpe.save_files(tmp_path / "run")
    again = make_task(
        "text", files=files, text_field="body", tokenizer=str(tmp_path / "run" / "tokenizer")
    )
    assert again.vocab_size == bpe.vocab_size
    assert (again.source().valid == bpe.source().valid).all()


def test_a_run_keeps_its_tokenizer_and_export_hf_carries_it(corpus_files, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    files, _ = corpus_files
    task = make_task(
        "text", files=files, text_field="body", tokenizer="bpe", bpe_vocab=300, seq_len=16
    )
    spec = {"name": "tiny", "model": {"d_model": 16, "n_heads": 2, "n_layers": 1}}
    run = tmp_path / "run"
    miras.train(spec, task, steps=2, batch_size=4, eval_batches=1, progress=False, out_dir=run)
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    result = CliRunner().invoke(app, ["export-hf", str(run), str(tmp_path / "hf")])
    assert result.exit_code == 0, result.output
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert len(tokenizer) == model.config.vocab_size == task.vocab_size


def test_the_default_is_still_pydoc_in_bytes_with_the_same_options():
    task = make_task("text", seq_len=32)
    assert task.vocab_size == BYTES and task.source() is None
    assert task.options() == {"seq_len": 32, "valid_fraction": 0.1, "seed": 0}


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"files": ["nowhere.txt"]}, ["nowhere.txt", "no such file"]),
        ({"files": ["data.csv"]}, ["data.csv", ".jsonl", ".parquet"]),
        ({"tokenizer": "no-such-dir"}, ["tokenizer", "'bpe'", "directory"]),
    ],
    ids=["missing", "suffix", "tokenizer"],
)
def test_bad_sources_name_the_option(options, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        make_task("text", **options)
    for word in words:
        assert word in str(err.value)


def test_a_jsonl_row_without_the_field_is_named(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"content": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"row 0 has no text field 'text'"):
        make_task("text", files=[str(path)])
