"""Read a GGUF file (llama.cpp's format) into a plain Hugging Face causal LM and its tokenizer.

transformers reads GGUF itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package),
dequantizing every tensor to float, but it loads through its GGUF quantizer: the model keeps a
``quantization_config`` and ``save_pretrained`` refuses it ("not serializable"). :func:`load_gguf`
therefore copies the dequantized weights into a model built from the same config without the
quantization config, so what is saved is an ordinary checkpoint (tied embeddings stay tied: the
file stores no ``output.weight`` and transformers reads that as ``tie_word_embeddings``).

The tokenizer is rebuilt by transformers from the file's vocabulary, merges, special-token ids and
chat template. For a pre-tokenizer name it has no rule for (``tokenizer.ggml.pre``) it splits text
like GPT-2; :data:`PRE_TOKENIZERS` restores llama.cpp's split for the names where that differs. SmolLM's
("smollm": every digit on its own, then GPT-2's regex; llama.cpp ``llama-vocab.cpp``) matters: without
it "x  12" becomes ``x Ġ Ġ 1 2`` instead of the model's ``x ĠĠ 1 2``.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from pardec.common.errors import UnsupportedModelError

# llama.cpp pre-tokenizer names whose split transformers does not rebuild, and that split.
PRE_TOKENIZERS = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ]),
}
FLOAT_TYPES = {"F32", "F16", "BF16", "F64"}


@dataclass(frozen=True)
class GGUFSummary:
    architecture: str  # general.architecture, e.g. "llama"
    pre_tokenizer: str | None  # tokenizer.ggml.pre, e.g. "smollm"
    tensor_types: dict[str, int]  # GGML type name -> number of tensors, most frequent first

    @property
    def quantization(self) -> str:
        """The most frequent quantized tensor type ("Q4_1"), or "none" for an all-float file."""
        return next((name for name in self.tensor_types if name not in FLOAT_TYPES), "none")


def summarize_gguf(path: Path) -> GGUFSummary:
    """The file's architecture, pre-tokenizer name and tensor types, read from its header."""
    reader = gguf.GGUFReader(path)

    def field(key: str) -> str | None:  # a string field (parts[data[0]] holds its UTF-8 bytes)
        found = reader.fields.get(key)
        return bytes(found.parts[found.data[0]]).decode() if found is not None else None

    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return GGUFSummary(field("general.architecture") or "?", field("tokenizer.ggml.pre"), dict(types.most_common()))


def load_gguf(path: Path, dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The file's model, dequantized into a plain (unquantized) model in ``dtype``, and its tokenizer.

    Raises :class:`UnsupportedModelError` naming the file and its architecture when the installed
    transformers cannot read it as a causal LM."""
    path = Path(path)
    summary = summarize_gguf(path)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as err:
        raise UnsupportedModelError(
            f"{path}: transformers {transformers.__version__} cannot read a GGUF file of architecture "
            f"{summary.architecture!r} ({err})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {summary.architecture!r} is read by transformers as {type(config).__name__}, "
            f"which has no causal LM class")
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    plain_config = copy.deepcopy(loaded.config)
    del plain_config.quantization_config
    model = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.to(dtype).eval()

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    if summary.pre_tokenizer in PRE_TOKENIZERS:
        tokenizer.backend_tokenizer.pre_tokenizer = PRE_TOKENIZERS[summary.pre_tokenizer]()
    return model, tokenizer
