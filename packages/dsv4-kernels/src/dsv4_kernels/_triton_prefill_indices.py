# mypy: allow-untyped-defs
"""Triton kernel for the prefill index rows as global cache slots.

Launched from :mod:`.prefill_indices`.  One launch writes, for every query
token of a prefill chunk, its window row (window-cache slots of positions
``pos-W+1 .. pos``), its compressed row (compressed-cache slots of the C4A
top-k entries or of the C128A entries ``0 .. topk_len-1``), or both, and
their lengths.

Design (like the metadata kernels):

* token-parallel: a program owns ``BLOCK_T`` tokens and one ``BLOCK_C``-wide
  column tile of either the window row (the first ``win_tiles`` tiles of grid
  axis 1) or the compressed row (the rest), so one long request and many
  short ones give the same amount of independent work;
* every output element is written exactly once, in the same launch (no
  separate ``-1`` fill); the block tables are read only for live entries and
  pages inside the table, so no read goes out of bounds whatever the values;
* row offsets are 64-bit; sizes and strides are run-time values excluded from
  specialisation; only geometry (window, page sizes, ratio, tiles) is
  ``tl.constexpr``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._triton_metadata import token_positions

# Run-time arguments that must not be specialised on value (==1, %16) or on
# pointer alignment: a new batch must not compile a new kernel.  The top-k
# rows are a slice of vLLM's buffer at a decode-count offset, so their
# alignment varies from step to step.
RUNTIME_ARGS = [
    "qsl_ptr",
    "topk_ptr",
    "seq_lens_ptr",
    "win_table_ptr",
    "comp_table_ptr",
    "win_lens_ptr",
    "comp_lens_ptr",
    "win_table_stride",
    "comp_table_stride",
    "topk_stride",
    "win_stride",
    "comp_stride",
    "num_tokens",
    "num_reqs",
    "win_pages",
    "comp_pages",
    "topk",
    "win_tiles",
    "lead_ptr",
    "win_starts_ptr",
]


@triton.jit
def _slots(table_row, entry, live, num_pages, BS: tl.constexpr):
    """``table[entry // BS] * BS + entry % BS`` for live entries whose page exists, else -1.

    Negative entries wrap to huge unsigned pages, so one comparison rejects
    them together with pages past the table; a negative page id gives -1.
    """
    u_entry = entry.to(tl.uint32)
    page = u_entry // BS
    live = live & (page < num_pages.to(tl.uint32))
    block = tl.load(table_row + tl.where(live, page, 0).to(tl.int32), mask=live, other=-1)
    slot = block * BS + (u_entry % BS).to(tl.int32)
    return tl.where(live & (block >= 0), slot, -1)


@triton.jit(do_not_specialize=RUNTIME_ARGS)
def _prefill_indices_kernel(
    # pointers
    qsl_ptr,  # [num_reqs + 1] int32, not rebased
    seq_lens_ptr,  # [>= num_reqs] int32
    win_table_ptr,  # [>= num_reqs, win_pages] int32 (HAS_WINDOW)
    comp_table_ptr,  # [>= num_reqs, comp_pages] int32 (COMP_MODE > 0)
    topk_ptr,  # [>= num_tokens, >= topk] int32 (COMP_MODE == 1)
    win_ptr,  # [num_tokens, WINDOW] int32
    win_lens_ptr,  # [num_tokens] int32
    comp_ptr,  # [num_tokens, topk] int32 (COMP_MODE 3: [num_tokens], each token's request)
    comp_lens_ptr,  # [num_tokens] int32
    lead_ptr,  # [num_tokens] int32 (GROUP > 1): each token's leader
    win_starts_ptr,  # [num_tokens] int32 (GROUP > 1 with HAS_WINDOW)
    floor_ptr,  # [>= num_reqs] int32 (HAS_FLOOR): each request's first window position
    # sizes and strides
    win_table_stride,
    comp_table_stride,
    topk_stride,
    win_stride,
    comp_stride,
    num_tokens,
    num_reqs,
    win_pages,
    comp_pages,
    topk,
    win_tiles,  # column tiles of the window row (0 without HAS_WINDOW)
    # meta-parameters
    WINDOW: tl.constexpr,
    WIN_BS: tl.constexpr,
    COMP_BS: tl.constexpr,
    RATIO: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    # 0: no compressed row, 1: map top-k (C4A), 2: generate (C128A), 3: C128A as block
    # rows (lengths and each token's request only; the attention reads the block table)
    COMP_MODE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GROUP: tl.constexpr = 1,  # > 1: grouped rows (build_grouped_prefill_indices)
    HAS_FLOOR: tl.constexpr = False,  # window rows start no lower than floor_ptr[req]
):
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < num_tokens

    req, seq_len, pos = token_positions(
        qsl_ptr, seq_lens_ptr, toks, tok_ok, num_reqs, BLOCK_T, BLOCK_R
    )
    req64 = req.to(tl.int64)[:, None]
    rows64 = toks.to(tl.int64)[:, None]
    # Grouped rows: a token's leader is the first token of its group (tokens GROUP * k ..
    # GROUP * k + GROUP - 1 of the chunk) in its own request; the leader's rows are filled
    # past its own length with the request's later slots, so they hold the group's keys.
    lead_back = tl.zeros_like(toks)
    if GROUP > 1:
        q_first = tl.load(qsl_ptr + req, mask=tok_ok, other=0) - tl.load(qsl_ptr)
        lead = tl.maximum((toks // GROUP) * GROUP, q_first)
        lead_back = toks - lead
        if pid_c == 0:
            tl.store(lead_ptr + toks, lead, mask=tok_ok)

    # Constexpr test outside, run-time test inside: the dead branch compiles away.
    if HAS_WINDOW:  # noqa: SIM102
        if pid_c < win_tiles:
            # vLLM's SWA bounded replay: a request holds window KV from its floor on
            lo = tl.zeros_like(pos)
            if HAS_FLOOR:
                lo = tl.maximum(tl.load(floor_ptr + req, mask=tok_ok, other=0), 0)
            swa_start = tl.maximum(pos - (WINDOW - 1), lo)
            swa_len = tl.maximum(tl.minimum(pos + 1 - swa_start, WINDOW), 0)
            if pid_c == 0:
                tl.store(win_lens_ptr + toks, swa_len, mask=tok_ok)
                if GROUP > 1:
                    lead_start = tl.maximum(pos - lead_back - (WINDOW - 1), lo)
                    tl.store(win_starts_ptr + toks, swa_start - lead_start, mask=tok_ok)
            c = (pid_c * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
            if GROUP > 1:  # every position of the request from the window's start on
                live = (swa_start[:, None] + c < seq_len[:, None]) & (pos[:, None] >= 0)
                live = live & tok_ok[:, None]
            else:
                live = (c < swa_len[:, None]) & tok_ok[:, None]
            slot = _slots(
                win_table_ptr + req64 * win_table_stride,
                swa_start[:, None] + c,
                live,
                win_pages,
                WIN_BS,
            )
            tl.store(
                win_ptr + rows64 * win_stride + c,
                slot,
                mask=tok_ok[:, None] & (c < WINDOW + GROUP - 1),
            )
    if COMP_MODE > 0:  # noqa: SIM102
        if pid_c >= win_tiles:
            topk_len = tl.minimum(tl.maximum((pos + 1) // RATIO, 0), topk)
            if pid_c == win_tiles:
                tl.store(comp_lens_ptr + toks, topk_len, mask=tok_ok)
                if COMP_MODE == 3:
                    tl.store(comp_ptr + toks, req, mask=tok_ok)
            if COMP_MODE < 3:  # the row of slots (3: the attention reads the table)
                c = ((pid_c - win_tiles) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
                if GROUP > 1:  # every entry of the request (C128A: later tokens' prefixes)
                    entries = tl.minimum(tl.maximum(seq_len // RATIO, 0), topk)
                    live = (c < entries[:, None]) & tok_ok[:, None]
                else:
                    live = (c < topk_len[:, None]) & tok_ok[:, None]
                if COMP_MODE == 1:
                    entry = tl.load(topk_ptr + rows64 * topk_stride + c, mask=live, other=-1)
                else:
                    entry = c + tl.zeros([BLOCK_T, 1], dtype=tl.int32)
                slot = _slots(
                    comp_table_ptr + req64 * comp_table_stride,
                    entry,
                    live,
                    comp_pages,
                    COMP_BS,
                )
                tl.store(
                    comp_ptr + rows64 * comp_stride + c, slot, mask=tok_ok[:, None] & (c < topk)
                )
