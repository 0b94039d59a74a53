"""The text task's own corpus and tokenizer: local files read through `datasets` (streamed, so
a large file is read only up to `max_bytes`), tokenized by bytes, by a transformers tokenizer
directory, or by a byte-level BPE trained with `tokenizers` on the training split.

    source = text_source(("a.jsonl", "b.txt"), "text", "bpe", 4096, 1 << 28, 0.1)
    source.train, source.valid     # int32 token ids [N] of each split
    source.tokens_per_byte         # of the validation split (bits per byte)
    source.tokenizer               # a PreTrainedTokenizerFast, or None for bytes

Files by suffix: .txt / .text / .md (plain text, read line by line), .jsonl / .json (one JSON
object a line, its `text_field`), .parquet (a column `text_field`). Documents are joined by a
blank line; the last `valid_fraction` of the text's characters is the validation split. These
need the `hf` extra (datasets, tokenizers, transformers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

BUILDERS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "json", ".json": "json"}
BUILDERS[".parquet"] = "parquet"
SEPARATOR = "\n\n"
END_OF_TEXT = "<|endoftext|>"


@dataclass(frozen=True)
class TextSource:
    train: np.ndarray  # [N_train] int32 token ids
    valid: np.ndarray  # [N_valid]
    tokens_per_byte: float  # of the validation split
    tokenizer: Any  # a transformers tokenizer, None for bytes

    @property
    def vocab_size(self) -> int:
        return 256 if self.tokenizer is None else len(self.tokenizer)


def read_text(files: tuple[str, ...], text_field: str, max_bytes: int) -> str:
    """The files' documents joined by blank lines, up to about `max_bytes` of UTF-8."""
    from datasets import load_dataset

    documents: list[str] = []
    size = 0
    for name in files:
        path = Path(name)
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            allowed = ", ".join(sorted(BUILDERS))
            raise ValueError(f"files: {name}: expected one of the suffixes {allowed}")
        if not path.is_file():
            raise ValueError(f"files: {name}: no such file")
        rows = load_dataset(builder, data_files=[str(path)], split="train", streaming=True)
        field = "text" if builder == "text" else text_field
        lines = []
        for i, row in enumerate(rows):
            if field not in row or not isinstance(row[field], str):
                raise ValueError(
                    f"files: {name}: row {i} has no text field {field!r} (text_field); "
                    f"its fields: {sorted(row)}"
                )
            lines.append(row[field])
            size += len(row[field].encode("utf-8")) + 1
            if size >= max_bytes:
                break
        # a plain file's rows are its lines: one document; a JSONL's or parquet's rows are each one
        documents.extend(["\n".join(lines)] if builder == "text" else lines)
        if size >= max_bytes:
            break
    text = SEPARATOR.join(documents)
    if not text:
        raise ValueError(f"files: {list(files)} hold no text")
    return text


def train_bpe(text: str, vocab_size: int):
    """A byte-level BPE of `vocab_size` tokens (the 256 bytes, merges, <|endoftext|>) trained on
    `text`, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[END_OF_TEXT],
        show_progress=False,
    )
    tok.train_from_iterator(text.split(SEPARATOR), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT)


def load_tokenizer(path: str):
    """A transformers tokenizer saved in the local directory `path` (nothing is downloaded)."""
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise ValueError(
            f"tokenizer: {path!r}: expected 'bytes', 'bpe' or a local tokenizer directory"
        )
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def encode(tokenizer, text: str) -> np.ndarray:
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
    parts = text.split(SEPARATOR)
    ids = tokenizer(parts, add_special_tokens=False)["input_ids"]
    separator = tokenizer(SEPARATOR, add_special_tokens=False)["input_ids"]
    joined: list[int] = []
    for i, part in enumerate(ids):
        joined.extend(([] if i == 0 else separator) + part)
    return np.asarray(joined, dtype=np.int32)


@functools.cache
def text_source(
    files: tuple[str, ...],
    text_field: str,
    tokenizer: str,
    bpe_vocab: int,
    max_bytes: int,
    valid_fraction: float,
    default_text: str | None = None,
) -> TextSource:
    """The corpus (the files, or `default_text`), split, tokenized (cached per arguments)."""
    text = default_text if default_text is not None else read_text(files, text_field, max_bytes)
    cut = len(text) - int(len(text) * valid_fraction)
    train_text, valid_text = text[:cut], text[cut:]
    if tokenizer == "bytes":
        tok = None
    elif tokenizer == "bpe":
        tok = train_bpe(train_text, bpe_vocab)
    else:
        tok = load_tokenizer(tokenizer)
    valid = encode(tok, valid_text)
    return TextSource(
        train=encode(tok, train_text),
        valid=valid,
        tokens_per_byte=len(valid) / max(1, len(valid_text.encode("utf-8"))),
        tokenizer=tok,
    )
