"""Jacobi Forcing training: the packed single forward against naive per-block forwards, the batch
layout (labels, consistency pairs), the loss against a naive per-block computation, and a run of
the real trainer through both progressive-distillation rounds."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from pardec.cli.collect_trajectories import collect
from pardec.common.constants import IGNORE_INDEX
from pardec.common.errors import ConfigError, DataError
from pardec.data_pipelines.jacobi_batch import build_jacobi_batch
from pardec.data_pipelines.jacobi_trajectories import load_trajectories
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.tokenize import format_prompt_ids
from pardec.inference.decoders.registry import build_decoder
from pardec.losses.jacobi import jacobi_forcing_loss
from pardec.methods.base import forward_logits, move_batch
from tests.conftest import tiny_model
from tests.train_utils import FAST, compose_train, logged_metrics, run_in_process

torch.set_num_threads(1)

VOCAB = 30


def make_sample(gen: torch.Generator, p: int, num_blocks: int, n: int, last_valid: int | None = None) -> dict:
    """Random prompt and fixed points; noisy states share each block's first token and differ
    elsewhere with probability 1/2; ``last_valid`` < n puts EOS (id 0) in the last block."""
    clean = torch.randint(3, VOCAB, (num_blocks, n), generator=gen)
    other = torch.randint(3, VOCAB, (num_blocks, n), generator=gen)
    noisy = torch.where(torch.rand(num_blocks, n, generator=gen) < 0.5, other, clean)
    valid = [n] * num_blocks
    if last_valid is not None:
        valid[-1] = last_valid
        clean[-1, last_valid - 1] = 0
        clean[-1, last_valid:] = noisy[-1, last_valid:] = 0
    noisy[:, 0] = clean[:, 0]
    return {"prompt_ids": torch.randint(3, VOCAB, (p,), generator=gen).tolist(), "noisy_blocks": noisy.tolist(),
            "clean_blocks": clean.tolist(), "valid_lens": valid}


N_BLOCK = 3
SAMPLES_SPEC = [(4, 3, None), (2, 2, 2), (5, 1, None), (3, 4, 1)]  # (P, blocks, last valid)
PACK = 40  # slots 22 + 14 in row 0, 11 + 27 in row 1


def samples(seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [make_sample(gen, p, b, N_BLOCK, v) for p, b, v in SAMPLES_SPEC]


def naive_logits(model, sample: dict, mask: str = "nc", window: int = 1) -> dict:
    """Separate causal forwards: prompt; noisy block j on [prompt, k_0..k_j] (NC) or
    [prompt, c_0..c_{s-1}, k_s..k_j] (NC-IC, s = first block of j's window); clean block j on
    [prompt, c_0..c_j]. Returns logits ``prompt [P, V]``, ``noisy [N, n, V]``, ``clean [N, n, V]``."""
    prompt, noisy, clean = sample["prompt_ids"], sample["noisy_blocks"], sample["clean_blocks"]

    def run(seq: list[int]) -> torch.Tensor:
        return model(input_ids=torch.tensor([seq], device=model.device)).logits[0]

    out = {"prompt": run(prompt), "noisy": [], "clean": []}
    for j in range(len(clean)):
        start = j // window * window if mask == "nc_ic" else 0
        context = [t for b in clean[:start] for t in b] + [t for b in noisy[start:j] for t in b]
        out["noisy"].append(run(prompt + context + noisy[j])[-N_BLOCK:])
        out["clean"].append(run(prompt + [t for b in clean[: j + 1] for t in b])[-N_BLOCK:])
    return {k: torch.stack(v) if isinstance(v, list) else v for k, v in out.items()}


def slot_map(batch_samples: list[dict], pack_length: int, layout: str = "interleaved") -> list[dict]:
    """Where each sample's prompt / noisy / clean slots are in the packed batch (greedy rows):
    ``[prompt][k_0][c_0][k_1][c_1]...`` (interleaved) or ``[prompt][k_0 k_1 ...][c_0 c_1 ...]`` (streams)."""
    places, row, used = [], -1, pack_length
    for s in batch_samples:
        p, nb = len(s["prompt_ids"]), len(s["clean_blocks"])
        length = p + 2 * nb * N_BLOCK
        if used + length > pack_length:
            row, used = row + 1, 0
        start = used
        if layout == "streams":
            noisy = [[start + p + j * N_BLOCK + o for o in range(N_BLOCK)] for j in range(nb)]
            clean = [[i + nb * N_BLOCK for i in b] for b in noisy]
        else:
            noisy = [[start + p + 2 * j * N_BLOCK + o for o in range(N_BLOCK)] for j in range(nb)]
            clean = [[i + N_BLOCK for i in b] for b in noisy]
        places.append({"row": row, "prompt": list(range(start, start + p)), "noisy": noisy, "clean": clean})
        used += length
    return places


@pytest.mark.parametrize("arch,attn", [("qwen3", "sdpa"), ("llama", "sdpa"), ("qwen3", "eager")])
@pytest.mark.parametrize("mask,window", [("nc", 1), ("nc_ic", 2)])
@pytest.mark.parametrize("layout", ["interleaved", "streams"])
@torch.no_grad()
def test_packed_forward_equals_naive_per_block_forwards(arch, attn, mask, window, layout):
    model = tiny_model(VOCAB, arch)
    model.set_attn_implementation(attn)
    batch_samples = samples()
    batch = build_jacobi_batch(batch_samples, block_size=N_BLOCK, pack_length=PACK, pad_token_id=0, mask=mask,
                               window=window, layout=layout)
    assert batch["input_ids"].shape == (2, PACK)
    logits = forward_logits(model, batch)  # [r, s, V]
    for sample, place in zip(batch_samples, slot_map(batch_samples, PACK, layout)):
        ref = naive_logits(model, sample, mask, window)
        r = place["row"]
        torch.testing.assert_close(logits[r, place["prompt"]], ref["prompt"], atol=1e-5, rtol=1e-4)
        for j in range(len(sample["clean_blocks"])):
            torch.testing.assert_close(logits[r, place["noisy"][j]], ref["noisy"][j], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(logits[r, place["clean"][j]], ref["clean"][j], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask,window", [("nc", 1), ("nc_ic", 2)])
@pytest.mark.parametrize("layout", ["interleaved", "streams"])
def test_flex_attention_training_path_on_gpu(mask, window, layout):
    """The GPU path: FlexAttention with the compiled BlockMask from the same predicate gives the
    naive per-block (SDPA) logits, and the loss backpropagates through it."""

    def model_with(attn: str):
        return tiny_model(VOCAB, attn_implementation=attn, hidden_size=64, intermediate_size=128, head_dim=16,
                          eos_token_id=None, bos_token_id=None, pad_token_id=None).train().cuda()

    model, reference = model_with("flex_attention"), model_with("sdpa").eval()
    batch_samples = samples()
    batch = move_batch(build_jacobi_batch(batch_samples, block_size=N_BLOCK, pack_length=PACK, pad_token_id=0,
                                          mask=mask, window=window, layout=layout), "cuda")
    logits = forward_logits(model, batch)  # [r, s, V]
    with torch.no_grad():
        for sample, place in zip(batch_samples, slot_map(batch_samples, PACK, layout)):
            ref = naive_logits(reference, sample, mask, window)
            r = place["row"]
            torch.testing.assert_close(logits[r, place["prompt"]], ref["prompt"], atol=1e-4, rtol=1e-3)
            for j in range(len(sample["clean_blocks"])):
                torch.testing.assert_close(logits[r, place["noisy"][j]], ref["noisy"][j], atol=1e-4, rtol=1e-3)
                torch.testing.assert_close(logits[r, place["clean"][j]], ref["clean"][j], atol=1e-4, rtol=1e-3)
    total, _ = jacobi_forcing_loss(logits, batch["labels"], batch["pc_student_index"], batch["pc_teacher_index"],
                                   batch["n_blocks"])
    total.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(g.abs().sum() > 0 for g in grads)


def test_batch_layout_labels_and_pairs_by_hand():
    full = {"prompt_ids": [3, 4], "clean_blocks": [[5, 6, 7], [8, 9, 10]], "noisy_blocks": [[5, 11, 7], [8, 9, 12]],
            "valid_lens": [3, 3]}
    batch = build_jacobi_batch([full], block_size=3, pack_length=16, pad_token_id=0)
    #          p0 p1 | k0       | c0       | k1       | c1        | pad
    assert batch["input_ids"][0].tolist() == [3, 4, 5, 11, 7, 5, 6, 7, 8, 9, 12, 8, 9, 10, 0, 0]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 5, 6, 7, 0, 0]
    x = IGNORE_INDEX  # prompt's last -> c0[0]; c0[2] -> c1[0]; the cap-cut last slot -> nothing
    assert batch["labels"][0].tolist() == [x, 5, x, x, x, 6, 7, 8, x, x, x, 9, 10, x, x, x]
    # block 0: first mismatch at offset 1 -> offsets 1, 2; block 1: at offset 2 -> offset 2
    assert batch["pc_student_index"].tolist() == [3, 4, 10]
    assert batch["pc_teacher_index"].tolist() == [6, 7, 13]
    assert int(batch["n_blocks"]) == 2

    eos = {"prompt_ids": [3], "clean_blocks": [[5, 6, 7, 8], [9, 13, 0, 0]],
           "noisy_blocks": [[5, 6, 7, 8], [9, 14, 0, 0]], "valid_lens": [4, 3]}  # EOS (0) at block 1, offset 2
    batch = build_jacobi_batch([eos], block_size=4, pack_length=17, pad_token_id=0)
    #                                 p0 | k0 (1-4)   | c0 (5-8)     | k1 (9-12)     | c1 (13-16)
    assert batch["labels"][0].tolist() == [5, x, x, x, x, 6, 7, 8, 9, x, x, x, x, 13, 0, x, x]
    assert batch["pc_student_index"].tolist() == [10]  # offset 1 only: the EOS logit predicts nothing
    assert batch["pc_teacher_index"].tolist() == [14]
    assert int(batch["n_blocks"]) == 2


def test_streams_layout_by_hand():
    """layout=streams: [prompt][k_0 k_1][c_0 c_1], the same positions, labels and pairs per slot."""
    full = {"prompt_ids": [3, 4], "clean_blocks": [[5, 6, 7], [8, 9, 10]], "noisy_blocks": [[5, 11, 7], [8, 9, 12]],
            "valid_lens": [3, 3]}
    batch = build_jacobi_batch([full], block_size=3, pack_length=16, pad_token_id=0, layout="streams")
    #          p0 p1 | k0       | k1        | c0       | c1        | pad
    assert batch["input_ids"][0].tolist() == [3, 4, 5, 11, 7, 8, 9, 12, 5, 6, 7, 8, 9, 10, 0, 0]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 6, 7, 0, 0]
    x = IGNORE_INDEX
    assert batch["labels"][0].tolist() == [x, 5, x, x, x, x, x, x, 6, 7, 8, 9, 10, x, x, x]
    assert batch["pc_student_index"].tolist() == [3, 4, 7]
    assert batch["pc_teacher_index"].tolist() == [9, 10, 13]
    meta = batch["attention"].metadata
    assert meta["block_ids"][0, :14].tolist() == [-1, -1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError,
                       match="'blocks' is not a valid JacobiLayout: expected one of \\['interleaved', 'streams'\\]"):
        build_jacobi_batch([full], block_size=3, pack_length=16, pad_token_id=0, layout="blocks")


def test_two_samples_per_row_use_segments_and_global_indices():
    a = {"prompt_ids": [3], "clean_blocks": [[5, 6]], "noisy_blocks": [[5, 9]], "valid_lens": [2]}
    batch = build_jacobi_batch([a, a, a], block_size=2, pack_length=10, pad_token_id=0)
    assert batch["input_ids"].shape == (2, 10)  # 5 slots each: two per row
    assert batch["pc_student_index"].tolist() == [2, 7, 12]
    assert batch["pc_teacher_index"].tolist() == [4, 9, 14]
    assert batch["attention"].metadata["segment_ids"][0].tolist() == [0] * 5 + [1] * 5
    assert batch["attention"].metadata["segment_ids"][1].tolist() == [0] * 5 + [-1] * 5


def test_rows_padded_to_the_longest_keep_slots_and_pairs():
    """pad_to=longest over two rows (36 and 38 used slots of PACK=40): the same slots as pack_length
    padding without its last two columns, and the flat pair indices name the same slots (r * s moves)."""
    full = build_jacobi_batch(samples(), block_size=N_BLOCK, pack_length=PACK, pad_token_id=0)
    short = build_jacobi_batch(samples(), block_size=N_BLOCK, pack_length=PACK, pad_token_id=0, pad_to="longest")
    assert full["input_ids"].shape == (2, PACK) and short["input_ids"].shape == (2, 38)
    for key in ("input_ids", "position_ids", "labels"):
        assert torch.equal(short[key], full[key][:, :38]), key
    for key in ("segment_ids", "stream", "block_ids"):
        assert torch.equal(short["attention"].metadata[key], full["attention"].metadata[key][:, :38]), key
    assert full["pc_student_index"].numel() > 0
    for key in ("pc_student_index", "pc_teacher_index"):
        assert torch.equal(short["input_ids"].flatten()[short[key]], full["input_ids"].flatten()[full[key]]), key
        assert torch.equal(short["position_ids"].flatten()[short[key]], full["position_ids"].flatten()[full[key]]), key
        assert (short[key] // 38).tolist() == (full[key] // PACK).tolist(), key


@pytest.mark.parametrize("bad,match", [
    ({"valid_lens": [2, 3]}, r"sample 0: valid_lens\[0\]=2; expected 1..3, and < 3 only in the last block"),
    ({"noisy_blocks": [[6, 11, 7], [8, 9, 12]]}, "sample 0: block 0's noisy state starts with 6 but its fixed point "
                                                  "with 5"),
    ({"clean_blocks": [[5, 6, 7]]}, "same N >= 1 blocks"),
    ({"noisy_blocks": [[5, 11], [8, 9, 12]]}, "block 0 has 2 noisy / 3 clean tokens; block_size is 3"),
])
def test_bad_samples_are_named(bad, match):
    sample = {"prompt_ids": [3, 4], "clean_blocks": [[5, 6, 7], [8, 9, 10]], "noisy_blocks": [[5, 11, 7], [8, 9, 12]],
              "valid_lens": [3, 3], **bad}
    with pytest.raises(ValueError, match=match):
        build_jacobi_batch([sample], block_size=3, pack_length=16, pad_token_id=0)


def test_sample_longer_than_the_row_is_named():
    sample = {"prompt_ids": [3, 4], "clean_blocks": [[5, 6, 7], [8, 9, 10]], "noisy_blocks": [[5, 11, 7], [8, 9, 12]],
              "valid_lens": [3, 3]}
    with pytest.raises(ValueError, match=r"sample 1: 14 slots \(prompt \+ 2 x blocks x block_size\) > pack_length=13"):
        build_jacobi_batch([sample | {"prompt_ids": [3]}, sample], block_size=3, pack_length=13, pad_token_id=0)


def naive_loss(model, batch_samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block loops over naive forwards: L_pc = sum over blocks of the KL summed over offsets
    m..last, divided by the number of blocks; L_AR = CE of a plain causal forward over prompt + answer."""
    kl_sum, blocks, ce_sum, ce_count = torch.zeros(()), 0, torch.zeros(()), 0
    for s in batch_samples:
        ref = naive_logits(model, s)
        valid = s["valid_lens"]
        for j, (k, c, v) in enumerate(zip(s["noisy_blocks"], s["clean_blocks"], valid)):
            blocks += 1
            mismatches = [o for o in range(v) if k[o] != c[o]]
            if not mismatches:
                continue
            last = N_BLOCK - 1 if v == N_BLOCK else v - 2
            for o in range(mismatches[0], last + 1):
                p_t = F.softmax(ref["clean"][j, o], -1)
                kl_sum = kl_sum + (p_t * (p_t.log() - F.log_softmax(ref["noisy"][j, o], -1))).sum()
        answer = [t for c, v in zip(s["clean_blocks"], valid) for t in c[:v]]
        full = model(input_ids=torch.tensor([s["prompt_ids"] + answer])).logits[0]
        p = len(s["prompt_ids"])
        ce_sum = ce_sum + F.cross_entropy(full[p - 1 : p - 1 + len(answer)], torch.tensor(answer), reduction="sum")
        ce_count += len(answer)
    return kl_sum / blocks, ce_sum / ce_count


@pytest.mark.parametrize("arch,layout", [("qwen3", "interleaved"), ("llama", "interleaved"), ("qwen3", "streams")])
def test_loss_equals_naive_per_block_computation(arch, layout):
    model = tiny_model(VOCAB, arch)
    batch_samples = samples(seed=1)
    batch = build_jacobi_batch(batch_samples, block_size=N_BLOCK, pack_length=PACK, pad_token_id=0, layout=layout)
    with torch.no_grad():
        logits = forward_logits(model, batch)
        l_pc_ref, l_ar_ref = naive_loss(model, batch_samples)
    total, logs = jacobi_forcing_loss(logits, batch["labels"], batch["pc_student_index"], batch["pc_teacher_index"],
                                      batch["n_blocks"], ar_weight=10.0)
    assert l_pc_ref > 0 and logs["n_pc_pairs"] > 0
    assert logs["l_pc"] == pytest.approx(float(l_pc_ref), rel=1e-4, abs=1e-6)
    assert logs["l_ar"] == pytest.approx(float(l_ar_ref), rel=1e-5)
    assert float(total) == pytest.approx(float(l_pc_ref + 10.0 * l_ar_ref), rel=1e-4)
    assert logs["n_ar_tokens"] == sum(sum(s["valid_lens"]) for s in batch_samples)


def test_teacher_is_detached_and_empty_cases_are_zero():
    batch = build_jacobi_batch(samples(), block_size=N_BLOCK, pack_length=PACK, pad_token_id=0)
    logits = torch.randn(*batch["input_ids"].shape, VOCAB, requires_grad=True)
    total, _ = jacobi_forcing_loss(logits, batch["labels"], batch["pc_student_index"], batch["pc_teacher_index"],
                                   batch["n_blocks"], ar_weight=0.0)
    total.backward()
    grad = logits.grad.flatten(0, 1).abs().sum(-1)  # [r*s]
    assert torch.all(grad[batch["pc_teacher_index"]] == 0) and torch.all(grad[batch["pc_student_index"]] > 0)

    fresh = torch.randn(2, 5, VOCAB, requires_grad=True)
    none = torch.zeros(0, dtype=torch.long)
    total, logs = jacobi_forcing_loss(fresh, torch.full((2, 5), IGNORE_INDEX), none, none, 0)
    assert float(total.detach()) == 0.0 and logs["n_pc_pairs"] == 0.0 and logs["n_ar_tokens"] == 0.0
    total.backward()
    assert torch.all(fresh.grad == 0)


def test_trainer_runs_both_distillation_rounds(tmp_path):
    """Round 1 (n=4) collects with the initial model and trains 2 steps; round 2 (n=8, two blocks
    per sample so that the second one is noisy) re-collects with round 1's export, so its fixed
    points are that export's AR greedy output."""
    stages = ("[{name:r1,max_steps:2,overrides:{block_size:4,window:2}},"
              "{name:r2,max_steps:1,overrides:{block_size:8,window:2,max_new_tokens:16}}]")
    result = run_in_process([
        "recipe=jacobi_forcing", f"output_dir={tmp_path}", "data.max_train_samples=6", "recipe.max_new_tokens=8",
        "recipe.shard_size=4", f"recipe.stages={stages}",
    ])
    assert result.status == "finished" and result.step == 1
    r1, r2 = tmp_path / "stages" / "00-r1", tmp_path / "stages" / "01-r2"
    for stage, steps in ((r1, 2), (r2, 1)):
        metrics = logged_metrics(stage)
        assert [m["step"] for m in metrics] == list(range(1, steps + 1))
        assert all(m["l_ar"] > 0 and m["n_pc_pairs"] > 0 for m in metrics)
        assert sorted(p.name for p in (stage / "trajectories").glob("shard-*")) == [
            "shard-00000-of-00002.parquet", "shard-00001-of-00002.parquet"]
    assert json.loads((r2 / "trajectories" / "meta.json").read_text())["block_size"] == 8

    round1 = AutoModelForCausalLM.from_pretrained(r1 / "hf").eval()
    assert round1.config.pardec == {"recipe": "jacobi_forcing", "jacobi_block_size": 4}
    row = load_trajectories(r2 / "trajectories")[0]
    tokens = [t for fp, v in zip(row["fixed_points"], row["valid_lens"]) for t in fp[:v]]
    decoder = build_decoder({"name": "ar", "max_new_tokens": len(tokens)}, tokenizer=None)
    eos = round1.config.eos_token_id
    assert decoder.decode(round1, [row["prompt_ids"]], {eos}, [0])[0].tokens == tokens


SMALL = ["recipe=jacobi_forcing", "recipe.stages=[]", "data.max_train_samples=4", "recipe.block_size=4",
         "recipe.window=2", "recipe.max_new_tokens=8", "recipe.shard_size=2"]


def test_resumed_stage_reuses_its_collected_shards(tmp_path):
    first = run_in_process([*SMALL, f"output_dir={tmp_path}", "trainer.max_steps=2", "trainer.stop_after_steps=1"])
    assert first.status == "stopped"
    shards = sorted((tmp_path / "trajectories").glob("shard-*"))
    assert len(shards) == 2
    stamps = [p.stat().st_mtime_ns for p in shards]
    second = run_in_process([*SMALL, f"output_dir={tmp_path}", "trainer.max_steps=2"])
    assert second.status == "finished" and second.step == 2
    assert [p.stat().st_mtime_ns for p in shards] == stamps


def test_lora_run_collects_the_same_trajectories_and_starts_at_the_full_runs_loss(tmp_path):
    """model.lora on recipe=jacobi_forcing: the stage collects with the base (the adapter does not touch
    it), and with B = 0 the first step sees the full run's model and batch, so L_pc and L_AR are the full
    run's; the merged export is a Jacobi Forcing checkpoint."""
    full = run_in_process([*SMALL, f"output_dir={tmp_path / 'full'}", "trainer.max_steps=1"])
    lora = run_in_process([*SMALL, f"output_dir={tmp_path / 'lora'}", "trainer.max_steps=1", "model.lora.rank=4"])
    rows = [load_trajectories(tmp_path / run / "trajectories") for run in ("full", "lora")]
    assert len(rows[0]) == 4 and [dict(r) for r in rows[0]] == [dict(r) for r in rows[1]]
    (a,), (b,) = (logged_metrics(r.export_dir.parent) for r in (full, lora))
    assert a["n_pc_pairs"] == b["n_pc_pairs"] > 0 and a["n_ar_tokens"] == b["n_ar_tokens"]
    for term in ("l_pc", "l_ar", "loss"):
        assert b[term] == pytest.approx(a[term], rel=1e-6, abs=0), term
    exported = AutoModelForCausalLM.from_pretrained(lora.export_dir)
    assert exported.config.pardec == {"recipe": "jacobi_forcing", "jacobi_block_size": 4}
    assert not any("lora" in name for name in exported.state_dict())


def test_training_on_trajectories_from_the_collection_script(tmp_path):
    directory = collect(compose_train([*FAST, *SMALL, f"output_dir={tmp_path / 'collect'}"]))
    assert directory == tmp_path / "collect" / "trajectories"
    result = run_in_process([*SMALL, f"output_dir={tmp_path / 'train'}", "trainer.max_steps=1",
                             f"recipe.trajectories_dir={directory}"])
    assert result.status == "finished"
    assert not (tmp_path / "train" / "trajectories").exists()
    with pytest.raises(DataError, match="block_size=4 but recipe.block_size=2"):
        run_in_process([*SMALL, f"output_dir={tmp_path / 'other'}", "trainer.max_steps=1", "recipe.block_size=2",
                        f"recipe.trajectories_dir={directory}"])


def test_window_phase_reaches_the_training_examples(tmp_path):
    """recipe.window_phase=random noises block 0 in some samples (phase zero never does), and an
    unknown phase fails at start with the key's name."""
    from pardec.methods.jacobi_forcing import _examples

    fixed_point = [1, 2, 3, 4]
    trajectory = [[1, 9, 9, 9], [1, 2, 9, 9], fixed_point]
    noisy_block0 = {"zero": 0, "random": 0}
    for phase in noisy_block0:
        for index in range(40):
            row = {"index": index, "prompt_ids": [5, 6], "states": [trajectory] * 3,
                   "fixed_points": [fixed_point] * 3, "valid_lens": [4] * 3}
            example = _examples(row, block_size=4, window=3, schedule="progressive", phase=phase, seed=0)
            noisy_block0[phase] += example["noisy_blocks"][0] != fixed_point
    assert noisy_block0["zero"] == 0 and noisy_block0["random"] > 0
    with pytest.raises(ConfigError, match="recipe.window_phase"):
        run_in_process([*SMALL, f"output_dir={tmp_path}", "recipe.window_phase=sometimes"])


def test_streams_layout_trains_the_same_losses(tmp_path, monkeypatch):
    """recipe.layout=streams reaches the batches: the first step's losses equal the interleaved
    layout's (same attention, slots moved); an unknown layout fails at start with the key's name."""
    import pardec.methods.jacobi_forcing as recipe

    built_layouts = []

    def recording(*args, **kwargs):
        batch = build_jacobi_batch(*args, **kwargs)
        built_layouts.append((kwargs["layout"], batch["attention"].metadata["stream"][0].tolist()))
        return batch

    monkeypatch.setattr(recipe, "build_jacobi_batch", recording)
    first_step = {}
    for layout in ("interleaved", "streams"):
        out = tmp_path / layout
        result = run_in_process([*SMALL, f"output_dir={out}", "trainer.max_steps=1", f"recipe.layout={layout}"])
        assert result.status == "finished"
        first_step[layout] = logged_metrics(out)[0]
    streams_rows = [stream for layout, stream in built_layouts if layout == "streams"]
    assert streams_rows and [stream for layout, stream in built_layouts if layout == "interleaved"] != streams_rows
    for key in ("l_pc", "l_ar", "n_pc_pairs", "n_ar_tokens"):
        assert first_step["streams"][key] == pytest.approx(first_step["interleaved"][key], rel=1e-4), key
    assert first_step["streams"]["n_pc_pairs"] > 0
    with pytest.raises(ConfigError, match="recipe.layout"):
        run_in_process([*SMALL, f"output_dir={tmp_path / 'bad'}", "recipe.layout=blocks"])


def test_each_round_collects_from_its_own_prompt_range(tmp_path):
    """Per-stage prompt ranges: round 1 collects prompts [0, 2), round 2 prompts [2, 5) of the split;
    a range past the split's end is named."""
    stages = ("[{name:r1,max_steps:1,overrides:{prompt_start:0,num_prompts:2}},"
              "{name:r2,max_steps:1,overrides:{prompt_start:2,num_prompts:3}}]")
    common = [*SMALL, "data.max_train_samples=5"]
    result = run_in_process([*common, f"output_dir={tmp_path}", f"recipe.stages={stages}"])
    assert result.status == "finished"
    cfg = compose_train([*FAST, *common, f"output_dir={tmp_path}"])
    tok = AutoTokenizer.from_pretrained(tmp_path / "stages" / "00-r1" / "hf")
    prompts = [format_prompt_ids(tok, row["prompt"], "plain") for row in load_raw_split(cfg.data, "train")]
    for stage, expected in (("00-r1", prompts[0:2]), ("01-r2", prompts[2:5])):
        rows = load_trajectories(tmp_path / "stages" / stage / "trajectories")
        assert [list(r["prompt_ids"]) for r in rows] == [list(p) for p in expected]
    with pytest.raises(DataError, match="recipe.prompt_start=4 \\+ recipe.num_prompts=3 > 5"):
        run_in_process([*common, f"output_dir={tmp_path / 'over'}", "trainer.max_steps=1",
                        "recipe.prompt_start=4", "recipe.num_prompts=3"])
    # The collection script selects the same range; with pre-collected trajectories a range is refused.
    directory = collect(compose_train([*FAST, *common, f"output_dir={tmp_path / 'script'}", "recipe.prompt_start=2",
                                       "recipe.num_prompts=3"]))
    assert [list(r["prompt_ids"]) for r in load_trajectories(directory)] == [list(p) for p in prompts[2:5]]
    with pytest.raises(ConfigError, match="recipe.trajectories_dir"):
        run_in_process([*common, f"output_dir={tmp_path / 'both'}", f"recipe.trajectories_dir={directory}",
                        "recipe.prompt_start=2"])
