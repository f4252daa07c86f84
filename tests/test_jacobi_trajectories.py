"""Jacobi trajectory collection: fixed points equal AR greedy, stored states are real copies, EOS
inside a block, the AR-greedy check, sharding over ranks and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import pardec.data_pipelines.jacobi_trajectories as jt
from pardec.common.attention import COMPILED_FLEX_BACKEND
from pardec.data_pipelines.jacobi_trajectories import (
    CollectSettings,
    TrajectoryError,
    check_ar_greedy,
    collect_batch,
    collect_one,
    collect_trajectories,
    load_trajectories,
)
from pardec.inference.decoders.registry import build_decoder
from tests.conftest import tiny_model

torch.set_num_threads(1)

VOCAB = 30
UNUSED_EOS = 1000  # outside the vocabulary: never generated
PROMPTS = [[3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [19, 20], [21, 22, 23, 24]]


def settings(n: int, max_new: int = 12, eos: int = UNUSED_EOS, **kw) -> CollectSettings:
    return CollectSettings(block_size=n, max_new_tokens=max_new, eos_token_ids=(eos,), pad_token_id=0, **kw)


def generated(row) -> list[int]:
    return [t for fp, v in zip(row["fixed_points"], row["valid_lens"]) for t in fp[:v]]


def ar_greedy(model, prompt, steps: int, eos: int) -> list[int]:
    decoder = build_decoder({"name": "ar", "max_new_tokens": steps}, tokenizer=None)
    return decoder.decode(model, [prompt], {eos}, [0])[0].tokens


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("n", [1, 3, 4])
def test_fixed_points_equal_ar_greedy_and_states_are_real(arch, n):
    model = tiny_model(VOCAB, arch)
    s = settings(n)
    initial_differs = 0
    for index, prompt in enumerate(PROMPTS):
        row = collect_one(model, index, prompt, s)
        tokens = generated(row)
        assert len(tokens) == -(-s.max_new_tokens // n) * n and not row["hit_eos"]  # whole blocks up to the cap
        assert tokens == ar_greedy(model, prompt, len(tokens), UNUSED_EOS)

        rng = np.random.default_rng([s.seed, index])  # replay the drafts
        done: list[int] = []
        for states, fp in zip(row["states"], row["fixed_points"]):
            pool = prompt + done
            draft = [fp[0]] + [pool[i] for i in rng.integers(0, len(pool), size=n - 1).tolist()]
            assert states[0] == draft  # the stored initial state is the draft, not an alias of the fixed point
            assert states[-1] == fp and 1 <= len(states) <= n
            assert all(a != b for a, b in zip(states, states[1:]))  # every forward changes the state
            assert all(st[0] == fp[0] for st in states)
            initial_differs += states[0] != fp
            done += fp
        assert row["forwards"] == 1 + sum(len(st) for st in row["states"])
    if n > 1:
        assert initial_differs > 0


def _first_occurrence_at(tokens: list[int], want) -> int:
    """An index k where tokens[k] appears for the first time and ``want(k)`` holds."""
    for k, t in enumerate(tokens):
        if t not in tokens[:k] and want(k):
            return k
    raise AssertionError(f"no suitable EOS candidate in {tokens}")


@pytest.mark.parametrize("where", ["inside", "block_start", "block_end"])
def test_eos_inside_a_block_stops_and_masks_the_tail(where):
    n = 4
    model = tiny_model(VOCAB)
    prompt = PROMPTS[0]
    free = ar_greedy(model, prompt, 16, UNUSED_EOS)
    want = {"inside": lambda k: k % n in (1, 2), "block_start": lambda k: k % n == 0 and k > 0,
            "block_end": lambda k: k % n == n - 1}[where]
    k = _first_occurrence_at(free, want)
    eos = free[k]
    row = collect_one(model, 0, prompt, settings(n, max_new=16, eos=eos))
    assert row["hit_eos"]
    assert generated(row) == free[: k + 1] == ar_greedy(model, prompt, 16, eos)
    assert len(row["fixed_points"]) == k // n + 1
    valid = k % n + 1
    assert row["valid_lens"] == [n] * (k // n) + [valid]
    last_fp, last_states = row["fixed_points"][-1], row["states"][-1]
    assert last_fp[valid - 1] == eos and last_fp[valid:] == [0] * (n - valid)  # post-EOS padded
    assert all(st[valid:] == [0] * (n - valid) for st in last_states)
    if where == "block_start":  # EOS was the previous block's "+1" token: a one-token block, no forward
        assert last_states == [[eos] + [0] * (n - 1)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("n", [1, 3])
def test_a_batch_equals_its_prompts_decoded_alone(arch, n):
    """Prompts of different lengths decoded together (left-padded, in lockstep) give each prompt's
    batch-1 row exactly: drafts, states, fixed points, forwards; with an EOS that ends some rows
    early (they leave the batch and its cache) and the cap ending the rest."""
    model = tiny_model(VOCAB, arch).double()  # float64: no near-ties between the batch shapes' kernels
    free = {i: ar_greedy(model, p, 12, UNUSED_EOS) for i, p in enumerate(PROMPTS)}
    # an EOS generated early by some prompts and not at all (within the cap) by others
    eos = next(t for t in range(3, VOCAB) if 0 < sum(t in toks for toks in free.values()) < len(PROMPTS))
    s = settings(n, max_new=12, eos=eos)
    alone = [collect_one(model, i, p, s) for i, p in enumerate(PROMPTS)]
    together = collect_batch(model, list(range(len(PROMPTS))), PROMPTS, s)
    assert together == alone
    assert {r["hit_eos"] for r in alone} == {True, False}  # both ways of ending are exercised
    for i, row in enumerate(alone):
        assert generated(row) == ar_greedy(model, PROMPTS[i], 12, eos)[: len(generated(row))]


def test_batches_within_shards_equal_batch_one(tmp_path):
    model = tiny_model(VOCAB)
    collect_trajectories(model, PROMPTS, tmp_path / "one", settings(3, max_new=6, shard_size=4))
    collect_trajectories(model, PROMPTS, tmp_path / "four", settings(3, max_new=6, shard_size=4, batch_size=3))
    assert _rows(load_trajectories(tmp_path / "four")) == _rows(load_trajectories(tmp_path / "one"))
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        collect_trajectories(model, PROMPTS, tmp_path / "zero", settings(3, batch_size=0))


def test_ar_greedy_check_names_the_sample():
    model = tiny_model(VOCAB)
    prompt = PROMPTS[2]
    tokens = ar_greedy(model, prompt, 6, UNUSED_EOS)
    other = PROMPTS[3]  # a longer prompt beside it: the batched check's padding must not matter
    other_tokens = ar_greedy(model, other, 3, UNUSED_EOS)
    names = ["sample 7", "sample 8"]
    assert check_ar_greedy(model, [prompt, other], [tokens, other_tokens], 0.0, names) == [0, 0]
    bad = tokens[:-1] + [(tokens[-1] + 1) % VOCAB]  # only the last token is wrong
    with pytest.raises(TrajectoryError, match=r"sample 7: generated token 5 \(position 8\)"):
        check_ar_greedy(model, [prompt, other], [bad, other_tokens], 0.0, names)
    assert check_ar_greedy(model, [prompt, other], [bad, other_tokens], 1e9, names) == [1, 0]  # a near-tie
    bad_other = [(other_tokens[0] + 1) % VOCAB] + other_tokens[1:]  # the first token is wrong
    with pytest.raises(TrajectoryError, match=r"sample 8: generated token 0 \(position 7\)"):
        check_ar_greedy(model, [prompt, other], [tokens, bad_other], 0.0, names)


def test_empty_prompt_is_named():
    with pytest.raises(TrajectoryError, match="sample 4: .*empty prompt"):
        collect_one(tiny_model(VOCAB), 4, [], settings(2))


def _rows(ds) -> list[dict]:
    return [dict(r) for r in ds]


def test_two_ranks_equal_one_rank_and_resume_skips_finished_shards(tmp_path, monkeypatch):
    model = tiny_model(VOCAB)
    s = settings(3, max_new=6, shard_size=2)  # 6 prompts -> 3 shards
    collect_trajectories(model, PROMPTS, tmp_path / "one", s)
    owned0 = collect_trajectories(model, PROMPTS, tmp_path / "two", s, rank=0, world_size=2)
    owned1 = collect_trajectories(model, PROMPTS, tmp_path / "two", s, rank=1, world_size=2)
    assert [p.name for p in owned0] == ["shard-00000-of-00003.parquet", "shard-00002-of-00003.parquet"]
    assert [p.name for p in owned1] == ["shard-00001-of-00003.parquet"]
    one, two = load_trajectories(tmp_path / "one"), load_trajectories(tmp_path / "two")
    assert _rows(one) == _rows(two)
    assert one["index"] == list(range(len(PROMPTS))) and one["prompt_ids"] == PROMPTS

    # resume: a missing shard is an error on load; a stale temporary file is not a finished shard
    (tmp_path / "two" / "shard-00001-of-00003.parquet").unlink()
    (tmp_path / "two" / ".shard-00001-of-00003.parquet.123.tmp").write_text("partial")
    with pytest.raises(TrajectoryError, match="1 of 3 shards are missing .*shard-00001-of-00003"):
        load_trajectories(tmp_path / "two")
    calls = []
    real = jt.collect_batch
    monkeypatch.setattr(jt, "collect_batch", lambda m, i, p, st: calls.extend(i) or real(m, i, p, st))
    collect_trajectories(model, PROMPTS, tmp_path / "two", s, rank=0, world_size=2)
    assert calls == []  # rank 0's shards are done
    collect_trajectories(model, PROMPTS, tmp_path / "two", s, rank=1, world_size=2)
    assert calls == [2, 3]  # only the missing shard is collected again
    assert _rows(load_trajectories(tmp_path / "two")) == _rows(one)


def test_resuming_with_other_settings_is_an_error(tmp_path):
    model = tiny_model(VOCAB)
    collect_trajectories(model, PROMPTS[:2], tmp_path, settings(2, max_new=4))
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["block_size"] == 2 and meta["num_shards"] == 1
    with pytest.raises(TrajectoryError, match="block_size=2.*block_size=4"):
        collect_trajectories(model, PROMPTS[:2], tmp_path, settings(4, max_new=4))
    with pytest.raises(TrajectoryError, match="prompts_sha256"):
        collect_trajectories(model, PROMPTS[1:3], tmp_path, settings(2, max_new=4))


def test_collection_runs_a_flex_model_with_sdpa_and_gives_its_backend_back(tmp_path, flex_called):
    """The trainer loads Jacobi Forcing models with FlexAttention on GPU, compiled for every new shape:
    collection must not call it (its rows equal an SDPA model's), and the model trains with it after."""
    model = tiny_model(VOCAB)
    collect_trajectories(model, PROMPTS, tmp_path / "sdpa", settings(3, max_new=6, batch_size=2))
    model.set_attn_implementation(COMPILED_FLEX_BACKEND)
    collect_trajectories(model, PROMPTS, tmp_path / "flex", settings(3, max_new=6, batch_size=2))
    assert _rows(load_trajectories(tmp_path / "flex")) == _rows(load_trajectories(tmp_path / "sdpa"))
    assert model.config._attn_implementation == COMPILED_FLEX_BACKEND
    with pytest.raises(flex_called):  # the restored backend is the one a forward runs
        model(input_ids=torch.tensor([PROMPTS[0]]))


def test_collection_restores_training_mode(tmp_path):
    model = tiny_model(VOCAB).train()
    collect_trajectories(model, PROMPTS[:1], tmp_path, settings(2, max_new=2))
    assert model.training


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collection_on_gpu():
    """float32 on CUDA: fixed points equal the KV-cached AR greedy decoder, one prompt at a time and
    in a batch; bfloat16: the AR-greedy check passes with the automatic near-tie tolerance."""
    model = tiny_model(VOCAB).cuda()
    batch = collect_batch(model, list(range(len(PROMPTS))), PROMPTS, settings(4, max_new=16))
    for index, prompt in enumerate(PROMPTS):
        row = collect_one(model, index, prompt, settings(4, max_new=16))
        assert generated(row) == generated(batch[index]) == ar_greedy(model, prompt, 16, UNUSED_EOS)
    model = model.to(torch.bfloat16)
    rows = [collect_one(model, i, p, settings(4, max_new=16)) for i, p in enumerate(PROMPTS)]
    rows += collect_batch(model, list(range(len(PROMPTS))), PROMPTS, settings(4, max_new=16))
    assert all(len(generated(r)) == 16 for r in rows)
