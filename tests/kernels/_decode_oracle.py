"""Float64 oracle of the sparse MLA decode over exactly the indexed keys (docs/design.md,
"Sparse MLA with sink"), shared by the CPU and GPU decode tests; and the checks."""

from __future__ import annotations

import math

import torch

# bf16 output of values up to ~10 after fp32 sums and a split combine; lse in fp32.
OUT_TOL = dict(atol=2e-2, rtol=2e-2)
LSE_TOL = dict(atol=2e-4, rtol=1e-5)


def oracle(
    q: torch.Tensor,
    sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
    sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` in float64 on q's device; sources are (values [slots, 512],
    indices [T, K], lens [T] or None).  A key counts where its column is below the
    length and its index is in ``[0, slots)``."""
    keys, masks = [], []
    for values, idx, lens in sources:
        n = idx.shape[1]
        col = torch.arange(n, device=idx.device).unsqueeze(0)
        ok = (idx >= 0) & (idx < values.shape[0])
        if lens is not None:
            ok &= col < lens.to(torch.int64).unsqueeze(1)
        safe = torch.where(ok, idx.to(torch.int64), 0)
        keys.append(values.to(torch.float64)[safe])
        masks.append(ok)
    k = torch.cat(keys, dim=1)
    ok = torch.cat(masks, dim=1)
    s = torch.einsum("thd,tkd->thk", q.to(torch.float64), k) * scale
    s = s.masked_fill(~ok.unsqueeze(1), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    has = torch.isfinite(lse)
    p = torch.exp(s - torch.where(has, lse, 0.0).unsqueeze(-1))
    out = torch.einsum("thk,tkd->thd", p, k)
    if sink is not None:
        out = out * torch.sigmoid(lse - sink.to(torch.float64)).unsqueeze(-1)
    out = torch.where(has.unsqueeze(-1), out, 0.0)
    return out, lse


def check(out: torch.Tensor, lse: torch.Tensor, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """No NaN (poisoned outputs fully written), outputs and lse against the oracle,
    ``lse = -inf`` exactly where a token has no valid key (and ``out = 0`` there)."""
    assert not torch.isnan(out.float()).any(), "out has NaN (unwritten or bad arithmetic)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or bad arithmetic)"
    w_out, w_lse = want
    torch.testing.assert_close(out.double(), w_out, **OUT_TOL)
    empty = torch.isneginf(w_lse)
    assert torch.equal(torch.isneginf(lse), empty), "lse -inf exactly where a row has no key"
    assert torch.all(out[empty] == 0), "a row without keys must give 0"
    torch.testing.assert_close(lse.double()[~empty], w_lse[~empty], **LSE_TOL)
