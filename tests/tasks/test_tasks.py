"""Memory tasks: generator invariants, determinism, metrics, named errors, the capacity probe."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from miras.tasks import IGNORE, TASKS, Batch, Task, make_task
from miras.tasks.capacity import (
    capacity_curve,
    capacity_table,
    delta_rule_spec,
    feature_rank,
    least_squares_curve,
    transition,
)
from miras.tasks.mad import SUBTASKS
from miras.tasks.niah import MAX_SNAP, TEMPLATES
from miras.tasks.text import corpus, split_bounds

ROOT = Path(__file__).resolve().parents[2]

# Every generator, at small sizes where the defaults are large.
CONFIGS = [
    ("mqar", {}),
    ("mqar", {"vocab_size": 64, "seq_len": 64, "num_pairs": 8, "power_a": 1.0}),
    ("mqar", {"random_non_queries": True}),
    ("forgetting_mqar", {}),
    *[("mad", {"subtask": s}) for s in SUBTASKS],
    ("mad", {"subtask": "in_context_recall", "train_labels": "answers"}),
    ("niah", {"kind": "passkey", "lengths": [160, 200], "depths": [0.0, 0.5, 1.0]}),
    ("niah", {"kind": "number", "lengths": [200]}),
    ("niah", {"kind": "word", "lengths": [200]}),
    ("niah", {"kind": "uuid", "lengths": [256]}),
    ("text", {"seq_len": 64}),
    ("parity", {}),
    ("modular_arithmetic", {"modulus": 7}),
    ("group_word", {"group": "S3"}),
    ("group_word", {"group": "S5", "seq_len": 16}),
]
IDS = [f"{n}-{'-'.join(str(v) for v in o.values()) or 'default'}" for n, o in CONFIGS]


def rows(batch: Batch) -> set[tuple[int, ...]]:
    return {tuple(r) for r in batch.inputs.tolist()}


# --- the registry and the interface -------------------------------------------------------


def test_registry_lists_the_training_tasks():
    assert list(TASKS) == [
        "mqar",
        "forgetting_mqar",
        "continuous_mqar",
        "mad",
        "niah",
        "text",
        "parity",
        "modular_arithmetic",
        "group_word",
    ]
    for name, cls in TASKS.items():
        task = make_task(name)
        assert cls.name == name and isinstance(task, cls)
        assert isinstance(task.vocab_size, int) and isinstance(task.seq_len, int)
        assert cls.primary_metric in ("accuracy", "exact_match", "perplexity")
        assert cls.higher_is_better == (cls.primary_metric != "perplexity")


@pytest.mark.parametrize(
    ("name", "options"), [*CONFIGS, ("continuous_mqar", {})], ids=[*IDS, "continuous_mqar"]
)
def test_every_task_answers_the_hooks_training_calls(name, options, tmp_path):
    """miras.training and miras.checkpoint call these plainly: Task declares each one."""
    task = make_task(name, **options)
    slices = task.slices("test")
    assert slices and all(isinstance(part, Task) for part in slices.values())
    assert make_task(task.name, **task.options()) == task
    io, layers = task.io_options(), task.model_io(8)
    assert (io is None) == (layers is None) == (name != "continuous_mqar")
    task.save_files(tmp_path)  # only the text task has files, and only with a tokenizer
    assert list(tmp_path.iterdir()) == []


def test_pyproject_ships_the_package():
    assert '"miras.tasks",' in (ROOT / "pyproject.toml").read_text()  # the packages list


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_shapes_ranges_and_determinism(name, options):
    task = make_task(name, **options)
    batch = task.batch("train", 3, 5)
    b, t = batch.inputs.shape
    assert b == 5 and batch.labels.shape == (b, t)
    assert batch.inputs.dtype == batch.labels.dtype == torch.int64
    assert t == task.seq_len or (name == "niah" and t in task.lengths)
    assert batch.inputs.min() >= 0 and batch.inputs.max() < task.vocab_size
    scored = batch.labels[batch.labels != IGNORE]
    assert scored.numel() > 0 and scored.min() >= 0 and scored.max() < task.vocab_size
    again = task.batch("train", 3, 5)
    assert torch.equal(again.inputs, batch.inputs) and torch.equal(again.labels, batch.labels)
    other_seed = make_task(name, **{**options, "seed": 1}).batch("train", 3, 5)
    for different in (task.batch("train", 4, 5), task.batch("valid", 3, 5), other_seed):
        assert not torch.equal(different.inputs, batch.inputs)


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_options_rebuild_an_equal_task(name, options):
    task = make_task(name, **options)
    assert make_task(name, **task.options()) == task
    assert json.loads(json.dumps(task.options())) == task.options()


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_train_and_valid_never_share_a_sequence(name, options):
    task = make_task(name, **options)
    train = set().union(*(rows(task.batch("train", i, 16)) for i in range(4)))
    valid = set().union(*(rows(task.batch("valid", i, 16)) for i in range(4)))
    assert not train & valid


@pytest.mark.parametrize(
    ("split", "index", "batch_size", "named"),
    [("tset", 0, 2, "split"), ("train", -1, 2, "index"), ("valid", 0, 0, "batch_size")],
)
def test_bad_batch_arguments_are_named(split, index, batch_size, named):
    with pytest.raises(ValueError, match=named):
        make_task("mqar").batch(split, index, batch_size)


# --- MQAR ----------------------------------------------------------------------------------


def test_mqar_labels_are_the_values_of_the_queried_keys():
    task = make_task("mqar", vocab_size=128, seq_len=128, num_pairs=16)
    n, half = task.num_pairs, task.vocab_size // 2
    batch = task.batch("train", 0, 32)
    for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        keys, values = inputs[0 : 2 * n : 2], inputs[1 : 2 * n : 2]
        assert all(1 <= k < half for k in keys) and all(half <= v < 128 for v in values)
        assert len(set(keys)) == n and len(set(values)) == n
        value_of = dict(zip(keys, values, strict=True))
        assert labels[: 2 * n] == [IGNORE] * (2 * n)
        queried = []
        for t in range(2 * n, task.seq_len):
            if labels[t] == IGNORE:
                assert inputs[t] == 0  # filler between queries
            else:
                assert (t - 2 * n) % 2 == 0 and labels[t] == value_of[inputs[t]]
                queried.append(inputs[t])
        assert sorted(queried) == sorted(keys)  # every key exactly once


def test_mqar_power_law_puts_queries_near_the_context():
    def mean_gap(power_a: float) -> float:
        task = make_task("mqar", seq_len=256, num_pairs=8, power_a=power_a)
        labels = task.batch("valid", 0, 64).labels
        where = (labels != IGNORE).nonzero()[:, 1].float()
        return (where - 2 * task.num_pairs).mean().item()

    assert mean_gap(0.01) < 0.7 * mean_gap(1.0)


# --- MAD -----------------------------------------------------------------------------------


def test_in_context_recall_labels_are_consistent_with_the_context():
    task = make_task("mad", subtask="noisy_recall", frac_noise=0.3)
    c = task.vocab_size - task.noise_vocab_size
    batch = task.batch("valid", 0, 16)
    noise_pairs = total_pairs = 0
    for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        value_of: dict[int, int] = {}  # keys of earlier noise-free pairs
        for i in range(0, task.seq_len, 2):
            k, v = inputs[i], inputs[i + 1]
            total_pairs += 1
            assert labels[i + 1] == IGNORE  # scored at the key: the value comes next
            if k >= c:  # a noise pair: both tokens from the noise vocabulary, never scored
                assert v >= c and labels[i] == IGNORE
                noise_pairs += 1
                continue
            assert k < c // 2 <= v < c
            assert labels[i] == (v if k in value_of else IGNORE)
            assert value_of.setdefault(k, v) == v  # a key keeps its value
        assert labels[-2] != IGNORE  # the final pair is always a query
    assert 0.2 < noise_pairs / total_pairs < 0.4


def test_recall_trains_on_next_tokens_like_mad():
    task = make_task("mad", subtask="in_context_recall")
    train = task.batch("train", 0, 4)
    assert torch.equal(train.labels[:, :-1], train.inputs[:, 1:])
    assert (train.labels[:, -1] == IGNORE).all()
    valid = task.batch("valid", 0, 4)
    assert (valid.labels[:, 1::2] == IGNORE).all()  # only keys' positions are scored


@pytest.mark.parametrize("split", ["train", "valid"])
def test_fuzzy_recall_values_follow_their_keys(split):
    task = make_task("mad", subtask="fuzzy_recall", train_labels="answers")
    pad, n_keys = task.vocab_size - 1, (task.vocab_size - 1) // 2
    batch = task.batch(split, 2, 8)
    queries = 0
    for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        t_end = len(inputs)
        for t, label in enumerate(labels[:-1]):  # scored positions predict the next token
            assert label in (IGNORE, inputs[t + 1])
        start = next(t for t, x in enumerate(inputs) if x != pad)
        assert all(x == pad for x in inputs[:start])
        # Runs of key tokens and of value tokens alternate: each run is one motif.
        runs, t = [], start
        while t < t_end:
            end = t
            while end < t_end and (inputs[end] < n_keys) == (inputs[t] < n_keys):
                end += 1
            runs.append((inputs[t] < n_keys, t, end))
            t = end
        value_of = {}
        for (is_key, k0, k1), (_, v0, v1) in zip(runs[:-1:2], runs[1::2], strict=False):
            assert is_key and 1 <= k1 - k0 <= task.k_motif_size
            assert split == "train" or k1 - k0 == task.k_motif_size  # valid: longest keys
            key, value = tuple(inputs[k0:k1]), tuple(inputs[v0:v1])
            scored = labels[k1 - 1 : v1 - 1]
            if key in value_of:
                queries += 1
                whole = v1 < t_end  # the last value is cut by the shift
                assert value == value_of[key] if whole else value_of[key][: len(value)] == value
                assert scored == list(value)
            else:
                assert scored == [IGNORE] * len(scored)
                value_of[key] = value
        assert labels[-1] != IGNORE  # the final probe's last value token
    assert queries >= 8  # every row asks at least its probe


def test_selective_copying_labels_are_the_content_in_order():
    task = make_task("mad", subtask="selective_copying")
    blank, copy, n = task.vocab_size - 2, task.vocab_size - 1, task.num_tokens_to_copy
    batch = task.batch("train", 0, 8)
    for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
        marker = inputs.index(copy)
        assert inputs.count(copy) == 1 and marker == task.seq_len - n - 1
        content = [x for x in inputs[:marker] if x != blank]
        assert len(content) == n and inputs[marker + 1 :] == [blank] * n
        assert labels[marker + 1 :] == content and labels[: marker + 1] == [IGNORE] * (marker + 1)


def test_compression_reproduces_the_first_half():
    task = make_task("mad", subtask="compression")
    batch = task.batch("valid", 0, 4)
    half = task.seq_len // 2
    assert torch.equal(batch.labels[:, half:], batch.inputs[:, :half])
    assert (batch.inputs[:, half:] == task.vocab_size - 1).all()
    assert (batch.labels[:, :half] == IGNORE).all()


def test_memorization_map_is_fixed_across_batches_and_splits():
    task = make_task("mad", subtask="memorization")
    mapping = task.memorization_map()
    assert len(set(mapping.values())) == len(mapping) == (task.vocab_size - 1) // 2
    assert mapping == make_task("mad", subtask="memorization").memorization_map()
    assert mapping != make_task("mad", subtask="memorization", seed=1).memorization_map()
    for split, index in (("train", 0), ("train", 7), ("valid", 0)):
        batch = task.batch(split, index, 8)
        keys, inserts = batch.inputs[:, 0::2], batch.inputs[:, 1::2]
        assert (inserts == task.vocab_size - 1).all()
        expected = torch.tensor([[mapping[k] for k in row] for row in keys.tolist()])
        assert torch.equal(batch.labels[:, 1::2], expected)
        assert (batch.labels[:, 0::2] == IGNORE).all()


@pytest.mark.parametrize("subtask", SUBTASKS)
def test_train_examples_fix_the_training_set_and_reshuffle_each_epoch(subtask):
    n, b = 12, 8  # batches straddle the epochs: 12 rows, 8 a batch
    task = make_task("mad", subtask=subtask, train_examples=n)
    fixed = {tuple(row) for row in task.train_set()[0].tolist()}
    assert len(fixed) == n
    rows = [task.batch("train", i, b) for i in range(6)]  # 48 rows: epochs 0 to 3
    inputs = [tuple(r) for batch in rows for r in batch.inputs.tolist()]
    assert set(inputs) <= fixed
    epochs = [inputs[e * n : (e + 1) * n] for e in range(4)]
    assert all(sorted(epoch) == sorted(fixed) for epoch in epochs)  # each epoch: every row once
    assert epochs[0] != epochs[1]  # in a new order
    again = task.batch("train", 1, b)  # deterministic, labels with their inputs
    assert torch.equal(again.inputs, rows[1].inputs) and torch.equal(again.labels, rows[1].labels)
    pairs = {tuple(i): tuple(l) for batch in rows for i, l in
             zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True)}  # fmt: skip
    assert len(pairs) == n  # a sequence keeps its labels
    valid = {tuple(r) for r in task.batch("valid", 0, 64).inputs.tolist()}
    assert len(valid - fixed) > 32  # valid stays new draws
    assert not torch.equal(
        make_task("mad", subtask=subtask).batch("train", 1, b).inputs, rows[1].inputs
    )


def test_memorization_with_few_train_examples_leaves_facts_unseen():
    # MAD's hardest memorization setting: V 8192, 256 sequences of 16 facts, about one view of
    # each of the 4095 keys; the valid split asks for keys the training set never showed.
    task = make_task("mad", subtask="memorization", vocab_size=8192, train_examples=256)
    seen = set(task.train_set()[0][:, 0::2].ravel().tolist())
    asked = set(task.batch("valid", 0, 64).inputs[:, 0::2].ravel().tolist())
    assert 0.5 < len(seen) / 4095 < 0.75  # 1 - e^-1 = 0.63 expected
    assert asked - seen


# --- NIAH ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(TEMPLATES))
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.75, 1.0])
def test_niah_needle_sits_at_its_depth_and_labels_spell_its_value(kind, depth):
    task = make_task("niah", kind=kind, lengths=[300, 400], depths=[depth])
    needle, question = (s.split("{}")[0].encode() for s in TEMPLATES[kind])
    for split in ("train", "valid"):
        batch = task.cell_batch(split, 400, depth, 0, 4)
        assert batch.inputs.shape == (4, 400)
        for inputs, labels in zip(batch.inputs.tolist(), batch.labels.tolist(), strict=True):
            text = bytes(inputs)
            at, asked = text.index(needle), text.index(question)
            value = text[at + len(needle) :].split(b". ")[0]
            answer = bytes(x for x in labels if x != IGNORE)
            assert answer == value and labels[-len(value) :] == list(answer)
            size = len(TEMPLATES[kind][0].format(value.decode(), value.decode()))
            target = round(depth * (asked - size))  # depth x the haystack's length
            # The needle starts at depth x haystack, moved back to the start of its word.
            assert target - MAX_SNAP <= at <= target
            if at < target:
                assert at == 0 or text[at - 1 : at] in (b" ", b"\n")
                assert not any(ch in b" \n" for ch in text[at + size : target + size])
            if kind != "passkey":  # prose from the batch's own split
                start, end = split_bounds(split, 0.1)
                assert text[:32] in corpus()[start:end] or at < 32


def test_niah_batches_walk_the_grid():
    task = make_task("niah", lengths=[160, 200], depths=[0.0, 1.0])
    assert task.cells() == [(160, 0.0), (160, 1.0), (200, 0.0), (200, 1.0)]
    assert [task.batch("valid", i, 1).inputs.shape[1] for i in range(5)] == [
        160,
        160,
        200,
        200,
        160,
    ]
    assert torch.equal(
        task.batch("valid", 2, 3).inputs, task.cell_batch("valid", 200, 0.0, 2, 3).inputs
    )


# --- text ----------------------------------------------------------------------------------


def test_text_windows_are_pydoc_prose_from_their_split():
    from pydoc_data.topics import topics

    assert topics["assert"].encode() in corpus()
    task = make_task("text", seq_len=96)
    cut = split_bounds("train", task.valid_fraction)[1]
    assert split_bounds("valid", task.valid_fraction) == (cut, len(corpus()))
    for split in ("train", "valid"):
        batch = task.batch(split, 5, 8)
        starts = task.window_starts(split, 5, 8)
        for row, start in enumerate(starts.tolist()):
            window = bytes(batch.inputs[row].tolist() + batch.labels[row, -1:].tolist())
            assert window == corpus()[start : start + 97]
            assert bytes(batch.labels[row].tolist()) == window[1:]
            assert (start >= cut) if split == "valid" else (start + 97 <= cut)


# --- metrics -------------------------------------------------------------------------------


def one_hot_logits(labels: torch.Tensor, vocab: int, scale: float = 50.0) -> torch.Tensor:
    return scale * torch.nn.functional.one_hot(labels.clamp_min(0), vocab).float()


@pytest.mark.parametrize(("name", "options"), CONFIGS, ids=IDS)
def test_perfect_and_uniform_logits(name, options):
    task = make_task(name, **options)
    labels = task.batch("valid", 0, 8).labels
    v = task.vocab_size
    perfect = task.metrics(one_hot_logits(labels, v), labels)
    assert perfect["loss"] < 1e-6  # accuracy, exact match and perplexity are all 1
    assert perfect[task.primary_metric] == pytest.approx(1.0, abs=1e-5)
    uniform = task.metrics(torch.zeros(*labels.shape, v), labels)
    assert uniform["loss"] == pytest.approx(math.log(v), rel=1e-5)  # float32 logits
    if name == "text":
        assert uniform["perplexity"] == pytest.approx(256, rel=1e-5) and uniform[
            "bits_per_byte"
        ] == pytest.approx(8, rel=1e-5)


def test_random_logits_score_about_one_in_v():
    task = make_task("mqar", vocab_size=64, seq_len=256, num_pairs=30)
    labels = task.batch("valid", 0, 256).labels
    logits = torch.randn(*labels.shape, 64, generator=torch.Generator().manual_seed(0))
    assert task.metrics(logits, labels)["accuracy"] == pytest.approx(1 / 64, abs=0.01)


def test_niah_exact_match_needs_every_answer_byte():
    task = make_task("niah", lengths=[160], depths=[0.5])
    labels = task.batch("valid", 0, 4).labels
    logits = one_hot_logits(labels, 256)
    last = (labels[0] != IGNORE).nonzero()[-1].item()
    logits[0, last] = 0.0  # row 0 gets its last answer byte wrong
    scores = task.metrics(logits, labels)
    assert scores["exact_match"] == pytest.approx(0.75)
    assert 0.75 < scores["accuracy"] < 1.0


@pytest.mark.parametrize(
    ("logits", "labels", "named"),
    [
        (torch.zeros(2, 5), torch.zeros(2, 5, dtype=torch.long), "logits"),
        (torch.zeros(2, 5, 256), torch.zeros(2, 4, dtype=torch.long), "labels"),
        (torch.zeros(2, 5, 8), torch.zeros(2, 5, dtype=torch.long), "vocab_size"),
    ],
)
def test_metrics_name_bad_inputs(logits, labels, named):
    with pytest.raises(ValueError, match=named):
        make_task("mqar").metrics(logits, labels)


# --- named errors --------------------------------------------------------------------------

BAD_OPTIONS = [
    ("mqr", {}, r"unknown task 'mqr'.*did you mean 'mqar'"),
    (
        "mqar",
        {"num_pair": 3},
        r"unknown option 'num_pair'; allowed options: .*\(did you mean 'num_pairs'\?\)",
    ),
    ("mqar", {"num_pairs": 0}, r"option 'num_pairs': expected an integer >= 1, got 0"),
    ("mqar", {"num_pairs": 40}, r"num_pairs=40 needs seq_len >= 4 \* num_pairs = 160"),
    ("mqar", {"vocab_size": 16, "num_pairs": 8}, r"num_pairs=8 needs 8 distinct keys"),
    ("mqar", {"power_a": 0}, r"option 'power_a'"),
    ("mqar", {"seq_len": "long"}, r"option 'seq_len': expected an integer, got 'long'"),
    (
        "mad",
        {"subtask": "fuzzy_recal"},
        r"option 'subtask': expected one of .*did you mean 'fuzzy_recall'",
    ),
    (
        "mad",
        {"num_tokens_to_copy": 4},
        r"'num_tokens_to_copy' does not apply to subtask 'in_context_recall'",
    ),
    (
        "mad",
        {"subtask": "selective_copying", "seq_len": 20},
        r"seq_len must exceed 2 \* num_tokens_to_copy",
    ),
    ("mad", {"subtask": "noisy_recall", "frac_noise": 1.0}, r"option 'frac_noise'"),
    ("mad", {"subtask": "noisy_recall", "noise_vocab_size": 32}, r"leaves no keys and values"),
    ("mad", {"subtask": "compression", "seq_len": 63}, r"must be even"),
    ("mad", {"train_labels": "all"}, r"option 'train_labels': expected one of next_token, answers"),
    ("mad", {"train_examples": 0}, r"option 'train_examples': expected an integer >= 1, got 0"),
    ("mad", {"train_examples": "all"}, r"option 'train_examples': expected an integer, got 'all'"),
    ("niah", {"kind": "needle"}, r"option 'kind': expected one of passkey, number, word, uuid"),
    ("niah", {"lengths": [50]}, r"every length >= \d+, got 50"),
    ("niah", {"depths": [1.5]}, r"option 'depths\[0\]'"),
    ("niah", {"depths": []}, r"option 'depths': expected at least one value"),
    ("niah", {"kind": "number", "lengths": [10**6]}, r"validation split"),
    ("text", {"seq_len": 10**6}, r"seq_len=1000000 does not fit the validation split"),
    ("text", {"valid_fraction": 0.9}, r"option 'valid_fraction'"),
]


@pytest.mark.parametrize(
    ("name", "options", "message"), BAD_OPTIONS, ids=[m for _, _, m in BAD_OPTIONS]
)
def test_bad_options_get_named_errors(name, options, message):
    with pytest.raises(ValueError, match=message) as info:
        make_task(name, **options)
    assert not isinstance(info.value.__cause__, Exception)  # one clear message, no pydantic dump


def test_cli_style_strings_are_accepted():
    task = make_task("niah", lengths="160, 200", depths="0,0.5", seed="3")
    assert task.lengths == (160, 200) and task.depths == (0.0, 0.5) and task.seed == 3


def test_mad_accepts_mads_hyphenated_names_and_fills_baselines():
    task = make_task("mad", subtask="noisy-recall")
    assert task.subtask == "noisy_recall"
    assert (task.vocab_size, task.seq_len, task.noise_vocab_size, task.frac_noise) == (
        32,
        128,
        16,
        0.2,
    )
    assert make_task("mad", subtask="noisy_recall", frac_noise=0.4).frac_noise == 0.4


# --- capacity ------------------------------------------------------------------------------

IDENTITY, TAYLOR = delta_rule_spec("identity"), delta_rule_spec("taylor")


def test_orthogonal_keys_are_recalled_exactly_up_to_d_k():
    curve = dict(capacity_curve(IDENTITY, 4, [1, 2, 4, 16], keys="orthogonal", trials=4, epochs=20))
    assert curve[1] < 1e-9 and curve[2] < 1e-9 and curve[4] < 1e-9
    assert curve[16] > 0.7  # least squares: about sqrt(1 - 4/16)


def test_the_tensor_map_stores_more_than_the_matrix():
    d_k, n = 4, 8
    matrix = dict(capacity_curve(IDENTITY, d_k, [n], trials=4, epochs=100))[n]
    taylor = dict(capacity_curve(TAYLOR, d_k, [n], trials=4, epochs=100))[n]
    assert taylor < 0.1 < 0.5 < matrix


def test_least_squares_is_exact_below_the_rank_and_the_rule_approaches_it():
    assert feature_rank(IDENTITY, 4) == 4
    assert feature_rank(TAYLOR, 4) == 14  # C(6, 2) - 1: unit keys tie k.k to the constant
    assert feature_rank(TAYLOR, 4, keys="gaussian") == 15
    best = dict(least_squares_curve(TAYLOR, 4, [14, 15, 30], trials=4))
    assert best[14] < 1e-9 and best[15] > 0.05 and best[30] > best[15]
    rule = dict(capacity_curve(TAYLOR, 4, [30], trials=4, epochs=100))
    assert rule[30] == pytest.approx(best[30], rel=0.05)


def test_capacity_table_and_transition():
    rows = capacity_table({"matrix": IDENTITY}, 4, [2, 4, 8], trials=2, epochs=50)
    assert [r["n_pairs"] for r in rows] == [2, 4, 8] and {r["rank"] for r in rows} == {4}
    assert rows[0]["theory_error"] == 0 and rows[2]["theory_error"] == pytest.approx(math.sqrt(0.5))
    assert transition([(2, 0.0), (4, 0.05), (8, 0.6), (16, 0.05)]) == 4
    assert transition([(2, 0.5)]) is None


def test_capacity_holds_other_gates_constant_and_names_missing_ones():
    curve = capacity_curve(str(ROOT / "specs" / "gated_deltanet.yaml"), 4, [2], trials=2, epochs=40)
    assert curve[0][1] < 1e-6  # decay held at 1: the delta rule, converged
    with pytest.raises(ValueError, match="gate 'momentum'"):
        capacity_curve(str(ROOT / "specs" / "titans.yaml"), 4, [2], trials=1, epochs=1)
    with pytest.raises(ValueError, match="keys"):
        capacity_curve(IDENTITY, 4, [2], keys="random")
    with pytest.raises(ValueError, match="pair_counts"):
        capacity_curve(IDENTITY, 4, [0])
