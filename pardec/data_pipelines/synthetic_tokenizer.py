"""Tokenizer of the embedded default data: a small, offline, deterministic word-level tokenizer.

Design (built with the ``tokenizers`` library, no files or network needed):

- pre-tokenizer: a regex ``Split`` in "isolated" mode; a single space is attached to the token
  that follows it (``" apples"``), every digit is its own token (``"54"`` -> ``"5"``, ``"4"``) so
  the arithmetic is learnable digit by digit, ``"####"`` is one token and ``"\\n"`` is its own;
- model: ``WordLevel`` over a vocabulary enumerated from the generator's full template and word
  lists (:func:`pardec.data_pipelines.synthetic_gsm.vocabulary_texts`), each word/punctuation mark with
  and without its leading space, so every text the generator can emit encodes without
  ``<|unk|>``;
- decoder: ``Fuse`` (decoding is plain concatenation), so ``decode(encode(text)) == text``.

Special tokens: ``<|endoftext|>`` (eos and pad) and ``<|unk|>``; no bos, no automatic special
tokens when encoding (the framework appends EOS itself). ``<|mask|>`` is not added here: the
framework adds it per method. The vocabulary does not depend on the config's numeric knobs, so
``cfg`` only documents which generator the tokenizer serves.
"""

from __future__ import annotations

import re

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, vocabulary_texts

EOS_TOKEN = "<|endoftext|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (EOS_TOKEN, UNK_TOKEN)
SPLIT_PATTERN = r" ?####| ?[A-Za-z]+| ?\d|\n| ?[^\sA-Za-z\d]"
_PIECES = re.compile(r"####|[A-Za-z]+|\d|[^\sA-Za-z\d]")


def synthetic_vocabulary() -> list[str]:
    """Special tokens, then every piece the generator can emit, each bare and with a leading space."""
    pieces = {str(d) for d in range(10)}
    for text in vocabulary_texts():
        pieces.update(_PIECES.findall(text))
    tokens = list(SPECIAL_TOKENS) + ["\n"]
    for piece in sorted(pieces):
        tokens += [piece, " " + piece]
    return tokens


def build_synthetic_tokenizer(cfg: SyntheticGSMConfig) -> PreTrainedTokenizerFast:
    """The embedded default's tokenizer (see the module docstring); identical on every call."""
    del cfg  # the vocabulary covers every configuration of the generator
    vocab = {token: i for i, token in enumerate(synthetic_vocabulary())}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
