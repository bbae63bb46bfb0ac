"""ferry.model.cpu_linear: weight matmuls through oneDNN's packed weights give F.linear's results, and
loading a model packs each matmul's weight once (fused projections as one, their slices not again)."""

import pytest
import torch
import torch.nn.functional as F

from ferry.model import load_model
from ferry.model.causal_lm import CausalLM
from ferry.model.cpu_linear import FusedProjection, Linear, linear, pack
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 16, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linear_matches_f_linear(rows, dtype):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 64).to(dtype), torch.randn(96).to(dtype), torch.randn(rows, 64).to(dtype)
    packed = pack(w)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert packed is None  # oneDNN's bf16 needs AVX-512 (or AVX-NE-CONVERT): the plain path is kept
    else:
        assert packed is not None and packed.is_mkldnn
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(linear(x, w, b, packed), F.linear(x, w, b), rtol=tol, atol=tol)
    x3 = x.view(1, rows, 64)  # leading dims are kept
    assert linear(x3, w, None, packed).shape == (1, rows, 96)


def test_no_packing_where_it_does_not_apply():
    assert pack(torch.randn(8, 8, dtype=torch.float16)) is None
    assert linear(torch.ones(2, 3), torch.ones(4, 3), None, None).tolist() == [[3.0] * 4] * 2


@needs_onednn
def test_switch_off_uses_plain_torch():
    lin = Linear(64, 32)
    lin.prepack()
    x = torch.randn(5, 64)
    lin.backend = "torch"  # what set_attention_backend gives it under FERRY_CPU_KERNELS=0
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # bit-identical: the same op runs


@needs_onednn
def test_loaded_model_packs_each_matmul_once(tmp_path):
    lm = load_model(make_model(tmp_path / "tiny", "llama", "tiny"))
    cfg = lm.config
    fused = [v for m in lm.model.modules() for v in vars(m).values() if isinstance(v, FusedProjection)]
    linears = [m for m in lm.model.modules() if isinstance(m, Linear)]
    assert len(fused) == 2 * cfg.num_layers and all(f.packed is not None for f in fused)  # qkv, gate_up
    packed = [m for m in linears if m.packed is not None]
    assert len(packed) == 2 * cfg.num_layers + 1  # o_proj, down_proj per layer, and lm_head
    assert all(m.packed is None for m in linears if m.is_fused)  # q/k/v, gate/up slices: not packed twice
    with torch.device("meta"):
        unfused = CausalLM(cfg)  # as constructed: no fused copies, nothing packed
    assert sum(p.numel() for p in lm.model.parameters()) == sum(p.numel() for p in unfused.parameters())
