"""Validation metrics from per-sample records (definitions: docs/methods/conventions.md#counting).

A record is a dict with at least ``committed``, ``forwards``, ``wall_time_s``, ``rank``,
``hit_eos``, ``output_ids``, ``correct`` (bool, or None when the sample has no gold answer) and
``reference_ids`` (the AR greedy output, or None when not computed). Aggregates:

- ``tpf`` = Σ committed / Σ forwards over every sample (prefill excluded, EOS included);
- ``nfe`` = Σ forwards; ``nfe_per_sample`` its mean;
- ``tps`` = Σ committed / ``decode_time_s``, where ``decode_time_s`` is the largest per-rank sum
  of decoding-loop time: ranks decode their shards concurrently, so the slowest rank bounds the
  wall time (with one process it is simply the summed loop time);
- ``accuracy`` = exact-answer accuracy over the samples that have a gold answer
  (``accuracy_n`` of them): :func:`pardec.data_pipelines.synthetic_gsm.extract_answer` of the output
  equals the gold answer; ``accuracy_flexible`` the same with the output's last number
  (:func:`pardec.data_pipelines.synthetic_gsm.extract_last_number`), for models that answer in
  their own words (a chat model before fine-tuning);
- ``agreement_exact`` = fraction of samples whose output equals the AR greedy output token for
  token, ``agreement_prefix`` = mean over samples of LCP(out, ref) / max(|out|, |ref|) (1 only
  when identical). For the AR greedy decoder itself both are the string ``"reference"`` (never a
  trivially true 100 %); they are None when no reference was computed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from pardec.data_pipelines.synthetic_gsm import extract_answer, extract_last_number

REFERENCE = "reference"


def gold_answer(row: Mapping[str, Any]) -> str | None:
    """The gold answer of a dataset row: its ``answer`` column, else extracted from ``response``."""
    if row.get("answer") is not None:
        return str(row["answer"]).strip()
    return extract_answer(row.get("response") or "")


def score_answer(output_text: str, gold: str | None) -> tuple[str | None, bool | None]:
    """``(predicted answer, correct)``; correct is None when there is no gold answer."""
    predicted = extract_answer(output_text)
    if gold is None:
        return predicted, None
    return predicted, predicted is not None and _normalise(predicted) == _normalise(gold)


def _normalise(answer: str) -> str:
    answer = answer.strip().replace(",", "")
    try:
        return str(int(answer))
    except ValueError:
        return answer


def prefix_agreement(output: Sequence[int], reference: Sequence[int]) -> float:
    """Length of the common prefix over the longer of the two sequences (1.0 for two empty ones)."""
    longest = max(len(output), len(reference))
    if longest == 0:
        return 1.0
    lcp = 0
    for a, b in zip(output, reference):
        if a != b:
            break
        lcp += 1
    return lcp / longest


def compute_metrics(records: Sequence[Mapping[str, Any]], is_ar_greedy: bool) -> dict[str, Any]:
    if not records:
        raise ValueError("no records to compute metrics from (empty eval set?)")
    committed = sum(r["committed"] for r in records)
    forwards = sum(r["forwards"] for r in records)
    rank_time: dict[int, float] = defaultdict(float)
    for r in records:
        rank_time[r["rank"]] += r["wall_time_s"]
    decode_time = max(rank_time.values())
    scored = [r["correct"] for r in records if r["correct"] is not None]
    metrics: dict[str, Any] = {
        "num_samples": len(records),
        "committed_tokens": committed,
        "nfe": forwards,
        "nfe_per_sample": forwards / len(records),
        "tpf": committed / forwards if forwards else None,
        "tps": committed / decode_time if decode_time > 0 else None,
        "decode_time_s": decode_time,
        "mean_new_tokens": committed / len(records),
        "eos_rate": sum(bool(r["hit_eos"]) for r in records) / len(records),
        "accuracy": sum(scored) / len(scored) if scored else None,
        "accuracy_flexible": _flexible_accuracy(records),
        "accuracy_n": len(scored),
    }
    metrics.update(_agreement(records, is_ar_greedy))
    return metrics


def _flexible_accuracy(records: Sequence[Mapping[str, Any]]) -> float | None:
    golds = [(r.get("output_text") or "", r.get("answer")) for r in records if r.get("correct") is not None]
    if not golds:
        return None
    hits = [(p := extract_last_number(text)) is not None and _normalise(p) == _normalise(gold) for text, gold in golds]
    return sum(hits) / len(hits)


def _agreement(records: Sequence[Mapping[str, Any]], is_ar_greedy: bool) -> dict[str, Any]:
    if is_ar_greedy:
        return {"agreement_exact": REFERENCE, "agreement_prefix": REFERENCE}
    if any(r.get("reference_ids") is None for r in records):
        return {"agreement_exact": None, "agreement_prefix": None}
    exact = [list(r["output_ids"]) == list(r["reference_ids"]) for r in records]
    prefix = [prefix_agreement(r["output_ids"], r["reference_ids"]) for r in records]
    return {"agreement_exact": sum(exact) / len(records), "agreement_prefix": sum(prefix) / len(records)}


def format_markdown(metrics: Mapping[str, Any], title: str | None = None) -> str:
    """A two-column markdown table (floats with 4 significant decimals)."""
    lines = [f"### {title}", ""] if title else []
    lines += ["| metric | value |", "| --- | --- |"]
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif value is None:
            value = "n/a"
        lines.append(f"| {key} | {value} |")
    return "\n".join(lines) + "\n"
