"""The lm-eval model ``pardec`` (pardec/evaluation/): against lm-eval's own HF model, AR greedy against a
lossless parallel decoder, stop strings, decoder stats, the offline synthetic task against validation.

Offline and on CPU: tiny random Qwen3 models over the embedded synthetic tokenizer (plus one whose answer is
fixed, so exact match is not trivially 0), the task's data written by ``pardec-lm-eval-data``'s code, and an
lm-eval TaskManager that indexes only that folder."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.data_pipelines.sources import load_raw_split
from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, generate_split
from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer
from pardec.evaluation.model import PardecLM, harness_device, validate_overrides
from pardec.evaluation.stopping import hf_continuation, special_stop_ids
from pardec.evaluation.synthetic_task import DATA_FILE, TASK, process_results, synthetic_config, write_task
from pardec.inference.checkpoint import load_for_decoding
from pardec.inference.compose import compose_validate_config
from pardec.inference.evaluate import evaluate
from pardec.models.loading import add_mask_token
from tests.conftest import tiny_model
from tests.train_utils import TORCHRUN_2

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
NUM_TEST = 8
MAX_NEW = 16
JACOBI = "decoder=jacobi,block_size=4"


@pytest.fixture(scope="module")
def tok():
    return build_synthetic_tokenizer(SyntheticGSMConfig())


@pytest.fixture(scope="module")
def rows():
    return generate_split(SyntheticGSMConfig(num_test=NUM_TEST), "test")


def answering_model(tok, answer: str):
    """Writes ``#### <answer>`` then EOS after any prompt: attention and MLP outputs are zeroed, so the logits
    depend on the current token only, and the embeddings/head map any token -> ``####`` -> `` <answer>`` -> EOS."""
    model = tiny_model(len(tok))
    hashes, digit = tok.convert_tokens_to_ids(["####", " " + answer])
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        embed.zero_()
        head.zero_()
        embed[:, 0] = 1.0
        embed[hashes], embed[digit] = torch.eye(embed.shape[1])[1], torch.eye(embed.shape[1])[2]
        head[hashes, 0], head[digit, 1], head[tok.eos_token_id, 2] = 10.0, 10.0, 10.0
    return model


@pytest.fixture(scope="module")
def common_answer(rows) -> str:
    digits = Counter(r["answer"] for r in rows if len(r["answer"]) == 1)
    assert digits, "the test problems need a one-digit answer"
    return digits.most_common(1)[0][0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tok, common_answer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ck")
    models = {"random": tiny_model(len(tok)), "answering": answering_model(tok, common_answer)}
    for name, model in models.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return {name: root / name for name in models}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tasks")
    write_task(out, SyntheticGSMConfig(num_test=NUM_TEST))
    return out


@pytest.fixture(scope="module")
def task_manager(task_dir):
    return TaskManager(include_path=str(task_dir), include_defaults=False)


def requests(rows, gen_kwargs: dict) -> list[Instance]:
    return [
        Instance("generate_until", row, (row["prompt"], dict(gen_kwargs)), i, ("toy", i, 1))
        for i, row in enumerate(rows)
    ]


def record_decodes(lm) -> list[list[int]]:
    """The token lists ``lm`` turns into continuation text (decode with special tokens skipped)."""
    seen: list[list[int]] = []
    decode = lm.tokenizer.decode

    def spy(*args, **kwargs):
        ids = args[0] if args else kwargs.get("token_ids")
        if kwargs.get("skip_special_tokens") and isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            seen.append(list(ids))
        return decode(*args, **kwargs)

    lm.tokenizer.decode = spy
    return seen


def pardec_lm(checkpoint: Path, model_args: str = "", **kwargs) -> PardecLM:
    args = dict(kv.split("=") for kv in model_args.split(",") if kv)
    return PardecLM(checkpoint=str(checkpoint), device="cpu", max_new_tokens=MAX_NEW, **args, **kwargs)


@pytest.fixture(scope="module")
def hf_lm(checkpoints):
    return HFLM(pretrained=str(checkpoints["random"]), device="cpu", batch_size=1)


# -- against lm-eval's HF model ---------------------------------------------------------------------


def test_ar_generate_until_equals_hf_token_for_token(checkpoints, hf_lm, rows):
    ours = pardec_lm(checkpoints["random"])
    hf_tokens, our_tokens = record_decodes(hf_lm), record_decodes(ours)
    reqs = requests(rows, {"until": [], "max_gen_toks": MAX_NEW, "do_sample": False})
    hf_text, our_text = hf_lm.generate_until(reqs), ours.generate_until(reqs)
    assert our_text == hf_text
    assert sorted(our_tokens) == sorted(hf_tokens) and len(our_tokens) == len(rows)  # HF decodes longest first
    assert all(len(t) == MAX_NEW for t in our_tokens)  # the random model never emits EOS here


def stop_strings(free: list[str], tok) -> list[str]:
    """Stop strings met inside the free generations: two tokens of sample 0 (a multi-token stop), one token of
    sample 1, and one that never occurs."""
    ids0, ids1 = (tok(text, add_special_tokens=False)["input_ids"] for text in free[:2])
    return [tok.decode(ids0[5:7]), tok.decode(ids1[9:10]), "never in any output"]


@pytest.mark.parametrize("model_args", ["", JACOBI])
def test_stop_strings_cut_where_hf_cuts(checkpoints, hf_lm, rows, tok, model_args):
    free = hf_lm.generate_until(requests(rows, {"until": [], "max_gen_toks": MAX_NEW}))
    until = stop_strings(free, tok)
    reqs = requests(rows, {"until": until, "max_gen_toks": MAX_NEW})
    expected = hf_lm.generate_until(reqs)
    assert sum(len(e) < len(f) for e, f in zip(expected, free)) >= 2  # the stops do cut
    assert pardec_lm(checkpoints["random"], model_args).generate_until(reqs) == expected


def test_special_token_stop_ends_where_generate_stops(tok):
    """A stop string that is a special token: HF stops on the step that emits it and skips it when decoding,
    so the text after it is dropped although the stop string itself never shows in the decoded text."""
    unk = tok.unk_token_id
    before, after = (tok(text, add_special_tokens=False)["input_ids"] for text in ("Tom has", " 5 apples"))
    assert hf_continuation(tok, before + [unk] + after, [tok.unk_token]) == "Tom has"
    assert hf_continuation(tok, before + [unk] + after, []) == "Tom has 5 apples"
    assert special_stop_ids(tok, [tok.unk_token, tok.eos_token, "Tom"]) == {unk, tok.eos_token_id}


def mdm_export(tok, path: Path) -> Path:
    """A tiny checkpoint recording what a recipe=mdm export records (bidirectional attention, shift, <|mask|>)."""
    tok = copy.deepcopy(tok)
    model = tiny_model(len(tok) + 1)
    mask_id = add_mask_token(model, tok)
    CheckpointMetadata(recipe="mdm", attention="bidirectional", logit_shift=True, mask_token_id=mask_id).write_to(model)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_loglikelihood_on_an_ar_checkpoint_a_named_error_on_an_mdm(checkpoints, hf_lm, rows, tok, tmp_path):
    """lm-eval's HF loglikelihood on the AR head; an MDM export (no AR head) refuses both likelihood requests
    and still generates with an MDM decoder; a causal decoder on it is refused when the model is built."""
    reqs = [Instance("loglikelihood", row, (row["prompt"], row["response"]), i) for i, row in enumerate(rows[:3])]
    ours = pardec_lm(checkpoints["random"]).loglikelihood(reqs)
    theirs = hf_lm.loglikelihood(reqs)
    assert [g for _, g in ours] == [g for _, g in theirs]
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], rel=1e-5)
    mdm = mdm_export(tok, tmp_path / "mdm")
    lm = pardec_lm(mdm, "decoder=mdm_lowconf,block_size=8")
    with pytest.raises(CheckpointError, match="loglikelihood needs a next-token .* kind mdm-bidirectional"):
        lm.loglikelihood(reqs)
    with pytest.raises(CheckpointError, match="loglikelihood_rolling needs"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", rows[0], (rows[0]["prompt"],), 0)])
    [text] = lm.generate_until(requests(rows[:1], {"until": [], "max_gen_toks": MAX_NEW}))
    assert lm.decoder_stats()["toy"]["num_samples"] == 1 and isinstance(text, str)
    with pytest.raises(CheckpointError, match="decoder 'ar' decodes checkpoints of kind"):
        pardec_lm(mdm)


# -- the offline task -------------------------------------------------------------------------------


def harness(checkpoint: Path, model_args: str, task_manager, batch_size: int = 1, limit: int | None = None) -> dict:
    args = f"checkpoint={checkpoint},device=cpu,max_new_tokens={MAX_NEW},{model_args}".strip(",")
    return simple_evaluate(model="pardec", model_args=args, tasks=[TASK], task_manager=task_manager,
                           batch_size=batch_size, limit=limit, log_samples=True, bootstrap_iters=0)


def responses(results: dict) -> list[str]:
    return [s["filtered_resps"][0] for s in sorted(results["samples"][TASK], key=lambda s: s["doc_id"])]


@pytest.mark.parametrize("name", ["random", "answering"])
def test_lossless_parallel_decoder_scores_as_ar_greedy(checkpoints, task_manager, rows, common_answer, name):
    ar = harness(checkpoints[name], "", task_manager)
    jacobi = harness(checkpoints[name], JACOBI, task_manager, batch_size=2)
    assert responses(jacobi) == responses(ar) and len(responses(ar)) == NUM_TEST
    score = ar["results"][TASK]["exact_match,none"]
    assert jacobi["results"][TASK]["exact_match,none"] == score
    if name == "answering":  # brute force: the fraction of problems whose answer is the one the model writes
        assert score == sum(r["answer"] == common_answer for r in rows) / NUM_TEST > 0
    ar_stats = ar["config"]["pardec"]["decoder_stats"][TASK]
    jacobi_stats = jacobi["config"]["pardec"]["decoder_stats"][TASK]
    assert ar_stats["tpf"] == 1.0 and ar_stats["num_samples"] == jacobi_stats["num_samples"] == NUM_TEST
    assert jacobi_stats["committed_tokens"] == ar_stats["committed_tokens"]
    assert jacobi_stats["nfe"] <= ar_stats["nfe"] and jacobi_stats["tps"] > 0
    decoder = jacobi["config"]["pardec"]["decoder"]
    assert (decoder["name"], decoder["batch_size"]) == ("jacobi", 2)


def validation(checkpoint: Path, decoder_overrides: list[str]):
    """pardec-validate's result on the synthetic test split (its config, loading and evaluation core)."""
    cfg = compose_validate_config([
        f"checkpoint={checkpoint}", "device=cpu", f"data.synthetic.num_test={NUM_TEST}",
        f"decoder.max_new_tokens={MAX_NEW}", *decoder_overrides,
    ])
    model, tokenizer, auxiliary = load_for_decoding(cfg)
    return evaluate(model, tokenizer, load_raw_split(cfg.data, "eval"), cfg.decoder, template=cfg.data.template,
                    add_bos=cfg.add_bos, agreement=False, auxiliary=auxiliary)


@pytest.mark.parametrize("name", ["random", "answering"])
def test_local_task_score_equals_validation(checkpoints, task_manager, name):
    result = validation(checkpoints[name], ["decoder=jacobi", "decoder.block_size=4"])
    harnessed = harness(checkpoints[name], JACOBI, task_manager)
    assert responses(harnessed) == [r["output_text"] for r in result.records]
    per_doc = [s["exact_match"] for s in sorted(harnessed["samples"][TASK], key=lambda s: s["doc_id"])]
    assert per_doc == [float(r["correct"]) for r in result.records]
    assert harnessed["results"][TASK]["exact_match,none"] == result.metrics["accuracy"]
    stats = harnessed["config"]["pardec"]["decoder_stats"][TASK]
    assert (stats["committed_tokens"], stats["nfe"]) == (result.metrics["committed_tokens"], result.metrics["nfe"])


def run_cli(launcher: list[str], checkpoint: Path, task_dir: Path, out: Path, extra: list[str]) -> tuple[dict, str]:
    """``pardec-lm-eval`` (lm-eval's CLI with the model registered) on the task written by ``pardec-lm-eval-data``;
    the results file it wrote and its standard output."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [*launcher, "-m", "pardec.cli.lm_eval_harness", "--model", "pardec", "--model_args",
           f"checkpoint={checkpoint},decoder=jacobi,block_size=4,max_new_tokens={MAX_NEW}",
           "--include_path", str(task_dir), "--tasks", TASK, "--output_path", str(out / "run.json"), *extra]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [written] = list(out.glob("run_*.json"))
    return json.loads(written.read_text()), proc.stdout


@pytest.mark.slow  # ~30 s: lm-eval's CLI indexes its thousands of built-in task files first
def test_cli_writes_scores_and_decoder_stats(checkpoints, task_dir, tmp_path):
    results, stdout = run_cli([sys.executable], checkpoints["answering"], task_dir, tmp_path / "out", [])
    expected = validation(checkpoints["answering"], ["decoder=jacobi", "decoder.block_size=4"]).metrics
    assert results["results"][TASK]["exact_match,none"] == expected["accuracy"] > 0
    stats = results["config"]["pardec"]["decoder_stats"][TASK]
    assert stats["tpf"] == expected["tpf"] and stats["num_samples"] == NUM_TEST
    assert "| tpf |" in stdout


@pytest.mark.slow  # ~70 s: two lm-eval CLI processes under torchrun (gloo on CPU)
def test_two_ranks_match_one_process(checkpoints, task_dir, task_manager, tmp_path):
    """lm-eval's data parallelism on pardec's process group: 7 documents over 2 ranks (one padding copy on
    rank 1), the same per-document answers as one process, the stats gathered without the padding copy."""
    results, _ = run_cli(TORCHRUN_2, checkpoints["random"], task_dir, tmp_path / "out",
                         ["--limit", "7", "--log_samples"])
    single = harness(checkpoints["random"], JACOBI, task_manager, limit=7)
    [samples_file] = list((tmp_path / "out").glob("samples_*.jsonl"))
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == responses(single)
    stats = results["config"]["pardec"]["decoder_stats"][TASK]
    single_stats = single["config"]["pardec"]["decoder_stats"][TASK]
    assert results["config"]["pardec"]["world_size"] == 2 and stats["num_samples"] == 7
    assert (stats["committed_tokens"], stats["nfe"]) == (single_stats["committed_tokens"], single_stats["nfe"])


# -- small pieces -----------------------------------------------------------------------------------


def test_model_args_map_to_validation_overrides():
    assert validate_overrides("ck", "jacobi", {"block_size": 16, "add_bos": True, "dtype": "float32", "x": None}) == [
        "checkpoint=ck", "decoder=jacobi", "decoder.block_size=16", "add_bos=true", "dtype=float32", "decoder.x=null",
    ]
    assert harness_device("cpu") == "cpu"
    assert harness_device("cuda:0") == ("cuda:0" if torch.cuda.is_available() else "auto")


def test_bad_model_args_are_named(checkpoints):
    with pytest.raises(ConfigError, match="batch_size 'auto'"):
        pardec_lm(checkpoints["random"], batch_size="auto")
    with pytest.raises(ConfigError, match="decoder.blok"):
        pardec_lm(checkpoints["random"], "decoder=jacobi,blok=4")
    with pytest.raises(ConfigError, match="decoder/nope"):
        pardec_lm(checkpoints["random"], "decoder=nope")


def test_task_files_and_scoring(task_dir, rows):
    written = [json.loads(line) for line in (task_dir / DATA_FILE).read_text().splitlines()]
    assert written == rows
    yaml_text = (task_dir / f"{TASK}.yaml").read_text()
    assert "pardec/evaluation/tasks/pardec_synthetic_gsm.yaml" in yaml_text
    assert str((task_dir / DATA_FILE).resolve()) in yaml_text
    assert process_results({"answer": "12"}, ["... so #### 3\n#### 012"]) == {"exact_match": 1.0}
    assert process_results({"answer": "12"}, ["#### 12 and #### 13"]) == {"exact_match": 0.0}
    assert process_results({"answer": "12"}, ["12"]) == {"exact_match": 0.0}
    with pytest.raises(ConfigError, match="nmu_test"):
        synthetic_config(["nmu_test=3"])
    assert synthetic_config(["num_test=3"]).num_test == 3


def test_repeats_and_padding_copies(checkpoints, rows):
    """lm-eval repeats a request object for repeats and again to pad ranks: repeat r samples with its own seed
    index, and padding copies are answered but left out of the stats."""
    lm = pardec_lm(checkpoints["random"], "decoder=ar_sample")
    [request] = requests(rows[:1], {"until": [], "max_gen_toks": MAX_NEW})
    request.repeats = 2
    first, second, _padding = lm.generate_until([request, request, request])
    assert first != second
    assert lm.decoder_stats()["toy"]["num_samples"] == 2


def test_sampling_request_keys_are_reported_once_as_ignored(checkpoints, rows, caplog):
    lm = pardec_lm(checkpoints["random"])
    greedy = {"until": [], "max_gen_toks": 2, "do_sample": False, "temperature": 0.0}
    sampled = {"until": [], "max_gen_toks": 2, "do_sample": True, "top_p": 0.9}

    def ours():
        return [r for r in caplog.records if r.name == "pardec.evaluation.model"]

    lm.generate_until(requests(rows[:1], greedy))
    assert not ours()
    lm.generate_until(requests(rows[:2], sampled))
    lm.generate_until(requests(rows[:1], sampled))
    [warning] = ours()
    assert "'do_sample': True" in warning.getMessage() and "'top_p': 0.9" in warning.getMessage()
