"""``fit_decode_splits.py`` reads a sweep table and scores split rules as the library's ``decode_config`` picks."""

from __future__ import annotations

import pytest

from triage.experiments.bench import fit_decode_splits as fit
from triage.kernels.nvfp4 import gemm_decode as gd

TABLE = """\
## Split-K and tile rows at each shape (W4A16 decode kernel, CUDA-graph µs; * = the default)
| N×K | M | bf16 | split 1 | split 2 | split 4 | split 8 | split 16 | best BN=16 | bf16/best |
|---|---|---|---|---|---|---|---|---|---|
| 1024×2560 | 1 | 5.5 | 13.0 | 9.7* | 7.3 | 6.4 | - | 6.0 (split 8) | 0.92 |
| 9728×2560 | 16 | 19.3 | 14.6 | 15.7* | 12.7 | 15.2 | - | - | 1.52 |
"""


@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 2560), (9728, 2560), (2560, 9728), (4096, 12288)])
def test_pick_is_the_library_rule(monkeypatch, n, k):
    monkeypatch.setattr(gd, "interpreting", lambda: False)
    monkeypatch.setattr(gd, "num_sms", lambda: 132)
    cfg = gd.decode_config(1, n, k)
    assert cfg["BN"] == 64 and k > gd.NARROW_K  # the split rule's tiles
    assert fit.pick(n, k, gd.WAVES, gd.MIN_SPLIT_STEPS, 1 << 30, 132) == cfg["SPLIT_K"]


@pytest.mark.parametrize("m,k,bn,split", [(1, 1024, 32, 1), (16, 1024, 32, 1), (16, 1040, 64, 4), (17, 1024, 64, 8)])
def test_narrow_tiles_below_narrow_k(monkeypatch, m, k, bn, split):
    """M ≤ 16 and K ≤ NARROW_K: 32-row tiles, no split; else 64 rows and the split rule (3072 rows here)."""
    monkeypatch.setattr(gd, "interpreting", lambda: False)
    monkeypatch.setattr(gd, "num_sms", lambda: 132)
    cfg = gd.decode_config(m, 3072, k)
    assert (cfg["BN"], cfg["SPLIT_K"]) == (bn, split)
    assert gd.decode_config(m, 3072, k, 2)["SPLIT_K"] == 2  # an explicit split is kept


def test_read_and_score(tmp_path):
    log = tmp_path / "bench_gemm.log"
    log.write_text(TABLE)
    rows = fit.read_sweep(str(log))
    assert rows == [
        (1024, 2560, 1, {1: 13.0, 2: 9.7, 4: 7.3, 8: 6.4}, 2),
        (9728, 2560, 16, {1: 14.6, 2: 15.7, 4: 12.7, 8: 15.2}, 2),
    ]
    # waves < 3, >= 1 K step: split 8 for 1024×2560 (16 tiles), split 4 for 9728×2560 (152 tiles)
    assert fit.score(rows, 3, 1, 16, 132) == (6.4 + 12.7, 2)
    assert fit.score(rows, 8, 1, 32, 132) == (6.4 + 15.2, 1)  # 9728×2560 at split 8
    assert fit.score(rows, 3, 0.5, 32, 132) is None  # 1024×2560 would take split 16: not timed
    with pytest.raises(SystemExit, match="no split table"):
        (tmp_path / "empty.log").write_text("nothing\n")
        fit.read_sweep(str(tmp_path / "empty.log"))
