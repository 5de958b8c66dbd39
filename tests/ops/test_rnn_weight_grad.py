"""``weight_grad.dR_db``: the recurrent weights' gradients from drh and the saved states, against a float64 sum."""
import pytest
import torch

from tfla.ops.rnn.weight_grad import dR_db


def _reference(states, drh):
    Tm, NH, N, GD = drh.shape
    D = states.shape[-1]
    h = states[:Tm, 0].double()  # [Tm, NH, N, D]
    dR = torch.einsum("tnbe,tnbd->ned", drh.double(), h).view(NH, GD // D, D, D).permute(1, 0, 2, 3)
    return dR, drh.double().sum((0, 2)).view(NH, GD // D, D).transpose(0, 1)


@pytest.mark.parametrize("Tm, NH, N, G, D, S", [
    (1, 1, 1, 1, 1, 1),      # one row, one unit
    (3, 2, 5, 4, 16, 2),     # rows not a multiple of the row slice
    (70, 1, 3, 3, 20, 1),    # D not a power of two
    (300, 2, 4, 4, 48, 4),   # 1200 rows: several row slices summed
    (9, 3, 2, 1, 130, 1),    # D > 128: several column tiles (through the hi / lo copies and the GEMM)
    (50, 2, 3, 4, 200, 2),   # D > 128, 150 rows: several 64-row blocks of the copies, db's partial sums
])
@pytest.mark.parametrize("tf32", [False, True])
def test_dR_db_against_float64(Tm, NH, N, G, D, S, tf32, device, poison_empty):
    """IEEE fp32 products on the interpreter (rel-L2 <= 1e-6), split bf16 products on a GPU (<= 5e-5), with
    ``tf32`` (the cells' 16-bit inputs) above D = 128 one TF32 product over transposed copies (<= 1e-3 on a GPU;
    the copies' indexing at IEEE fp32 on the interpreter); every partial sum written (NaN-filled allocations)."""
    gen = torch.Generator().manual_seed(Tm + D)
    states = torch.randn(Tm + 1, S, NH, N, D, generator=gen).to(device)
    drh = torch.randn(Tm, NH, N, G * D, generator=gen).to(device)
    dR, db = dR_db(states, drh, tf32=tf32)
    ref_R, ref_b = _reference(states, drh)
    tol = (1e-3 if tf32 and D > 128 else 5e-5) if device == "cuda" else 1e-6
    assert dR.shape == (G, NH, D, D) and db.shape == (G, NH, D) and dR.dtype == torch.float32
    assert ((dR.double() - ref_R).norm() / ref_R.norm()).item() <= tol
    assert ((db.double() - ref_b).norm() / ref_b.norm()).item() <= 1e-6
    dR2, db2 = dR_db(states, drh, tf32=tf32)
    assert torch.equal(dR, dR2) and torch.equal(db, db2)  # fixed order of the slices' sums


def test_dR_db_empty_and_float64():
    states = torch.randn(1, 2, 3, 0, 8)
    dR, db = dR_db(states, torch.randn(0, 3, 0, 32))
    assert dR.shape == (4, 3, 8, 8) and not dR.any() and not db.any()
    states = torch.randn(5, 1, 2, 3, 8, dtype=torch.float64)
    drh = torch.randn(4, 2, 3, 16, dtype=torch.float64)
    dR, db = dR_db(states, drh)
    ref_R, ref_b = _reference(states, drh)
    assert dR.dtype == torch.float64 and torch.allclose(dR, ref_R, rtol=1e-12, atol=1e-12)
    assert torch.allclose(db, ref_b, rtol=1e-12, atol=1e-12)
