"""The builders the suites share, all offline and built in seconds: a tiny word-level tokenizer,
tiny random causal LMs (Qwen3 or Llama), a checkpoint directory and a small jsonl eval set.

Test modules import them (``from tests.conftest import tiny_model``); every tiny model in the suite
comes from :func:`tiny_model`, so a change of architecture defaults happens in one place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

WORDS = "Question: Answer: what is plus minus ? #### apples Tom has".split() + [str(d) for d in range(10)]
SPECIAL = ["<eos>", "<unk>", "<bos>"]


def tiny_tokenizer(extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS + list(extra_tokens))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", bos_token="<bos>", pad_token="<eos>"
    )


def tiny_model(
    vocab_size: int,
    arch: str = "qwen3",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **config_overrides,
):
    """A random causal LM in eval mode: 2 layers, hidden 32, 4 heads of 8 (2 KV heads: grouped-query
    attention), 256 positions, ids 0 = eos/pad and 2 = bos; ``config_overrides`` change any of it.
    Weights depend only on ``seed`` and the shapes."""
    torch.manual_seed(seed)
    config = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        eos_token_id=0,
        bos_token_id=2,
        pad_token_id=0,
    )
    config.update(config_overrides)
    if arch == "llama":
        config_cls = LlamaConfig
    elif arch == "qwen3":
        config_cls = Qwen3Config
    else:
        raise ValueError(f"arch must be qwen3 or llama, got {arch!r}")
    model = AutoModelForCausalLM.from_config(config_cls(**config), attn_implementation=attn_implementation)
    return model.eval()


def save_checkpoint(path: Path, arch: str = "qwen3", seed: int = 0) -> Path:
    tok = tiny_tokenizer()
    tiny_model(len(tok), arch, seed).save_pretrained(path)
    tok.save_pretrained(path)
    return path


EVAL_ROWS = [
    {"prompt": f"Question: what is {a} plus {b} ? Answer:", "response": f"#### {a + b}", "answer": str(a + b)}
    for a, b in [(1, 2), (3, 4), (2, 2), (5, 1), (0, 7), (4, 4), (6, 3)]
]


def write_eval_jsonl(path: Path, rows: list[dict] = EVAL_ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def data_cfg(**overrides):
    """The ``data`` config (``DataConfig`` defaults) with ``overrides`` set by dotted key."""
    from omegaconf import OmegaConf

    from pardec.data_pipelines.config import DataConfig

    cfg = OmegaConf.structured(DataConfig)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value)
    return cfg


def synthetic_tokenizer():
    """The embedded default's word-level tokenizer (default generator config)."""
    from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig
    from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer

    return build_synthetic_tokenizer(SyntheticGSMConfig())


CHAT_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML with a default system turn, as SmolLM2-Instruct's template; the turn ends with <|im_end|>,
# which is not the tokenizer's EOS (<|endoftext|>), as with Llama 3's <|eot_id|>.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chat_bpe_tokenizer(vocab_size: int = 400) -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained here on generated word problems, with a ChatML chat
    template, EOS ``<|endoftext|>``, no pad, no unk and no ``<|mask|>``: what a real chat model's
    tokenizer looks like to pardec (SmolLM2, Qwen), in a second."""
    from tokenizers import decoders, trainers
    from tokenizers.models import BPE

    from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, generate_split

    rows = generate_split(SyntheticGSMConfig(num_train=300, num_test=20, num_val=20), "train")
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHAT_SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([r["prompt"] + r["response"] for r in rows] + ["system user assistant helpful"],
                                trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<|im_start|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    tok.chat_template = CHATML_TEMPLATE
    return tok


def save_chat_checkpoint(path: Path, seed: int = 0, tie: bool = True) -> Path:
    """A tiny random Llama with tied embeddings and :func:`chat_bpe_tokenizer`, saved as a local
    Hugging Face checkpoint (``model=hf model.path=...``)."""
    tok = chat_bpe_tokenizer()
    model = tiny_model(len(tok), "llama", seed, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                       pad_token_id=None, tie_word_embeddings=tie)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class FlexCalled(Exception):
    """Raised by the ``flex_called`` fixture's stand-in for pardec's FlexAttention."""


@pytest.fixture
def flex_called(monkeypatch):
    """``pardec_flex`` registered with its attention function replaced, for this test, by one that
    raises :class:`FlexCalled`: a model set to it shows whether a forward went through FlexAttention
    without compiling anything. Returns the exception class."""
    from transformers import AttentionInterface

    from pardec.common.attention import COMPILED_FLEX_BACKEND
    from pardec.models.flex_attention import register

    def spy(*args, **kwargs):
        raise FlexCalled

    register()
    monkeypatch.setitem(AttentionInterface._global_mapping, COMPILED_FLEX_BACKEND, spy)
    return FlexCalled


def interrupt_evaluate(monkeypatch, module, after: int) -> list[int]:
    """Patch ``module.evaluate`` (a benchmark's) to raise KeyboardInterrupt on call ``after + 1``, as a run
    stopped mid-chunk; returns the problem count of every call made."""
    evaluate, calls = module.evaluate, []

    def stopping(model, tok, rows, decoder, **kwargs):
        calls.append(len(rows))
        if len(calls) > after:
            raise KeyboardInterrupt
        return evaluate(model, tok, rows, decoder, **kwargs)

    monkeypatch.setattr(module, "evaluate", stopping)
    return calls


def stopped_after_first_chunk(monkeypatch, module, args: list[str], out_dir: Path, rows: int,
                              problems: int, decoding=None, before: int = 0) -> list[str]:
    """``module.main(args)`` in chunks of one problem under ``out_dir``, stopped after ``before`` calls of
    ``evaluate`` (a val sweep's) and the first chunk's ``rows`` rows (each after its warm-up) by the
    ``evaluate`` of ``decoding`` (the module that calls it, ``module`` by default); checks that the table it
    left covers that chunk and says so, restores that ``evaluate`` and returns the chunked arguments, to run
    again."""
    decoding = decoding or module
    evaluate = decoding.evaluate
    interrupt_evaluate(monkeypatch, decoding, after=before + 2 * rows)
    chunked = [*args, "--chunk-dir", str(out_dir / "chunks"), "--chunk-size", "1", "--out", str(out_dir / "c")]
    with pytest.raises(KeyboardInterrupt):
        module.main(chunked)
    assert f"1 of {problems} problems done" in (out_dir / "c.md").read_text()
    table = json.loads((out_dir / "c.json").read_text())
    if isinstance(table, dict):  # the test rows beside a val phase (jacobi_forcing's under "decoding")
        table = table.get("test") or table["decoding"]
    assert [r["num_samples"] for r in table] == [1] * rows
    monkeypatch.setattr(decoding, "evaluate", evaluate)
    return chunked
