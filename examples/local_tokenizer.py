"""Train small T5-, GPT-2- and BERT-style tokenizers on local text, for demos and tests that cannot reach the Hub.

    from local_tokenizer import build_bert_tokenizer, build_gpt2_tokenizer, build_t5_tokenizer
    tok = build_t5_tokenizer(texts, vocab_size=512)
    tok(["Anna sold the car."])  # input_ids end with </s> (id 1)
    gpt2 = build_gpt2_tokenizer(texts, vocab_size=512)  # byte-level BPE, no special tokens added

The layout matches T5's so T5 code works unchanged: pad = 0 (also the decoder start token),
eos = 1, unk = 2, and every encoded sequence ends with ``</s>``. Words are marked with "▁" as in
T5's SentencePiece model, so ``decode`` restores the spacing. Unlike T5's it lowercases, strips
accents and splits punctuation off words; its model is BPE, because the Unigram trainer of
`tokenizers` degrades to single characters on corpora of a few hundred sentences.

The GPT-2 one is byte-level BPE like GPT-2's: any text encodes (every byte is a piece), case and
spacing are kept and ``decode`` returns the text exactly; ``<|endoftext|>`` (id 0) is its only
special token and is never added by encoding, as with GPT-2.

The BERT one is WordPiece like ``bert-base-uncased``'s (``[CLS] A [SEP] B [SEP]``, token type
ids), for models with a BERT head such as extractive question answering.
"""

from __future__ import annotations

import string
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, UNK = "<pad>", "</s>", "<unk>"  # ids 0, 1, 2, in this order

# Every printable ASCII character (and the word marker) gets a piece, so text outside the
# training corpus still encodes without <unk>, letter by letter at worst.
_ALPHABET = sorted(set(string.ascii_lowercase + string.digits + string.punctuation)) + ["▁"]


def build_t5_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a BPE tokenizer on ``texts`` and wrap it as a fast tokenizer with T5's special tokens.

    Args:
        texts (`Iterable[str]`):
            Training text, e.g. every premise, hypothesis and target label of a dataset.
        vocab_size (`int`, defaults to 512):
            Upper bound on the vocabulary, special tokens included. A small corpus yields fewer.

    Returns:
        `PreTrainedTokenizerFast`: ``pad_token_id == 0``, ``eos_token_id == 1``,
        ``unk_token_id == 2``; ``save_pretrained`` / ``AutoTokenizer.from_pretrained`` round-trip.
    """
    if vocab_size < len(_ALPHABET) + 3:
        raise ValueError(
            f"`vocab_size` must hold the 3 special tokens and {len(_ALPHABET)} base characters, "
            f"got {vocab_size}; pass at least {len(_ALPHABET) + 3}"
        )
    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKD(), normalizers.StripAccents(), normalizers.Lowercase()]
    )
    # "Anna sold the car." -> ▁anna ▁sold ▁the ▁car . : punctuation is its own piece and carries
    # no "▁", so decoding glues it back to the word before it.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Split(Regex(r"[^\w▁]"), behavior="isolated")]
    )
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, EOS, UNK],
        initial_alphabet=_ALPHABET,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    eos_id = tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}", special_tokens=[(EOS, eos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        model_max_length=512,
        padding_side="right",
    )
    ids = (wrapped.pad_token_id, wrapped.eos_token_id, wrapped.unk_token_id)
    if ids != (0, 1, 2):  # guards against a tokenizers release that orders special tokens differently
        raise RuntimeError(f"special token ids are {ids}, T5 needs (pad, eos, unk) = (0, 1, 2)")
    return wrapped


ENDOFTEXT = "<|endoftext|>"


def build_gpt2_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` and wrap it with GPT-2's special token.

    Args:
        texts (`Iterable[str]`):
            Training text, e.g. the lines of a language-modeling corpus.
        vocab_size (`int`, defaults to 512):
            Upper bound on the vocabulary: ``<|endoftext|>``, the 256 bytes, then merges.

    Returns:
        `PreTrainedTokenizerFast`: ``<|endoftext|>`` (id 0) as bos, eos and unk token, no pad
        token (as GPT-2); ``decode(encode(text)) == text`` for any text.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"`vocab_size` must hold {ENDOFTEXT} and the {len(alphabet)} bytes, got {vocab_size}; "
            f"pass at least {len(alphabet) + 1}"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[ENDOFTEXT], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        model_max_length=1024,
    )


BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # ids 0 to 4, in this order


def build_bert_tokenizer(texts: Iterable[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a WordPiece tokenizer on ``texts`` and wrap it with BERT's special tokens and pair layout.

    Uncased like ``bert-base-uncased``: lowercased, accents stripped, punctuation split off
    words; a pair encodes as ``[CLS] A [SEP] B [SEP]`` with token type ids 0 for ``A`` and 1 for
    ``B``. A fast tokenizer, so extractive QA gets ``return_offsets_mapping`` and ``sequence_ids``.

    Args:
        texts (`Iterable[str]`):
            Training text, e.g. every question and context of a dataset.
        vocab_size (`int`, defaults to 512):
            Upper bound on the vocabulary, special tokens included. A small corpus yields fewer.

    Returns:
        `PreTrainedTokenizerFast`: ``[PAD]`` = 0, ``[UNK]`` = 1, ``[CLS]`` = 2, ``[SEP]`` = 3,
        ``[MASK]`` = 4, padding on the right.
    """
    # every character gets a piece (and a "##" continuation), so unseen words still encode
    minimum = len(BERT_SPECIALS) + 2 * len(_ALPHABET)
    if vocab_size < minimum:
        raise ValueError(
            f"`vocab_size` must hold the {len(BERT_SPECIALS)} special tokens and {len(_ALPHABET) - 1} base "
            f"characters with their continuations, got {vocab_size}; pass at least {minimum}"
        )
    pad, unk, cls, sep, mask = BERT_SPECIALS
    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=list(BERT_SPECIALS),
        initial_alphabet=[c for c in _ALPHABET if c != "▁"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    ids = {token: tokenizer.token_to_id(token) for token in BERT_SPECIALS}
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}",
        pair=f"{cls} $A {sep} $B:1 {sep}:1",
        special_tokens=[(cls, ids[cls]), (sep, ids[sep])],
    )
    if list(ids.values()) != list(range(len(BERT_SPECIALS))):  # a tokenizers release ordering them otherwise
        raise RuntimeError(f"special token ids are {ids}, expected 0 to {len(BERT_SPECIALS) - 1} in this order")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=pad,
        unk_token=unk,
        cls_token=cls,
        sep_token=sep,
        mask_token=mask,
        model_input_names=["input_ids", "token_type_ids", "attention_mask"],
        model_max_length=512,
        padding_side="right",
    )
