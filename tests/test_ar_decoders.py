"""AR decoders (KV cache, EOS, TPF, sampling), metrics on hand-built records, checkpoint errors."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

from pardec.common.errors import CheckpointError, ConfigError
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.base import DecoderConfig, DecodeResult, PerSampleDecoder
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.decoders.sampling import SamplingParams, probs_from_logits, sample_seed
from pardec.inference.metrics import compute_metrics, format_markdown, prefix_agreement, score_answer
from tests.conftest import save_checkpoint, tiny_model, tiny_tokenizer

torch.set_num_threads(1)

PROMPTS = [[3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18]]
NO_EOS: set[int] = set()


def ar(**overrides):
    return build_decoder({"name": "ar", "max_new_tokens": 10, **overrides}, tokenizer=None)


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """No cache: re-run the whole sequence every step and take the argmax of the last position."""
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
            out.append(token)
            seq.append(token)
    return out


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_kv_cached_greedy_matches_no_cache_reference(arch):
    model = tiny_model(30, arch)
    for i, prompt in enumerate(PROMPTS):
        [result] = ar().decode(model, [prompt], NO_EOS, [i])
        assert result.tokens == reference_greedy(model, prompt, 10)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cached_decoding_passes_the_cache_by_its_current_keyword(arch):
    """transformers >= 5.24 takes the cache as ``cache`` and warns on ``past_key_values`` (a FutureWarning,
    the old name announced to go in 5.40): prefill and cached steps must not use the old name."""
    model = tiny_model(30, arch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        [result] = ar(batch_size=2).decode(model, PROMPTS[:1], NO_EOS, [0])
    assert len(result.tokens) == 10


def test_batched_greedy_matches_batch_one():
    model = tiny_model(30)
    batched = ar(batch_size=4).decode(model, PROMPTS, NO_EOS, [0, 1, 2, 3])
    for i, prompt in enumerate(PROMPTS):
        assert batched[i].tokens == ar().decode(model, [prompt], NO_EOS, [i])[0].tokens


def test_eos_stops_and_is_committed_batched_rows_do_not_overcount():
    model = tiny_model(30)
    free = [r.tokens for r in ar().decode(model, PROMPTS, NO_EOS, [0, 1, 2, 3])]
    eos = free[0][3]  # the 4th token of sample 0 becomes EOS
    results = ar(batch_size=4).decode(model, PROMPTS, {eos}, [0, 1, 2, 3])
    for tokens, result in zip(free, results):
        cut = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert result.tokens == tokens[:cut]
        assert result.hit_eos == (eos in tokens)
        assert result.committed == result.forwards == len(result.tokens)
    assert results[0].tokens[-1] == eos and len(results[0].tokens) <= 4


def test_ar_greedy_tpf_is_exactly_one():
    model = tiny_model(30)
    results = ar(batch_size=2).decode(model, PROMPTS, {5}, [0, 1, 2, 3])
    records = [
        {"committed": r.committed, "forwards": r.forwards, "wall_time_s": r.wall_time_s, "rank": 0,
         "hit_eos": r.hit_eos, "correct": None, "output_ids": r.tokens, "reference_ids": None}
        for r in results
    ]
    metrics = compute_metrics(records, is_ar_greedy=True)
    assert metrics["tpf"] == 1.0
    assert metrics["nfe"] == sum(len(r.tokens) for r in results)
    assert metrics["agreement_exact"] == "reference"


def test_sampling_is_reproducible_and_independent_of_batching():
    model = tiny_model(30)
    seeds = [sample_seed(7, i) for i in range(4)]
    first = ar(greedy=False, temperature=1.5, batch_size=4).decode(model, PROMPTS, NO_EOS, seeds)
    again = ar(greedy=False, temperature=1.5, batch_size=4).decode(model, PROMPTS, NO_EOS, seeds)
    single = [ar(greedy=False, temperature=1.5).decode(model, [p], NO_EOS, [s])[0] for p, s in zip(PROMPTS, seeds)]
    assert [r.tokens for r in first] == [r.tokens for r in again] == [r.tokens for r in single]
    other = ar(greedy=False, temperature=1.5, batch_size=4).decode(model, PROMPTS, NO_EOS, [s + 1 for s in seeds])
    assert [r.tokens for r in other] != [r.tokens for r in first]


def test_tiny_temperature_and_top_k_1_equal_greedy():
    model = tiny_model(30)
    greedy = [r.tokens for r in ar(batch_size=4).decode(model, PROMPTS, NO_EOS, [0, 1, 2, 3])]
    cold = ar(greedy=False, temperature=1e-4, batch_size=4).decode(model, PROMPTS, NO_EOS, [0, 1, 2, 3])
    top1 = ar(greedy=False, top_k=1, batch_size=4).decode(model, PROMPTS, NO_EOS, [0, 1, 2, 3])
    assert [r.tokens for r in cold] == greedy == [r.tokens for r in top1]


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top_p = probs_from_logits(logits, SamplingParams(greedy=False, top_p=0.7))
    assert torch.allclose(top_p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    top_k = probs_from_logits(logits, SamplingParams(greedy=False, top_k=3))
    assert torch.allclose(top_k, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_decoder_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="decoder.temprature"):
        ar(temprature=0.5)
    with pytest.raises(ConfigError, match="known decoders"):
        build_decoder({"name": "nope"}, None)
    with pytest.raises(ConfigError, match="decoder.top_p"):
        ar(greedy=False, top_p=1.5)
    with pytest.raises(ConfigError, match="decoder.max_new_tokens"):
        ar(max_new_tokens=0)


def test_metrics_on_hand_built_records():
    def rec(rank, committed, forwards, t, out, ref, correct, text="", answer=None):
        return {"rank": rank, "committed": committed, "forwards": forwards, "wall_time_s": t, "hit_eos": True,
                "output_ids": out, "reference_ids": ref, "correct": correct, "output_text": text, "answer": answer}

    records = [
        rec(0, 6, 3, 1.0, [1, 2, 3], [1, 2, 3], True, "3 + 4 = 7\n#### 7", "7"),
        rec(0, 4, 2, 1.0, [1, 2, 9, 9], [1, 2, 3], False, "so she has 12 apples", "12"),  # flexible only
        rec(1, 2, 1, 3.0, [], [], None),
    ]
    m = compute_metrics(records, is_ar_greedy=False)
    assert m["tpf"] == 12 / 6 and m["nfe"] == 6 and m["nfe_per_sample"] == 2
    assert m["decode_time_s"] == 3.0 and m["tps"] == 12 / 3.0  # slowest rank bounds the wall time
    assert m["accuracy"] == 0.5 and m["accuracy_n"] == 2 and m["accuracy_flexible"] == 1.0
    assert m["agreement_exact"] == pytest.approx(2 / 3)
    assert m["agreement_prefix"] == pytest.approx((1 + 2 / 4 + 1) / 3)
    assert compute_metrics(records, is_ar_greedy=True)["agreement_prefix"] == "reference"
    assert "| tpf | 2.0000 |" in format_markdown(m)
    assert prefix_agreement([1, 2], [1, 2, 3]) == pytest.approx(2 / 3)
    assert score_answer("so 3 + 4 = 7\n#### 7", "7") == ("7", True)
    assert score_answer("no answer", "7") == (None, False)
    assert score_answer("#### 7", None) == ("7", None)


def test_checkpoint_loads(tmp_path):
    model, tok = load_checkpoint(save_checkpoint(tmp_path / "ck"))
    assert not model.training and len(tok) <= model.get_input_embeddings().num_embeddings


def test_checkpoint_missing_dir_config_and_weights(tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "absent"))):
        load_checkpoint(tmp_path / "absent")
    ck = save_checkpoint(tmp_path / "ck")
    (ck / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model weights in"):
        load_checkpoint(ck)
    (ck / "config.json").unlink()
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(ck)


def test_checkpoint_truncated_safetensors_names_the_file(tmp_path):
    ck = save_checkpoint(tmp_path / "ck")
    weights = ck / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=re.escape(str(weights))):
        load_checkpoint(ck)


def test_checkpoint_tokenizer_larger_than_embedding_names_both_sizes(tmp_path):
    ck = tmp_path / "ck"
    tiny_model(10).save_pretrained(ck)
    tok = tiny_tokenizer()
    tok.save_pretrained(ck)
    with pytest.raises(CheckpointError, match=f"{len(tok)} tokens.*10 rows"):
        load_checkpoint(ck)


def test_checkpoint_mask_token_id_must_match_tokenizer(tmp_path):
    ck = tmp_path / "ck"
    tok = tiny_tokenizer(extra_tokens=("<|mask|>",))
    tok.save_pretrained(ck)
    mask_id = tok.convert_tokens_to_ids("<|mask|>")
    tiny_model(len(tok)).save_pretrained(ck)
    config = json.loads((ck / "config.json").read_text())
    config["pardec"] = {"recipe": "idlm", "mask_token_id": mask_id}
    (ck / "config.json").write_text(json.dumps(config))
    load_checkpoint(ck)
    config["pardec"]["mask_token_id"] = mask_id - 1
    (ck / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"mask_token_id={mask_id - 1}.*id is {mask_id}"):
        load_checkpoint(ck)


def test_per_sample_decoder_base_loops_over_prompts():
    class Echo(PerSampleDecoder):  # commits the prompt's last token once per seed unit
        def decode_one(self, model, prompt, eos_token_ids, seed):
            return DecodeResult(tokens=[prompt[-1]] * seed, forwards=1, committed=seed, wall_time_s=0.0, hit_eos=False)

    results = Echo(DecoderConfig(name="echo"), None).decode(None, [[1, 2], [3]], NO_EOS, [2, 1])
    assert [r.tokens for r in results] == [[2, 2], [3]]
