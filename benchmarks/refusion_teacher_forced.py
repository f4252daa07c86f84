# python -m benchmarks.refusion_teacher_forced --base runs/default_base/hf --refusion runs/refusion_default/hf
"""Where a ReFusion conversion loses next-token accuracy: teacher-forced, by position in the slot.

ReFusion's ARM loss trains next-token targets inside a slot only (SPEC §3): a slot's first token is
never a next-token target, and the decoder takes it from the plan (the mask head). So the
conversion's own AR greedy can lose accuracy at slot starts while keeping it inside slots. For each
problem and each answer position j (the response and its EOS), each model sees the true prefix
``prompt + answer[:j]`` causally (``benchmarks.mdm_teacher_forced.ar_guesses``, one forward per
problem) and its argmax is scored against ``answer[j]``. Positions are split into slot starts
(``j % k == 0``, answer slots of k tokens from the first answer token, as the recipe cuts them) and
in-slot positions; k = the checkpoint's ``pardec.slot_size`` unless ``--slot-size``.

``--split val`` (default): the generator's validation split. Writes
``benchmarks/results/refusion_teacher_forced.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import held_out_rows, validation_rows
from benchmarks.mdm_teacher_forced import ar_guesses
from inference.checkpoint import load_checkpoint
from inference.decoders.refusion import resolve_slot_size

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="AR base export")
    p.add_argument("--refusion", required=True, help="ReFusion export (recipe=refusion)")
    p.add_argument("--num-samples", type=int, default=100)
    p.add_argument("--split", choices=("val", "test"), default="val")
    p.add_argument("--slot-size", type=int, default=None, help="k (default: the checkpoint's pardec.slot_size)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "refusion_teacher_forced"))
    return p.parse_args()


def slot_position_accuracy(guesses: Sequence[Sequence[int]], answers: Sequence[Sequence[int]], k: int) -> dict:
    """Accuracy of ``guesses[i][j]`` for ``answers[i][j]`` at slot starts (j % k == 0) and inside slots,
    with the token counts, and the share of problems with every token right."""
    hits = {"slot_start": [0, 0], "in_slot": [0, 0]}
    perfect = 0
    for guess, answer in zip(guesses, answers, strict=True):
        right = [g == a for g, a in zip(guess, answer, strict=True)]
        perfect += all(right)
        for j, ok in enumerate(right):
            key = "slot_start" if j % k == 0 else "in_slot"
            hits[key][0] += ok
            hits[key][1] += 1
    out = {f"accuracy_{key}": ok / n if n else None for key, (ok, n) in hits.items()}
    out.update({f"tokens_{key}": n for key, (_, n) in hits.items()})
    out["all_correct"] = perfect / len(answers) if answers else None
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = validation_rows(args.num_samples) if args.split == "val" else held_out_rows(args.num_samples)
    base, tok = load_checkpoint(args.base, device="cpu", dtype="float32")
    refusion, _ = load_checkpoint(args.refusion, device="cpu", dtype="float32")
    k = resolve_slot_size(refusion, args.slot_size)
    prompts = [tok(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows]
    answers = [tok(row["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for row in rows]
    table = []
    for label, model in ((f"base AR ({args.base})", base), (f"ReFusion ({args.refusion}), its AR head", refusion)):
        guesses = [ar_guesses(model, p, a) for p, a in zip(prompts, answers, strict=True)]
        table.append({"model": label, **slot_position_accuracy(guesses, answers, k)})
    fmt = lambda v: "—" if v is None else f"{v:.2%}"  # noqa: E731
    lines = [f"| model (causal, true prefix) | slot starts (k = {k}) | in-slot positions | problems all right |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {fmt(r['accuracy_slot_start'])} of {r['tokens_slot_start']} | "
              f"{fmt(r['accuracy_in_slot'])} of {r['tokens_in_slot']} | {fmt(r['all_correct'])} |" for r in table]
    md = "\n".join(lines)
    print(md)
    command = "python -m benchmarks.refusion_teacher_forced " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(
        f"Command: {command}\n\n{args.num_samples} problems ({args.split} split), teacher-forced next-token "
        f"accuracy (true answer prefix, causal), float32, CPU.\n\n{md}\n")
    out.with_suffix(".json").write_text(json.dumps({"slot_size": k, "rows": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
