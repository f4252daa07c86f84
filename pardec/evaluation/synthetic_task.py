# pardec-lm-eval-data --out_dir lm_eval_tasks [num_test=200 ...]   (= python -m pardec.evaluation.synthetic_task)
"""The embedded synthetic GSM test split as an offline lm-eval task (``pardec_synthetic_gsm``).

``pardec-lm-eval-data`` writes, into ``--out_dir``:

- ``synthetic_gsm_test.jsonl``: the test split of :func:`pardec.data_pipelines.synthetic_gsm.generate_split`
  (columns ``prompt``, ``response``, ``answer``), for the generator config given as ``key=value`` arguments
  (fields of :class:`pardec.data_pipelines.synthetic_gsm.SyntheticGSMConfig`; the defaults are
  ``pardec-validate``'s ``data=synthetic_gsm``);
- ``pardec_synthetic_gsm.yaml``: a task that includes the packaged ``pardec/evaluation/tasks/pardec_synthetic_gsm.yaml``
  and points its ``dataset_kwargs.data_files`` at that file (absolute paths: lm-eval resolves data files
  against the working directory).

Run it with ``pardec-lm-eval ... --include_path <out_dir> --tasks pardec_synthetic_gsm``. The task sends each
prompt verbatim, generates until EOS (no stop string: validation reads the whole output) and scores with
:func:`process_results`, validation's own answer extraction, so for a greedy decoder its ``exact_match`` equals
``pardec-validate``'s ``accuracy`` on the same problems (lm-eval's ``--limit N`` is validation's
``data.max_eval_samples=N``).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from importlib.resources import files
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pardec.common.errors import ConfigError
from pardec.data_pipelines.synthetic_gsm import SyntheticGSMConfig, generate_split
from pardec.inference.metrics import gold_answer, score_answer

TASK = "pardec_synthetic_gsm"
DATA_FILE = "synthetic_gsm_test.jsonl"


def process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    """lm-eval's per-document metric: validation's ``correct`` for the generation ``results[0]``."""
    _, correct = score_answer(results[0], gold_answer(doc))
    return {"exact_match": float(bool(correct))}


def synthetic_config(overrides: list[str]) -> SyntheticGSMConfig:
    """The generator config with ``key=value`` overrides; an unknown key or a bad value names it."""
    try:
        node = OmegaConf.merge(OmegaConf.structured(SyntheticGSMConfig), OmegaConf.from_dotlist(overrides))
    except OmegaConfBaseException as err:
        raise ConfigError(f"synthetic config override {overrides}: {str(err).splitlines()[0]}") from None
    return OmegaConf.to_object(node)


def packaged_task_yaml() -> Path:
    return Path(str(files("pardec.evaluation") / "tasks" / f"{TASK}.yaml"))


def write_task(out_dir: Path, cfg: SyntheticGSMConfig) -> Path:
    """Write the test file and the task YAML into ``out_dir``; returns the YAML's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = (out_dir / DATA_FILE).resolve()
    data.write_text("".join(json.dumps(row) + "\n" for row in generate_split(cfg, "test")))
    task = out_dir / f"{TASK}.yaml"
    task.write_text(
        f"# Written by pardec-lm-eval-data; synthetic config {json.dumps(asdict(cfg))}\n"
        f"# pardec-lm-eval --model pardec --model_args checkpoint=<export> --include_path {out_dir} --tasks {TASK}\n"
        f"include: {json.dumps(str(packaged_task_yaml()))}\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data))}\n"
    )
    return task


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pardec-lm-eval-data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="lm_eval_tasks", help="where the task YAML and its data file go")
    parser.add_argument("overrides", nargs="*", help="synthetic generator keys, e.g. num_test=50 seed=7")
    args = parser.parse_args(argv)
    try:
        cfg = synthetic_config(args.overrides)
    except ConfigError as err:
        parser.exit(2, f"config error: {err}\n")
    task = write_task(Path(args.out_dir), cfg)
    print(f"wrote {task} and {Path(args.out_dir) / DATA_FILE} ({cfg.num_test} problems)")
    print(f"run: pardec-lm-eval --model pardec --model_args checkpoint=<export> --include_path {args.out_dir} "
          f"--tasks {TASK}")


if __name__ == "__main__":
    main()
