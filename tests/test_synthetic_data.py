"""Embedded default data and tokenizer: determinism, disjoint splits, correct answers, round trips.

The answers are re-derived independently of the generator: once by re-evaluating every
chain-of-thought line's arithmetic, once by solving the question text with a small regex solver.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, extract_answer, extract_last_number, generate_split
from pardec.data_pipelines.synthetic_tokenizer import build_synthetic_tokenizer

REPO = Path(__file__).resolve().parents[1]
CFG = SyntheticGSMConfig(num_train=3000)
LINE = re.compile(r"(\d+) ([-+*]) (\d+) = (\d+)")
FINAL = re.compile(r"\n#### (\d+)$")
# (regex over one question sentence, how it changes the running value)
SOLVER_RULES = [
    (r"\w+ has (\d+) \w+ with (\d+) \w+ in each\.", lambda v, a, b: a * b),
    (r"\w+ has (\d+) \w+\.", lambda v, a: a),
    (r"\w+ buys (\d+) \w+ that cost (\d+) dollars each\.", lambda v, a, b: v - a * b),
    (r"\w+ (?:buys|finds) (\d+) more\.", lambda v, a: v + a),
    (r"\w+ gives \w+ (\d+) (?:more|dollars)\.", lambda v, a: v + a),
    (r"\w+ gives (\d+) to \w+\.", lambda v, a: v - a),
    (r"\w+ (?:sells|loses) (\d+) of them\.", lambda v, a: v - a),
    (r"\w+ then buys enough to have (\d+) times as many\.", lambda v, a: v * a),
    (r"\w+ (?:earns|finds) (\d+) dollars\.", lambda v, a: v + a),
    (r"\w+ (?:spends|pays) (\d+) dollars (?:on|for) a \w+\.", lambda v, a: v - a),
]


@pytest.fixture(scope="module")
def splits() -> dict[str, list[dict]]:
    return {split: generate_split(CFG, split) for split in ("train", "test")}


@pytest.fixture(scope="module")
def tok():
    return build_synthetic_tokenizer(CFG)


def _texts(rows: list[dict]) -> list[str]:
    return [row["prompt"] + row["response"] for row in rows]


def _solve(prompt: str) -> int:
    """Answer a generated question from its text alone."""
    body = prompt.removeprefix("Question: ").removesuffix("\nAnswer:")
    sentences = re.findall(r"[^.?]+[.?]", body)
    assert sentences[-1].strip().startswith("How many"), prompt
    value = None
    for sentence in sentences[:-1]:
        sentence = sentence.strip()
        for pattern, update in SOLVER_RULES:
            match = re.fullmatch(pattern, sentence)
            if match:
                value = update(value, *map(int, match.groups()))
                break
        else:
            raise AssertionError(f"unparsed sentence {sentence!r} in {prompt!r}")
    return value


def test_sizes_and_format(splits: dict[str, list[dict]]) -> None:
    assert len(splits["train"]) == CFG.num_train and len(splits["test"]) == CFG.num_test
    for row in splits["train"][:500] + splits["test"]:
        assert set(row) == {"prompt", "response", "answer"}
        assert all(isinstance(v, str) for v in row.values())
        assert row["prompt"].startswith("Question: ") and row["prompt"].endswith("\nAnswer:")
        assert row["response"].startswith(" ") and row["response"].endswith(f"\n#### {row['answer']}")
        assert int(row["answer"]) >= 0 and str(int(row["answer"])) == row["answer"]


def test_deterministic_per_seed(splits: dict[str, list[dict]]) -> None:
    assert generate_split(CFG, "test") == splits["test"]
    assert generate_split(CFG, "train") == splits["train"]
    other = replace(CFG, seed=CFG.seed + 1)
    assert generate_split(other, "test") != splits["test"]
    assert generate_split(other, "train")[:100] != splits["train"][:100]


def test_a_config_node_gives_the_same_problems_as_the_dataclass(splits: dict[str, list[dict]]) -> None:
    """Training and benchmarks pass an OmegaConf node (read once into the dataclass, not per access)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(CFG)
    assert generate_split(node, "test") == splits["test"]
    assert generate_split(node, "train") == splits["train"]
    assert generate_split(OmegaConf.create({**vars(CFG), "num_val": 7}), "val") == generate_split(
        replace(CFG, num_val=7), "val")


def test_independent_of_python_hash_seed(splits: dict[str, list[dict]]) -> None:
    code = (
        "from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, generate_split;"
        "print(generate_split(SyntheticGSMConfig(num_test=3), 'test')[2]['prompt'])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        ).stdout
        for hash_seed in ("0", "1")
    }
    assert outputs == {splits["test"][2]["prompt"] + "\n"}


def test_splits_disjoint_and_unique(splits: dict[str, list[dict]]) -> None:
    train = [row["prompt"] for row in splits["train"]]
    test = [row["prompt"] for row in splits["test"]]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)


def test_train_excludes_test_prompts_even_when_the_space_is_small() -> None:
    cfg = SyntheticGSMConfig(num_train=300, num_test=100, min_steps=1, max_steps=1, max_operand=3, max_value=6)
    train = {row["prompt"] for row in generate_split(cfg, "train")}
    test = {row["prompt"] for row in generate_split(cfg, "test")}
    assert len(train) == 300 and len(test) == 100 and not train & test


def test_chain_of_thought_arithmetic_gives_the_answer(splits: dict[str, list[dict]]) -> None:
    for row in splits["train"] + splits["test"]:
        lines = LINE.findall(row["response"])
        assert CFG.min_steps <= len(lines) <= CFG.max_steps, row
        for a, op, b, c in lines:
            a, b, c = int(a), int(b), int(c)
            assert c == {"+": a + b, "-": a - b, "*": a * b}[op], row
            assert 0 <= c <= CFG.max_value, row
            assert op == "*" or b <= CFG.max_operand, row
        assert FINAL.search(row["response"]).group(1) == lines[-1][3] == row["answer"], row


def test_question_text_determines_the_answer(splits: dict[str, list[dict]]) -> None:
    for row in splits["train"][:1000] + splits["test"]:
        assert _solve(row["prompt"]) == int(row["answer"]), row


def test_difficulty_knobs() -> None:
    cfg = SyntheticGSMConfig(num_train=0, num_test=300, min_steps=3, max_steps=3, max_operand=9,
                             max_value=30, allow_multiply=False)
    for row in generate_split(cfg, "test"):
        lines = LINE.findall(row["response"])
        assert len(lines) == 3 and all(op != "*" for _, op, _, _ in lines)
        assert all(int(n) <= 30 for line in lines for n in (line[0], line[2], line[3]))
        assert all(int(line[2]) <= 9 for line in lines)
        assert _solve(row["prompt"]) == int(row["answer"])


def test_bad_split_and_config_raise() -> None:
    with pytest.raises(ValueError, match="split"):
        generate_split(CFG, "validation")
    with pytest.raises(ValueError, match="min_steps"):
        generate_split(replace(CFG, min_steps=3, max_steps=2), "test")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (" Tom has 5 + 3 = 8 apples.\n#### 8", "8"),
        ("#### 3\n#### 12 apples", "12"),
        ("####12", "12"),
        ("#### 007", "7"),
        ("#### -4", "-4"),
        ("Tom has 8 apples.", None),
        ("#### eight", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Lily has 73 + 11 = 84 dollars, so she has 75 now.", "75"),
        ("The answer is **1,250** apples.", "1250"),
        ("#### 8", "8"),
        ("She ends with -3 dollars", "-3"),
        ("no number here", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


def test_extract_answer_on_generated_responses(splits: dict[str, list[dict]]) -> None:
    assert all(extract_answer(row["response"]) == row["answer"] for row in splits["test"])


def test_tokenizer_round_trip_without_unk(splits: dict[str, list[dict]], tok) -> None:
    for text in _texts(splits["test"] + splits["train"][:2000]):
        ids = tok(text).input_ids
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_covers_other_configurations(tok) -> None:
    cfg = SyntheticGSMConfig(num_train=0, num_test=500, seed=7, max_steps=4, max_operand=50, max_value=500)
    for text in _texts(generate_split(cfg, "test")):
        ids = tok(text).input_ids
        assert tok.unk_token_id not in ids and tok.decode(ids) == text


def test_tokenizer_layout(tok) -> None:
    assert len(tok) < 512
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == tok.pad_token_id
    assert tok.unk_token == "<|unk|>" and tok.bos_token is None
    assert "<|mask|>" not in tok.get_vocab()
    assert tok.convert_ids_to_tokens(tok(" 1207").input_ids) == [" 1", "2", "0", "7"]
    assert tok.convert_ids_to_tokens(tok("\n#### 8").input_ids) == ["\n", "####", " 8"]
    assert tok("Tom").input_ids[-1] != tok.eos_token_id  # no automatic special tokens
    assert build_synthetic_tokenizer(replace(CFG, seed=99)).get_vocab() == tok.get_vocab()


def test_tokenizer_save_reload(splits: dict[str, list[dict]], tok, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.get_vocab() == tok.get_vocab()
    assert (reloaded.eos_token_id, reloaded.pad_token_id, reloaded.unk_token_id) == (
        tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
    for text in _texts(splits["test"]):
        ids = tok(text).input_ids
        assert reloaded(text).input_ids == ids
        assert reloaded.decode(ids, skip_special_tokens=True) == text
