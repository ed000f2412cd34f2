"""Benchmark cases for the sparse MLA decode (issue 22): ours against FlashMLA's decode.

Matrix: tokens per step 1, 2, 4, ..., 1,024 (one token per request) plus MTP steps
of 2 tokens per request; V4-Flash TP8 (8 heads, top-k 512) and V4-Pro TP8 (16 heads,
top-k 1,024) on C4A, C128A (1,024 compressed entries: a 131,072-token context) and
SWA-only layers; V4-Flash DP attention (64 heads) on the same three kinds at 1-1,024
tokens (the H200 table's 64-head rows, issue 32).  Every request is at a
131,072-token context: 128 window keys, plus 512 / 1,024 C4A or 1,024 C128A keys.
Rows come from :mod:`dsv4_kernels.testing.decode` over page pools of 150-600 MB
(random pages: each call's keys are cold after do_bench's L2 flush).

Providers, both timed under CUDA graphs: one graph holds ``ROTATE`` calls, each on
its own set of index rows (and its own queries' rows of the same pools), and the
time per call is the replay's median over ``ROTATE``:

* ``dsv4-kernels``: :func:`dsv4_kernels.sparse_mla_decode` (split over keys and
  combine, or the per-token kernel where the sizes say so), scratch allocated once;
* ``flashmla-64h``: ``flash_mla_with_kvcache`` on heads padded to 64 as vLLM's
  ``_forward_decode`` calls it (:mod:`.flashmla_decode`), when FlashMLA imports;
* ``vllm-flashmla-decode``: the same call on vLLM 0.33's bundled FlashMLA
  (:mod:`.flashmla_vllm`), into a preallocated output as vLLM 0.33 passes it, when
  its staged files load.

All are checked first (outputs poisoned, every element written, no NaN, the last
set of the graph against the float32 reference).  ``floor``: the larger of the
bytes (584 B and a 4-byte index per valid key, q, out, lse) at the measured copy
bandwidth and the time per kernel of a graph replaying ``ROTATE`` empty kernels.
On a CPU (smoke) there are no graphs: tiny steps, wall clock, checks only.

One module past 500 lines: the matrix, the page pools shared by its cases, each
provider's graph and check, and the summary that reads them belong together.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from .flashmla_vllm import LABEL as VLLM_LABEL
from .harness import FLOOR, BenchCase, Provider, Result, not_run, progress_line
from .support.decode_table import VARIANTS

KERNEL = "sparse_mla_decode"
OURS = "dsv4-kernels"
# ours at more than 16 heads in wide blocks of 64 heads on two warpgroups (issue 41; the
# shipped default runs them in blocks of 16): beside the default in the same run
WIDE = "wide64"  # the variant's name in the dispatch data (``layer/heads/wide64``)
OURS_WIDE = f"dsv4-kernels-{WIDE}"
FLASHMLA = "flashmla-64h"
VLLM_FLASHMLA = "vllm-flashmla-decode"
SCALE = 512**-0.5
CONTEXT = 131072
C128A_WIDTH = CONTEXT // 128
STEPS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MTP_STEPS = (2, 4, 8, 16, 32, 64, 128, 256, 512)
DP_STEPS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
ROTATE = 8
_CACHE: dict[str, Any] = {}  # page pools per layer type and the scratch, shared by cases
# Pool pages per layer type (window pages of 64 slots; compressed pages of 64 or 2 slots).
POOL_PAGES = {
    "swa": (4096, 0),
    "c4a": (4096, 4096),
    "c128a": (4096, 131072),
    # DeepSeek-V4.1's top-k layers: pages of 256 (ratio 1) and 128 (ratio 2) entries
    "c1a": (4096, 1024),
    "c2a": (4096, 2048),
}
TOPK_LAYERS = ("c4a", "c1a", "c2a")
# The peers, as a run names them when they do not run and as the summary's columns name
# them, and why each did not run in this process (filled by build_cases: the summary
# drops the columns of a peer without results and says why instead).
PEERS = {FLASHMLA: "FlashMLA", VLLM_FLASHMLA: VLLM_LABEL}
COLUMNS = {FLASHMLA: "FlashMLA", VLLM_FLASHMLA: "vLLM 0.33 FlashMLA"}
NOT_RUN: dict[str, str] = {}


@dataclasses.dataclass(frozen=True)
class DecodeShape:
    layer: str  # c4a | c128a | swa; V4.1's top-k layers c1a | c2a
    model: str
    heads: int
    topk: int
    tokens: int  # per step
    per_request: int  # tokens per request (2: MTP)

    @property
    def name(self) -> str:
        mtp = f"-mtp{self.per_request}" if self.per_request > 1 else ""
        return f"{self.layer}-{self.model}-t{self.tokens}{mtp}"


def matrix(layers: Sequence[str] = ("c4a", "c128a", "swa"), dp: bool = True) -> list[DecodeShape]:
    out = []
    for layer in layers:
        for model, heads, topk in (("flash-tp8", 8, 512), ("pro-tp8", 16, 1024)):
            out += [DecodeShape(layer, model, heads, topk, t, 1) for t in STEPS]
            out += [DecodeShape(layer, model, heads, topk, t, 2) for t in MTP_STEPS]
    if dp:  # DP attention: every head of V4-Flash (64) and of V4-Pro (128) on one GPU
        for layer in layers:
            out += [DecodeShape(layer, "flash-dp", 64, 512, t, 1) for t in DP_STEPS]
            out += [DecodeShape(layer, "pro-dp", 128, 1024, t, 1) for t in DP_STEPS]
    return out


# DeepSeek-V4.1's top-k layers at TP8 (its window-only layers are the "swa" rows)
V41_LAYERS = ("c1a", "c2a")


SMOKE = [
    DecodeShape("c4a", "h3", 3, 64, 1, 1),
    DecodeShape("c1a", "h8", 8, 32, 2, 1),
    DecodeShape("c128a", "h8", 8, 0, 2, 1),
    DecodeShape("swa", "h16", 16, 0, 4, 2),
    DecodeShape("c4a", "h20", 20, 64, 1, 1),  # more than 16 heads: the wide provider too
]


def _graph(calls: list[Callable[[], object]], device: torch.device) -> Callable[[], object]:
    """One callable running every call: a CUDA graph replay on a GPU, eager on a CPU."""
    if device.type != "cuda":
        return lambda: [c() for c in calls]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:  # compile, plan, warm up outside the capture
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph.replay


def launch_floor_us(device: torch.device, rep_ms: int = 50) -> float:
    """Microseconds per kernel of a graph replaying ``ROTATE`` empty Triton kernels."""
    if device.type != "cuda":
        return 0.0
    import triton.testing

    from .empty_kernel import launch_empty

    replay = _graph([lambda: launch_empty(device)] * ROTATE, device)
    return float(triton.testing.do_bench(replay, rep=rep_ms, return_mode="median")) * 1e3 / ROTATE


def _assert_close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor],
                  what: str) -> None:  # fmt: skip
    out, lse = got
    assert not torch.isnan(out.float()).any(), f"{what}: NaN (unwritten) output"
    assert not torch.isnan(lse).any(), f"{what}: NaN (unwritten) lse"
    torch.testing.assert_close(out.float(), want[0].float(), atol=3e-2, rtol=3e-2, msg=what)
    empty = torch.isneginf(want[1])
    assert torch.equal(torch.isneginf(lse), empty), f"{what}: lse -inf pattern differs"
    torch.testing.assert_close(lse[~empty], want[1][~empty], atol=2e-3, rtol=1e-4, msg=what)


def build_cases(
    device: torch.device,
    smoke: bool,
    shapes: Sequence[DecodeShape] | None = None,
    flashmla: bool = True,
    policy: dict[str, int] | None = None,
) -> list[BenchCase]:
    """The cases of ``shapes`` (default: the matrix, or the smoke set), ours run with the
    split ``policy`` (:data:`dsv4_kernels.decode.DecodePolicy`; None: the defaults)."""
    import dsv4_kernels as dk
    from dsv4_kernels import reference as ref
    from dsv4_kernels.testing import decode as td
    from dsv4_kernels.testing.common import fresh_seed

    from . import flashmla_vllm
    from .flashmla_decode import PaddedFlashMLADecode, load_decode

    gpu = device.type == "cuda"
    fns, why = load_decode()
    vllm_fns, vllm_why = flashmla_vllm.load_decode()
    for peer, loaded, reason in ((FLASHMLA, fns, why), (VLLM_FLASHMLA, vllm_fns, vllm_why)):
        if loaded is None:
            NOT_RUN[peer] = reason
        elif not gpu:
            NOT_RUN[peer] = "its CUDA graphs need a CUDA GPU"
        elif not flashmla:
            NOT_RUN[peer] = "left out of this run (flashmla=False)"
        else:
            NOT_RUN.pop(peer, None)
            continue
        not_run(PEERS[peer], NOT_RUN[peer])
    rotate = ROTATE if gpu else 2
    context = CONTEXT if gpu else 700
    shapes = list(shapes if shapes is not None else (SMOKE if smoke else matrix()))
    max_t = max(s.tokens for s in shapes)
    max_h = max(s.heads for s in shapes)
    widths = [128 + (s.topk if s.layer in TOPK_LAYERS else 0) for s in shapes]
    widths.append(128 + (C128A_WIDTH if gpu else context // 128))
    sizes = dk.decode_scratch_sizes(max(max_t, 1024 if gpu else 1), max(max_h, 64 if gpu else 1),
                                    max(widths), device, policy=policy)  # fmt: skip
    if _CACHE.get("sizes") != sizes:
        _CACHE["sizes"] = sizes
        _CACHE["scratch"] = dk.make_decode_scratch(sizes, device)
    scratch = _CACHE["scratch"]
    pools: dict[str, Any] = _CACHE.setdefault("pools", {})
    cases = []
    for shape in shapes:
        seed = fresh_seed()
        g = torch.Generator(device=device).manual_seed(seed)
        if shape.layer not in pools:
            swa_pages, comp_pages = POOL_PAGES[shape.layer] if gpu else (64, 64)
            pools[shape.layer] = td.make_pools(
                shape.layer, swa_pages=swa_pages, comp_pages=comp_pages, generator=g, device=device
            )
        pool = pools[shape.layer]
        reqs = shape.tokens // shape.per_request
        topk = shape.topk if shape.layer in TOPK_LAYERS else 512
        sets = [
            td.decode_rows(
                pool,
                [context] * reqs,
                shape.per_request,
                generator=g,
                topk=topk,
                comp_width=C128A_WIDTH if gpu else None,
            )
            for _ in range(rotate)
        ]
        case = td.DecodeCase(
            td.random_q(shape.tokens, shape.heads, generator=g, device=device),
            td.random_sink(shape.heads, generator=g, device=device),
            pool, sets[-1], shape.per_request,
        )  # fmt: skip
        T, H = shape.tokens, shape.heads
        last = sets[-1]
        sample = torch.unique(torch.cat([torch.arange(0, T, max(1, T // 64)),
                                         torch.tensor([T - 1])])).to(device)  # fmt: skip
        kw_last = case.kwargs(last)
        if "comp_indices" in kw_last:
            kw_last.update(comp_indices=last.comp_indices[sample],
                           comp_lens=last.comp_lens[sample])  # fmt: skip
        want = ref.sparse_mla_paged(case.q[sample], pool.swa.cache, last.swa_indices[sample],
                                    last.swa_lens[sample], SCALE, **kw_last)  # fmt: skip
        out = torch.empty((T, H, 512), dtype=torch.bfloat16, device=device)
        lse = torch.empty((T, H), dtype=torch.float32, device=device)

        def ours_call(r: Any, c: Any = case, o: torch.Tensor = out, l: torch.Tensor = lse,
                      p: Any = policy) -> None:  # fmt: skip
            dk.sparse_mla_decode(c.q, c.pools.swa.cache, r.swa_indices, r.swa_lens, SCALE,
                                 scratch=scratch, out=o, lse=l, policy=p,
                                 **c.kwargs(r))  # fmt: skip

        def poison(o: torch.Tensor = out, l: torch.Tensor = lse) -> None:
            o.fill_(float("nan"))
            l.fill_(float("nan"))

        def check(o: torch.Tensor = out, l: torch.Tensor = lse, w: Any = want,
                  s: torch.Tensor = sample, n: str = shape.name,
                  sd: int = seed) -> None:  # fmt: skip
            assert not torch.isnan(o.float()).any(), f"{n}: unwritten (NaN) output elements"
            _assert_close((o[s], l[s]), w, f"ours {n} (seed {sd})")

        replay = _graph([lambda r=r: ours_call(r) for r in sets], device)
        providers = [Provider(OURS, replay, poison, check)]
        if H > 16:  # the wide blocks, into the same outputs, checked the same way
            wide = {**(policy or {}), **VARIANTS[WIDE]}
            wide_replay = _graph([lambda r=r, p=wide: ours_call(r, p=p) for r in sets], device)
            providers.append(Provider(OURS_WIDE, wide_replay, poison, check))
        if fns is not None and gpu and flashmla:
            fm = PaddedFlashMLADecode(
                case.q, pool.swa.cache, None if pool.comp is None else pool.comp.cache, sets,
                SCALE, case.sink,
            )  # fmt: skip

            def fm_check(f: Any = fm, w: Any = want, s: torch.Tensor = sample,
                         n: str = shape.name, sd: int = seed) -> None:  # fmt: skip
                o, l = f.outputs()
                _assert_close((o[s], l[s]), w, f"FlashMLA {n} (seed {sd})")

            def fm_poison(f: Any = fm) -> None:
                if f.result:
                    f.result[0].fill_(float("nan"))

            fm_replay = _graph([lambda i=i, f=fm: f.call(i) for i in range(rotate)], device)
            providers.append(Provider(FLASHMLA, fm_replay, fm_poison, fm_check))
        if vllm_fns is not None and gpu and flashmla:
            vfm = _vllm_decode(case, pool, sets, shape.name)
            if vfm is not None:

                def vfm_check(f: Any = vfm, w: Any = want, s: torch.Tensor = sample,
                              n: str = shape.name, sd: int = seed) -> None:  # fmt: skip
                    assert f.out is not None
                    assert not torch.isnan(f.out.float()).any(), f"{n}: unwritten (NaN) output"
                    o, l = f.outputs()
                    assert not torch.isnan(l).any(), f"{n}: unwritten (NaN) lse"
                    _assert_close((o[s], l[s]), w, f"vLLM 0.33 FlashMLA {n} (seed {sd})")

                vfm_replay = _graph([lambda i=i, f=vfm: f.call(i) for i in range(rotate)], device)
                providers.append(Provider(VLLM_FLASHMLA, vfm_replay, vfm.poison, vfm_check))
        keys = last.swa_lens.long() + (0 if last.comp_lens is None else last.comp_lens.long())
        floor_bytes = int(keys.sum()) * (584 + 4) + T * H * (1024 + 1024 + 4)
        splits = dk.decode.decode_splits(
            T,
            H,
            128,
            0 if last.comp_indices is None else last.comp_indices.shape[1],
            dk.decode.num_sms(device),
            policy=policy,
        )
        cases.append(
            BenchCase(
                KERNEL,
                shape.name,
                T,
                floor_bytes,
                providers,
                {
                    "layer": shape.layer,
                    "model": shape.model,
                    "heads": H,
                    "tokens": T,
                    "per_request": shape.per_request,
                    "keys_mean": float(keys.float().mean()),
                    "calls_per_graph": rotate,
                    "splits": splits[0],
                    "chunk": splits[1],
                    "seed": seed,
                    "graph": gpu,
                },
            )
        )
    return cases


def _vllm_decode(case: Any, pool: Any, sets: list[Any], name: str) -> Any:
    """vLLM 0.33's bundled decode on this case's pages (one call first, outside any graph:
    it plans the tile schedule, and a refusal is reported for this case, not timed)."""
    from . import flashmla_vllm

    try:
        fm = flashmla_vllm.decode_runner(
            case.q, pool.swa.cache, None if pool.comp is None else pool.comp.cache, sets,
            SCALE, case.sink,
        )  # fmt: skip
        fm.call(0)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, AssertionError) as exc:
        print(f"({VLLM_FLASHMLA} unavailable for {name}: {type(exc).__name__}: {exc})")
        return None
    return fm


def finalise(results: list[Result], launch_us: float) -> list[Result]:
    """Per call (each graph replay ran ``calls_per_graph`` calls) and the floor as the
    larger of bytes at bandwidth and one graph-replayed launch."""
    out = []
    for r in results:
        if r.kernel != KERNEL:
            out.append(r)
            continue
        n = r.params.get("calls_per_graph", 1)
        floor = max(r.floor_us, launch_us)
        if r.provider == FLOOR:
            out.append(dataclasses.replace(r, p20_us=floor, p50_us=floor, p80_us=floor,
                                           floor_us=floor))  # fmt: skip
        else:
            out.append(dataclasses.replace(r, p20_us=r.p20_us / n, p50_us=r.p50_us / n,
                                           p80_us=r.p80_us / n, floor_us=floor))  # fmt: skip
    return out


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _times(x: float) -> str:
    """A ratio as the tables print it; ``-`` where there is none (never ``nan``)."""
    return "-" if math.isnan(x) else f"{x:.2f}x"


def summarise(
    results: Sequence[Result], smoke: bool = False, why_not: dict[str, str] | None = None
) -> tuple[str, dict[str, Any]]:
    """Markdown table (us per call, ratios FlashMLA / ours for the source-built FlashMLA and
    vLLM 0.33's bundled one, floor) and the dispatch data: per layer and head count, the
    step sizes (one token per request) where ours was faster than the source-built
    FlashMLA.

    A peer without results has no columns: one line under the table says why it did not
    run (``why_not``, default :data:`NOT_RUN`); a case it refused shows ``-``.  A CPU smoke
    run (``smoke``) has no floor columns (interpreter wall clock over a GPU floor means
    nothing) and nothing bold; without FlashMLA results there is no dispatch table, and one
    line says why.
    """
    why_not = NOT_RUN if why_not is None else why_not
    rows: dict[str, dict[str, Result]] = {}
    for r in results:
        if r.kernel == KERNEL:
            rows.setdefault(r.case, {})[r.provider] = r
    ran = [peer for peer in PEERS if any(peer in row for row in rows.values())]
    wide = any(OURS_WIDE in row for row in rows.values())
    head = ["case", "layer", "heads", "tokens", "per req", "splits", "ours us"]
    if wide:
        head += ["ours wide-64 us", "ours / wide-64"]
    for peer in ran:
        head += [f"{COLUMNS[peer]} us", f"{COLUMNS[peer]} / ours"]
    if not smoke:
        head += ["floor us", "ours / floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups: dict[tuple[str, int, str], dict[str, Any]] = {}
    for case, row in rows.items():
        ours = row.get(OURS)
        if ours is None:
            continue
        p = ours.params
        cells = [case, p["layer"], p["heads"], p["tokens"], p["per_request"], p["splits"]]
        cells.append(f"{ours.p50_us:.2f}" if smoke else f"**{ours.p50_us:.2f}**")
        if wide:
            w = row.get(OURS_WIDE)
            cells += [f"{w.p50_us:.2f}", f"{ours.p50_us / w.p50_us:.2f}x"] if w else ["-", "-"]
        for peer in ran:
            other = row.get(peer)
            cells += (
                [f"{other.p50_us:.2f}", f"{other.p50_us / ours.p50_us:.2f}x"]
                if other
                else ["-", "-"]
            )
        if not smoke:
            floor = ours.floor_us
            cells += [f"{floor:.2f}", f"{ours.p50_us / floor:.2f}x" if floor else "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
        fm = row.get(FLASHMLA)
        if fm is None:
            continue
        for variant, mine in (("", ours), (f"/{WIDE}", row.get(OURS_WIDE))):
            if mine is None:
                continue
            grp = groups.setdefault((p["layer"], p["heads"], variant), {"steps": {}, "mtp": {}})
            grp["mtp" if p["per_request"] > 1 else "steps"][p["tokens"]] = round(
                fm.p50_us / mine.p50_us, 3
            )
    if len(lines) == 2:
        return f"No {KERNEL} results to summarise.", {}
    missing = [peer for peer in PEERS if peer not in ran]
    if missing:
        lines.append("")
        lines += [
            f"{PEERS[peer]}: not run ({why_not.get(peer, 'no results in this run')})"
            for peer in missing
        ]
    table: dict[str, Any] = {}
    if not groups:
        lines += ["", f"No dispatch summary: it compares ours with {PEERS[FLASHMLA]} "
                  f"({FLASHMLA}), which did not run."]  # fmt: skip
        return "\n".join(lines), table
    lines += ["", "| layer | heads | geomean (1 token/req) | min | steps faster | "
              "1-32 tokens >= 1.3x | MTP geomean |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (layer, heads, variant), grp in sorted(groups.items()):
        steps = grp["steps"]
        ratios = list(steps.values())
        faster = sorted(t for t, x in steps.items() if x >= 1.0)
        small = [steps[t] for t in steps if t <= 32]
        mtp = list(grp["mtp"].values())
        lines.append(  # "-" where a group has no such steps (the DP rows have no MTP)
            f"| {layer} | {heads}{variant} | {_times(_geomean(ratios))} | "
            f"{_times(min(ratios, default=math.nan))} | "
            f"{len(faster)}/{len(steps)} | {sum(x >= 1.3 for x in small)}/{len(small)} | "
            f"{_times(_geomean(mtp))} |"
        )
        table[f"{layer}/{heads}{variant}"] = {"ratios": steps, "mtp_ratios": grp["mtp"]}
    return "\n".join(lines), table


def write_outputs(results: Sequence[Result], out_dir: Path, smoke: bool = False) -> str:
    text, table = summarise(results, smoke=smoke)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode.md").write_text(text + "\n")
    (out_dir / "decode_table.json").write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return text


def run(
    device: torch.device,
    smoke: bool,
    bandwidth: float,
    rep_ms: int,
    only: Sequence[str] = (),
    log: Callable[[str], None] = print,
    shapes_pool: Sequence[DecodeShape] | None = None,
) -> list[Result]:
    """Build, check and time the matrix one case at a time (each case's graphs and
    buffers are freed before the next); results per call, with the launch floor (on a
    GPU; a CPU run has no graphs and no floor to speak of).

    Each timed run replays ``calls_per_graph`` calls; the progress lines give the time
    per call, as the tables do, once a case's providers are all checked and timed."""
    from . import harness

    gpu = device.type == "cuda"
    launch = launch_floor_us(device)
    if gpu:
        log(f"decode: one graph-replayed kernel {launch:.2f} us")
    pool = SMOKE if smoke or not gpu else list(shapes_pool or matrix())
    shapes = [s for s in pool if not only or any(o in s.name for o in only)]
    results: list[Result] = []
    for shape in shapes:
        cases = build_cases(device, smoke, [shape])
        timed = finalise(harness.run_cases(cases, device, bandwidth, rep_ms, lambda _: None),
                         launch)  # fmt: skip
        for r in timed:
            if r.provider != FLOOR:
                n = r.params.get("calls_per_graph", 1)
                per = "graph replay" if r.params.get("graph") else "timed run"
                log(progress_line(r, f"us per call ({n} calls per {per})"))
        results += timed
        del cases
        if gpu:
            torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.cases_decode [--only SUBSTR] [--out DIR]``: this matrix alone."""
    import argparse

    from . import harness

    p = argparse.ArgumentParser(prog="python -m benchmarks.cases_decode")
    p.add_argument("--only", default="", help="comma-separated case-name substrings")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument(
        "--v41",
        action="store_true",
        help="DeepSeek-V4.1's top-k layers (ratio 1 and 2 pages) at TP8 instead of V4's matrix",
    )
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    only = [s for s in args.only.split(",") if s]
    env = harness.environment(device)
    bw = harness.copy_bandwidth(device)
    env.update(copy_bandwidth_gbps=f"{bw / 1e9:.1f}")
    print(f"device {env['gpu']} torch {env['torch']} triton {env['triton']} sha {env['git_sha']}"
          + (f" bandwidth {bw / 1e9:.0f} GB/s" if gpu else ""))  # fmt: skip
    pool = matrix(V41_LAYERS, dp=False) if args.v41 else None
    results = run(device, not gpu, bw, args.rep_ms, only, shapes_pool=pool)
    text = summarise(results, smoke=not gpu)[0]
    print(text)
    if args.out is not None:
        harness.write_jsonl(results, env, args.out / "results.jsonl")
        write_outputs(results, args.out, smoke=not gpu)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
