# pardec-lm-eval --model pardec --model_args checkpoint=<export>,decoder=jacobi --tasks gsm8k
"""``pardec-lm-eval``: lm-evaluation-harness's own command line with the ``pardec`` model registered.

lm-eval 0.4 finds models only in its registry (no entry point or plugin group for external packages), so
the plain ``lm_eval`` command cannot load ``--model pardec``; this command imports
:mod:`pardec.evaluation.model` (which registers it) and hands every argument to lm-eval's CLI unchanged.
Multi-GPU: ``torchrun --nproc_per_node N -m pardec.cli.lm_eval_harness ...`` (see
:mod:`pardec.evaluation.model`). Guide: docs/guide/lm_eval.md.
"""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import pardec.evaluation.model  # noqa: F401  (registers the lm-eval model "pardec")


def main() -> None:
    cli_evaluate()


if __name__ == "__main__":
    main()
