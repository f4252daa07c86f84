# python -m pardec.benchmarks.mdm_teacher_forced --base runs/default_base/hf --mdm runs/mdm_default/hf
"""Where an MDM conversion loses accuracy: next-token accuracy with the true answer prefix given.

For each problem and each answer position j (the response and its stop token: EOS, or the end of turn
under a chat template; prompt and answer tokenised as the recipes do, ``--template``, so a chat base is
scored on the format it was fine-tuned on), the MDM sees the state of
left-to-right decoding after j correct commits: ``prompt + answer[:j]`` followed by ``<|mask|>`` up
to ``--gen-length`` answer positions, under the checkpoint's own attention (``pardec.masks.mdm``, as the
MDM decoders build it). With the logit shift, its argmax at position ``P + j - 1`` is its guess for
``answer[j]``. The base gets the same prefix causally, as AR greedy would. Both are teacher-forced:
every prefix is the true one, so the numbers say how well each model predicts, not how errors
compound.

Columns: per-token accuracy over all answer tokens, over digit tokens (the copied and computed
numbers) and over the other tokens, and the share of problems whose every answer token is right
(what greedy one-token-per-step decoding in left-to-right order needs to reproduce the answer).

``--split val`` (default): the generator's validation split, where conversions are diagnosed.
Writes ``benchmarks/results/mdm_teacher_forced.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse

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
from pardec.data_pipelines.tokenize import encode_example, stop_token_ids
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.mdm_common import mdm_info
from pardec.inference.decoders.mdm_guided import check_guide_tokenizer
from pardec.masks.core import additive_mask
from pardec.masks.mdm import answer_block_ids, mdm_mask
from pardec.models.bidirectional import non_causal


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="AR base export")
    p.add_argument("--mdm", required=True, help="MDM export (recipe=mdm)")
    p.add_argument("--num-samples", type=int, default=50)
    add_split_arg(p, default="val")
    p.add_argument("--gen-length", type=int, default=64, help="answer positions the MDM sees (the decoders' L)")
    add_template_arg(p)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "mdm_teacher_forced"))
    return p.parse_args()


@torch.no_grad()
def mdm_guesses(model, prompt: list[int], answer: list[int], gen_length: int) -> list[int]:
    """The MDM's argmax for ``answer[j]`` given ``prompt + answer[:j]`` and masks, for every j (one batch)."""
    info = mdm_info(model)
    p_len, total = len(prompt), len(prompt) + gen_length
    rows = torch.tensor([prompt + answer[:j] + [info.mask_id] * (gen_length - j) for j in range(len(answer))])
    positions = torch.arange(total)
    metadata = {"segment_ids": torch.zeros(1, total, dtype=torch.long),
                "block_ids": answer_block_ids(positions, p_len, info.attention_block_size or 1)[None]}
    mask = additive_mask(mdm_mask(info.attention, **metadata), 1, total, total, model.dtype)  # [1, 1, P + L, P + L]
    with non_causal(model):
        logits = model(input_ids=rows, position_ids=positions.expand_as(rows),
                       attention_mask=mask.expand(len(answer), -1, -1, -1)).logits  # [n_answer, P + L, V]
    queries = torch.arange(len(answer)) + p_len - 1  # row j reads its guess at P + j - 1
    return logits[torch.arange(len(answer)), queries].argmax(-1).tolist()


@torch.no_grad()
def ar_guesses(model, prompt: list[int], answer: list[int]) -> list[int]:
    """The AR base's argmax for ``answer[j]`` given ``prompt + answer[:j]``, for every j (one causal forward)."""
    logits = model(input_ids=torch.tensor([prompt + answer[:-1]])).logits[0]  # [P + n - 1, V]
    return logits[len(prompt) - 1:].argmax(-1).tolist()


def prompt_and_answer(tok, row, template: str = "auto") -> tuple[list[int], list[int]]:
    """A problem's prompt ids and its answer ids, as the recipes tokenise them under ``template``
    (``encode_example``; ``auto``: the chat template for a chat tokenizer, the format a chat base was
    fine-tuned on), the answer cut after its first stop token (EOS or the end of turn): where decoding stops."""
    ids, p_len = encode_example(tok, row["prompt"], row["response"], template)
    answer, stops = ids[p_len:], stop_token_ids(tok)
    end = next((i for i, token in enumerate(answer) if token in stops), len(answer) - 1)
    return ids[:p_len], answer[:end + 1]


def score(rows, tok, guess, template: str = "auto") -> dict:
    """Per-token accuracy (all, digits, other) and the share of problems with every token right."""
    hits = {"all": [0, 0], "digits": [0, 0], "other": [0, 0]}
    perfect = 0
    for row in rows:
        prompt, answer = prompt_and_answer(tok, row, template)
        right = [g == a for g, a in zip(guess(prompt, answer), answer, strict=True)]
        perfect += all(right)
        for token, ok in zip(answer, right):
            kind = "digits" if tok.decode([token]).strip().isdigit() else "other"
            for key in ("all", kind):
                hits[key][0] += ok
                hits[key][1] += 1
    out = {f"accuracy_{k}": ok / total if total else None for k, (ok, total) in hits.items()}
    out["tokens"] = hits["all"][1]
    out["all_correct"] = perfect / len(rows)
    return out


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    rows = split_rows(args.split, args.num_samples)
    base, tok = load_checkpoint(args.base, device="cpu", dtype="float32")
    mdm, mdm_tok = load_checkpoint(args.mdm, device="cpu", dtype="float32")
    check_guide_tokenizer(base, mdm_tok)  # the base must share the MDM's tokenizer, <|mask|> aside

    table = [
        {"model": f"base AR ({args.base}), causal",
         **score(rows, tok, lambda p, a: ar_guesses(base, p, a), args.template)},
        {"model": f"MDM ({args.mdm}), {mdm_info(mdm).attention}, {args.gen_length} answer positions",
         **score(rows, tok, lambda p, a: mdm_guesses(mdm, p, a, args.gen_length), args.template)},
    ]
    lines = ["| model | tokens | next-token accuracy | on digits | on other tokens | problems all right |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['tokens']} | {or_dash(r['accuracy_all'], '.1%')} | "
              f"{or_dash(r['accuracy_digits'], '.1%')} | "
              f"{or_dash(r['accuracy_other'], '.1%')} | {or_dash(r['all_correct'], '.1%')} |" for r in table]
    md = "\n".join(lines)
    print(md)
    write_results(args.out, invoked_command("pardec.benchmarks.mdm_teacher_forced"),
                  f"{args.num_samples} problems ({args.split} split), teacher-forced (true answer prefix), float32, "
                  f"CPU.\n\n{md}", table)


if __name__ == "__main__":
    main()
