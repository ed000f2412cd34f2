"""What a user gains per step: the whole model's attention with and without the plugin.

One decode step and one prefill chunk of every attention layer of DeepSeek-V4-Flash (43
layers) and V4-Pro (61), in their real mix of window-only, C4A and C128A layers
(:mod:`benchmarks.model_facts`), on one GPU at TP8's local heads (8 and 16), as vLLM 0.33
runs them (:mod:`.model_step_decode`, :mod:`.model_step_prefill`):

* ``vllm-tp8``: vLLM's path: its metadata kernels and FlashMLA padded to 64 heads;
* ``dsv4-tp8``: the plugin's path, each layer kind where the H200 table takes it;
* ``vllm-dp8``: the DP8 layout's step on one GPU: all 64 (128) heads, FlashMLA at its
  native head count, ``ceil(batch / 8)`` of the requests (decode) or a whole chunk
  (prefill) per GPU;
* ``dsv4-dp8``: the same DP8 step on the plugin's path, each layer kind where the H200
  table takes it at 64 (128) heads (issue 41; the prefill only where the table has a
  wide row for a kind at that head count, which the shipped one does not yet).

Decode steps include each C4A layer's lightning indexer (scores + top-k; vLLM's pair on
vLLM's paths, ours on the plugin's where the table takes it: :mod:`.model_step_indexer`),
where vLLM's pair is staged (``python3 -m benchmarks.support.fetch_vllm_indexer``);
without it the indexer is left out of every path, as before, and the run says so.

Grid: decode batches 1, 8, 32, 128, 256 requests of 1 token, or 2 with MTP's draft (the
``mtp`` presets), at 8K, 128K and 1M context, one CUDA graph per step; prefill chunks of
4,096 and 16,384 tokens at the same contexts, eager (as vLLM runs prefill attention).
Every path is poisoned, run, checked (every layer written; the first and last layer of
each kind against the float32 reference on sampled tokens) and only then timed.
``floor``: the distinct keys' FP8 bytes, query, output and lse of every layer at the
measured copy bandwidth.

    PYTHONPATH=packages/dsv4-kernels/src:packages/dsv4-attention/src:. \\
        python3 -m benchmarks.model_step --out results/model_step [--vllm-peer .vllm_peer]

writes ``results.jsonl`` (every provider and case), ``model_step.json`` (the rows of the
tables), ``model_step.md`` and ``model_step.png``.  Without a GPU: a labelled smoke run
of a tiny four-layer model through Triton's interpreter (checks only).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from . import harness
from .harness import BenchCase, Provider, Result, say_once
from .model_step_common import StepModel, metadata_ops, step_model, tiny_model

DECODE = "model_step_decode"
PREFILL = "model_step_prefill"
VLLM, OURS, DP8 = "vllm-tp8", "dsv4-tp8", "vllm-dp8"
DP8_OURS = "dsv4-dp8"
MODELS = ("v4-flash", "v4-pro")
BATCHES = (1, 8, 32, 128, 256)
PER_REQUEST = (1, 2)  # plain decode; MTP with one draft token (the mtp presets)
CONTEXTS = (8192, 131072, 1048576)
CHUNKS = (4096, 16384)
SMOKE_CONTEXT = 300


def decode_cases(
    models: Sequence[str], device: torch.device, ops: Any, only: Sequence[str] = ()
) -> list[Callable[[], BenchCase]]:
    """A builder of each case of the decode grid (or the smoke set on a CPU)."""
    from . import model_step_decode as md

    gpu = device.type == "cuda"
    cells = []
    if gpu:
        for name in models:
            tp, dp = step_model(name, "tp8"), step_model(name, "dp8")
            for ctx in CONTEXTS:
                for b in BATCHES:
                    for g in PER_REQUEST:
                        cells.append(
                            (md.DecodeCell(tp, b, g, ctx), md.DecodeCell(dp, -(-b // 8), g, ctx))
                        )
    else:
        tp, dp = tiny_model(8), tiny_model(64, "dp8")
        cells = [
            (md.DecodeCell(tp, b, g, SMOKE_CONTEXT), md.DecodeCell(dp, 1, g, SMOKE_CONTEXT))
            for b, g in ((1, 1), (2, 2))
        ]
    cells = [c for c in cells if not only or any(o in c[0].name for o in only)]

    def build(tp_cell: Any, dp_cell: Any) -> BenchCase:
        from dsv4_kernels.testing.common import fresh_seed

        seed = fresh_seed()
        step = md.build_step(tp_cell, device, seed)
        dp_step = md.build_step(dp_cell, device, seed + 1)
        paths = [
            (md.vllm_path(step, ops, VLLM), step),
            (md.plugin_path(step, ops, OURS), step),
            (md.vllm_path(dp_step, ops, DP8), dp_step),
            (md.plugin_path(dp_step, ops, DP8_OURS), dp_step),
        ]
        providers = [Provider(p.name, p.run, p.poison, md.checker(s, p)) for p, s in paths]
        params = _params(tp_cell, dp_cell, paths[1][0].ours, seed, gpu)
        params["dp_kinds_ours"] = list(paths[3][0].ours)
        params["indexer"] = {p.name: None if p.indexer is None else p.indexer.who
                             for p, _ in paths}  # fmt: skip
        params["indexer_note"] = step.indexer_note
        say_once(f"model step: indexer: {step.indexer_note}")
        return BenchCase(DECODE, tp_cell.name, tp_cell.tokens, md.floor_bytes(step), providers,
                         params)  # fmt: skip

    return [lambda c=c: build(*c) for c in cells]


def prefill_cases(
    models: Sequence[str], device: torch.device, ops: Any, only: Sequence[str] = ()
) -> list[Callable[[], BenchCase]]:
    from . import model_step_prefill as mp

    gpu = device.type == "cuda"
    if gpu:
        cells = [
            (
                mp.chunk_cell(step_model(n, "tp8"), chunk, ctx),
                mp.chunk_cell(step_model(n, "dp8"), chunk, ctx),
            )
            for n in models
            for chunk in CHUNKS
            for ctx in CONTEXTS
        ]
    else:
        cells = [
            (
                mp.PrefillCell(tiny_model(8), 1, 6, SMOKE_CONTEXT),
                mp.PrefillCell(tiny_model(64, "dp8"), 1, 6, SMOKE_CONTEXT),
            )
        ]
    cells = [c for c in cells if not only or any(o in c[0].name for o in only)]

    def build(tp_cell: Any, dp_cell: Any, dp: bool) -> BenchCase:
        """The TP8 paths, or (``dp``) the DP8 step under the same case name: built and run
        one after the other, so only one of them holds memory at a time."""
        from dsv4_kernels.testing.common import fresh_seed

        seed = fresh_seed()
        cell = dp_cell if dp else tp_cell
        step = mp.build_step(cell, device, seed)
        keep = cell.model.checked_layers()
        if dp:
            paths = [mp.vllm_path(step, ops, DP8, keep=keep)]
            dp_ours = mp.takes_ours(step)
            if dp_ours:  # else the plugin's path is vLLM's (with the plugin's combine)
                paths.append(mp.plugin_path(step, ops, DP8_OURS, dp_ours, keep=keep))
        else:
            ours = mp.takes_ours(step)
            paths = [mp.vllm_path(step, ops, VLLM, keep=keep),
                     mp.plugin_path(step, ops, OURS, ours, keep=keep)]  # fmt: skip
        providers = [Provider(p.name, p.run, p.poison, mp.checker(step, p)) for p in paths]
        floor = 0 if dp else mp.floor_bytes(step)
        params = _params(tp_cell, dp_cell, () if dp else paths[-1].ours, seed, gpu)
        params["dp_kinds_ours"] = list(mp.cell_takes_ours(dp_cell))
        return BenchCase(PREFILL, tp_cell.name, tp_cell.tokens, floor, providers, params)

    return [lambda c=c, dp=dp: build(*c, dp) for c in cells for dp in (False, True)]


def _params(tp: Any, dp: Any, ours: tuple[str, ...], seed: int, gpu: bool) -> dict[str, Any]:
    m: StepModel = tp.model
    kinds = {k: m.kinds.count(k) for k in dict.fromkeys(m.kinds)}
    out = {
        "model": m.name,
        "layers": len(m.kinds),
        "kinds": kinds,
        "heads": m.heads,
        "dp_heads": dp.model.heads,
        "requests": tp.requests,
        "dp_requests": dp.requests,
        "context": tp.context,
        "ours_kinds": list(ours),
        "seed": seed,
        "graph": gpu,
    }
    if hasattr(tp, "per_request"):
        out["per_request"] = tp.per_request
    else:
        out["query_len"] = tp.query_len
    return out


def run(
    device: torch.device,
    bandwidth: float,
    rep_ms: int,
    parts: Sequence[str],
    models: Sequence[str],
    only: Sequence[str],
    peer: Path | None,
    log: Callable[[str], None] = print,
    done: Callable[[list[Result], str], None] | None = None,
) -> tuple[list[Result], str]:
    """Build, check and time every case, one at a time (each case's graphs and buffers
    are freed before the next); the results and where the metadata kernels came from.
    ``done`` gets the results so far after every case (the run writes them as it goes)."""
    ops = metadata_ops(peer)
    log(f"model step: metadata kernels: {ops.source}")
    todo: list[Callable[[], BenchCase]] = []
    if "decode" in parts:
        todo += decode_cases(models, device, ops, only)
    if "prefill" in parts:
        todo += prefill_cases(models, device, ops, only)
    results: list[Result] = []
    for make in todo:
        case = make()
        results += harness.run_cases([case], device, bandwidth, rep_ms, log)
        del case
        if done is not None:
            done(results, ops.source)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results, ops.source


def _rows(results: Sequence[Result]) -> list[dict[str, Any]]:
    """One row per case: each provider's p50 (us per step), the saving and the floor."""
    by: dict[tuple[str, str], dict[str, Result]] = {}
    for r in results:
        by.setdefault((r.kernel, r.case), {})[r.provider] = r
    rows = []
    for (kernel, case), provs in by.items():
        if VLLM not in provs or OURS not in provs:
            continue
        v, o = provs[VLLM], provs[OURS]
        row: dict[str, Any] = {
            "kernel": kernel,
            "case": case,
            **o.params,
            VLLM: v.p50_us,
            OURS: o.p50_us,
            "floor": o.floor_us,
            "saving_us": v.p50_us - o.p50_us,
            "saving_pct": 100 * (v.p50_us - o.p50_us) / v.p50_us,
            "speedup": v.p50_us / o.p50_us,
        }
        for dp in (DP8, DP8_OURS):
            if dp in provs:
                row[dp] = provs[dp].p50_us
        if kernel == DECODE and row["model"] in _facts():
            per_req = _facts()[row["model"]].kv_bytes_per_request(row["context"], mtp=True)
            row["kv_gb_tp8"] = row["requests"] * per_req / 1e9  # every GPU holds every request
            row["kv_gb_dp8"] = row["dp_requests"] * per_req / 1e9  # its own requests
        rows.append(row)
    return rows


def _facts() -> dict[str, Any]:
    from . import model_facts

    return model_facts.load()


def _kinds(p: dict[str, Any]) -> str:
    return ", ".join(f"{n} {k}" for k, n in p["kinds"].items())


def table(rows: Sequence[dict[str, Any]], smoke: bool) -> str:
    """Markdown tables: decode and prefill, the two paths, the saving, DP8 beside TP8."""
    out = []
    dec = [r for r in rows if r["kernel"] == DECODE]
    pre = [r for r in rows if r["kernel"] == PREFILL]
    if dec:
        out += [
            "### Decode step (all attention layers; on a GPU one CUDA graph per step)",
            "",
            f"Layers: {_kinds(dec[0])} ({dec[0]['model']})."
            if len({r["model"] for r in dec}) == 1
            else "Layers: " + "; ".join(sorted({f"{r['model']} {_kinds(r)}" for r in dec})) + ".",
            "",
            "Each C4A layer's lightning indexer: "
            + "; ".join(sorted({str(r.get("indexer_note") or "not included") for r in dec}))
            + ".",
            "",
        ]
        if smoke:
            out += _checked(dec)
        else:
            out += [
                "| model | batch | tokens/req | context | vLLM TP8 us | ours TP8 us | saving us |"
                " saving % | speed-up | floor us | DP8 per GPU (64/128 heads) us | DP8 + plugin "
                "us | faster attention step | KV GB per GPU: TP8 / DP8 |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in dec:
                dp, dp_ours = r.get(DP8, math.nan), r.get(DP8_OURS, math.nan)
                best, fastest = "TP8 + plugin", r[OURS]
                for name, us in (("DP8", dp), ("DP8 + plugin", dp_ours)):
                    if us < fastest:  # False for a path that did not run (nan)
                        best, fastest = f"{name} ({r['dp_requests']} req/GPU)", us
                out.append(
                    f"| {r['model']} | {r['requests']} | {r['per_request']} | "
                    f"{_ctx(r['context'])} | "
                    f"{r[VLLM]:.1f} | **{r[OURS]:.1f}** | {r['saving_us']:.1f} | "
                    f"{r['saving_pct']:.0f}% | {r['speedup']:.2f}x | {r['floor']:.1f} | {dp:.1f} | "
                    f"{'-' if math.isnan(dp_ours) else f'{dp_ours:.1f}'} | {best} | {_kv(r)} |"
                )
        out.append("")
    if pre:
        out += ["### Prefill chunk (all attention layers, eager)", ""]
        if smoke:
            out += _checked(pre)
        else:
            out += [
                "| model | requests x tokens | context | vLLM TP8 us | ours TP8 us | saving us | "
                "saving % | speed-up | floor us | DP8: one chunk on one GPU us | DP8 + plugin "
                "us | 8 chunks on the node: TP8+plugin / DP8 ms | kinds ours |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
            for r in pre:
                dp, dp_ours = r.get(DP8, math.nan), r.get(DP8_OURS, math.nan)
                dp_cell = "-" if math.isnan(dp_ours) else f"{dp_ours:.0f}"
                out.append(
                    f"| {r['model']} | {r['requests']}x{r['query_len']} | {_ctx(r['context'])} | "
                    f"{r[VLLM]:.0f} | **{r[OURS]:.0f}** | {r['saving_us']:.0f} | "
                    f"{r['saving_pct']:.0f}% | {r['speedup']:.2f}x | {r['floor']:.0f} | {dp:.0f} | "
                    f"{dp_cell} | {8 * r[OURS] / 1e3:.1f} / {dp / 1e3:.1f} | "
                    f"{', '.join(r['ours_kinds']) or '-'} |"
                )
        out.append("")
    return "\n".join(out)


def _checked(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A smoke run's table: which paths ran and were checked (its times mean nothing)."""
    head = ["| case | vLLM's path | ours | DP8 | DP8 + plugin |", "|---|---|---|---|---|"]
    return head + [
        f"| {r['case']} | checked | checked | checked | {'checked' if DP8_OURS in r else '-'} |"
        for r in rows
    ]


def _kv(r: dict[str, Any]) -> str:
    """KV GB per GPU under TP8 / DP8, where the model's facts are known."""
    return f"{r['kv_gb_tp8']:.2f} / {r['kv_gb_dp8']:.2f}" if "kv_gb_tp8" in r else "-"


def _ctx(n: int) -> str:
    return f"{n // 1048576}M" if n % 1048576 == 0 else f"{n // 1024}K"


def plot(rows: Sequence[dict[str, Any]], env: dict[str, str], path: Path) -> bool:
    """Decode time per step against batch: one panel per model and tokens per request,
    one line per path and context (log-log)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return False
    dec = [r for r in rows if r["kernel"] == DECODE]
    panels = sorted({(r["model"], r["per_request"]) for r in dec})
    if not panels:
        return False
    cols = min(2, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(6.5 * cols, 4.6 * rows_n), squeeze=False)
    styles = {VLLM: "--", OURS: "-", DP8: ":", DP8_OURS: "-."}
    colours = dict(zip(CONTEXTS, ("#1f77b4", "#ff7f0e", "#2ca02c"), strict=True))
    for ax, (model, g) in zip(axes.flat, panels, strict=False):
        for ctx in CONTEXTS:
            pts = sorted(
                (r["requests"], r)
                for r in dec
                if r["model"] == model and r["per_request"] == g and r["context"] == ctx
            )
            if not pts:
                continue
            for prov, style in styles.items():
                ax.plot(
                    [b for b, _ in pts],
                    [r.get(prov, math.nan) / 1e3 for _, r in pts],
                    style,
                    marker="o",
                    ms=3,
                    color=colours[ctx],
                    label=f"{prov} @{_ctx(ctx)}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch: requests on the node (DP8: ceil(batch / 8) on each GPU)")
        ax.set_ylabel("attention time per decode step (ms)")
        ax.set_title(f"{model}, {g} token(s) per request", fontsize=10)
        ax.legend(fontsize=6, ncol=3)
    fig.suptitle(f"DSV4 attention per decode step, {env['gpu']}, {env['git_sha']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.model_step", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", type=Path, default=None, help="folder for the results")
    p.add_argument("--part", choices=("decode", "prefill", "all"), default="all")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model_facts keys")
    p.add_argument("--only", default="", help="comma-separated case-name substrings")
    p.add_argument(
        "--vllm-peer",
        type=Path,
        default=None,
        help="vLLM's staged metadata kernels (python -m benchmarks.support.vllm_peer)",
    )
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="render the tables and plot of earlier runs' results.jsonl files",
    )
    args = p.parse_args(argv)
    if args.merge:
        results, env, source = read_results(args.merge)
        write(results, env, source, args.out)
        return 0
    gpu = torch.cuda.is_available()
    if not gpu:  # our kernels through Triton's interpreter: set before dsv4_kernels imports
        os.environ["TRITON_INTERPRET"] = "1"
    device = torch.device("cuda" if gpu else "cpu")
    env = harness.environment(device)
    env["mode"] = "gpu" if gpu else "cpu-smoke"
    bw = harness.copy_bandwidth(device)
    env["copy_bandwidth_gbps"] = f"{bw / 1e9:.1f}"
    print(f"device {env['gpu']} torch {env['torch']} triton {env['triton']} sha {env['git_sha']}")
    if not gpu:
        print(
            "CPU smoke run: a tiny four-layer model through Triton's interpreter; every path "
            "is checked, no time is meaningful (FlashMLA: a torch reference stands in)."
        )
    parts = ("decode", "prefill") if args.part == "all" else (args.part,)
    models = [m for m in args.models.split(",") if m]
    only = [s for s in args.only.split(",") if s]

    def done(so_far: list[Result], source: str) -> None:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            harness.write_jsonl(so_far, {**env, "metadata": source}, args.out / "results.jsonl")

    results, source = run(device, bw, args.rep_ms, parts, models, only, args.vllm_peer, done=done)
    write(results, env, source, args.out)
    return 0


def read_results(paths: Sequence[Path]) -> tuple[list[Result], dict[str, str], str]:
    """Results, environment and metadata source of earlier runs' ``results.jsonl`` files."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(Result)}
    results, env, source, shas = [], {}, "", []
    for path in paths:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            results.append(Result(**{k: row[k] for k in names}))
            env = {k: str(v) for k, v in row.items() if k not in names}
            source = env.pop("metadata", source)
            shas.append(env["git_sha"])
    env["git_sha"] = " and ".join(dict.fromkeys(shas))  # runs of several commits say so
    return results, env, source


def write(results: Sequence[Result], env: dict[str, str], source: str, out: Path | None) -> None:
    """Print the tables; with ``out``, write the JSON rows, Markdown and (GPU) plot."""
    gpu = env.get("mode") == "gpu"
    rows = _rows(results)
    text = table(rows, not gpu)
    head = (
        f"{env['gpu']}; torch {env['torch']}; Triton {env['triton']}; git {env['git_sha']}; "
        f"metadata kernels: {source}."
    )
    print(head + "\n\n" + text)
    if out is None:
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_step.json").write_text(
        json.dumps({"env": env, "metadata": source, "rows": rows}, indent=1, sort_keys=True) + "\n"
    )
    (out / "model_step.md").write_text((head + "\n\n" + text).rstrip("\n") + "\n")
    if gpu:
        plot(rows, env, out / "model_step.png")


if __name__ == "__main__":
    raise SystemExit(main())
