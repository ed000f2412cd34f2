"""A DSV4-shaped prefill for the layer-forward tests: requests, chunks, FP8 caches, dense oracle.

Three layers (SWA-only, C4A, C128A) with vLLM 0.32's cache layout: the three
window caches are one block-outer group of 64-token pages, the C4A and C128A
compressed caches another group (C4A run first, then C128A), both with the
block size of the widest group, so every layer's view has ``stride(0)`` of
three window pages.  Keys are bf16, written into the FP8 pages with
``dsv4_kernels.quantize_and_insert_k_cache`` through those views just before
the step that first needs them (vLLM's fused writers fill the caches before
attention runs); only keys some query can see are written, every other byte
of the caches is random.

The dense oracle works from positions alone: for each query token (position
``pos`` of its request) it attends the request's window keys at ``pos-127 ..
pos`` and its compressed entries (C4A: the top-k row's first
``min((pos+1)//4, topk)`` entries, holes skipped; C128A: entries ``0 ..
min((pos+1)//128, c128a_topk) - 1``), in float64, with the per-head sink.  It
never sees a block table, a slot or an FP8 byte.  Run on the bf16 keys it
gives the target within the FP8 quantisation bound; run on the keys'
UE8M0 round trip (what the pages hold) it gives the same result as the
kernel up to float32/bf16 rounding.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import dsv4_kernels as dk
from dsv4_kernels.geometry import HEAD_DIM, NOPE_DIM, NUM_QUANT_BLOCKS, QUANT_BLOCK, UE8M0_BIAS
from dsv4_kernels.reference import kv_cache as ref_kv
from dsv4_kernels.reference.kv_cache import quantize_k
from dsv4_kernels.testing import generator
from dsv4_kernels.testing.k_cache import block_outer_k_cache_group
from dsv4_kernels.testing.sparse_mla import random_keys, random_sink

WINDOW = 128
WINDOW_BS = 64
KV_BS = 256
SCALE = HEAD_DIM**-0.5
LAYERS = ("swa", "c4a", "c128a")
# DeepSeek-V4.1's layers as the kernels see them: window-only, and top-k rows over a
# full-length (ratio 1) or ratio-2 compressed cache
V41_LAYERS = ("swa", "c1a", "c2a")
RATIO = {"swa": 1, "c4a": 4, "c128a": 128, "c1a": 1, "c2a": 2}
TOPK_LAYERS = ("c4a", "c1a", "c2a")
PADDED_HEADS = 64  # vLLM pads q and the output to 64 heads for FlashMLA


def fp8_round_trip(k: torch.Tensor) -> torch.Tensor:
    """bf16 keys -> UE8M0 FP8 -> values (float64), from the layout's definition."""
    codes, scales = quantize_k(k)
    n = k.shape[0]
    vals = codes.view(torch.float8_e4m3fn).to(torch.float64).reshape(n, NUM_QUANT_BLOCKS, -1)
    exps = scales[:, :NUM_QUANT_BLOCKS].to(torch.float64) - UE8M0_BIAS
    nope = (vals * torch.exp2(exps).unsqueeze(-1)).reshape(n, NOPE_DIM)
    assert vals.shape[-1] == QUANT_BLOCK
    rope = k[:, NOPE_DIM:].to(torch.float64)
    return torch.cat([nope, rope], dim=1)


@dataclasses.dataclass
class StepRequest:
    name: str
    context: int  # tokens of the request before this chunk
    query: int  # tokens in this chunk


@dataclasses.dataclass
class StepInputs:
    """One step's prefill metadata, the way vLLM's prefill slice holds it."""

    query_start_loc: torch.Tensor  # slice with a nonzero first element
    seq_lens: torch.Tensor
    num_tokens: int
    window_table: torch.Tensor  # [num_decodes:] slice: more rows and columns than needed
    comp_table: torch.Tensor
    topk_indices: torch.Tensor  # C4A top-k of the step's tokens (+ spare rows)
    positions: list[tuple[str, torch.Tensor]]  # per request: its tokens' positions
    # every top-k layer's rows (C4A's is ``topk_indices``; V4.1's per ratio)
    topk: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


class Scenario:
    """Requests with random keys, FP8 caches in vLLM's layout, and the steps that prefill them."""

    def __init__(
        self,
        steps: list[list[StepRequest]],
        *,
        heads: int,
        topk: int,
        c128a_topk: int,
        seed: int,
        device: torch.device,
        hole_fraction: float = 0.05,
        dense_chunk: int = 64,
        layers: tuple[str, ...] = LAYERS,
    ) -> None:
        self.steps = steps
        self.layers = layers
        comp_layers = [layer for layer in layers if layer != "swa"]
        self.dense_chunk = dense_chunk
        self.heads = heads
        self.topk = topk
        self.c128a_topk = c128a_topk
        self.seed = seed
        self.device = device
        self.hole_fraction = hole_fraction
        self.g = generator(seed)
        g = self.g
        total: dict[str, int] = {}
        first_pos: dict[str, int] = {}
        for step in steps:
            for r in step:
                total[r.name] = max(total.get(r.name, 0), r.context + r.query)
                first_pos[r.name] = min(first_pos.get(r.name, 1 << 30), r.context)
        self.names = list(total)
        self.total = total
        # bf16 keys per layer and request: window keys per position, compressed per entry
        self.window_keys = {
            layer: {n: random_keys(total[n], generator=g, device="cpu") for n in self.names}
            for layer in layers
        }
        self.comp_keys = {
            layer: {
                n: random_keys(total[n] // RATIO[layer], generator=g, device="cpu")
                for n in self.names
            }
            for layer in comp_layers
        }
        self.sinks = {layer: random_sink(heads, generator=g, device="cpu") for layer in layers}

        # Block tables (one row per request, wider than needed).  Window pages a
        # request can no longer see are the null block 0, as vLLM's sliding-window
        # manager leaves them; every other page is distinct.
        w_pages = {n: -(-total[n] // WINDOW_BS) for n in self.names}
        c_pages = {n: -(-total[n] // KV_BS) for n in self.names}
        w_perm = (torch.randperm(sum(w_pages.values()), generator=g) + 1).tolist()
        c_perm = (torch.randperm(sum(c_pages.values()), generator=g) + 1).tolist()
        width_w = max(w_pages.values()) + 3
        width_c = max(c_pages.values()) + 3
        self.window_rows: dict[str, torch.Tensor] = {}
        self.comp_rows: dict[str, torch.Tensor] = {}
        for n in self.names:
            row = torch.randint(0, 1 << 20, (width_w,), generator=g, dtype=torch.int32)
            for p in range(w_pages[n]):
                row[p] = w_perm.pop()
            dead = max(first_pos[n] - (WINDOW - 1), 0) // WINDOW_BS
            row[:dead] = 0
            self.window_rows[n] = row
            crow = torch.randint(0, 1 << 20, (width_c,), generator=g, dtype=torch.int32)
            for p in range(c_pages[n]):
                crow[p] = c_perm.pop()
            self.comp_rows[n] = crow
        num_w_blocks = sum(w_pages.values()) + 1
        num_c_blocks = sum(c_pages.values()) + 1
        comp_pages = [(KV_BS // RATIO[layer], 1) for layer in comp_layers]
        # the widest group's block: the window pages of every layer, or the compressed ones
        block_bytes = max(
            len(layers) * dk.k_cache_page_stride(WINDOW_BS),
            sum(dk.k_cache_page_stride(slots) for slots, _ in comp_pages),
        )
        wg = block_outer_k_cache_group(
            num_w_blocks, [(WINDOW_BS, len(layers))], device, block_bytes=block_bytes, generator=g
        )
        cg = block_outer_k_cache_group(
            num_c_blocks, comp_pages, device, block_bytes=block_bytes, generator=g
        )
        self.window_cache = {layer: wg.views[0][i] for i, layer in enumerate(layers)}
        self.comp_cache = {layer: cg.views[i][0] for i, layer in enumerate(comp_layers)}
        assert all(v.stride(0) == block_bytes for v in self.window_cache.values())
        self._written: dict[tuple[str, str, str], set[int]] = {}
        self.topk_rows: list[torch.Tensor] = []

    # --- per step ---------------------------------------------------------------------

    def _topk_rows(self, step: list[StepRequest], ratio: int = 4) -> torch.Tensor:
        """Top-k rows of the step's tokens (C4A at ratio 4, V4.1's at 1 and 2): distinct
        request-local entries, random order, a few holes, -1 past the token's entry count;
        a long request always picks an entry past 2048 when it has one."""
        g = self.g
        rows = []
        for r in step:
            for i in range(r.query):
                pos = r.context + i
                n = (pos + 1) // ratio
                row = torch.full((self.topk,), -1, dtype=torch.int32)
                if n > 0:
                    pick = torch.randperm(n, generator=g)[: self.topk]
                    if n > 2048 and not bool((pick >= 2048).any()):
                        pick[0] = n - 1
                    holes = torch.rand(pick.shape[0], generator=g) < self.hole_fraction
                    row[: pick.shape[0]] = torch.where(holes, -1, pick).to(torch.int32)
                rows.append(row)
        spare = torch.randint(-1, 50, (2, self.topk), generator=g, dtype=torch.int32)
        return torch.cat([torch.stack(rows), spare]) if rows else spare

    def _insert(self, layer: str, kind: str, name: str, entries: list[int], first_new: int) -> None:
        """Write keys (positions or compressed entries) not yet in the cache.

        Those of the step's chunk (``>= first_new``) go through
        ``dsv4_kernels.quantize_and_insert_k_cache``, as vLLM's writers fill the
        caches just before attention; history from earlier steps the scenario
        does not run goes through the reference insert (the same bytes, tested in
        ``tests/kernels/test_kv_cache.py``), which is faster under the interpreter.
        """
        key = (layer, kind, name)
        done = self._written.setdefault(key, set())
        new = sorted(set(entries) - done)
        if not new:
            return
        done.update(new)
        if kind == "window":
            keys, row, bs = self.window_keys[layer][name], self.window_rows[name], WINDOW_BS
            cache = self.window_cache[layer]
        else:
            keys, row, bs = self.comp_keys[layer][name], self.comp_rows[name], KV_BS // RATIO[layer]
            cache = self.comp_cache[layer]
        for insert, part in (
            (ref_kv.quantize_and_insert_k_cache, [e for e in new if e < first_new]),
            (dk.quantize_and_insert_k_cache, [e for e in new if e >= first_new]),
        ):
            if not part:
                continue
            idx = torch.tensor(part, dtype=torch.int64)
            slots = row.long()[idx // bs] * bs + idx % bs
            insert(keys[idx].to(self.device), cache, slots.to(self.device), bs)

    def prepare_step(self, s: int, *, qsl_base: int = 3) -> StepInputs:
        """Write the keys step ``s`` can see into the caches and return its metadata."""
        step = self.steps[s]
        topk = {
            layer: self._topk_rows(step, RATIO[layer])
            for layer in self.layers
            if layer in TOPK_LAYERS
        }
        topk_rows = topk.get("c4a", next(iter(topk.values()), None))
        if topk_rows is None:
            topk_rows = torch.full(
                (sum(r.query for r in step) + 2, self.topk), -1, dtype=torch.int32
            )
        t0 = 0
        positions = []
        for r in step:
            pos = torch.arange(r.context, r.context + r.query)
            positions.append((r.name, pos))
            lo = max(r.context - (WINDOW - 1), 0)
            for layer in self.layers:
                self._insert(
                    layer, "window", r.name, list(range(lo, r.context + r.query)), r.context
                )
            for layer, layer_rows in topk.items():
                ratio = RATIO[layer]
                rows = layer_rows[t0 : t0 + r.query]
                lens = ((pos + 1) // ratio).clamp(max=self.topk)
                live = torch.arange(self.topk)[None, :] < lens[:, None]
                picked = rows[live & (rows >= 0)].tolist()
                # entry c is complete (written by the compressor) at position (c+1)*ratio - 1
                self._insert(layer, "comp", r.name, picked, r.context // ratio)
            if "c128a" in self.layers:
                n128 = min((r.context + r.query) // 128, self.c128a_topk)
                self._insert("c128a", "comp", r.name, list(range(n128)), r.context // 128)
            t0 += r.query
        q = torch.tensor([r.query for r in step], dtype=torch.int32)
        qsl = torch.cat(
            [
                torch.tensor([0, qsl_base], dtype=torch.int32),
                qsl_base + q.cumsum(0, dtype=torch.int32),
            ]
        )[1:]
        seq = torch.tensor([r.context + r.query for r in step] + [5], dtype=torch.int32)
        # one leading decode row (sliced away, as vLLM's block_table[num_decodes:]), one spare
        w = torch.stack(
            [self.window_rows[self.names[0]]]
            + [self.window_rows[r.name] for r in step]
            + [self.window_rows[self.names[-1]]]
        )[1:]
        c = torch.stack(
            [self.comp_rows[self.names[0]]]
            + [self.comp_rows[r.name] for r in step]
            + [self.comp_rows[self.names[-1]]]
        )[1:]
        d = self.device
        return StepInputs(
            qsl.to(d),
            seq.to(d),
            int(q.sum()),
            w.to(d),
            c.to(d),
            topk_rows.to(d),
            positions,
            {layer: rows.to(d) for layer, rows in topk.items()},
        )

    # --- dense oracle -----------------------------------------------------------------

    def dense(
        self, layer: str, inputs: StepInputs, q: torch.Tensor, *, round_trip: bool
    ) -> dict[str, torch.Tensor]:
        """Float64 attention over the keys each token sees, from positions alone.

        Returns ``out [T, H, 512]`` (sink applied), ``lse [T, H]`` (sink excluded),
        ``abs_pk [T, H, 512]`` = sum_j p_j |k_j|, and, with bf16 keys, the FP8 terms
        ``abs_pdelta`` = sum_j p_j |delta_j| and ``E [T, H]`` = max_j scale |q . delta_j|.
        """
        T, H = inputs.num_tokens, q.shape[1]
        out = torch.zeros((T, H, HEAD_DIM), dtype=torch.float64)
        lse = torch.zeros((T, H), dtype=torch.float64)
        abs_pk = torch.zeros_like(out)
        abs_pd = torch.zeros_like(out)
        E = torch.zeros_like(lse)
        sink = self.sinks[layer].to(torch.float64)
        t0 = 0
        for name, pos in inputs.positions:
            nq = pos.shape[0]
            if nq == 0:
                continue
            lo = max(int(pos[0]) - (WINDOW - 1), 0)
            hi = int(pos[-1]) + 1
            kw = self.window_keys[layer][name][lo:hi]
            wpos = torch.arange(lo, hi)
            mask_w = (wpos[None, :] <= pos[:, None]) & (
                wpos[None, :] >= pos[:, None] - (WINDOW - 1)
            )
            keys = [kw]
            masks = [mask_w]
            if layer != "swa":
                kc = self.comp_keys[layer][name]
                n_c = kc.shape[0]
                if layer in TOPK_LAYERS:
                    rows = inputs.topk[layer][t0 : t0 + nq].cpu().long()
                    lens = ((pos + 1) // RATIO[layer]).clamp(max=self.topk)
                    live = (torch.arange(self.topk)[None, :] < lens[:, None]) & (rows >= 0)
                    mask_c = torch.zeros((nq, n_c + 1), dtype=torch.bool)
                    mask_c.scatter_(1, torch.where(live, rows, n_c), True)
                    mask_c = mask_c[:, :n_c]
                else:
                    lens = ((pos + 1) // 128).clamp(max=self.c128a_topk)
                    mask_c = torch.arange(n_c)[None, :] < lens[:, None]
                keys.append(kc)
                masks.append(mask_c)
            dev = self.device
            k_bf16 = torch.cat(keys).to(dev)
            mask_all = torch.cat(masks, dim=1).to(dev)  # [nq, K]
            k_rt = fp8_round_trip(k_bf16)
            k = k_rt if round_trip else k_bf16.to(torch.float64)
            delta = k_rt - k_bf16.to(torch.float64)
            sink_d = sink.to(dev)
            for c0 in range(0, nq, self.dense_chunk):
                c1 = min(nq, c0 + self.dense_chunk)
                mask = mask_all[c0:c1]
                qq = q[t0 + c0 : t0 + c1].to(dev, torch.float64)  # [n, H, 512]
                s = torch.einsum("thd,kd->thk", qq, k) * SCALE
                s = s.masked_fill(~mask[:, None, :], -math.inf)
                row_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - row_lse[..., None])
                f = torch.sigmoid(row_lse - sink_d[None, :])  # exp(lse) / (exp(lse) + exp(sink))
                rows = slice(t0 + c0, t0 + c1)
                out[rows] = (torch.einsum("thk,kd->thd", p, k) * f[..., None]).cpu()
                lse[rows] = row_lse.cpu()
                abs_pk[rows] = torch.einsum("thk,kd->thd", p, k.abs()).cpu()
                abs_pd[rows] = torch.einsum("thk,kd->thd", p, delta.abs()).cpu()
                qd = (torch.einsum("thd,kd->thk", qq, delta) * SCALE).abs()
                E[rows] = qd.masked_fill(~mask[:, None, :], 0.0).amax(dim=-1).cpu()
            t0 += nq
        return {"out": out, "lse": lse, "abs_pk": abs_pk, "abs_pdelta": abs_pd, "E": E}

    # --- vLLM's own prefill path ------------------------------------------------------

    def workspace_forward(
        self, layer: str, inputs: StepInputs, q: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's prefill the way vLLM 0.32's ``_forward_prefill`` builds it.

        Gather every compressed entry and the window region of each request into a
        bf16 workspace (``N`` = most compressed entries, then ``gather_lens =
        query_len + min(prefix, W-1)`` window tokens from row ``N``), combine the
        top-k and window into workspace rows, and attend: all through
        ``dsv4_kernels.reference`` (the references of vLLM's drop-in kernels).
        The FP8 values are exact in bf16, so this sees the same keys as the
        paged forward, in another order.
        """
        from dsv4_kernels import reference as ref
        from dsv4_kernels.reference import sparse_mla as ref_attn

        ratio = RATIO[layer]
        T = inputs.num_tokens
        B = len(inputs.positions)
        qsl = inputs.query_start_loc
        seq = inputs.seq_lens[:B]
        qlen = (qsl[1:] - qsl[:-1]).to(seq.dtype)
        gather = qlen + (seq - qlen).clamp(max=WINDOW - 1)
        compressed = layer != "swa"
        N = int((seq // ratio).max()) if compressed else 0
        M = N + int(gather.max())
        kv = torch.zeros((B, M, HEAD_DIM), dtype=torch.bfloat16, device=self.device)
        if compressed:
            ref.dequantize_and_gather_k_cache(
                kv, self.comp_cache[layer], seq // ratio, None, inputs.comp_table, KV_BS // ratio, 0
            )
        ref.dequantize_and_gather_k_cache(
            kv, self.window_cache[layer], seq, gather, inputs.window_table, WINDOW_BS, N
        )
        topk = 0 if layer == "swa" else self.c128a_topk if layer == "c128a" else self.topk
        combined, lens = ref.combine_topk_swa_indices(
            inputs.topk[layer][:T] if layer in TOPK_LAYERS else None,
            qsl,
            seq,
            gather,
            WINDOW,
            ratio,
            topk,
            M,
            N,
            num_tokens=T,
        )
        return ref_attn.sparse_mla_workspace(
            q.to(self.device),
            kv.reshape(B * M, HEAD_DIM),
            combined,
            lens,
            SCALE,
            attn_sink=self.sinks[layer].to(self.device),
        )


def fp8_bound(dense_bf16: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tolerances (out, lse) of FP8 keys against the bf16-key oracle.

    Each score moves by at most E = max_j scale |q . delta_j| (delta: the
    keys' quantisation error, |delta| <= half an E4M3 unit times 2**e), so
    the lse moves by at most E, every softmax weight by a factor in
    [e**-2E, e**2E] and the sink factor sigmoid(lse - sink) by at most E/4:

        |out - out_bf16| <= e**2E sum p|delta| + (e**2E - 1 + E/4) sum p|k|

    plus bf16 rounding of the weights and the output (2**-7 sum p|k| +
    2**-8 |out|).
    """
    E = dense_bf16["E"][..., None]
    grow = torch.exp(2 * E)
    tol_out = (
        grow * dense_bf16["abs_pdelta"]
        + (grow - 1 + E / 4 + 2.0**-7) * dense_bf16["abs_pk"]
        + 2.0**-8 * dense_bf16["out"].abs()
        + 1e-6
    )
    tol_lse = dense_bf16["E"] + 2e-4
    return tol_out, tol_lse


def bf16_bound(dense_rt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tolerances (out, lse) against the oracle run on the pages' own values.

    Scores are exact products of bf16 values summed in float32; the weights
    may be rounded to bf16 before P V (2**-8 each) and the output is rounded
    to bf16 (2**-9): ``2**-7 sum p|k| + 2**-8 |out|``; the lse to 2e-4.
    """
    tol_out = 2.0**-7 * dense_rt["abs_pk"] + 2.0**-8 * dense_rt["out"].abs() + 1e-6
    return tol_out, torch.full_like(dense_rt["lse"], 2e-4)
