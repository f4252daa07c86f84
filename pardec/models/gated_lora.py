"""Gated LoRA for R-ISD: the LoRA residual is applied only where the *input token* is ``<|mask|>``.

Each targeted linear layer computes ``h_j = W x_j + 1[input_j == <|mask|>] * s * B A x_j`` (paper
App. G, Eq. 11). Prompt, committed, pending/draft tokens and padding get gate 0, so they run the
base weights bit for bit; because clean queries never attend to ``<|mask|>`` positions (I-DLM
training mask, strict causal ISD), the clean stream *equals the base model* and greedy R-ISD is
lossless w.r.t. the base (docs/methods/idlm.md#r-isd-with-gated-lora).

Construction, on PEFT's ordinary ``lora.Linear`` (adapters save and load as plain PEFT adapters):

* :func:`wrap_gated_lora` calls ``peft.get_peft_model`` and then :func:`_attach_gate`;
  :func:`load_gated_lora` calls ``PeftModel.from_pretrained`` and then :func:`_attach_gate`;
* a forward *pre-hook* on the transformers model's decoder stack (``model.base_model``, e.g.
  ``Qwen3Model``) reads ``input_ids`` of every call and stores the per-token gate ``[b, s, 1]`` (bool)
  in one shared :class:`GateHolder`; callers just call the model (``inputs_embeds`` alone is refused:
  the gate is defined on token ids). The hook sits on the decoder stack, not on the causal LM, because
  PEFT before 0.21 runs the causal LM as ``model.forward(...)``, which skips that module's hooks,
  while the causal LM always calls its decoder stack as a module;
* a forward hook on every LoRA-A module (``lora_A[adapter]``) zeroes its output where the gate is
  0 (``masked_fill``, so gate-0 rows are exactly 0 and get no gradient), hence ``B A x`` is exactly
  0 there and ``W x + 0`` is bitwise the base output;
* an adapter loaded for decoding (:func:`load_gated_lora` with ``is_trainable=False``, as
  :func:`load_gated_lora_export` does) computes the same sum in a lean forward of each layer,
  without PEFT's per-call bookkeeping (:func:`_decoding_forward`). A deliberate departure from
  the hook construction above, for decoding only: that forward applies the gate itself instead of
  through the LoRA-A hook, with PEFT's arithmetic (bitwise PEFT's output) in 8-10% less time
  per forward of SmolLM2-135M on a CPU; training and anything the lean forward does not cover run
  PEFT's forward and the hook.

Gradient checkpointing: non-reentrant checkpointing re-runs each decoder layer during backward,
after the top-level forward (and possibly after later forwards that set other gates). The gate
therefore stays in the holder after the forward (nothing clears it), and every checkpointed
layer's checkpoint function is wrapped (lazily, at the next forward, so it works whether
checkpointing was enabled before or after wrapping) with a ``context_fn`` that re-installs *the
gate of that layer's own forward* while torch recomputes it, the same way torch restores the RNG
state. Reentrant checkpointing cannot take a ``context_fn`` and is refused with a clear error.

Refused, with an error naming the reason: merging (``merge_and_unload``, ``merge_adapter``,
``lora.Linear.merge``: a merged ``W + BA`` applies the residual at every token, which the gate
cannot express); every LoraConfig key that makes the layer anything but plain ``W x + s B A x``
(DoRA ``use_dora``, aLoRA ``alora_invocation_tokens`` whose activation is a suffix of the
sequence, ``lora_bias`` which is non-zero at gate 0, ``modules_to_save`` / ``trainable_token_indices``
/ ``bias`` which train base tensors at every token, base-mutating inits such as PiSSA/OLoRA/LoftQ,
...); LoRA on anything other than ``nn.Linear`` (e.g. embeddings); adapters other than the gated one.

Export layout (:func:`save_base_and_adapter`, read back by :func:`load_gated_lora_export`)::

    <export>/config.json, model.safetensors, tokenizer files   the frozen base incl. <|mask|>;
                                                               config.pardec records mask_token_id
                                                               and gated_lora_adapter = "adapter"
    <export>/adapter/adapter_config.json, adapter_model.safetensors   a plain PEFT LoRA adapter
    <export>/adapter/gated_lora.json                            {"gate": "input_is_mask", "mask_token_id": id}

References: I-DLM, Introspective Diffusion Language Models, arXiv:2604.11035, §3.2 and App. G.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from transformers import AutoModelForCausalLM
from transformers.modeling_layers import GradientCheckpointingLayer

from pardec.common.constants import MASK_TOKEN, METADATA_KEY
from pardec.common.errors import CheckpointError, ConfigError
from pardec.common.metadata import CheckpointMetadata
from pardec.models.lora import base_state_dict

GATED_LORA_FILE = "gated_lora.json"
ADAPTER_SUBDIR = "adapter"
GATE_KIND = "input_is_mask"
_HOLDER_ATTR = "pardec_gate_holder"

# LoraConfig keys that may differ from their defaults: they only choose where plain LoRA goes, its
# rank/scale/dropout, or bookkeeping. Any other key that differs from its default is refused.
_PLAIN_KEYS = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout",
    "fan_in_fan_out", "use_rslora", "layers_to_transform", "layers_pattern", "rank_pattern",
    "alpha_pattern", "runtime_config",
})
# init_lora_weights values that only initialise A and B (others, e.g. PiSSA/OLoRA/LoftQ/CorDA,
# rewrite the base weights, so the gate-0 path would no longer be the base model).
_PLAIN_INITS = (True, False, "gaussian")
_WHY = {
    "use_dora": "DoRA rescales the whole weight W + BA by a learned magnitude at every token",
    "alora_invocation_tokens": "aLoRA activates on a suffix of the sequence, not on <|mask|> inputs",
    "lora_bias": "a bias in lora_B is added even where A x is gated to 0",
    "bias": "it trains base biases, which apply at every token",
    "modules_to_save": "it trains full copies of base modules, which apply at every token",
    "trainable_token_indices": "it trains base embedding rows outside the gated residual",
    "init_lora_weights": "this init rewrites the base weights",
}


class GateHolder:
    """The per-token gate shared by every gated LoRA-A hook of one model.

    ``gate``: bool ``[b, s, 1]``, True exactly where the input token is ``<|mask|>``; set by the
    model's forward pre-hook and kept (not cleared) so a checkpointed backward can still read it.
    """

    def __init__(self, mask_token_id: int, adapter_name: str, checkpoint_layers: list[torch.nn.Module]):
        self.mask_token_id = mask_token_id
        self.adapter_name = adapter_name
        self.gate: torch.Tensor | None = None
        self._checkpoint_layers = checkpoint_layers

    def set_gate(self, model: torch.nn.Module, decoder: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        """Forward pre-hook (with kwargs) on ``decoder``, the decoder stack of the transformers model
        ``model`` (bound with :func:`functools.partial`): gate from ``input_ids``."""
        adapters = set(getattr(model, "peft_config", {}))
        if not adapters:  # ``unload()`` removed the LoRA layers: the plain base runs, nothing to gate
            return
        if adapters != {self.adapter_name}:
            raise RuntimeError(
                f"gated LoRA: the model holds adapters {sorted(adapters)} but only {self.adapter_name!r} is gated; "
                "an ungated adapter would change the clean (base) stream. Load other adapters into a separate model."
            )
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError(
                f"gated LoRA needs input_ids: the LoRA gate is 1 exactly where the input token is {MASK_TOKEN} "
                f"(id {self.mask_token_id}), which inputs_embeds alone cannot tell"
            )
        self.gate = (input_ids == self.mask_token_id).unsqueeze(-1)  # [b, s, 1]
        for layer in self._checkpoint_layers:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if func is not None and not isinstance(func, _GateReplayingCheckpoint):
                layer._gradient_checkpointing_func = _GateReplayingCheckpoint(func, self)

    def gate_lora_a(self, module: torch.nn.Module, inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook on ``lora_A[adapter]``: its output gated (:meth:`gated`)."""
        return self.gated(output)

    def gated(self, output: torch.Tensor) -> torch.Tensor:
        """A LoRA-A output ``[b, s, r]`` zeroed where the gate is 0."""
        gate = self.gate
        if gate is None:
            raise RuntimeError("gated LoRA ran before any forward set its gate (call the model with input_ids)")
        if output.shape[:-1] != gate.shape[:-1]:
            raise RuntimeError(
                f"gated LoRA: a LoRA-A output of shape {tuple(output.shape)} does not match the per-token gate "
                f"{tuple(gate.shape)} taken from input_ids; only projections over [batch, seq, features] can be gated"
            )
        return output.masked_fill(~gate.to(output.device), 0.0)

    @contextlib.contextmanager
    def replaying(self, gate: torch.Tensor) -> Iterator[None]:
        """While a checkpointed layer is recomputed in backward: the gate of its own forward."""
        current, self.gate = self.gate, gate
        try:
            yield
        finally:
            self.gate = current


class _GateReplayingCheckpoint:
    """A layer's checkpoint function that also restores, during recomputation, the gate its forward saw."""

    def __init__(self, checkpoint_fn: Callable[..., Any], holder: GateHolder):
        self.checkpoint_fn = checkpoint_fn
        self.holder = holder

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(self.checkpoint_fn, "keywords", {}).get("use_reentrant") is not False:
            raise ValueError(
                "gated LoRA with gradient checkpointing needs non-reentrant checkpointing (backward re-runs each "
                "layer and must see the gate of that layer's own forward): call "
                "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        gate = self.holder.gate

        def contexts():
            return contextlib.nullcontext(), self.holder.replaying(gate)

        return self.checkpoint_fn(function, *args, context_fn=contexts, **kwargs)


def check_plain_lora(config: PeftConfig) -> None:
    """Refuse every LoraConfig that is not plain ``W x + s B A x`` (ConfigError naming the key)."""
    if not isinstance(config, LoraConfig):
        raise ConfigError(f"gated LoRA needs a LoraConfig, got {type(config).__name__}")
    defaults = LoraConfig()
    for field in dataclasses.fields(LoraConfig):
        name, value = field.name, getattr(config, field.name)
        if name == "init_lora_weights":
            plain = value in _PLAIN_INITS
        else:
            plain = name in _PLAIN_KEYS or value == getattr(defaults, name)
        if plain:
            continue
        reason = _WHY.get(name, "it is not plain LoRA")
        raise ConfigError(
            f"LoraConfig key {name!r} = {value!r} is not supported by gated LoRA: {reason}; the per-token "
            f"gate (1 only on {MASK_TOKEN} inputs) needs plain W x + s * gate * B A x"
        )


def wrap_gated_lora(model: torch.nn.Module, lora_config: LoraConfig, mask_token_id: int,
                    adapter_name: str = "default") -> PeftModel:
    """Wrap a transformers causal LM with a gated LoRA adapter (base frozen, LoRA trainable)."""
    check_plain_lora(lora_config)
    peft_model = get_peft_model(model, lora_config, adapter_name=adapter_name)
    _attach_gate(peft_model, mask_token_id, adapter_name)
    return peft_model


def load_gated_lora(base_model: torch.nn.Module, adapter_dir: str | Path, mask_token_id: int | None = None,
                    is_trainable: bool = False) -> PeftModel:
    """Load a plain PEFT adapter onto ``base_model`` and re-attach the gate.

    ``mask_token_id`` defaults to the id recorded in ``adapter_dir/gated_lora.json``; when both are
    given they must agree.
    """
    adapter_dir = Path(adapter_dir)
    recorded = _read_gate_record(adapter_dir)
    if mask_token_id is None:
        if recorded is None:
            raise ConfigError(f"{adapter_dir}: no {GATED_LORA_FILE} records the mask id; pass mask_token_id")
        mask_token_id = recorded
    elif recorded is not None and recorded != mask_token_id:
        raise ConfigError(f"{adapter_dir}: {GATED_LORA_FILE} records mask id {recorded}, caller passed {mask_token_id}")
    config = PeftConfig.from_pretrained(str(adapter_dir))
    check_plain_lora(config)
    peft_model = PeftModel.from_pretrained(base_model, str(adapter_dir), config=config, is_trainable=is_trainable)
    _attach_gate(peft_model, mask_token_id, "default", decoding=not is_trainable)
    return peft_model


def save_gated_lora(peft_model: PeftModel, adapter_dir: str | Path,
                    state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Save the adapter as a plain PEFT adapter plus ``gated_lora.json`` (gate kind, mask id).

    ``state_dict``: optional full state dict of ``peft_model`` (e.g. gathered under ZeRO-3)."""
    holder = gate_holder(peft_model)
    adapter_dir = Path(adapter_dir)
    extra = {} if state_dict is None else {"state_dict": state_dict}
    peft_model.save_pretrained(str(adapter_dir), safe_serialization=True, save_embedding_layers=False, **extra)
    record = {"gate": GATE_KIND, "mask_token_id": holder.mask_token_id}
    (adapter_dir / GATED_LORA_FILE).write_text(json.dumps(record, indent=2) + "\n")


def save_base_and_adapter(peft_model: PeftModel, out_dir: str | Path,
                          state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write the export layout: the frozen base as a plain HF checkpoint in ``out_dir`` (keys and
    config as if LoRA had never been added) and the adapter in ``out_dir/adapter``."""
    out_dir = Path(out_dir)
    state = peft_model.state_dict() if state_dict is None else state_dict
    base_model = peft_model.get_base_model()
    base_state = base_state_dict(state)
    metadata = CheckpointMetadata.of_model(base_model)
    metadata.updated(mask_token_id=gate_holder(peft_model).mask_token_id,
                     gated_lora_adapter=ADAPTER_SUBDIR).write_to(base_model)
    base_model.save_pretrained(str(out_dir), state_dict=base_state, safe_serialization=True)
    save_gated_lora(peft_model, out_dir / ADAPTER_SUBDIR, state)


def load_gated_lora_export(export_dir: str | Path, **from_pretrained_kwargs: Any) -> PeftModel:
    """Base + gated adapter from an export written by :func:`save_base_and_adapter`."""
    export_dir = Path(export_dir)
    base = AutoModelForCausalLM.from_pretrained(str(export_dir), **from_pretrained_kwargs)
    meta = CheckpointMetadata.of_model(base)
    if meta.gated_lora_adapter is None or meta.mask_token_id is None:
        raise CheckpointError(f"{export_dir}: config.json has no {METADATA_KEY}.gated_lora_adapter/mask_token_id; "
                              "not a gated-LoRA export")
    return load_gated_lora(base, export_dir / meta.gated_lora_adapter, meta.mask_token_id)


def gate_holder(peft_model: PeftModel) -> GateHolder:
    """The gate holder of a model wrapped by :func:`wrap_gated_lora` / :func:`load_gated_lora`."""
    holder = getattr(peft_model.get_base_model(), _HOLDER_ATTR, None)
    if holder is None:
        raise ValueError("not a gated LoRA model (wrap it with wrap_gated_lora or load_gated_lora)")
    return holder


def _attach_gate(peft_model: PeftModel, mask_token_id: int, adapter_name: str, decoding: bool = False) -> None:
    model = peft_model.get_base_model()
    if getattr(model, _HOLDER_ATTR, None) is not None:
        raise ValueError("this model already carries a gated LoRA")
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, BaseTunerLayer)]
    wrong = [f"{name} ({type(m).__name__})" for name, m in layers if type(m) is not LoraLinear]
    if wrong:
        raise ConfigError(f"gated LoRA supports plain lora.Linear layers only (nn.Linear targets); got {wrong[:3]}")
    n_embed = model.get_input_embeddings().num_embeddings
    if not 0 <= mask_token_id < n_embed:
        raise ConfigError(f"gated LoRA: mask token id {mask_token_id} is outside the model's {n_embed} embedding rows")
    holder = GateHolder(mask_token_id, adapter_name,
                        [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)])
    for _, layer in layers:
        layer.lora_A[adapter_name].register_forward_hook(holder.gate_lora_a)
        layer.merge = _refuse_merge
        if decoding:
            layer.forward = functools.partial(_decoding_forward, layer, holder, layer.forward)
    peft_model.base_model._check_merge_allowed = _refuse_merge
    decoder = model.base_model  # the decoder stack: transformers' base_model_prefix module (the model if none)
    decoder.register_forward_pre_hook(functools.partial(holder.set_gate, model), with_kwargs=True)
    setattr(model, _HOLDER_ATTR, holder)


def _decoding_forward(layer: LoraLinear, holder: GateHolder, peft_forward: Callable[..., torch.Tensor],
                      x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The forward of one gated ``lora.Linear`` of an adapter loaded for decoding (bound to the layer
    with :func:`functools.partial`, which ``copy.deepcopy`` rebinds to the copy).

    PEFT's own sum for one plain adapter, ``W x + B (gate * A x) * s``, computed as PEFT computes it
    (so bitwise PEFT's output), without what PEFT's forward checks and loops over on every call or the
    LoRA-A module call and its hook. On SmolLM2-135M (30 layers, 7 projections each) on the 2-core
    CPU that bookkeeping is 4.5-5.5 ms of a 47-71 ms gated forward (docs/results/real_cpu.md).
    Training mode, disabled adapters, extra call arguments and an input in another dtype than the
    adapter's (PEFT casts it) run PEFT's forward."""
    name = holder.adapter_name
    lora_a, lora_b = layer.lora_A[name].weight, layer.lora_B[name].weight
    if args or kwargs or layer.training or layer.disable_adapters or x.dtype != lora_a.dtype:
        return peft_forward(x, *args, **kwargs)
    result = layer.base_layer(x)
    lora_x = holder.gated(F.linear(x, lora_a))  # [b, s, r]
    return result + F.linear(lora_x, lora_b) * layer.scaling[name]


def _refuse_merge(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError(
        f"a gated LoRA cannot be merged: its residual applies only at {MASK_TOKEN} input positions (a per-token "
        "gate), while merged weights W + BA would apply it at every token and break the lossless clean stream"
    )


def _read_gate_record(adapter_dir: Path) -> int | None:
    path = adapter_dir / GATED_LORA_FILE
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    if record.get("gate") != GATE_KIND:
        raise ConfigError(f"{path}: unknown gate kind {record.get('gate')!r} (expected {GATE_KIND!r})")
    return int(record["mask_token_id"])
