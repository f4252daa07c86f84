"""Model cards (pardec/common/model_card.py): the trainer's exporter writes one, ``pardec-validate``
rewrites it with the evaluation, a README pardec did not write is kept."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from pardec.common.metadata import CheckpointMetadata
from pardec.common.model_card import MARKER, write_model_card
from pardec.trainers.export import export_hf
from tests.conftest import tiny_model, tiny_tokenizer, write_eval_jsonl
from tests.train_utils import FAST, child_env, save_tiny_base

torch.set_num_threads(1)


def export(path: Path, base_model: str) -> tuple[Path, CheckpointMetadata, int]:
    tok = tiny_tokenizer()
    model = tiny_model(len(tok))
    meta = CheckpointMetadata(recipe="jacobi_forcing", jacobi_block_size=4, base_model=base_model,
                              command="pardec-train experiment=jacobi_default 'model.path=a b'", license="apache-2.0")
    meta.write_to(model)
    export_hf(model, tok, path, zero_stage=0, rank=0)
    return path, meta, sum(p.numel() for p in model.parameters())


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_export_writes_a_card_with_command_and_metadata(tmp_path):
    out, meta, params = export(tmp_path / "hf", base_model="Qwen/Qwen3-0.6B")
    card = (out / "README.md").read_text()
    assert front_matter(card) == {"license": "apache-2.0", "base_model": "Qwen/Qwen3-0.6B",
                                  "library_name": "transformers", "pipeline_tag": "text-generation",
                                  "tags": ["pardec", "jacobi_forcing"]}
    assert MARKER in card and "| method | pardec recipe `jacobi_forcing`" in card
    assert f"```bash\n{meta.command}\n```" in card
    assert f"| parameters | {params:,} |" in card and "| layers | 2 |" in card
    recorded = json.loads(card.split("```json\n")[1].split("```")[0])
    assert recorded == meta.to_dict() == CheckpointMetadata.read(out).to_dict()
    assert "Not validated yet" in card


def test_a_local_base_model_stays_out_of_the_front_matter(tmp_path, monkeypatch):
    (tmp_path / "org" / "base").mkdir(parents=True)  # "org/base" looks like a Hub id, but is a directory here
    monkeypatch.chdir(tmp_path)
    out, _, _ = export(tmp_path / "hf", base_model="org/base")
    card = (out / "README.md").read_text()
    assert "base_model" not in front_matter(card) and "| base model | `org/base` |" in card


def test_validation_adds_its_results_to_the_card(tmp_path):
    out, _, _ = export(tmp_path / "hf", base_model="Qwen/Qwen3-0.6B")
    data = write_eval_jsonl(tmp_path / "eval.jsonl")
    env = child_env()
    cmd = [sys.executable, "-m", "pardec.cli.validate", f"checkpoint={out}", "data.source=files",
           f"data.eval_files=[{data}]", "decoder.max_new_tokens=4", "progress=false"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads((out / "eval" / "ar_greedy" / "metrics.json").read_text())["metrics"]
    card = (out / "README.md").read_text()
    row = f"| `ar_greedy` | eval.jsonl | {metrics['num_samples']} | {metrics['accuracy']:.4f} | {metrics['tpf']:.4f} |"
    assert row in card and "Not validated yet" not in card


def test_a_readme_pardec_did_not_write_is_kept(tmp_path):
    out, _, _ = export(tmp_path / "hf", base_model="Qwen/Qwen3-0.6B")
    (out / "README.md").write_text("# The author's own card\n")
    assert write_model_card(out) is None
    assert (out / "README.md").read_text() == "# The author's own card\n"


def test_training_records_its_command_and_base_model(tmp_path):
    base = save_tiny_base(tmp_path / "base")
    overrides = [*FAST, f"output_dir={tmp_path / 'run'}", "trainer.max_steps=1", "model=hf", f"model.path={base}"]
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "pardec.cli.train", *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    meta = CheckpointMetadata.read(tmp_path / "run" / "hf")
    assert (meta.command, meta.base_model) == (shlex.join(["pardec-train", *overrides]), str(base))
    assert f"```bash\n{meta.command}\n```" in (tmp_path / "run" / "hf" / "README.md").read_text()
