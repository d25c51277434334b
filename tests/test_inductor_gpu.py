"""The inductor backend on a CUDA GPU: build, reload, agree with eager PyTorch, decode with CUDA graphs.

Marked `gpu`; skipped (with the reason) where torch sees no CUDA GPU. Self-contained (random-weight
tiny Llama made here), so it also runs with `--noconftest` on a machine without the servers' packages.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tasks.backends.inductor.backend import EngineMismatch, InductorBackend
from tasks.config.spec import InductorTarget, ProfileSpec
from tasks.measure import gpu_measure
from tasks.runtime.gpu import detect_gpu

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config.architectures = ["LlamaForCausalLM"]
    out = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def built(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, InductorTarget]:
    target = InductorTarget(name="gpu", backend="inductor", device="cuda", arch=detect_gpu().arch,
                            format="compiled", compile_mode="default")
    engine = tmp_path_factory.mktemp("engine")
    facts = InductorBackend().build_from_model(
        llama_dir, "text-generation", "fp32", target,
        [ProfileSpec(batch=[1, 2, 4], seq=[1, 8, 8], past=[0, 8, 24])], engine)
    print(f"built: {facts}")
    assert facts["gpu"]["arch"] == detect_gpu().arch and facts["cache_bytes"] > 0
    return engine, target


def test_prefill_and_cuda_graph_decode_match_eager(built: tuple[Path, InductorTarget], llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    engine, target = built
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).cuda().eval()
    runner = InductorBackend().load(engine, target)
    ids = torch.randint(0, 512, (4, 8), device="cuda")
    with torch.no_grad():
        expected = reference(input_ids=ids).logits.float()
    got = runner.infer({"input_ids": ids.cpu().numpy(), "attention_mask": np.ones((4, 8), dtype=np.int64)})["logits"]
    np.testing.assert_allclose(got, expected[:, -1].cpu().numpy(), rtol=1e-3, atol=1e-3)
    session = runner.decoder(4, 32)
    steps = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(8)], dim=1)  # each kept past the next step
    error = float((steps - expected).norm() / expected.norm())
    print(f"decode vs eager relative error {error:.2e}")
    assert error < 1e-3
    # the build's precompiled decode step at this shape, replayed from the session's own CUDA graph
    assert session._precompiled is not None and session._graph is not None, session.problem


def test_a_prefill_replayed_with_cuda_graphs_keeps_each_result(llama_dir: Path, tmp_path: Path) -> None:
    """compile_mode reduce-overhead records the prefill per shape; a result held across calls stays its own."""
    from transformers import AutoModelForCausalLM

    target = InductorTarget(name="gpu", backend="inductor", device="cuda", arch=detect_gpu().arch,
                            compile_mode="reduce-overhead")
    InductorBackend().build_from_model(llama_dir, "text-generation", "fp32", target,
                                       [ProfileSpec(batch=[1, 4, 4], seq=[1, 8, 8])], tmp_path)
    runner = InductorBackend().load(tmp_path, target)
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).cuda().eval()
    prompts = [torch.randint(0, 512, (4, 8), device="cuda") for _ in range(4)]
    held = [runner.prefill(p, torch.ones_like(p)) for p in prompts]  # the third and fourth are replays
    with torch.no_grad():
        for p, got in zip(prompts, held):
            torch.testing.assert_close(got, reference(input_ids=p).logits[:, -1], rtol=1e-3, atol=1e-3)


def test_an_encoder_engine_replays_its_forward_and_matches_eager_with_padding(tmp_path: Path) -> None:
    """A BERT-family engine (smelter's encoder graph) records its forward at the warmed shape and replays it;
    padded rows give HF's hidden states, and a result held across calls stays its own."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model_dir = tmp_path / "bert"
    BertModel(BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=256, max_position_embeddings=64)).save_pretrained(model_dir)
    target = InductorTarget(name="gpu", backend="inductor", device="cuda", arch=detect_gpu().arch,
                            compile_mode="default")
    engine = tmp_path / "engine"
    engine.mkdir()
    InductorBackend().build_from_model(model_dir, "feature-extraction", "fp32", target,
                                       [ProfileSpec(batch=[1, 4, 4], seq=[1, 16, 16])], engine)
    sidecar = json.loads((engine / "engine.json").read_text())
    assert sidecar["prefill_graph"] == "encoder" and sidecar["prefill_cuda_graphs"]
    runner = InductorBackend().load(engine, target)
    reference = BertModel.from_pretrained(model_dir).cuda().eval()
    feeds = []
    for i in range(4):
        ids = torch.randint(0, 512, (4, 16), device="cuda")
        mask = torch.ones_like(ids)
        mask[1, 16 - 3 * i - 1:] = 0
        mask[2, 2:] = 0
        feeds.append((ids, mask))
    held = [runner.prefill(ids, mask) for ids, mask in feeds]  # run, record, replay, replay
    assert [r.graph is not None for r in runner._prefill_graphs.values()] == [True], runner.precompile_problems
    with torch.no_grad():
        for (ids, mask), got in zip(feeds, held):
            torch.testing.assert_close(got, reference(input_ids=ids, attention_mask=mask).last_hidden_state,
                                       rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("heads,head_dim,seq", [(12, 32, 128), (12, 64, 512), (4, 64, 200), (2, 128, 72)])
def test_the_encoder_attention_kernel_matches_sdpa_with_padding(heads: int, head_dim: int, seq: int) -> None:
    """smelter's Triton attention (bf16, as engines run it) reads q, k, v from the qkv product's output and
    gives SDPA's fp32 result for rows padded to different lengths, a row of all padding (attends evenly,
    no NaN) and a sequence that does not fill its last block; without a mask too."""
    from tasks.backends.inductor import encoder_ops as ea

    torch.manual_seed(0)
    batch = 4
    qkv = torch.randn(batch, seq, 3 * heads * head_dim, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(batch, seq, device="cuda")
    mask[1, seq // 3:] = 0
    mask[2, 1:] = 0
    mask[3, :] = 0
    key_bias = (1 - mask.bfloat16()) * torch.finfo(torch.bfloat16).min
    assert ea.usable(qkv, key_bias, heads)
    scale = torch.tensor(8.0, device="cuda")
    for bias in (key_bias, None):
        got = torch.ops.smelter.encoder_attention(qkv, bias, heads)
        expected = ea.reference(qkv.float(), None if bias is None else bias.float(), heads)
        assert torch.isfinite(got).all()
        error = ((got.float() - expected).norm(dim=-1) / expected.norm(dim=-1)).max()
        assert error < 1e-2, f"relative error {float(error):.2e} per token at most"
        if torch.cuda.get_device_capability() >= (8, 9):  # the input of a static fp8 o product, in e4m3
            rounded = torch.ops.smelter.encoder_attention(qkv, bias, heads, scale)
            assert rounded.dtype == torch.float8_e4m3fn
            error = ((rounded.float() / 8 - expected).norm(dim=-1) / expected.norm(dim=-1)).max()
            assert error < 5e-2, f"relative error {float(error):.2e} per token at most (e4m3 rounds by 3%)"


def test_engine_refused_on_another_arch(built: tuple[Path, InductorTarget], tmp_path: Path) -> None:
    engine, target = built
    engine = Path(shutil.copytree(engine, tmp_path / "engine"))
    sidecar = json.loads((engine / "engine.json").read_text())
    sidecar["gpu"] = {**sidecar["gpu"], "compute_capability": "7.5", "arch": "sm75", "gpu_name": "Tesla T4"}
    (engine / "engine.json").write_text(json.dumps(sidecar))
    with pytest.raises(EngineMismatch, match="built for sm75 .* rebuild the target on a sm75 GPU"):
        InductorBackend().load(engine, target)


def test_ceilings_are_measured_on_random_data() -> None:
    gemm = gpu_measure.gemm_ceiling(n=4096, repeats=5)
    copy = gpu_measure.copy_bandwidth(nbytes=256 << 20, repeats=5)
    print(f"bf16 GEMM 4096^3: {gemm['tflops']} TFLOP/s; copy 256 MiB: {copy['tb_per_s']} TB/s")
    assert gemm["tflops"] > 1 and copy["tb_per_s"] > 0.05
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    kernels = gpu_measure.kernel_profile(lambda: torch.relu(a @ a), calls=3)
    print(f"kernels of relu(a @ a): {kernels}")
    assert len(kernels) >= 3 and kernels[-1]["kernel"] == "(all kernels)"
    assert sum(k.get("share", 0) for k in kernels[:-1]) == pytest.approx(1.0, abs=0.01)


def fp8_target(**settings: object) -> InductorTarget:
    """An fp8 target on this GPU; skips where its compute capability is below 8.9."""
    gpu = detect_gpu()
    if gpu.compute_capability < (8, 9):
        pytest.skip(f"fp8 products need compute capability 8.9 or more; this GPU has {gpu.cc}")
    return InductorTarget(name="gpu", backend="inductor", device="cuda", arch=gpu.arch, compile_mode="default",
                          **settings)


def cosine_vs_fp32(engine: Path, target: InductorTarget, llama_dir: Path) -> float:
    """The loaded engine's prefill logits against the fp32 model's, the smallest cosine over four prompts."""
    from transformers import AutoModelForCausalLM

    runner = InductorBackend().load(engine, target)
    ids = torch.randint(0, 512, (4, 8), device="cuda")
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(llama_dir).cuda().eval()(input_ids=ids).logits[:, -1]
    got = runner.prefill(ids, torch.ones_like(ids)).float()
    return float(torch.nn.functional.cosine_similarity(got, expected, dim=-1).min())


def test_fp8_engine_builds_and_stays_near_fp32(llama_dir: Path, tmp_path: Path) -> None:
    """e4m3 products through torch._scaled_mm on the GPU (compute capability 8.9 or more), bf16 elsewhere."""
    target = fp8_target(fp8_exclude=["layers.1.*"])
    InductorBackend().build_from_model(llama_dir, "text-generation", "fp8", target,
                                       [ProfileSpec(batch=[1, 4, 4], seq=[1, 8, 8])], tmp_path)
    kept = json.loads((tmp_path / "engine.json").read_text())["fp8_kept_bf16"]
    assert kept == ["layers.1.qkv", "layers.1.o", "layers.1.gate_up", "layers.1.down"]
    cosine = cosine_vs_fp32(tmp_path, target, llama_dir)
    print(f"fp8 engine vs fp32: cosine min {cosine:.4f}")
    assert cosine > 0.98


def test_a_static_fp8_engine_is_calibrated_at_build(llama_dir: Path, tmp_path: Path) -> None:
    """fp8_scaling static: one scale per product input, from the calibration feeds the build is given."""
    target = fp8_target(fp8_scaling="static")
    profiles = [ProfileSpec(batch=[1, 4, 4], seq=[1, 8, 8])]
    with pytest.raises(ValueError, match="no calibration feeds"):
        InductorBackend().build_from_model(llama_dir, "text-generation", "fp8", target, profiles, tmp_path)
    rng = np.random.default_rng(0)
    calibration = [{"input_ids": rng.integers(0, 512, (4, 16)), "attention_mask": np.ones((4, 16), dtype=np.int64)}
                   for _ in range(2)]
    InductorBackend().build_from_model(llama_dir, "text-generation", "fp8", target, profiles, tmp_path,
                                       calibration=calibration)
    sidecar = json.loads((tmp_path / "engine.json").read_text())
    assert sidecar["fp8_scaling"] == "static" and sidecar["fp8_calibration"]["tokens"] == 128
    assert len(sidecar["fp8_calibration"]["input_amax"]) == 8
    cosine = cosine_vs_fp32(tmp_path, target, llama_dir)
    print(f"static fp8 engine vs fp32: cosine min {cosine:.4f}")
    assert cosine > 0.98


def test_an_fp8_engine_keeps_its_most_sensitive_products_in_bf16(llama_dir: Path, tmp_path: Path) -> None:
    """fp8_bf16_share: fp8_exclude's products, then the products measured most sensitive on the
    calibration feeds, up to that share of the products' arithmetic."""
    from transformers import AutoConfig

    from tasks.backends.inductor.llama_support import product_costs

    target = fp8_target(fp8_exclude=["layers.0.down"], fp8_bf16_share=0.3)
    rng = np.random.default_rng(0)
    calibration = [{"input_ids": rng.integers(0, 512, (4, 16)), "attention_mask": np.ones((4, 16), dtype=np.int64)}
                   for _ in range(2)]
    InductorBackend().build_from_model(llama_dir, "text-generation", "fp8", target,
                                       [ProfileSpec(batch=[1, 4, 4], seq=[1, 8, 8])], tmp_path,
                                       calibration=calibration)
    sidecar = json.loads((tmp_path / "engine.json").read_text())
    kept, sensitivity = sidecar["fp8_kept_bf16"], sidecar["fp8_sensitivity"]
    print(f"fp8 sensitivity: kept {kept}, {json.dumps({k: v for k, v in sensitivity.items() if k != 'logit_mse'})}")
    costs = product_costs(AutoConfig.from_pretrained(llama_dir))
    assert "layers.0.down" in kept and len(kept) > 1
    assert sum(costs[n] for n in kept) <= 0.3 * sum(costs.values()) and sensitivity["kept_share"] <= 0.3
    assert len(sensitivity["logit_mse"]) == 8 and sensitivity["error_kept_share"] > 0
    cosine = cosine_vs_fp32(tmp_path, target, llama_dir)
    print(f"fp8 engine with its sensitive products in bf16 vs fp32: cosine min {cosine:.4f}")
    assert cosine > 0.98


def test_an_fp8_encoder_engine_is_calibrated_keeps_its_sensitive_products_and_replays_near_fp32(
        tmp_path: Path) -> None:
    """A BERT-family fp8 engine: static scales and each product's sensitivity measured on the calibration
    feeds, the most sensitive products kept in bf16 within fp8_bf16_share, e4m3 products through
    smelter::scaled_mm; its forward, replayed from a CUDA graph, stays near HF's fp32 hidden states with
    padding."""
    from transformers import BertConfig, BertModel

    from tasks.backends.inductor.encoder_support import product_costs

    torch.manual_seed(0)
    config = BertConfig(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=64)
    model_dir = tmp_path / "bert"
    BertModel(config).save_pretrained(model_dir)
    target = fp8_target(fp8_scaling="static", fp8_bf16_share=0.2)
    rng = np.random.default_rng(0)
    calibration = [{"input_ids": rng.integers(0, 512, (4, 16)), "attention_mask": np.ones((4, 16), dtype=np.int64)}
                   for _ in range(2)]
    engine = tmp_path / "engine"
    engine.mkdir()
    InductorBackend().build_from_model(model_dir, "feature-extraction", "fp8", target,
                                       [ProfileSpec(batch=[1, 4, 4], seq=[1, 16, 16])], engine, calibration=calibration)
    sidecar = json.loads((engine / "engine.json").read_text())
    kept, sensitivity = sidecar["fp8_kept_bf16"], sidecar["fp8_sensitivity"]
    print(f"fp8 encoder: kept {kept}, {json.dumps({k: v for k, v in sensitivity.items() if k != 'hidden_mse'})}")
    assert sidecar["prefill_graph"] == "encoder" and sidecar["fp8_calibration"]["tokens"] == 128
    assert len(sidecar["fp8_calibration"]["input_amax"]) == len(sensitivity["hidden_mse"]) == 8
    costs = product_costs(config)
    assert kept and sum(costs[n] for n in kept) <= 0.2 * sum(costs.values())
    runner = InductorBackend().load(engine, target)
    reference = BertModel.from_pretrained(model_dir).cuda().eval()
    ids = torch.randint(0, 512, (4, 16), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    held = [runner.prefill(ids, mask) for _ in range(3)]  # run, record, replay
    assert [r.graph is not None for r in runner._prefill_graphs.values()] == [True], runner.precompile_problems
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
    for got in held:
        cosine = torch.nn.functional.cosine_similarity(got[mask.bool()].float(), expected, dim=-1)
        assert cosine.min() > 0.99, cosine
    print(f"fp8 encoder engine vs fp32: cosine min {float(cosine.min()):.5f}")
    kernels = " ".join(k["kernel"] for k in gpu_measure.kernel_profile(lambda: runner.prefill(ids, mask), top=30))
    assert "_encoder_attention_kernel" in kernels


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17, 64, 65])
def test_decode_products_compute_their_reference_on_fresh_inputs(rows: int) -> None:
    """smelter::decode_linear on the GPU (the weight-streaming kernels up to ROWS_KERNEL_ROWS rows,
    then for e4m3 weights the activations rounded to e4m3 and the fp8 rows kernel up to
    FP8_ROWS_KERNEL_ROWS, cuBLAS above; e4m3 weights with per-channel scales; the input as is,
    silu(gate) * up of it, or its rms_norm; with and without a residual) against the same function
    in fp32, odd sizes included, the output poisoned first."""
    from tasks.backends.inductor import decode_products as dp

    for n, k in ((3072, 2048), (1000, 304), (64, 8192)):
        x = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        norm = (1 + 0.1 * torch.randn(k, device="cuda")).to(torch.bfloat16)
        residual = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        quantised, scale = dp.quantize_weight(w)
        for weight, s in ((w, None), (quantised, scale)):
            rounded = s is not None and rows > dp.ROWS_KERNEL_ROWS[1]  # the activations rounded to e4m3
            if rounded and rows > dp.FP8_ROWS_KERNEL_ROWS and (n % 16 or k % 16):
                continue  # cuBLAS's fp8 product needs sizes divisible by 16
            for mode in ("plain", "gated", "norm"):
                inputs = x if mode == "gated" else x[:, :k] * 3
                options = {"gated": mode == "gated", "norm": norm if mode == "norm" else None, "eps": 1e-5}
                product_input = dp.product_input(inputs, **options).float()
                exact = product_input @ (weight.float() * (s[:, None] if s is not None else 1)).t()
                for r in (None, residual):
                    truth = exact + r.float() if r is not None else exact
                    torch.full((rows, n), float("nan"), device="cuda")  # poison what the allocator hands out next
                    got = torch.ops.smelter.decode_linear(inputs, weight, s, residual=r, **options).float()
                    error = float((got - truth).norm() / truth.norm())
                    print(f"rows {rows} n {n} k {k} {weight.dtype} {mode} residual {r is not None}: "
                          f"relative error {error:.2e}")
                    assert torch.isfinite(got).all() and error < (0.06 if rounded else 1e-2)


@pytest.mark.parametrize("batch, max_len, pos", [(1, 528, 512), (3, 100, 0), (5, 70, 69), (64, 528, 300)])
def test_decode_attention_computes_its_reference_on_fresh_inputs(batch: int, max_len: int, pos: int) -> None:
    """smelter::decode_attention (rotary q, grouped query heads, positions split over programs at
    small batch) against the unfused attention in fp32; positions past `pos` hold NaN, so reading
    one shows."""
    from tasks.backends.inductor import decode_products as dp

    heads, kv_heads, d = 32, 8, 64
    k = torch.randn(batch, kv_heads, max_len, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, kv_heads, max_len, d, device="cuda", dtype=torch.bfloat16)
    k[:, :, pos + 1:] = float("nan")
    v[:, :, pos + 1:] = float("nan")
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :heads * d]  # a slice of the fused product's output, as the step passes it
    angles = torch.rand(d // 2, device="cuda") * 6.28
    cos = torch.cat([angles.cos(), angles.cos()]).to(torch.bfloat16)
    sin = torch.cat([angles.sin(), angles.sin()]).to(torch.bfloat16)
    where = torch.tensor(pos, device="cuda")
    exact = dp.attention_reference(q.float(), cos.float(), sin.float(), k[:, :, :pos + 1].float(),
                                   v[:, :, :pos + 1].float(), where)
    got = torch.ops.smelter.decode_attention(q, cos, sin, k, v, where).float()
    error = float((got - exact).norm() / exact.norm())
    print(f"attention batch {batch} cache {max_len} pos {pos}: relative error {error:.2e}")
    assert torch.isfinite(got).all() and error < 1e-2


def test_an_fp8_engine_decodes_with_e4m3_weights(llama_dir: Path, tmp_path: Path) -> None:
    """Precision fp8: the decode step reads e4m3 weights (per-channel scales, the LM head too) and
    follows the fp32 model token by token, at two batches the weight-streaming kernels run."""
    from transformers import AutoModelForCausalLM

    target = fp8_target(fp8_exclude=["layers.1.down"])
    InductorBackend().build_from_model(llama_dir, "text-generation", "fp8", target,
                                       [ProfileSpec(batch=[1, 2, 16], seq=[1, 1, 8], past=[0, 8, 16])], tmp_path)
    sidecar = json.loads((tmp_path / "engine.json").read_text())
    assert sidecar["decode_products"]["fp8_weights"] and sidecar["decode_products"]["kept"] == ["layers.1.down"]
    runner = InductorBackend().load(tmp_path, target)
    reference = AutoModelForCausalLM.from_pretrained(llama_dir).cuda().eval()
    for batch in (2, 16):
        ids = torch.randint(0, 512, (batch, 8), device="cuda")
        with torch.no_grad():
            expected = reference(input_ids=ids).logits.float()
        session = runner.decoder(batch, 24)
        steps = torch.stack([session.step(ids[:, i:i + 1], i) for i in range(8)], dim=1).float()
        cosine = float(torch.nn.functional.cosine_similarity(steps, expected, dim=-1).min())
        print(f"fp8-weight decode step, batch {batch}, vs fp32: cosine min {cosine:.4f}")
        assert cosine > 0.98
