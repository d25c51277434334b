"""The inductor backend without a GPU: its table entry, refusals, the Llama-family graphs (fp8 too: torch's
CPU kernels run torch._scaled_mm), AOTInductor on the CPU."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tasks.backends.base import BackendUnavailable, get_backend
from tasks.backends.inductor.backend import (DecodeSession, EngineMismatch, InductorBackend, export_decode,
                                             export_prefill, load_problem, prefill_graph_name, versions, warm_shapes)
from tasks.backends.inductor.encoder_graphs import EncoderPrefill
from tasks.backends.inductor.encoder_graphs import unsupported as unsupported_encoder
from tasks.backends.inductor.fp8_linear import FP8_MAX
from tasks.backends.inductor.llama_graphs import (LlamaPrefill, StaticDecoder, calibrate_input_amax, empty_cache,
                                                  fp8_sensitivity)
from tasks.backends.inductor.llama_support import fp8_unsupported, keep_sensitive, product_costs, product_names
from tasks.backends.table import BACKENDS
from tasks.config.spec import InductorTarget, ProfileSpec
from tasks.runtime.gpu import GpuInfo

H200 = GpuInfo("NVIDIA H200", (9, 0), "580.159.04")
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", (8, 0), "580.159.04")
SIDECAR = {"gpu": H200.facts(), "versions": {"torch": "2.11.0+cu130", "cuda": "13.0", "triton": "3.6.0"}}


@pytest.fixture(scope="module")
def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, rope_scaling={
                             "rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                             "original_max_position_embeddings": 64})
    config.architectures = ["LlamaForCausalLM"]
    return LlamaForCausalLM(config).eval()


def test_the_table_loads_the_inductor_backend_built_from_torch() -> None:
    assert BACKENDS["inductor"].source == "torch"
    backend = get_backend("inductor")
    assert isinstance(backend, InductorBackend) and backend.version() == torch.__version__
    with pytest.raises(TypeError, match="builds from the model's own files .* call build_from_model"):
        backend.build(Path("model.onnx"), None, [], Path("."), Path("."))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_target_is_refused_without_a_gpu() -> None:
    target = InductorTarget(name="h200", backend="inductor", arch="sm90")
    assert "needs a CUDA GPU (sm90)" in InductorBackend().missing(target)
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
        InductorBackend().build_from_model(Path("."), "text-generation", "bf16", target, [], Path("."))


def test_an_engine_is_refused_on_another_arch_or_torch() -> None:
    here = {**SIDECAR["versions"]}
    assert load_problem(SIDECAR, H200, here) is None
    problem = load_problem(SIDECAR, A100, here)
    assert problem == ("inductor engine built for sm90 (NVIDIA H200, compute capability 9.0) cannot run on "
                       "NVIDIA A100-SXM4-80GB (compute capability 8.0): its kernels are compiled for one arch; "
                       "rebuild the target on a sm90 GPU")
    assert "no CUDA GPU is visible here" in load_problem(SIDECAR, None, here)
    assert "compiled with torch 2.11.0+cu130; this machine has torch 2.13.0" in load_problem(
        SIDECAR, H200, {**here, "torch": "2.13.0"})


def test_loading_a_gpu_engine_here_says_why_it_cannot(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps({**SIDECAR, "versions": versions()}))
    target = InductorTarget(name="h200", backend="inductor", arch="sm90")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the refusal on another arch is tested in tests/test_inductor_gpu.py")
    with pytest.raises(EngineMismatch, match="built for sm90 .* no CUDA GPU is visible here"):
        InductorBackend().load(tmp_path, target)


def test_warm_shapes_come_from_prompt_and_decode_profiles() -> None:
    profiles = [ProfileSpec(batch=[1, 8, 8], seq=[1, 512, 512]),
                ProfileSpec(batch=[1, 1, 64], seq=[1, 1, 16], past=[0, 512, 512])]
    assert warm_shapes(profiles) == ([(8, 512)], [(1, 528), (64, 528)])


def test_the_exported_decode_step_computes_the_hf_model(llama: LlamaForCausalLM) -> None:
    """Token by token through the saved-format graph, any batch and cache length, equals one HF forward."""
    step = export_decode(llama, torch.float32).module()
    ids = torch.randint(0, 256, (3, 10))
    expected = llama(ids).logits
    session = DecodeSession(step, llama.config, batch=3, max_len=16, dtype=torch.float32, device="cpu")
    got = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(10)], dim=1)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="position 16 is outside this session's cache of 16 tokens"):
        session.step(ids[:, :1], 16)


def test_the_decode_step_through_smelters_products_computes_the_hf_model(llama: LlamaForCausalLM) -> None:
    """products='smelter' (smelter::decode_linear, torch operations off the GPU) is the same function;
    with e4m3 weights (per-channel scales, the LM head too) it stays close, and the products it is
    told to keep stay in the model's dtype."""
    ids = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        expected = llama(ids).logits
    for options, tolerance in (({}, 1e-4), ({"fp8_weights": True, "fp8_head": True}, None)):
        step = export_decode(llama, torch.float32, products="smelter", **options).module()
        session = DecodeSession(step, llama.config, batch=2, max_len=8, dtype=torch.float32, device="cpu")
        got = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(8)], dim=1)
        if tolerance:
            torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
        else:
            relative = float((got - expected).norm() / expected.norm())
            assert 1e-4 < relative < 0.1, relative
    graph = StaticDecoder(llama, products="smelter", fp8_weights=True, kept=["layers.1.down"])
    assert graph.layers[0].down.weight.dtype == torch.float8_e4m3fn and graph.layers[0].down.scale.shape == (64,)
    assert graph.layers[1].down.weight.dtype == torch.float32 and graph.layers[1].down.scale is None
    assert graph.head.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="products='smelter'"):
        StaticDecoder(llama, fp8_weights=True)


def test_the_decode_step_writes_only_its_position(llama: LlamaForCausalLM) -> None:
    k, v = empty_cache(llama.config, 2, 8, torch.float32, "cpu")
    before = [t.clone() for t in k]
    StaticDecoder(llama)(torch.tensor([[5], [7]]), torch.tensor(3), k, v)
    for old, new in zip(before, k):
        changed = (old != new).any(dim=(0, 1, 3))
        assert changed.tolist() == [False, False, False, True, False, False, False, False]


def test_the_prefill_graph_gives_each_rows_next_token_after_its_last_real_token(llama: LlamaForCausalLM) -> None:
    """Right-padded prompts of different lengths: each row's logits are HF's at that row's last real token."""
    ids = torch.randint(0, 256, (3, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    expected = llama(ids, attention_mask=mask).logits[torch.arange(3), mask.sum(1) - 1]
    program = export_prefill(llama, causal=True, batch=2, seq=8)
    torch.testing.assert_close(program.module()(ids, mask), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(LlamaPrefill(llama)(ids, mask), expected, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def bert() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64)
    return BertModel(config).eval()


def test_the_encoder_graph_computes_berts_hidden_states_with_padding(bert: torch.nn.Module) -> None:
    """Rows padded to different lengths (one all padding): every token's hidden state is HF's, exported too,
    and the graph without a mask is HF's on unpadded feeds."""
    ids = torch.randint(0, 256, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 1:] = 0
    mask[3, :] = 0
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        program = export_prefill(bert, causal=False, batch=2, seq=8)
        assert prefill_graph_name(bert, causal=False) == "encoder"
        torch.testing.assert_close(program.module()(ids, mask), expected, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(EncoderPrefill(bert, own_attention=False)(ids, mask), expected, rtol=1e-4,
                                   atol=1e-4)
        unpadded = torch.ones_like(ids)
        for own_attention in (True, False):
            torch.testing.assert_close(EncoderPrefill(bert, padding=False, own_attention=own_attention)(ids),
                                       bert(input_ids=ids, attention_mask=unpadded).last_hidden_state,
                                       rtol=1e-4, atol=1e-4)
    assert not torch.isnan(expected).any()
    assert "smelter.encoder_attention" in str(program.program.graph)


def test_the_encoder_attention_op_is_registered_for_export_and_compile() -> None:
    """smelter::encoder_attention passes torch's checks of a custom op (schema, fake tensors, dispatch), with
    a key bias and without, so exported encoder graphs trace and compile through it."""
    from tasks.backends.inductor import encoder_ops  # noqa: F401

    qkv = torch.randn(2, 12, 3 * 64, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(2, 12)
    bias[1, 5:] = torch.finfo(torch.float32).min
    for key_bias in (bias, None):
        torch.library.opcheck(torch.ops.smelter.encoder_attention.default, (qkv, key_bias, 4))
        # a static fp8 o product's input: scaled and rounded to e4m3 by the op itself
        scale = torch.tensor(4.0)
        torch.library.opcheck(torch.ops.smelter.encoder_attention.default, (qkv, key_bias, 4, scale))
        rounded = torch.ops.smelter.encoder_attention(qkv, key_bias, 4, scale)
        assert rounded.dtype == torch.float8_e4m3fn
        torch.testing.assert_close(rounded.float() / 4, torch.ops.smelter.encoder_attention(qkv, key_bias, 4),
                                   rtol=0.07, atol=1e-3)


def test_encoders_the_graph_does_not_cover_export_through_the_hf_forward(bert: torch.nn.Module) -> None:
    from transformers import RobertaConfig, RobertaModel

    config = RobertaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=64)
    assert "model_type bert" in unsupported_encoder(config)
    relative = copy.deepcopy(bert.config)
    relative.position_embedding_type = "relative_key"
    assert "absolute positions" in unsupported_encoder(relative)
    roberta = RobertaModel(config).eval()
    assert prefill_graph_name(roberta, causal=False) == "hf"
    ids = torch.randint(3, 256, (2, 8))
    with torch.no_grad():
        torch.testing.assert_close(export_prefill(roberta, causal=False, batch=2, seq=8).module()(ids, torch.ones_like(ids)),
                                   roberta(input_ids=ids).last_hidden_state, rtol=1e-4, atol=1e-4)


def test_an_encoders_forward_is_replayed_with_cuda_graphs_where_cuda_graphs_says() -> None:
    from tasks.backends.inductor.backend import prefill_cuda_graphs

    gpu = dict(name="gpu", backend="inductor", device="cuda", arch="sm90")
    assert prefill_cuda_graphs(InductorTarget(**gpu), causal=False)
    assert not prefill_cuda_graphs(InductorTarget(**gpu, cuda_graphs=False), causal=False)
    assert not prefill_cuda_graphs(InductorTarget(**gpu), causal=True)  # a decoder's follows compile_mode
    assert prefill_cuda_graphs(InductorTarget(**gpu, compile_mode="max-autotune"), causal=True)
    assert not prefill_cuda_graphs(InductorTarget(name="cpu", backend="inductor", device="cpu"), causal=False)


def test_fp8_prefill_stays_close_to_the_model(llama: LlamaForCausalLM) -> None:
    """e4m3 weights per channel and activations per token: the exported graph runs and stays near fp32."""
    ids = torch.randint(0, 256, (4, 16))
    mask = torch.ones_like(ids)
    expected = llama(ids).logits[:, -1]
    got = export_prefill(llama, causal=True, batch=2, seq=8, fp8=True).module()(ids, mask)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min() > 0.99, cosine
    assert not torch.equal(got, expected), "fp8 products give (slightly) other numbers than fp32"
    layer = LlamaPrefill(llama, fp8=True).layers[0]
    assert layer.qkv.weight.dtype == torch.float8_e4m3fn and layer.qkv.scale.shape == (1, 64 + 2 * 32)


def test_fp8_keeps_the_products_it_is_told_to_in_the_models_dtype(llama: LlamaForCausalLM) -> None:
    ids = torch.randint(0, 256, (2, 8))
    mask = torch.ones_like(ids)
    partly = LlamaPrefill(llama, fp8=True, kept=["layers.0.qkv", "layers.0.o", "layers.0.gate_up", "layers.0.down"])
    first, second = partly.layers
    assert first.qkv.weight.dtype == first.o.weight.dtype == first.gate_up.weight.dtype == torch.float32
    assert second.qkv.weight.dtype == second.down.weight.dtype == torch.float8_e4m3fn
    all_kept = LlamaPrefill(llama, fp8=True, kept=product_names(2))
    torch.testing.assert_close(all_kept(ids, mask), LlamaPrefill(llama)(ids, mask), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"no such products \['layers.2.qkv'\]: this model's are layers.0-1"):
        LlamaPrefill(llama, fp8=True, kept=["layers.2.qkv"])


def test_static_fp8_scales_are_set_from_real_tokens_only(llama: LlamaForCausalLM) -> None:
    """Padding after a prompt's real tokens is computed but never read: its activations must not set a scale."""
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.model.embed_tokens.weight[255] = 0  # the padding token: one spike, which survives the norm
        model.model.embed_tokens.weight[255, 0] = 1
    ids = torch.randint(0, 255, (2, 12))
    ids[1, 5:] = 255
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    padded = calibrate_input_amax(model, [(ids, mask)])
    real_only = calibrate_input_amax(model, [(ids[:1], mask[:1]), (ids[1:, :5], mask[1:, :5])])
    assert list(padded) == product_names(2)
    assert padded == pytest.approx(real_only, rel=1e-5)
    counting_padding = calibrate_input_amax(model, [(ids, torch.ones_like(ids))])
    assert counting_padding["layers.0.qkv"] > 1.5 * padded["layers.0.qkv"]
    with pytest.raises(ValueError, match="no real tokens"):
        calibrate_input_amax(model, [(ids, torch.zeros_like(ids))])


def test_static_fp8_prefill_stays_close_to_the_model(llama: LlamaForCausalLM) -> None:
    """One e4m3 scale per product input, fixed at build: the exported graph runs, stays near fp32, and
    clips what lies past the calibrated range instead of overflowing."""
    calibration = [(torch.randint(0, 256, (4, 16)), torch.ones(4, 16, dtype=torch.long)) for _ in range(2)]
    scales = {name: amax / FP8_MAX for name, amax in calibrate_input_amax(llama, calibration).items()}
    ids = torch.randint(0, 256, (4, 16))
    mask = torch.ones_like(ids)
    expected = llama(ids).logits[:, -1]
    got = export_prefill(llama, causal=True, batch=2, seq=8, fp8=True, input_scales=scales).module()(ids, mask)
    cosine = torch.nn.functional.cosine_similarity(got, expected, dim=-1)
    assert cosine.min() > 0.99, cosine
    per_token = LlamaPrefill(llama, fp8=True).layers[0].down
    static = LlamaPrefill(llama, fp8=True, input_scales=scales).layers[0].down
    assert static.weight.dtype == torch.float8_e4m3fn and torch.equal(static.weight, per_token.weight)
    assert 1 / float(static.inv_input_scale) == pytest.approx(scales["layers.0.down"])
    # the input's scale is folded into the weight's channel scales
    torch.testing.assert_close(static.scale, per_token.scale * scales["layers.0.down"])
    tiny = {name: 1e-6 for name in scales}  # everything past range: clipped to it
    assert torch.isfinite(LlamaPrefill(llama, fp8=True, input_scales=tiny)(ids, mask)).all()
    with pytest.raises(ValueError, match=r"static fp8 scales are missing for \['layers.1.down'\]"):
        LlamaPrefill(llama, fp8=True, input_scales={k: v for k, v in scales.items() if k != "layers.1.down"})
    kept = LlamaPrefill(llama, fp8=True, kept=["layers.1.down"],
                        input_scales={k: v for k, v in scales.items() if k != "layers.1.down"})
    assert kept.layers[1].down.weight.dtype == torch.float32


def test_fp8_sensitivity_finds_the_products_that_dominate_the_logits_and_errors_add_up(
        llama: LlamaForCausalLM) -> None:
    """Each product's logit error alone in e4m3: the products whose output dominates the residual stream
    (a layer's MLP made 30x louder: down's own rounding, and gate_up's amplified by down) round worst,
    and the errors of all products add up to the all-e4m3 prefill's (independent noise)."""
    model = copy.deepcopy(llama)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(30)
    batches = [(torch.randint(0, 256, (4, 16)), torch.ones(4, 16, dtype=torch.long)) for _ in range(2)]
    batches[1][1][2, 9:] = 0  # a padded row: only real tokens count, here and below
    errors = fp8_sensitivity(model, batches)
    assert list(errors) == product_names(2) and all(e > 0 for e in errors.values())
    assert set(sorted(errors, key=errors.get)[-2:]) == {"layers.1.gate_up", "layers.1.down"}
    exact, rounded = LlamaPrefill(model).eval(), LlamaPrefill(model, fp8=True).eval()
    with torch.no_grad():
        squared = [(exact.logits(rounded.hidden(ids)) - exact.logits(exact.hidden(ids)))[mask.bool()].pow(2)
                   for ids, mask in batches]
    all_e4m3 = float(torch.cat(squared).mean())
    assert 0.5 < sum(errors.values()) / all_e4m3 < 2, (sum(errors.values()), all_e4m3)
    assert fp8_sensitivity(model, batches, {name: 1.0 for name in errors}) != errors  # static scales are used


def test_the_encoder_graph_runs_its_products_in_fp8_but_those_kept(bert: torch.nn.Module) -> None:
    """An fp8 encoder graph: every product but those `kept` holds e4m3 weights with per-channel scales (a
    static one folds its input scale into them), stays near fp32 with padding, and refuses names of no
    product and static scales that miss a product."""
    from tasks.backends.inductor.encoder_graphs import calibrate_input_amax as encoder_amax
    from tasks.backends.inductor.fp8_linear import Fp8Linear

    ids = torch.randint(0, 256, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    calibration = [(torch.randint(0, 256, (4, 12)), torch.ones_like(ids))]
    scales = {name: amax / FP8_MAX for name, amax in encoder_amax(bert, calibration).items()}
    assert list(scales) == product_names(2, ("qkv", "o", "up", "down"))
    with torch.no_grad():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
        for kwargs in ({}, {"input_scales": scales}, {"kept": ["layers.1.up"], "input_scales": scales}):
            graph = EncoderPrefill(bert, fp8=True, own_attention=True, **kwargs).eval()
            got = graph(ids, mask)[mask.bool()]
            assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() > 0.99, kwargs
            assert not torch.equal(got, expected), "e4m3 products give (slightly) other numbers than fp32"
    layer = graph.layers[1]
    assert isinstance(layer.up, torch.nn.Module) and not isinstance(layer.up, Fp8Linear)
    assert layer.up.weight.dtype == torch.float32, "a kept product stays in the model's dtype"
    assert isinstance(layer.down, Fp8Linear) and layer.down.weight.dtype == torch.float8_e4m3fn
    per_token = EncoderPrefill(bert, fp8=True).layers[1].down
    torch.testing.assert_close(layer.down.scale, per_token.scale * scales["layers.1.down"])
    with pytest.raises(ValueError, match=r"no such products \['layers.1.gate_up'\]"):
        EncoderPrefill(bert, fp8=True, kept=["layers.1.gate_up"])
    with pytest.raises(ValueError, match=r"static fp8 scales are missing for \['layers.0.o'\]"):
        EncoderPrefill(bert, fp8=True, input_scales={k: v for k, v in scales.items() if k != "layers.0.o"})


def test_encoder_fp8_calibration_reads_real_tokens_and_sensitivity_finds_the_loud_product(
        bert: torch.nn.Module) -> None:
    """Static scales of an encoder come from its real tokens only, and each product's error alone in e4m3,
    as the last hidden state sees it, is largest in the MLP that dominates the residual stream (its down
    product and the up product it amplifies, far above the rest); the errors of all products add up to the
    all-e4m3 graph's."""
    from tasks.backends.inductor.encoder_graphs import calibrate_input_amax as encoder_amax
    from tasks.backends.inductor.encoder_graphs import fp8_sensitivity as encoder_sensitivity

    model = copy.deepcopy(bert)
    with torch.no_grad():
        model.embeddings.word_embeddings.weight[255] = 0  # the padding token: one spike, which survives the norm
        model.embeddings.word_embeddings.weight[255, 0] = 30
        model.encoder.layer[1].output.dense.weight.mul_(30)
    tokens = torch.Generator().manual_seed(0)  # the same feeds whatever ran before in this process
    ids = torch.randint(0, 255, (2, 12), generator=tokens)
    ids[1, 5:] = 255
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    padded = encoder_amax(model, [(ids, mask)])
    assert padded == pytest.approx(encoder_amax(model, [(ids[:1], mask[:1]), (ids[1:, :5], mask[1:, :5])]), rel=1e-5)
    assert encoder_amax(model, [(ids, torch.ones_like(ids))])["layers.0.qkv"] > 1.5 * padded["layers.0.qkv"]
    batches = [(ids, mask), (torch.randint(0, 255, (4, 12), generator=tokens), torch.ones(4, 12, dtype=torch.long))]
    errors = encoder_sensitivity(model, batches)
    assert list(errors) == list(padded) and all(e > 0 for e in errors.values())
    # which of the two leads depends on the tokens (up did for 14 of 60 seeds); the rest is 500x quieter
    second, third = sorted(errors.values(), reverse=True)[1:3]
    assert {k for k, e in errors.items() if e >= second} == {"layers.1.up", "layers.1.down"}
    assert second > 100 * third
    exact, rounded = EncoderPrefill(model).eval(), EncoderPrefill(model, fp8=True).eval()
    with torch.no_grad():
        squared = [(rounded(i, m) - exact(i, m))[m.bool()].pow(2) for i, m in batches]
    all_e4m3 = float(torch.cat(squared).mean())
    assert 0.5 < sum(errors.values()) / all_e4m3 < 2, (sum(errors.values()), all_e4m3)


def test_fp8_is_admitted_for_bert_encoders_and_refused_for_other_encoders_with_the_reason() -> None:
    """smelter validate's rule (the target's model_problems): fp8 for a BERT-family encoder whose products
    divide by 16, fp8_exclude over its own product names; another encoder, or odd sizes, said as such."""
    target = InductorTarget(name="h100", backend="inductor", arch="sm90",
                            fp8_exclude=["layers.0.up", "layers.*.gate_up"])
    bert = {"model_type": "bert", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 2}
    assert target.model_problems("fp8", bert, decoder=False) == [
        (("fp8_exclude", 1), "'layers.*.gate_up' matches no product of this model; its 2 layers' products are "
                             "layers.<0-1>.qkv|o|up|down")]
    assert target.model_problems("bf16", {"model_type": "distilbert"}, decoder=False) == []
    assert target.model_problems("fp8", {**bert, "model_type": "distilbert"}, decoder=False) == [
        ((), "fp8 is built for Llama-family decoders and BERT-family encoders only: the encoder graph supports "
             "model_type bert; this model is distilbert")]
    assert target.model_problems("fp8", {**bert, "intermediate_size": 100}, decoder=False) == [
        ((), "fp8 products need sizes divisible by 16; this model has intermediate_size = 100")]
    assert "lacks them" in target.model_problems("fp8", {"model_type": "bert"}, decoder=False)[0][1]
    from tasks.backends.inductor import encoder_graphs, encoder_support

    assert set(encoder_graphs.ACTIVATION_FUNCTIONS) == set(encoder_support.ACTIVATIONS), "the graph runs what validate admits"


def test_keep_sensitive_fills_the_share_with_the_most_error_per_multiply_add(llama: LlamaForCausalLM) -> None:
    costs = product_costs(llama.config)
    assert costs["layers.0.qkv"] == 64 * (4 + 2 * 2) * 16 and costs["layers.1.down"] == 128 * 64
    total = sum(costs.values())
    errors = dict.fromkeys(costs, 1.0) | {"layers.1.o": 50.0, "layers.0.gate_up": 60.0}
    # layers.1.o: 50 per 4096; layers.0.gate_up: 60 per 16384; the rest: 1 per their cost
    assert keep_sensitive(errors, costs, 0.0, []) == []
    assert keep_sensitive(errors, costs, 4096 / total, []) == ["layers.1.o"]
    assert keep_sensitive(errors, costs, (4096 + 16384) / total, []) == ["layers.0.gate_up", "layers.1.o"]
    kept = keep_sensitive(errors, costs, 0.5, ["layers.0.down"])
    assert "layers.0.down" in kept and "layers.1.o" in kept and sum(costs[n] for n in kept) <= 0.5 * total
    assert keep_sensitive(errors, costs, 0.01, ["layers.0.down"]) == ["layers.0.down"], "what fp8_exclude keeps stays"


def test_fp8_is_refused_with_the_reason(llama: LlamaForCausalLM) -> None:
    odd = llama.config.__class__(**{**llama.config.to_dict(), "intermediate_size": 100})
    assert fp8_unsupported(odd) == "fp8 products need sizes divisible by 16; this model has intermediate_size = 100"
    gpt2 = llama.config.__class__(**{**llama.config.to_dict(), "architectures": ["GPT2LMHeadModel"]})
    assert fp8_unsupported(gpt2).startswith("fp8 is built for Llama-family decoders and BERT-family encoders only: "
                                            "the Llama-family graphs")
    with pytest.raises(BackendUnavailable, match="BERT-family encoders only: the encoder graph supports model_type "
                                                 "bert; this model is llama"):
        export_prefill(llama.model, causal=False, batch=2, seq=8, fp8=True)


def test_aoti_package_builds_and_loads_on_the_cpu(llama: LlamaForCausalLM, tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    llama.save_pretrained(model_dir)
    target = InductorTarget(name="cpu-pt", backend="inductor", device="cpu", format="aoti", compile_mode="default")
    engine = tmp_path / "engine"
    engine.mkdir()
    backend = InductorBackend()
    facts = backend.build_from_model(model_dir, "text-generation", "fp32", target,
                                     [ProfileSpec(batch=[1, 2, 4], seq=[1, 8, 16])], engine)
    assert facts["format"] == "aoti" and facts["engine_bytes"] == (engine / "prefill.pt2").stat().st_size
    runner = backend.load(engine, target)
    ids = np.random.default_rng(0).integers(0, 256, (3, 12))
    got = runner.infer({"input_ids": ids, "attention_mask": np.ones_like(ids)})["logits"]
    expected = llama(torch.as_tensor(ids)).logits[:, -1].detach().numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(BackendUnavailable, match="no decode-step graph"):
        runner.decoder(1, 8)
    left_padded = np.ones_like(ids)
    left_padded[0, :3] = 0
    with pytest.raises(ValueError, match="right-padded prompts .* a 1 after a 0"):
        runner.infer({"input_ids": ids, "attention_mask": left_padded})


def test_a_compiled_engine_stores_its_weights_once_and_reloads_on_the_cpu(llama: LlamaForCausalLM,
                                                                           tmp_path: Path) -> None:
    """Format compiled: both graphs hold no weights, weights.safetensors holds each tensor once
    (tied embeddings and the weights both graphs share), and a reload in a fresh runner computes
    the HF model in the prefill and token by token in the decode step."""
    model_dir = tmp_path / "model"
    llama.save_pretrained(model_dir)
    target = InductorTarget(name="cpu-pt", backend="inductor", device="cpu", compile_mode="default")
    engine = tmp_path / "engine"
    engine.mkdir()
    backend = InductorBackend()
    facts = backend.build_from_model(model_dir, "text-generation", "fp32", target,
                                     [ProfileSpec(batch=[1, 2, 2], seq=[1, 4, 4], past=[0, 4, 8])], engine)
    weights = json.loads((engine / "engine.json").read_text())["weights"]
    matrices = sum(p.numel() * 4 for name, p in llama.named_parameters() if "norm" not in name)
    assert weights["tensors_stored"] == weights["names"] // 2 - 1, "one graph's tensors, less the tied LM head"
    assert matrices < weights["bytes"] < 1.05 * matrices, "each weight stored once, tied embeddings too"
    for graph in ("prefill.pt2", "decode.pt2"):
        program = torch.export.load(str(engine / graph))
        assert not program.state_dict and not program.constants, f"{graph} holds no weights"
    assert facts["engine_bytes"] == sum((engine / f).stat().st_size
                                        for f in ("prefill.pt2", "decode.pt2", "weights.safetensors"))
    torch.compiler.reset()
    runner = backend.load(engine, target)
    ids = torch.randint(0, 256, (2, 6))
    with torch.no_grad():
        expected = llama(ids).logits
    got = runner.infer({"input_ids": ids.numpy(), "attention_mask": np.ones((2, 6), dtype=np.int64)})["logits"]
    np.testing.assert_allclose(got, expected[:, -1].numpy(), rtol=1e-4, atol=1e-4)
    session = runner.decoder(2, 8)
    steps = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, expected, rtol=1e-4, atol=1e-4)
    # torch.compile takes the loaded prefill whole: a graph break would split it into graphs compiled,
    # cached and (with CUDA graphs) recorded apart
    explained = torch._dynamo.explain(runner._prefill._orig_mod)(ids, torch.ones_like(ids))
    assert explained.graph_break_count == 0, explained.break_reasons
    # Precompiled graphs (tasks/backends/inductor/precompiled.py): the shapes the build warmed load without
    # reading the exported programs or tracing them
    recorded = json.loads((engine / "engine.json").read_text())["precompiled"]
    assert not recorded["failed"], recorded["failed"]
    assert [e["file"] for e in recorded["prefill"]] == ["prefill-2x4.precompiled"]
    assert [e["file"] for e in recorded["decode"]] == ["decode-b1-len12.precompiled", "decode-b2-len12.precompiled"]
    torch.compiler.reset()
    warm = backend.load(engine, target)
    got = warm.infer({"input_ids": ids[:, :4].numpy(), "attention_mask": np.ones((2, 4), dtype=np.int64)})["logits"]
    np.testing.assert_allclose(got, expected[:, 3].numpy(), rtol=1e-4, atol=1e-4)
    session = warm.decoder(2, 12)
    steps = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(6)], dim=1)
    torch.testing.assert_close(steps, expected, rtol=1e-4, atol=1e-4)
    assert warm._prefill is None and warm._decode_graph is None, "neither exported program was read"
    assert not warm.precompile_problems
    assert [p.name for p in warm._pre_decode_used] == ["decode-b2-len12.precompiled"]
    # a precompiled file that cannot be read: that shape goes through torch.compile, and the runner says why
    (engine / "prefill-2x4.precompiled").write_bytes(b"not a precompiled function")
    broken = backend.load(engine, target)
    got = broken.infer({"input_ids": ids[:, :4].numpy(), "attention_mask": np.ones((2, 4), dtype=np.int64)})["logits"]
    np.testing.assert_allclose(got, expected[:, 3].numpy(), rtol=1e-4, atol=1e-4)
    assert broken._prefill is not None and len(broken.precompile_problems) == 1, broken.precompile_problems
    assert broken.precompile_problems[0].startswith("prefill-2x4.precompiled: ")


def test_smelters_triton_kernels_travel_with_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """kernel_bundle packs the Triton cache entries of smelter's own kernels and installs those a cache
    lacks, its group file naming the installed files."""
    from tasks.backends.inductor import kernel_bundle

    built, fresh = tmp_path / "built-cache", tmp_path / "fresh-cache"
    entry = built / "ABCDEF123"
    entry.mkdir(parents=True)
    (entry / "_gemv_kernel.json").write_text("{}")
    (entry / "_gemv_kernel.cubin").write_bytes(b"\x7fELF")
    (entry / "__grp___gemv_kernel.json").write_text(json.dumps({"child_paths": {
        "_gemv_kernel.cubin": str(entry / "_gemv_kernel.cubin"), "_gemv_kernel.json": str(entry / "_gemv_kernel.json")}}))
    (built / "OTHER").mkdir()
    (built / "OTHER" / "triton_poi_fused.json").write_text("{}")
    monkeypatch.setattr(kernel_bundle, "triton_cache_dir", lambda: built)
    facts = kernel_bundle.pack(tmp_path / kernel_bundle.FILE)
    assert facts["kernels"] == 1, facts
    monkeypatch.setattr(kernel_bundle, "triton_cache_dir", lambda: fresh)
    assert kernel_bundle.install(tmp_path / kernel_bundle.FILE) == 1
    assert kernel_bundle.install(tmp_path / kernel_bundle.FILE) == 0, "an entry the cache has is left alone"
    installed = fresh / "ABCDEF123"
    assert (installed / "_gemv_kernel.cubin").read_bytes() == b"\x7fELF" and not (fresh / "OTHER").exists()
    group = json.loads((installed / "__grp___gemv_kernel.json").read_text())
    assert group["child_paths"]["_gemv_kernel.cubin"] == str(installed / "_gemv_kernel.cubin")
    monkeypatch.setattr(kernel_bundle, "triton_cache_dir", lambda: tmp_path / "empty")
    assert kernel_bundle.pack(tmp_path / "none.zip") == {"kernels": 0} and not (tmp_path / "none.zip").exists()


def test_a_compiled_engine_from_before_shared_weights_is_refused_with_the_remedy(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps({"format": "compiled", "precision": "fp32", "causal": True,
                                                      "gpu": None, "versions": versions()}))
    target = InductorTarget(name="cpu-pt", backend="inductor", device="cpu")
    with pytest.raises(EngineMismatch, match="has no weights.safetensors: .* rebuild it"):
        InductorBackend().load(tmp_path, target)


def test_every_triton_kernel_of_smelters_ops_travels_with_the_engine() -> None:
    """A kernel left out of decode_products.KERNELS or encoder_ops.KERNELS is compiled again by every fresh
    process that loads an engine."""
    import ast

    from tasks.backends.inductor import decode_products, encoder_ops, kernel_bundle

    jitted = set()
    for module in (decode_products, encoder_ops):
        tree = ast.parse(Path(module.__file__).read_text())
        jitted |= {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
                   and any(ast.unparse(d).endswith("triton.jit") for d in node.decorator_list)}
    assert "_encoder_attention_kernel" in jitted and set(kernel_bundle.BUNDLED_KERNELS) == jitted
