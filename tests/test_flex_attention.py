"""``attn_implementation=pardec_flex`` (pardec/models/flex_attention.py) against dense-mask SDPA.

On GPU: a tiny model with grouped-query attention at a head ratio that is not a power of two
(6 query heads, 2 K/V heads) runs a packed I-DLM row and a Jacobi Forcing row; logits and every
parameter gradient equal those of the same model with SDPA and the dense float mask of the same
predicate, and a second row length (a second static compile) does too, with torch's kernel
choice and with other tile sizes (``pardec.models.flex_attention.configure``). On CPU: the registration,
the choice of backend, that configured kernel options and compile mode reach the compiled call, the
named errors, and with K/V heads repeated the output and what the compiled function keeps for backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen2Config

from pardec.common.attention import COMPILED_FLEX_BACKEND
from pardec.common.errors import ConfigError
from pardec.data_pipelines.idlm_batch import build_idlm_batch
from pardec.data_pipelines.jacobi_batch import build_jacobi_batch
from pardec.masks.core import causal_document_spec, dense_additive_mask, flex_block_mask
from pardec.methods.base import forward_logits, move_batch
from pardec.models import flex_attention
from pardec.models.flex_attention import compiled_flex_attention
from pardec.models.loading import check_attn_implementation, configure_flex_attention, resolve_attn_implementation

VOCAB = 64


def tiny_model(impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl, dtype=torch.float32)


def idlm_row(length: int) -> dict:
    g = torch.Generator().manual_seed(length)
    samples = [{"input_ids": torch.randint(0, VOCAB - 1, (n,), generator=g).tolist(), "prompt_len": 5}
               for n in (40, 23, 61)]
    return build_idlm_batch(samples, mask_token_id=VOCAB - 1, block_size=3, pack_length=length, pad_token_id=0)


def jacobi_row(length: int, **options) -> dict:
    g = torch.Generator().manual_seed(length)
    rand = lambda k: torch.randint(0, VOCAB - 1, (k,), generator=g).tolist()  # noqa: E731
    clean = [rand(8) for _ in range(6)]
    sample = {"prompt_ids": rand(17), "noisy_blocks": [[c[0]] + rand(7) for c in clean], "clean_blocks": clean,
              "valid_lens": [8, 8, 8, 8, 8, 5]}
    return build_jacobi_batch([sample], block_size=8, pack_length=length, pad_token_id=0, **options)


def test_pardec_flex_is_a_registered_backend_and_needs_a_gpu():
    check_attn_implementation(COMPILED_FLEX_BACKEND, "model.attn_implementation")
    with pytest.raises(ConfigError, match="pardec_flex needs a CUDA GPU"):
        resolve_attn_implementation(COMPILED_FLEX_BACKEND, on_gpu=False, needs_custom_mask=True)
    assert resolve_attn_implementation("auto", on_gpu=True, needs_custom_mask=True) == COMPILED_FLEX_BACKEND


def test_pardec_flex_rejects_a_dense_mask():
    spec = causal_document_spec(torch.zeros(1, 8, dtype=torch.long))
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(TypeError, match="needs a BlockMask"):
        compiled_flex_attention(None, q, q, q, dense_additive_mask(spec))


def test_configured_kernel_options_and_mode_reach_the_compiled_call(monkeypatch):
    compiled, calls = [], []

    def fake_compile(fn, dynamic, mode):
        compiled.append((fn, dynamic, mode))
        return lambda *args: calls.append(args) or args[0]

    monkeypatch.setattr(flex_attention.torch, "compile", fake_compile)
    monkeypatch.setattr(flex_attention, "BlockMask", torch.Tensor)  # any object passes as the mask here
    flex_attention._compiled_attend.cache_clear()
    q = torch.zeros(1, 2, 8, 4)
    try:
        flex_attention.configure({"BLOCK_M": 64, "BLOCK_N": 32}, "max-autotune-no-cudagraphs")
        compiled_flex_attention(None, q, q, q, q)
        flex_attention.configure()
        compiled_flex_attention(None, q, q, q, q)
    finally:
        flex_attention.configure()
        flex_attention._compiled_attend.cache_clear()
    assert [(dynamic, mode) for _, dynamic, mode in compiled] == [(False, "max-autotune-no-cudagraphs"), (False, None)]
    assert compiled[0][0] is flex_attention.attend
    assert calls[0][5] == {"BLOCK_M": 64, "BLOCK_N": 32}  # attend's kernel_options
    assert calls[1][5] is None


@pytest.mark.parametrize("key,value", [("flex_kernel_options", {"BLOCK_M": 64}), ("flex_compile_mode", "max-autotune"),
                                       ("flex_repeat_kv", True)])
def test_flex_kernel_choices_need_pardec_flex(key, value):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"flex_kernel_options": None, "flex_compile_mode": None, "flex_repeat_kv": False,
                            key: value})
    with pytest.raises(ConfigError, match=f"'model.{key}'.*needs attn_implementation=pardec_flex.*'sdpa'"):
        configure_flex_attention(cfg, "sdpa")
    try:
        configure_flex_attention(cfg, COMPILED_FLEX_BACKEND)
        state = {"flex_kernel_options": flex_attention._KERNEL_OPTIONS,
                 "flex_compile_mode": flex_attention._COMPILE_MODE,
                 "flex_repeat_kv": flex_attention._REPEAT_KV}
        assert state[key] == value
    finally:
        flex_attention.configure()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_repeated_kv_heads_give_the_grouped_query_attention(monkeypatch):
    """``repeat_kv`` hands the compiled function K/V heads as they are and the group to repeat them by;
    eager flex on CPU gives the same output as grouped-query attention inside the kernel."""
    seen = []

    def run(q, k, v, block_mask, scale, kernel_options, group):
        seen.append((k.shape[1], group))
        return flex_attention.attend(q, k, v, block_mask, scale, kernel_options, group)

    monkeypatch.setattr(flex_attention, "_compiled_attend", lambda: run)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 16, 8, generator=gen), torch.randn(1, 2, 16, 8, generator=gen),
               torch.randn(1, 2, 16, 8, generator=gen))
    spec = causal_document_spec(torch.tensor([[0] * 10 + [1] * 6]))
    mask = flex_block_mask(spec, compile=False, block_size=8)
    try:
        grouped, _ = compiled_flex_attention(None, q, k, v, mask)
        flex_attention.configure(repeat_kv=True)
        repeated, _ = compiled_flex_attention(None, q, k, v, mask)
    finally:
        flex_attention.configure()
    assert seen == [(2, 1), (2, 3)]
    torch.testing.assert_close(repeated, grouped)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_additive_mask(spec), enable_gqa=True)
    torch.testing.assert_close(grouped, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [2, 3, 7])
def test_repeated_kv_heads_are_recomputed_in_backward_not_kept(monkeypatch, group):
    """With K/V heads repeated, what the compiled function keeps for backward is the query, the
    output, its log-sum-exp and the K/V heads as given: the repeated copies are made again in backward
    (``repeat_partition``), and the forward kernel is not rerun. Without the budget the partition keeps
    the repeated copies (four ``[b, h, s, d]`` tensors). torch refuses flex's backward on CPU at its
    entry, so this lifts that check and compiles with torch.compile's partitioner (as inductor calls
    it) and no code generation: the dense reference kernels compute the gradients, checked against
    dense SDPA."""
    import functools

    import torch.nn.attention.flex_attention as torch_flex
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    monkeypatch.setattr(torch_flex, "_validate_device", lambda *args: None)
    backward_ops = []

    def keep_backward_ops(graph_module, example_inputs):
        backward_ops.extend(str(node.target) for node in graph_module.graph.nodes if node.op == "call_function")
        return make_boxed_func(graph_module)

    backend = aot_autograd(fw_compiler=lambda graph_module, example_inputs: make_boxed_func(graph_module),
                           bw_compiler=keep_backward_ops,
                           partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
    gen = torch.Generator().manual_seed(group)
    heads, kv_heads, length, dim = 2 * group, 2, 32, 8
    q = torch.randn(1, heads, length, dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, length, dim, generator=gen, requires_grad=True) for _ in range(2))
    spec = causal_document_spec(torch.tensor([[0] * 20 + [1] * 12]))
    mask = flex_block_mask(spec, compile=False, block_size=8)
    kept = []
    torch._dynamo.reset()
    try:
        compiled = torch.compile(flex_attention.attend, dynamic=False, backend=backend)
        with flex_attention.repeat_partition(group), torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.append(t) or t, lambda t: t):
            out = compiled(q, k, v, mask, None, None, group)  # [1, h, s, d]
        grad_out = torch.randn(out.shape, generator=gen)
        out.backward(grad_out)
    finally:
        torch._dynamo.reset()
    full = [t for t in kept if t.dim() == 4 and t.shape[2] == length]
    assert sorted(t.shape[1] for t in full) == [kv_heads, kv_heads, heads, heads]
    assert {t.data_ptr() for t in full} >= {q.data_ptr(), k.data_ptr(), v.data_ptr()}
    assert "flex_attention" not in backward_ops and "flex_attention_backward" in backward_ops
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*inputs, attn_mask=dense_additive_mask(spec), enable_gqa=True)
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for got, reference in zip((q, k, v), inputs):
        torch.testing.assert_close(got.grad, reference.grad, atol=1e-5, rtol=1e-5)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel_options,repeat_kv", [(None, False),
                                                     (flex_attention.AUTOTUNED_HOPPER_HEAD_DIM_64, False),
                                                     (flex_attention.AUTOTUNED_HOPPER_HEAD_DIM_64, True)],
                         ids=["torch-default", "autotuned-hopper", "autotuned-hopper-repeat-kv"])
@pytest.mark.parametrize("build", [idlm_row, jacobi_row], ids=["idlm", "jacobi"])
def test_pardec_flex_equals_dense_sdpa_forward_and_backward(build, kernel_options, repeat_kv):
    flex_attention.configure(kernel_options, repeat_kv=repeat_kv)
    try:
        check_against_dense_sdpa(build)
    finally:
        flex_attention.configure()


def check_against_dense_sdpa(build) -> None:
    reference = tiny_model("sdpa").cuda()
    flex = tiny_model(COMPILED_FLEX_BACKEND).cuda()
    for length in (256, 384):  # a second length compiles a second static kernel
        batch = move_batch(build(length), "cuda")
        outputs = []
        for model in (reference, flex):
            model.zero_grad(set_to_none=True)
            logits = forward_logits(model, batch)  # [1, s, vocab]
            logits.float().logsumexp(-1).sum().backward()
            outputs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
        (ref_logits, ref_grads), (flex_logits, flex_grads) = outputs
        torch.testing.assert_close(flex_logits, ref_logits, atol=2e-3, rtol=2e-3)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(flex_grads[name], grad, atol=2e-3, rtol=2e-3, msg=name)


@pytest.mark.parametrize("mask,window", [("nc", 1), ("nc_ic", 2)])
def test_jacobi_streams_layout_is_the_same_attention(mask, window):
    """layout=streams moves the Jacobi slots (pardec/benchmarks/mask_tiles.py counts its tiles): every token,
    named by (stream, block, position), attends to the same tokens as in the interleaved layout."""
    from pardec.masks.core import dense_bool_mask

    def attends(layout: str) -> set:
        batch = jacobi_row(256, mask=mask, window=window, layout=layout)
        meta = batch["attention"].metadata
        keep = meta["segment_ids"][0] >= 0
        name = list(zip(meta["stream"][0][keep].tolist(), meta["block_ids"][0][keep].tolist(),
                        meta["position_ids"][0][keep].tolist(), batch["input_ids"][0][keep].tolist()))
        allowed = dense_bool_mask(batch["attention"].mask_mod(), 1, 256, 256)[0][keep][:, keep]  # [t, t]
        return {(name[q], name[k]) for q, k in allowed.nonzero().tolist()}, name

    (interleaved, names_i), (streams, names_s) = attends("interleaved"), attends("streams")
    assert names_i != names_s and sorted(names_i) == sorted(names_s)  # the same tokens, moved
    assert interleaved == streams


def test_flex_kernel_options_must_be_a_mapping():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"flex_kernel_options": 64, "flex_compile_mode": None, "flex_repeat_kv": False})
    with pytest.raises(ConfigError, match="'model.flex_kernel_options' = 64; expected a mapping"):
        configure_flex_attention(cfg, COMPILED_FLEX_BACKEND)
