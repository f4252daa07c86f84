# python -m pardec.benchmarks.mdm_flashdlm --base runs/default_base/hf --mdm runs/mdm_default/hf
"""MDM + FlashDLM on the embedded default: AR greedy of the base vs the converted MDM decoded with
LLaDA low-confidence remasking (the baseline, one token per step, and two), Fast-dLLM threshold
decoding, FreeCache (refresh and the official freeze-at-last-step) and AR-guided diffusion.

All rows decode the same problems one sample at a time (batch 1) in one process, one after the
other, each after an untimed warm-up on two problems, so their TPS are comparable. MDM rows use a
fixed generation length ``--gen-length`` in blocks of ``--block-size`` and stop once everything
up to the first EOS is committed (``pardec.inference.decoders.mdm_common``); the guide is the AR base the
MDM was converted from. Columns:

* accuracy: exact final answer (``#### n``); = base AR greedy: fraction of samples whose tokens equal
  the base's AR greedy output exactly (guided ``shifted`` + strict must be 100%);
* TPF = committed tokens / all forwards (DLM + guide), TPF (DLM) = committed / DLM forwards;
* DLM forwards and guide forwards per sample; guide acceptance = accepted / verified drafts; TPS = committed
  tokens / decoding-loop wall time;
* TPS / MDM baseline (the low-confidence row at one token per step) and TPS / base AR greedy.

``--split test`` (default): the first ``--num-samples`` problems of the synthetic test split.
``--split val``: the first ``--num-samples`` problems of the generator's validation split (disjoint
from train and test), where the committed defaults are chosen; the test problems stay held out.
``--split fresh1`` (``fresh2``, ...): new problems, disjoint from all three, to check a table on.
``--chunk-dir DIR``: decode ``--chunk-size`` problems at a time, every row on each chunk in turn,
each chunk saved in DIR and skipped when the same command runs again; the table (of the problems
done so far, said in its header) is rewritten after every chunk (``pardec.benchmarks.chunks``).

Writes ``benchmarks/results/mdm_flashdlm.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse

import torch

from pardec.benchmarks.chunks import add_chunk_args, decode_all, decode_row, progress_note
from pardec.benchmarks.common import (
    RESULTS,
    add_runtime_args,
    add_split_arg,
    identical,
    invoked_command,
    named_keys,
    or_dash,
    split_label,
    split_rows,
    write_results,
)
from pardec.inference.checkpoint import load_checkpoint
from pardec.inference.decoders.mdm_common import default_block_size, mdm_info
from pardec.inference.decoders.registry import build_decoder
from pardec.inference.metrics import compute_metrics


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--base", required=True, help="AR base export (also the guide)")
    p.add_argument("--mdm", required=True, help="MDM export (recipe=mdm)")
    p.add_argument("--num-samples", type=int, default=200)
    add_split_arg(p)
    p.add_argument("--gen-length", type=int, default=64)
    p.add_argument("--block-size", type=int, default=None,
                   help="decoding block (default: the MDM's attention block for block models, else 32)")
    p.add_argument("--threshold", type=float, default=0.9)
    p.add_argument("--rows", default="all", help="comma-separated row keys to run (see ROWS), or all")
    add_runtime_args(p)
    add_chunk_args(p)
    p.add_argument("--out", default=str(RESULTS / "mdm_flashdlm"))
    return p.parse_args(argv)


def rows_config(args) -> list[tuple[str, str, str, dict | None]]:
    """(key, label, model, decoder config) per row; the baseline row is ``lowconf1``."""
    graphs = {"cuda_graphs": True} if args.cuda_graphs else {}  # only when on: eager chunks keep their fingerprint
    mdm = {"max_new_tokens": args.gen_length, "block_size": args.block_size, "batch_size": 1, **graphs}
    fc = {"freecache": True}
    guided = {"name": "mdm_guided", "guide": args.base, **mdm}
    half = max(args.block_size // 2, 1)
    return [
        ("ar", "AR greedy (base)", "base",
         {"name": "ar", "max_new_tokens": args.gen_length, "batch_size": 1, **graphs}),
        ("lowconf1", "MDM low-confidence, 1 token/step (baseline)", "mdm", {"name": "mdm_lowconf", **mdm}),
        ("lowconf2", "MDM low-confidence, 2 tokens/step", "mdm",
         {"name": "mdm_lowconf", "steps_per_block": half, **mdm}),
        ("threshold", f"MDM Fast-dLLM threshold tau={args.threshold} (prefix cache)", "mdm",
         {"name": "mdm_threshold", "threshold": args.threshold, **mdm}),
        ("fc_refresh", "FreeCache (refresh), low-confidence 1/step", "mdm", {"name": "mdm_lowconf", **fc, **mdm}),
        ("fc_freeze", "FreeCache (freeze at last step, official), low-confidence 1/step", "mdm",
         {"name": "mdm_lowconf", **fc, "freecache_mode": "freeze_last", **mdm}),
        ("fc_guided_strict", "FreeCache + guided (assisted, strict)", "mdm", {**guided, **fc}),
        ("fc_guided_relaxed", "FreeCache + guided (assisted, relaxed 0.5)", "mdm",
         {**guided, **fc, "acceptance": "relaxed"}),
        ("guided_shifted", "Guided (shifted, strict; = base AR greedy)", "mdm", {**guided, "commit": "shifted"}),
    ]


def table_row(key: str, label: str, which: str, decoder: dict, recs: list[dict], tok, ar_records) -> dict:
    """One row of the table from its records (every problem's, in index order)."""
    m = {**compute_metrics(recs, key == "ar"), **build_decoder(decoder, tok).summarize(recs)}
    n = len(recs)
    dlm = sum(r["stats"].get("dlm_forwards", 0) for r in recs)
    guide_f = sum(r["stats"].get("guide_forwards", 0) for r in recs)
    committed = sum(r["committed"] for r in recs)
    return {
        "key": key, "decoder": label, "config": decoder, "accuracy": m["accuracy"], "tpf": m["tpf"],
        "num_samples": m["num_samples"],
        "tpf_dlm": committed / dlm if dlm else None,
        "dlm_forwards_per_sample": dlm / n if which == "mdm" else None,
        "guide_forwards_per_sample": guide_f / n if which == "mdm" else None,
        "ar_forwards_per_sample": sum(r["forwards"] for r in recs) / n if which == "base" else None,
        "tokens_per_sample": committed / n, "tps": m["tps"],
        "guide_acceptance": m.get("guide_acceptance"),
        "identical_to_base_ar": identical(recs, ar_records) if ar_records is not None else None,
    }


def table_md(table: list[dict]) -> str:
    header = ("| decoder | accuracy | = base AR greedy | TPF | TPF (DLM) | DLM fwd / sample | guide fwd / sample | "
              "guide acceptance | TPS | TPS / MDM baseline | TPS / base AR |\n"
              "|---|---|---|---|---|---|---|---|---|---|---|")
    return "\n".join([header] + [
        f"| {r['decoder']} | {r['accuracy']:.1%} | {or_dash(r['identical_to_base_ar'], '.1%')} | {r['tpf']:.2f} | "
        f"{or_dash(r['tpf_dlm'], '.2f')} | "
        f"{or_dash(r['dlm_forwards_per_sample'], '.1f')} | "
        f"{or_dash(r['guide_forwards_per_sample'], '.1f')} | {or_dash(r['guide_acceptance'], '.2f')} | "
        f"{r['tps']:.1f} | {or_dash(r['tps_vs_mdm_baseline'], '.2f')}x | "
        f"{or_dash(r['tps_vs_base_ar'], '.2f')}x |"
        for r in table
    ])


def selected_rows(args) -> list[tuple[str, str, str, dict | None]]:
    """The rows ``--rows`` names (all by default), as :func:`rows_config` gives them; an unknown key is an error."""
    rows = rows_config(args)
    if args.rows == "all":
        return rows
    try:
        keys = named_keys(args.rows, [r[0] for r in rows])
    except ValueError as error:
        raise SystemExit(f"--rows: {error}") from None
    return [r for r in rows if r[0] in keys]


def chunk_fingerprint(args, selected: list[tuple[str, str, str, dict | None]]) -> dict:
    """What the chunks are made by (pardec.benchmarks.chunks: a chunk of another setting is refused)."""
    return {"benchmark": "mdm_flashdlm", "base": args.base, "mdm": args.mdm, "split": args.split,
            "gen_length": args.gen_length, "block_size": args.block_size, "template": args.template,
            "device": args.device, "dtype": args.dtype, "threads": args.threads,
            "rows": [[key, decoder] for key, _, _, decoder in selected]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    eval_rows = split_rows(args.split, args.num_samples)
    models = {name: load_checkpoint(path, device=args.device, dtype=args.dtype)
              for name, path in (("base", args.base), ("mdm", args.mdm))}
    guide = models["base"][0]
    if args.block_size is None:
        args.block_size = default_block_size(mdm_info(models["mdm"][0]))
    selected = selected_rows(args)

    warmed = set()

    def run_chunk(problems, first: int) -> dict[str, list[dict]]:
        """Every selected row on ``problems`` (the first numbered ``first``), one after the other, each warmed
        up once (:func:`pardec.benchmarks.chunks.decode_row`; records in index order)."""
        return {key: decode_row(*models[which], problems, decoder, args.template, warmed, key, first,
                                {"guide": guide} if decoder.get("name") == "mdm_guided" else None)
                for key, _, which, decoder in selected}

    def write_table(records: dict[str, list[dict]], done: int, machine: dict) -> None:
        ar_records = records.get("ar")
        table = [table_row(key, label, which, decoder, records[key], models[which][1], ar_records)
                 for key, label, which, decoder in selected]
        by_key = {r["key"]: r for r in table}
        for r in table:
            r["tps_vs_mdm_baseline"] = r["tps"] / by_key["lowconf1"]["tps"] if "lowconf1" in by_key else None
            r["tps_vs_base_ar"] = r["tps"] / by_key["ar"]["tps"] if "ar" in by_key else None
        md = table_md(table)
        print(md, flush=True)
        progress = progress_note(args.chunk_dir, args.chunk_size, done, len(eval_rows))
        write_results(args.out, invoked_command("pardec.benchmarks.mdm_flashdlm", argv),
                      f"{done} problems ({split_label(args.split)}){progress}, generation length {args.gen_length}, "
                      f"block {args.block_size}, batch 1, {args.dtype} on {args.device} ({args.threads} threads"
                      f"{', every decode step a CUDA graph' if args.cuda_graphs else ''}), "
                      f"template {args.template}.\n\n{md}", table, machine=machine)

    decode_all(eval_rows, args.chunk_dir, args.chunk_size, chunk_fingerprint(args, selected), run_chunk, write_table,
               checkpoints=[args.base, args.mdm])


if __name__ == "__main__":
    main()
