# python -m pardec.benchmarks.refusion_teacher_forced --base runs/default_base/hf --refusion runs/refusion_default/hf
"""Where a ReFusion conversion loses next-token accuracy: teacher-forced, by position in the slot.

ReFusion's ARM loss trains next-token targets inside a slot only (docs/methods/refusion.md#loss): a
slot's first token is never a next-token target, and the decoder takes it from the plan (the mask head). So the
conversion's own AR greedy can lose accuracy at slot starts while keeping it inside slots. For each
problem and each answer position j (the response and its stop token, tokenised as the recipes do:
``mdm_teacher_forced.prompt_and_answer``, ``--template``), each model sees the true prefix
``prompt + answer[:j]`` causally (``pardec.benchmarks.mdm_teacher_forced.ar_guesses``, one forward per
problem) and its argmax is scored against ``answer[j]``. Positions are split into slot starts
(``j % k == 0``, answer slots of k tokens from the first answer token, as the recipe cuts them) and
in-slot positions; k = the checkpoint's ``pardec.slot_size`` unless ``--slot-size``.

A third row scores what the decoder uses at a slot start instead: the plan. At b = k every slot is
planned after all earlier slots are committed, so its plan forward is the committed context
followed by the slot's masks (up to ``--max-new-tokens`` answer positions), plain causal attention
(``pardec.masks.refusion.refusion_decode_mask`` with every entry shared), each mask predicting its own
token; the first mask's argmax is the slot's first token (:func:`plan_guesses`).

``--split val`` (default): the generator's validation split. Writes
``benchmarks/results/refusion_teacher_forced.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from pardec.benchmarks.common import (
    RESULTS,
    add_split_arg,
    add_template_arg,
    invoked_command,
    or_dash,
    split_rows,
    write_results,
)
from pardec.benchmarks.mdm_teacher_forced import ar_guesses, prompt_and_answer
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.refusion import resolve_slot_size
from pardec.models.loading import mask_token_id


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="AR base export")
    p.add_argument("--refusion", required=True, help="ReFusion export (recipe=refusion)")
    p.add_argument("--num-samples", type=int, default=100)
    add_split_arg(p, default="val")
    p.add_argument("--slot-size", type=int, default=None, help="k (default: the checkpoint's pardec.slot_size)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="the decoders' target length (caps the masks)")
    add_template_arg(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "refusion_teacher_forced"))
    return p.parse_args()


@torch.no_grad()
def plan_guesses(model, prompt: list[int], answer: list[int], k: int, mask_id: int, max_new_tokens: int) -> list[int]:
    """The plan's first-token argmax for each slot start j of ``answer`` (j = 0, k, 2k, ...): one causal
    forward over ``prompt + answer[:j]`` and the slot's masks at positions ``P + j ..``."""
    guesses = []
    for j in range(0, len(answer), k):
        masks = min(k, max_new_tokens - j)
        ids = torch.tensor([prompt + answer[:j] + [mask_id] * masks])  # [1, P + j + masks]
        logits = model(input_ids=ids).logits[0]  # [P + j + masks, V]
        guesses.append(int(logits[len(prompt) + j].argmax()))  # the first mask predicts its own token
    return guesses


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
    rows = split_rows(args.split, args.num_samples)
    base, tok = load_checkpoint(args.base, device="cpu", dtype="float32")
    refusion, refusion_tok = load_checkpoint(args.refusion, device="cpu", dtype="float32")
    k = resolve_slot_size(refusion, args.slot_size)
    prompts, answers = zip(*(prompt_and_answer(tok, row, args.template) for row in rows), strict=True)
    table = []
    for label, model in ((f"base AR ({args.base})", base), (f"ReFusion ({args.refusion}), its AR head", refusion)):
        guesses = [ar_guesses(model, p, a) for p, a in zip(prompts, answers, strict=True)]
        table.append({"model": label, **slot_position_accuracy(guesses, answers, k)})
    mask_id = mask_token_id(refusion, refusion_tok)
    starts = [a[::k] for a in answers]
    plans = [plan_guesses(refusion, p, a, k, mask_id, args.max_new_tokens)
             for p, a in zip(prompts, answers, strict=True)]
    plan_row = slot_position_accuracy(plans, starts, 1)  # every scored position is a slot start
    table.append({"model": f"ReFusion ({args.refusion}), its plan at slot starts", "accuracy_slot_start":
                  plan_row["accuracy_slot_start"], "tokens_slot_start": plan_row["tokens_slot_start"],
                  "accuracy_in_slot": None, "tokens_in_slot": 0, "all_correct": plan_row["all_correct"]})
    def cell(row: dict, key: str) -> str:
        return f"{or_dash(row[f'accuracy_{key}'], '.2%')} of {row[f'tokens_{key}']}" if row[f"tokens_{key}"] else "—"

    lines = [f"| model (true prefix) | slot starts (k = {k}) | in-slot positions | problems all right |",
             "|---|---|---|---|"]
    lines += [f"| {r['model']} | {cell(r, 'slot_start')} | {cell(r, 'in_slot')} | {or_dash(r['all_correct'], '.2%')} |"
              for r in table]
    md = "\n".join(lines) + ("\n\nThe plan row's last column counts problems whose every slot start the plan gets "
                             "right (in-slot tokens come from the AR head when the decoder verifies or completes).")
    print(md)
    write_results(args.out, invoked_command("pardec.benchmarks.refusion_teacher_forced"),
                  f"{args.num_samples} problems ({args.split} split), teacher-forced (true answer prefix, causal): "
                  f"the AR heads' next-token guesses and the plan's first-token guesses, float32, CPU.\n\n{md}",
                  {"slot_size": k, "rows": table})


if __name__ == "__main__":
    main()
