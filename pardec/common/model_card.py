"""The model card (``README.md``) of a checkpoint pardec writes, as Hugging Face users expect one.

Everything on the card is read back from the checkpoint directory: ``config.json`` (the architecture and
pardec's :class:`~pardec.common.metadata.CheckpointMetadata`: base model, recipe, the command that made it,
the license, where imported weights came from), the safetensors headers (the parameter count) and
``eval/<decoder>/metrics.json`` (what ``pardec-validate`` writes by default). So the card is rewritten,
never edited: the trainer's exporter and ``pardec-import`` write it, and ``pardec-validate`` writes it
again after adding an evaluation. A ``README.md`` pardec did not write (a Hub checkpoint's own card) is
left alone.

The YAML front matter follows the Hub's model-card metadata: ``license``, ``base_model`` (a Hub id only:
the Hub rejects a local path there, so a local base is named in the text), ``library_name``,
``pipeline_tag`` and ``tags``.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from safetensors import safe_open

from pardec.common.metadata import CheckpointMetadata

CARD = "README.md"
EVAL_DIR = "eval"
# First line after the front matter; a README without it is not pardec's and is never overwritten.
MARKER = "<!-- pardec model card: rewritten from this directory by pardec.common.model_card -->"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# metrics.json keys shown in the evaluation table, in order, with their column titles.
EVAL_COLUMNS = (
    ("num_samples", "samples"),
    ("accuracy", "accuracy"),
    ("tpf", "TPF"),
    ("tps", "TPS"),
    ("agreement_exact", "same tokens as AR greedy"),
)


def command_line(program: str, args: Sequence[str]) -> str:
    """The command as a user would type it again (``pardec-train experiment=x``), shell-quoted."""
    return shlex.join([program, *args])


def write_model_card(checkpoint_dir: str | Path) -> Optional[Path]:
    """(Re)write ``checkpoint_dir/README.md`` from the directory's contents; returns its path, or None
    when a README pardec did not write is there (it is kept)."""
    directory = Path(checkpoint_dir)
    path = directory / CARD
    if path.exists() and MARKER not in path.read_text():
        return None
    path.write_text(render_model_card(directory))
    return path


def render_model_card(directory: Path) -> str:
    config = json.loads((directory / "config.json").read_text())
    meta = CheckpointMetadata.read(directory)
    front: dict[str, Any] = {}
    if meta.license:
        front["license"] = meta.license
    if meta.base_model and HUB_ID.fullmatch(meta.base_model) and not Path(meta.base_model).exists():
        front["base_model"] = meta.base_model
    front |= {"library_name": "transformers", "pipeline_tag": "text-generation",
              "tags": ["pardec"] + ([meta.recipe] if meta.recipe else []) + (["gguf-import"] if meta.source else [])}
    parts = [
        "---\n" + yaml.safe_dump(front, sort_keys=False) + "---",
        MARKER,
        f"# {_title(meta, config)}",
        "## How it was made\n\n" + _table(_provenance(meta)) + _command(meta),
        "## Model\n\n" + _table(_architecture(directory, config)),
        "## Evaluation\n\n" + _evaluation(directory),
        "## pardec metadata\n\n`config.json` key `pardec`, read by pardec's decoders:\n\n```json\n"
        + json.dumps(meta.to_dict(), indent=2) + "\n```",
    ]
    return "\n\n".join(parts) + "\n"


def _title(meta: CheckpointMetadata, config: dict) -> str:
    base = Path(meta.base_model).name if meta.base_model else config.get("model_type", "model")
    if meta.recipe:
        return f"{base}: pardec `{meta.recipe}` export"
    return f"{base}, imported by pardec" if meta.source else base


def _provenance(meta: CheckpointMetadata) -> list[tuple[str, str]]:
    if meta.base_model:
        base = f"`{meta.base_model}`"
    else:
        base = "not recorded" if meta.source else "none (random initialisation)"
    rows = [("base model", base)]
    rows.append(("method", f"pardec recipe `{meta.recipe}` (docs/methods/ in the pardec repository)" if meta.recipe
                 else "none: the weights as imported" if meta.source else "none recorded"))
    rows += [(f"source: {key.replace('_', ' ')}", f"`{value}`") for key, value in (meta.source or {}).items()]
    if meta.license:
        rows.append(("license", meta.license))
    return rows


def _command(meta: CheckpointMetadata) -> str:
    if not meta.command:
        return "\n\nThe command that made it was not recorded."
    return f"\n\nThe command that made it:\n\n```bash\n{meta.command}\n```"


def _architecture(directory: Path, config: dict) -> list[tuple[str, str]]:
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads", heads)
    return [
        ("architecture", ", ".join(config.get("architectures") or [config.get("model_type", "?")])),
        ("parameters", f"{count_parameters(directory):,}"),
        ("layers", str(config.get("num_hidden_layers", "?"))),
        ("hidden size", str(config.get("hidden_size", "?"))),
        ("attention heads", f"{heads} query, {kv_heads} key/value"),
        ("vocabulary", f"{config['vocab_size']:,}" if "vocab_size" in config else "?"),
        ("tied embeddings", "yes" if config.get("tie_word_embeddings") else "no"),
        ("dtype", str(config.get("dtype") or config.get("torch_dtype") or "?")),
        ("chat template", "yes" if _has_chat_template(directory) else "no"),
    ]


def count_parameters(directory: Path) -> int:
    """Elements of every tensor in the directory's ``*.safetensors`` files (tied weights are stored once)."""
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                numel = 1
                for size in f.get_slice(key).get_shape():
                    numel *= size
                total += numel
    return total


def _has_chat_template(directory: Path) -> bool:
    if (directory / "chat_template.jinja").exists():
        return True
    tokenizer_config = directory / "tokenizer_config.json"
    return tokenizer_config.exists() and bool(json.loads(tokenizer_config.read_text()).get("chat_template"))


def _evaluation(directory: Path) -> str:
    runs = sorted((directory / EVAL_DIR).glob("*/metrics.json"))
    if not runs:
        return ("Not validated yet. `pardec-validate checkpoint=<this directory> decoder=<decoder>` decodes an "
                "eval set and adds a row here.")
    header = ["decoder", "eval set"] + [title for _, title in EVAL_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for run in runs:
        result = json.loads(run.read_text())
        metrics = result.get("metrics", {})
        cells = [f"`{run.parent.name}`", _eval_set(result.get("config", {}).get("data", {}))]
        cells += [_cell(metrics.get(key)) for key, _ in EVAL_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nFrom `eval/<decoder>/metrics.json` (`pardec-validate`); TPS depends on the hardware."


def _eval_set(data: dict) -> str:
    source = data.get("source", "?")
    if source == "files":
        return ", ".join(Path(f).name for f in data.get("eval_files", [])) or "files"
    if source == "hub":
        return f"{data.get('hub_name')} ({data.get('eval_split')})"
    return f"{source} ({data.get('eval_split', '?')})"


def _cell(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.4f}"
    return str(value)


def _table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| | |", "| --- | --- |"] + [f"| {key} | {value} |" for key, value in rows])
