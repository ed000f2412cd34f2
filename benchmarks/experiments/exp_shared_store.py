"""Shared-memory wavefronts per 16-byte store of a bf16 tile, by register layout (GPU).

``ncu --kernel-name regex:_store_tiles --metrics
l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum,smsp__inst_executed_op_shared_st.sum
--csv python3 -m benchmarks.experiments.exp_shared_store``

Each of 132 programs stores the ``[64, 512]`` bf16 tile of the Gluon sparse MLA
kernel (wgmma's 128-byte swizzled layout, eight 64-column blocks) 1,000 times
from one of three register layouts: the ``REG_A`` codes layout of
:mod:`dsv4_kernels._gluon_sparse_mla`, eight lanes along a row's 128 bytes, and
the blocked layout of the kernel without ``REG_A``.  Run 16 (docs/attention.md)
measured 4.0 wavefronts per store instruction for all three and no bank
conflicts: the kernel's tile stores run at the ideal rate.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _store_tiles(out_ptr, n, MODE: gl.constexpr):
    if MODE == 0:  # REG_A's codes layout (rows r and r + 8, 16 contiguous columns)
        L: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
            lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]],
            block_bases=[],
            shape=[64, 64],
        )
    elif MODE == 1:  # eight lanes along a row's 128 bytes
        L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    else:  # the blocked layout of the kernel without REG_A
        L: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    tile = gl.allocate_shared_memory(
        gl.bfloat16, [64, 512], gl.NVMMASharedLayout.get_default_for([64, 512], gl.bfloat16)
    )
    r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    v = (gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0)).to(gl.bfloat16)
    for _ in range(n):
        for b in gl.static_range(8):
            tile.slice(b * 64, 64, dim=1).store(v)
        gl.thread_barrier()
    x = tile.slice(0, 64, dim=1).load(L)  # one block back out, so the stores are kept
    gl.store(out_ptr + gl.expand_dims(r, 1) * 64 + gl.expand_dims(c, 0), x)


def main() -> None:
    out = torch.empty(64, 64, dtype=torch.bfloat16, device="cuda")
    want = (torch.arange(64 * 64, device="cuda").reshape(64, 64)).to(torch.bfloat16)
    for mode in range(3):
        out.fill_(float("nan"))
        _store_tiles[(132,)](out, 1000, MODE=mode, num_warps=4)
        torch.cuda.synchronize()
        assert torch.equal(out, want), f"layout {mode}: the tile read back differs"
        print(f"layout {mode}: ok", flush=True)


if __name__ == "__main__":
    main()
