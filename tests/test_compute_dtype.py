"""bfloat16 on a CPU: only fast where the CPU multiplies it natively. On the AVX2-only AMD EPYC box the suite met,
a bf16 matrix product ran at 0.9 GFLOP/s against float32's 88 (the quality run trained for over ten minutes in
bf16); on the AMX box the CPU recipe was measured on, bf16 was 5.9x float32."""
from __future__ import annotations

from kimi_eagle_host import compute_dtype

AVX2 = "processor\t: 0\nflags\t\t: fpu sse2 avx fma avx2\n"
AMX = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"


def cpuinfo(tmp_path, text):
    path = tmp_path / f"cpuinfo-{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    return str(path)


def test_the_cpus_bf16_support_is_read_from_its_flags(tmp_path):
    assert compute_dtype.cpu_computes_bf16(cpuinfo(tmp_path, AMX))
    assert not compute_dtype.cpu_computes_bf16(cpuinfo(tmp_path, AVX2))
    assert not compute_dtype.cpu_computes_bf16(str(tmp_path / "missing"))


def test_auto_is_bfloat16_on_a_gpu_and_float32_on_any_cpu(tmp_path):
    for info in (AVX2, AMX):
        assert compute_dtype.resolve("auto", "cpu", cpuinfo=cpuinfo(tmp_path, info)) == "float32"
        assert compute_dtype.resolve("auto", "cuda", cpuinfo=cpuinfo(tmp_path, info)) == "bfloat16"


def test_a_bfloat16_asked_for_on_a_cpu_without_it_is_kept_and_said_once(tmp_path):
    said = []
    assert compute_dtype.resolve("bfloat16", "cpu", said.append, cpuinfo=cpuinfo(tmp_path, AVX2)) == "bfloat16"
    assert len(said) == 1 and "without AMX or AVX512-BF16" in said[0] and "float32" in said[0]
    for dtype, device, info in (("bfloat16", "cpu", AMX), ("bfloat16", "cuda", AVX2), ("float32", "cpu", AVX2)):
        quiet = []
        compute_dtype.resolve(dtype, device, quiet.append, cpuinfo=cpuinfo(tmp_path, info))
        assert quiet == [], (dtype, device, info)


def test_muon_on_a_cpu_without_bf16_orthogonalizes_in_float32_and_updates_as_torchs(monkeypatch):
    """torch's Muon runs its Newton-Schulz iteration in bf16: on the AVX2 box a 1536x576 matrix took 4.7 s a step
    (0.18 s in fp32), so the quality run's Muon training took tens of minutes. Such a CPU gets Float32Muon: the same
    update within bf16 error, the same state (a checkpoint of one resumes in the other)."""
    import types

    import torch

    from kimi_eagle_host.training import optim

    args = types.SimpleNamespace(optimizer="muon", lr=1e-2, weight_decay=0.0)
    model = torch.nn.Linear(32, 64, bias=False)
    for native, kind in ((False, optim.Float32Muon), (True, torch.optim.Muon)):
        monkeypatch.setattr(compute_dtype, "cpu_computes_bf16", lambda native=native: native)
        assert type(optim.make_optimizer(model, args, torch.device("cpu")).named["muon"]) is kind
    torch.manual_seed(0)
    ours = torch.nn.Parameter(torch.randn(64, 32))
    theirs = torch.nn.Parameter(ours.detach().clone())
    o_ours = optim.Float32Muon([ours], lr=1e-2, adjust_lr_fn="match_rms_adamw")
    o_theirs = torch.optim.Muon([theirs], lr=1e-2, adjust_lr_fn="match_rms_adamw")
    start = ours.detach().clone()
    for _ in range(3):
        grad = torch.randn(64, 32)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        o_ours.step()
        o_theirs.step()
    moved = (theirs - start).norm()
    assert moved > 0 and (ours - theirs).norm() < 0.05 * moved      # bf16 vs fp32 orthogonalization
    torch.optim.Muon([theirs], lr=1e-2).load_state_dict(o_ours.state_dict())
    from torch.optim import _muon
    assert _muon._zeropower_via_newtonschulz.__module__ == "torch.optim._muon"   # torch's own, restored


def test_a_vllm_engine_on_a_cpu_without_bf16_is_started_in_float32(tmp_path, monkeypatch):
    """vllm_dtype auto: vLLM 0.32's CPU kernels answered at 26.0 tokens/s in bf16 and 112.4 in fp32 on the AVX2 box
    (CI's box turned out to be one: the quality test's regenerate ran out of its 20 minutes). A GPU or a CPU with
    AMX/AVX512-BF16 keeps bf16; a dtype asked for by name is vLLM's to read, and bf16 on such a CPU is said once."""
    import torch

    avx2, amx = cpuinfo(tmp_path, AVX2), cpuinfo(tmp_path, AMX)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compute_dtype.for_vllm("auto", cpuinfo=avx2) == "float32"
    assert compute_dtype.for_vllm("auto", cpuinfo=amx) == "bfloat16"
    said = []
    assert compute_dtype.for_vllm("bfloat16", said.append, cpuinfo=avx2) == "bfloat16"
    assert len(said) == 1 and said[0].startswith("vllm_dtype bfloat16 on a CPU without AMX or AVX512-BF16"), said
    assert compute_dtype.for_vllm("float16", said.append, cpuinfo=avx2) == "float16" and len(said) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compute_dtype.for_vllm("auto", said.append, cpuinfo=avx2) == "bfloat16" and len(said) == 1
