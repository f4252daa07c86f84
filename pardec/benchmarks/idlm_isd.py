# python -m pardec.benchmarks.idlm_isd --base runs/default_base/hf --idlm runs/idlm_default/stages/02-stride4/hf \
#   --risd runs/idlm_lora_default/hf
"""I-DLM on the embedded default: AR greedy vs ISD (N = 2, 3, 4; greedy and sampling) vs R-ISD.

All rows decode the same held-out problems one sample at a time (batch 1) in one process, one
after the other, each after an untimed warm-up on two problems, so their TPS are comparable; TPS
ratios are to AR greedy of the base measured in this run. Columns:

* accuracy: exact final answer (``#### n``);
* = base: fraction of samples whose tokens equal the base model's AR greedy output exactly;
* TPF = committed tokens / decoding forwards (docs/methods/conventions.md#counting), TPS and its ratio to base
  AR greedy;
* alpha: introspective acceptance rate of the row's model at the row's stride, over the tokens it
  generated (arXiv:2604.11035 §2);
* TPF formula: the paper's (2 + P_1 + ... + P_{N-2}) / (2 - P_{N-1}) on the measured acceptance.

A real chat model (``--template auto`` renders its prompts through the chat template) runs the same
way, on any ``--device`` and ``--dtype``; ``--strides`` and ``--no-sample`` choose the ISD rows and
``--split val`` the validation problems. ``--num-val K`` chooses N on validation first: AR greedy of
both models and greedy ISD at every N of ``--strides`` on the first K val problems, N = the highest
TPS among the greedy rows identical to the checkpoint's own AR greedy (on a CPU a wider verify forward
costs more, so the highest TPF need not be the fastest); the ``--split`` rows then have ISD at that N
alone, or also at the N of ``--test-strides`` (a goal stated at a fixed N, answered whichever N val
chooses), and the JSON is ``{chosen_stride, choice_rule, test_strides, validation, test}`` instead of
the table.
``--chunk-dir DIR``: decode ``--chunk-size`` problems at a time, every row on each chunk in turn (so a
drift of the machine's speed reaches a row and its reference alike), each chunk saved in DIR and skipped
when the same command runs again; the table, of the problems done so far, is rewritten after every chunk
(``pardec.benchmarks.chunks``), alpha pooled from each record's introspection. With ``--num-val`` the
sweep and the N it chose are kept beside the chunks (``validation.json``) and read on restart, so a restart
decodes the same rows (the TPS-based choice could otherwise change); so are the bound's latencies
(``bound.json``, ``pardec.benchmarks.chunks.kept_bound``), so that a table read back from its chunks is the same
table. A sampled row seeds each problem by its number in the split, so in chunks it draws what one run draws.
``--cuda-graphs`` runs every row, AR included, over a static cache with each step width captured once
as a CUDA graph (``pardec.inference.decoders.decode_steps``), so that on a GPU TPS follows TPF.

Bound: where a forward of q tokens costs more than one of 1 (a CPU, the real model), a verify step
of stride N feeds 2N-1 tokens, so a decoder committing TPF tokens per forward reaches at most
TPF · t(1) / t(2N-1) times AR's TPS. ``t`` is measured on the base model in this run (median of
``--bound-repeats`` forwards after a ``--bound-cache``-token KV cache, the widths measured in turn, as
``pardec.benchmarks.real_model_speed``) and each ISD row shows its bound and the share of it that its
TPS / AR reaches (``--no-bound`` skips it). Writes ``<out>.{md,json}`` (default
``benchmarks/results/idlm_isd``).
"""

from __future__ import annotations

import argparse
import json

import torch

from pardec.benchmarks.chunks import add_chunk_args, decode_all, decode_row, kept_bound, kept_in, progress_note
from pardec.benchmarks.common import (
    RESULTS,
    add_bound_args,
    add_runtime_args,
    add_split_arg,
    fastest_lossless,
    identical,
    invoked_command,
    or_dash,
    split_label,
    split_rows,
    validation_rows,
    write_results,
)
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.isd import introspective_ratios, resolve_stride
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.evaluate import encode_prompt
from pardec.inference.metrics import compute_metrics
from pardec.models.loading import mask_token_id

VALIDATION_FILE = "validation.json"  # beside the chunks: the --num-val sweep and the N it chose


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (HF dir)")
    p.add_argument("--idlm", default=None, help="I-DLM export (recipe=idlm); without it only AR and R-ISD rows")
    p.add_argument("--risd", default=None, help="gated-LoRA export (recipe=idlm_lora)")
    p.add_argument("--num-samples", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--temperature", type=float, default=1.0)
    add_split_arg(p)
    p.add_argument("--strides", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--num-val", type=int, default=0,
                   help="choose N among --strides on this many val problems first (highest TPS, lossless)")
    p.add_argument("--test-strides", type=int, nargs="+", default=[],
                   help="with --num-val: greedy ISD also at these N on the --split rows, beside the N chosen on val")
    p.add_argument("--no-sample", action="store_true", help="greedy ISD rows only")
    add_runtime_args(p)
    add_bound_args(p, "2N-1")
    add_chunk_args(p)
    p.add_argument("--out", default=str(RESULTS / "idlm_isd"))
    return p.parse_args(argv)


def introspection(model, tokenizer, record: dict, stride: int, template: str) -> tuple[float, int]:
    """(sum, count) of the introspective ratios of one record's drafted tokens at ``stride``
    (:func:`pardec.inference.decoders.isd.introspective_ratios`; one untimed forward); (0, 0) when it
    generated fewer than 2 tokens."""
    if len(record["output_ids"]) < 2:
        return 0.0, 0
    prompt = encode_prompt(tokenizer, record["prompt"], template, False, record["index"])
    with torch.no_grad():
        ratios = introspective_ratios(model, prompt, record["output_ids"], mask_token_id(model, tokenizer), stride)
    return float(ratios.double().sum()), ratios.numel()


def alpha(records: list[dict]) -> float:
    """The introspective acceptance rate over the records' drafted tokens (each record's ``alpha_sum`` and
    ``alpha_tokens``, from :func:`introspection`): arXiv:2604.11035 §2's mean, pooled over problems."""
    tokens = sum(r["alpha_tokens"] for r in records)
    return sum(r["alpha_sum"] for r in records) / tokens if tokens else float("nan")


Row = tuple[str, str, dict, int | None]  # (label, model key, decoder config, ISD stride or None)


def greedy_config(args) -> dict:
    return {"max_new_tokens": args.max_new_tokens, "batch_size": 1, "cuda_graphs": args.cuda_graphs}


def base_ar_row(args) -> Row:
    """The base's AR greedy: every table's first row, the TPS ratios' reference."""
    return ("AR greedy (base)", "base", {"name": "ar", **greedy_config(args)}, None)


def isd_rows(args, strides: list[int], sampled: bool) -> list[Row]:
    """The I-DLM checkpoint's rows: its own AR greedy, greedy ISD at each N of ``strides`` and, if
    ``sampled``, sampled ISD at each."""
    greedy = greedy_config(args)
    sample = {**greedy, "mode": "sample", "temperature": args.temperature}
    return [
        ("AR greedy (I-DLM ckpt)", "idlm", {"name": "ar", **greedy}, None),
        *[(f"ISD N={n} greedy", "idlm", {"name": "isd", "stride": n, **greedy}, n) for n in strides],
        *[(f"ISD N={n} sample T={args.temperature}", "idlm", {"name": "isd", "stride": n, **sample}, n)
          for n in (strides if sampled else [])],
    ]


def table_rows(args, strides: list[int], risd_stride: int | None) -> list[Row]:
    """The ``--split`` table's rows: the base's AR greedy (the TPS reference), the I-DLM rows at ``strides``
    (with ``--idlm``) and R-ISD at its checkpoint's ``risd_stride`` (with ``--risd``)."""
    rows = [base_ar_row(args), *(isd_rows(args, strides, not args.no_sample) if args.idlm else [])]
    if args.risd:
        rows.append((f"R-ISD N={risd_stride} greedy (gated LoRA)", "risd",
                     {"name": "isd", "stride": risd_stride, **greedy_config(args)}, risd_stride))
    return rows


def decode_rows(args, models, problems, rows, warmed: set[str], first: int = 0) -> dict[str, list[dict]]:
    """Every row of ``rows`` (``(label, model key, decoder config, stride)``) on ``problems`` (the first
    numbered ``first``), one row after the other, each warmed up once (``warmed``,
    :func:`pardec.benchmarks.chunks.decode_row`); records by label in index order, each ISD record with its
    introspection (untimed)."""
    records = {}
    for label, which, decoder, stride in rows:
        model, tok = models[which]
        records[label] = decode_row(model, tok, problems, decoder, args.template, warmed, label, first)
        for r in records[label] if stride else ():
            r["alpha_sum"], r["alpha_tokens"] = introspection(model, tok, r, stride, args.template)
    return records


def table_of(models, rows, records: dict[str, list[dict]], latency) -> list[dict]:
    """One table row per entry of ``rows`` from its (pooled) records, in order; the first is the base's AR
    greedy, the TPS ratios' reference."""
    table, own_ar = [], {}
    for label, which, decoder, stride in rows:
        recs = records[label]
        m = {**compute_metrics(recs, decoder["name"] == "ar"),
             **build_decoder(decoder, models[which][1]).summarize(recs)}
        if decoder["name"] == "ar":
            own_ar[which] = recs
        # R-ISD's clean stream is the frozen base: its own AR greedy is the base's.
        own = own_ar["base" if which == "risd" else which]
        row = {
            "decoder": label, "accuracy": m["accuracy"],
            "identical_to_base": identical(recs, own_ar["base"]), "identical_to_own_ar": identical(recs, own),
            "stride": stride, "greedy": decoder.get("mode", "greedy") == "greedy",
            "tpf": m["tpf"], "num_samples": m["num_samples"],
            "tps": m["tps"], "tps_ratio": m["tps"] / table[0]["tps"] if table else 1.0,
            "alpha": alpha(recs) if stride else None,
            "tpf_formula": m.get("isd_tpf_predicted"),
            "bound": m["tpf"] * latency[1] / latency[2 * stride - 1] if stride and latency else None,
            "t_verify_over_t_1": latency[2 * stride - 1] / latency[1] if stride and latency else None,
        }
        row["share_of_bound"] = row["tps_ratio"] / row["bound"] if row["bound"] else None
        table.append(row)
    return table


def measure(args, models, eval_rows, rows, latency) -> list[dict]:
    """The table of ``rows`` on ``eval_rows`` decoded in one go (the validation rows)."""
    table = table_of(models, rows, decode_rows(args, models, eval_rows, rows, set()), latency)
    for row in table:
        print(json.dumps(row), flush=True)
    return table


def chunk_fingerprint(args, rows) -> dict:
    """What the chunks are made by (pardec.benchmarks.chunks: a chunk of another setting is refused)."""
    return {"benchmark": "idlm_isd", "base": args.base, "idlm": args.idlm, "risd": args.risd, "split": args.split,
            "template": args.template, "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "rows": [[label, decoder] for label, _, decoder, _ in rows]}


def choose_stride(val_table: list[dict]) -> tuple[int, str]:
    """(N, the rule that chose it): the fastest greedy ISD row identical to own AR greedy on val
    (:func:`pardec.benchmarks.common.fastest_lossless`)."""
    best, rule = fastest_lossless([r for r in val_table if r["stride"] and r["greedy"]], "greedy rows")
    return best["stride"], rule


def markdown(table: list[dict]) -> str:
    header = ("| decoder | accuracy | = base AR greedy | = own AR greedy | TPF | TPS | TPS / AR | alpha | TPF formula "
              "| bound TPF·t(1)/t(2N-1) | share of bound |\n|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([header] + [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {r['identical_to_base']:.1%} | {r['identical_to_own_ar']:.1%} | "
        f"{r['tpf']:.2f} | {r['tps']:.1f} | "
        f"{r['tps_ratio']:.2f}x | {or_dash(r['alpha'], '.3f')} | {or_dash(r['tpf_formula'], '.2f')} | "
        f"{or_dash(r['bound'], '.2f')} | {or_dash(r['share_of_bound'], '.0%')} |"
        for r in table
    ])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.idlm is None and args.risd is None:
        raise SystemExit("give --idlm, --risd or both: there is nothing to compare AR greedy with")
    if args.num_val and args.idlm is None:
        raise SystemExit("--num-val chooses the I-DLM checkpoint's N: give --idlm")
    if args.num_val and args.split == "val":
        raise SystemExit("--num-val chooses N on val to report on test: drop --split val")
    if args.test_strides and not args.num_val:
        raise SystemExit("--test-strides adds test rows beside the N chosen on val: give --num-val "
                         "(without it the test rows decode every N of --strides)")
    eval_rows = split_rows(args.split, args.num_samples)

    def load(path: str):
        return load_checkpoint(path, device=args.device, dtype=args.dtype)

    models = {"base": load(args.base)}
    if args.idlm:
        models["idlm"] = load(args.idlm)
    if args.risd:
        models["risd"] = load(args.risd)

    risd_stride = resolve_stride(models["risd"][0], None) if args.risd else None
    strides = sorted({*(args.strides if args.idlm else []), *args.test_strides,
                      *([risd_stride] if risd_stride else [])})
    checkpoints = [path for path in (args.base, args.idlm, args.risd) if path]
    widths = [1, *(2 * n - 1 for n in strides)]
    latency, note = kept_bound(args, "idlm_isd", models["base"][0], widths)
    bound_note = f"; t(q) {note}" if note else ""
    validation, chosen, rule, kept_note = None, None, None, ""
    test_strides = args.strides
    if args.num_val:
        val_rows = [base_ar_row(args), *isd_rows(args, args.strides, False)]

        def sweep() -> dict:
            table = measure(args, models, validation_rows(args.num_val), val_rows, latency)
            return {"table": table, "choice": choose_stride(table)}

        # chosen once per chunk directory: a restart decodes the same rows
        val_fingerprint = {**chunk_fingerprint(args, val_rows), "split": "val", "num_val": args.num_val}
        kept, note = kept_in(args.chunk_dir, VALIDATION_FILE, val_fingerprint, sweep, checkpoints)
        kept_note = f", {note}" if note else ""
        validation, (chosen, rule) = kept["table"], kept["choice"]
        test_strides = sorted({chosen, *args.test_strides})
    rows = table_rows(args, test_strides, risd_stride)
    command, warmed = invoked_command("pardec.benchmarks.idlm_isd", argv), set()

    def write_table(records: dict[str, list[dict]], done: int, machine: dict) -> None:
        table = table_of(models, rows, records, latency)
        at_n = f", ISD at N = {', '.join(map(str, test_strides))}" if validation is not None else ""
        what = (f"{split_label(args.split).capitalize()}, {done} problems{at_n}{bound_note}"
                f"{progress_note(args.chunk_dir, args.chunk_size, done, len(eval_rows))}:\n\n{markdown(table)}")
        if validation is None:
            md, payload = what, table
        else:
            md = (f"Validation split ({args.num_val} problems of the generator's val split{kept_note}; N chosen here: "
                  f"{chosen}, {rule}):\n\n{markdown(validation)}\n\n{what}")
            payload = {"command": command, "chosen_stride": chosen, "choice_rule": rule,
                       "test_strides": test_strides, "validation": validation, "test": table}
        print(md, flush=True)
        write_results(args.out, command, md, payload, machine=machine)

    decode_all(eval_rows, args.chunk_dir, args.chunk_size, chunk_fingerprint(args, rows),
               lambda problems, first: decode_rows(args, models, problems, rows, warmed, first), write_table,
               checkpoints)


if __name__ == "__main__":
    main()
