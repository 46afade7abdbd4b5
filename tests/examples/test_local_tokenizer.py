"""The offline demo's pieces: the local T5, GPT-2 and BERT tokenizers and the shipped synthetic RTE data."""

import json
from collections import Counter
from pathlib import Path

import pytest

from example_modules import load_example, regenerate_fixtures

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
DATA = EXAMPLES / "data"
SPLITS = {"train": 600, "validation": 200}


def _rows(split: str) -> list[dict]:
    with (DATA / f"rte_{split}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def texts() -> list[str]:
    rows = _rows("train") + _rows("validation")
    return [r["premise"] for r in rows] + [r["hypothesis"] for r in rows] + ["entailment", "not_entailment"]


@pytest.fixture(scope="module")
def tok(texts):
    return load_example("local_tokenizer").build_t5_tokenizer(texts, vocab_size=512)


def test_t5_special_token_layout(tok):
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "</s>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert len(tok) <= 512


def test_every_sequence_ends_with_eos(tok):
    for ids in tok(["Anna sold the car.", "not_entailment"]).input_ids:
        assert ids[-1] == 1
        assert ids.count(1) == 1


def test_round_trip_of_the_data(tok, texts):
    for text in texts:
        ids = tok(text).input_ids
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids, skip_special_tokens=True) == text.lower()


def test_corpus_words_are_single_pieces(tok):
    # A 512-piece vocabulary holds every word of the small corpus whole: short sequences.
    assert tok.tokenize("In the garden, Anna sold the car.") == [
        "▁in", "▁the", "▁garden", ",", "▁anna", "▁sold", "▁the", "▁car", ".",
    ]  # fmt: skip


def test_unseen_text_falls_back_to_characters(tok):
    ids = tok("Quixotic zebra 42?").input_ids
    assert tok.unk_token_id not in ids
    assert tok.decode(ids, skip_special_tokens=True) == "quixotic zebra 42?"


def test_padding_and_truncation(tok):
    batch = tok(["a b"], padding="max_length", max_length=16, truncation=True)
    (ids,) = batch.input_ids
    assert len(ids) == 16
    n = sum(batch.attention_mask[0])
    assert ids[n - 1] == 1 and set(ids[n:]) == {0}
    long = tok(["word " * 50], padding="max_length", max_length=16, truncation=True).input_ids[0]
    assert len(long) == 16 and long[-1] == 1


def test_save_and_reload_offline(tok, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    text = "The piano was not found by Ben."
    assert again(text).input_ids == tok(text).input_ids
    assert (again.pad_token_id, again.eos_token_id, again.unk_token_id) == (0, 1, 2)


def test_vocab_size_too_small_is_refused(texts):
    with pytest.raises(ValueError, match="`vocab_size` must hold"):
        load_example("local_tokenizer").build_t5_tokenizer(texts, vocab_size=10)


@pytest.mark.parametrize("split", SPLITS)
def test_data_has_rte_layout_and_balanced_labels(split):
    rows = _rows(split)
    assert len(rows) == SPLITS[split]
    assert all(list(r) == ["premise", "hypothesis", "idx", "label"] for r in rows)
    assert [r["idx"] for r in rows] == list(range(len(rows)))
    assert Counter(r["label"] for r in rows) == {0: len(rows) // 2, 1: len(rows) // 2}
    for r in rows:
        assert 0 < len(r["premise"].split()) <= 20 and 0 < len(r["hypothesis"].split()) <= 20


def test_validation_pairs_are_not_in_train():
    train = {(r["premise"], r["hypothesis"]) for r in _rows("train")}
    assert not train & {(r["premise"], r["hypothesis"]) for r in _rows("validation")}


def test_make_rte_regenerates_the_shipped_files(tmp_path):
    regenerate_fixtures("make_rte.py", tmp_path)
    for split in SPLITS:
        name = f"rte_{split}.jsonl"
        assert (tmp_path / name).read_bytes() == (DATA / name).read_bytes(), f"{name} is stale: rerun make_rte.py"


@pytest.fixture(scope="module")
def gpt2_tok():
    lines = (DATA / "wikitext_train.txt").read_text(encoding="utf-8").splitlines(keepends=True)
    return load_example("local_tokenizer").build_gpt2_tokenizer(lines, vocab_size=512)


def test_gpt2_tokenizer_layout_and_exact_round_trip(gpt2_tok):
    assert len(gpt2_tok) == 512
    assert (gpt2_tok.eos_token, gpt2_tok.eos_token_id, gpt2_tok.bos_token_id, gpt2_tok.pad_token) == (
        "<|endoftext|>", 0, 0, None,
    )  # fmt: skip
    for text in ["Quixotic Zebra 42?\n\n", " = Harwick = \n", "Ünïcode — ok"]:
        ids = gpt2_tok(text).input_ids
        assert 0 not in ids  # no special token added, no <unk>: every byte is a piece
        assert gpt2_tok.decode(ids) == text
    assert gpt2_tok.tokenize(" the River Avon") == ["Ġthe", "ĠRiver", "ĠAvon"]


def test_gpt2_vocab_size_too_small_is_refused():
    with pytest.raises(ValueError, match="`vocab_size` must hold"):
        load_example("local_tokenizer").build_gpt2_tokenizer(["a"], vocab_size=100)


def test_bert_tokenizer_pairs_offsets_and_reload(tmp_path, monkeypatch):
    build = load_example("local_tokenizer").build_bert_tokenizer
    tok = build(["Where does Anna live? Anna lives in Paris."] * 4, vocab_size=200)
    assert [tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id] == [
        0,
        1,
        2,
        3,
        4,
    ]
    context = "Anna lives in Zürich."
    encoded = tok("Where does Anna live?", context, return_offsets_mapping=True)
    tokens = tok.convert_ids_to_tokens(encoded["input_ids"])
    assert tokens[0] == "[CLS]" and tokens.count("[SEP]") == 2 and tokens[-1] == "[SEP]"
    second = tokens.index("[SEP]") + 1
    assert encoded["token_type_ids"] == [0] * second + [1] * (len(tokens) - second)
    assert encoded.sequence_ids()[second:-1] == [1] * (len(tokens) - second - 1)
    # offsets index the original text, so an unseen word ("zurich", split into pieces) maps back whole
    pieces = [encoded["offset_mapping"][i] for i, sid in enumerate(encoded.sequence_ids()) if sid == 1]
    assert context[pieces[3][0] : pieces[-2][1]] == "Zürich"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded("Where?", context)["input_ids"] == tok("Where?", context)["input_ids"]
    assert reloaded.model_input_names == ["input_ids", "token_type_ids", "attention_mask"]
    with pytest.raises(ValueError, match="vocab_size"):
        build(["a"], vocab_size=50)
