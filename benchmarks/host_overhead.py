"""Host time of the plugin's decode per layer call, with the attention itself taken out.

In vLLM's eager regions (``--enforce-eager``, PIECEWISE graphs, mixed batches) every
layer's decode runs the plugin's Python each step: its decision, the layer's cache
check, vLLM's metadata mapped to rows, the kernels' argument checks, the launch.  This
measures that Python for one layer call of each V4 kind (SWA-only, C4A, C128A at 8
heads, V4-Flash TP8), with vLLM's layer and metadata objects stood in by their
attributes and the attention replaced by a no-op at the point where the kernels would
launch it (the CPU reference's entry), so what is timed is everything of ours before
the launch.  It runs on a CPU; the GPU's launch itself is the same for every tree.

Paired A/B/A in one run: ``--tree NAME=PATH`` (repeatable; a clone or ``git worktree``
of another commit) runs the same measurement against that tree's packages in a fresh
process, alternating trees ``--rounds`` times::

    git worktree add /tmp/base <commit>
    python3 -m benchmarks.host_overhead --tree base=/tmp/base --tree head=. --out DIR

writes ``DIR/host_overhead.json`` and prints a table: microseconds per layer call
per tree and kind (per process the least of 5 timings, garbage collector off, as
``timeit``; the median over processes), and each tree's ratio to the first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import timeit
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HEADS, PADDED = 8, 64
KINDS = {"swa": 1, "c4a": 4, "c128a": 128}


def _layer(ratio: int, torch: Any, dk: Any) -> types.SimpleNamespace:
    """The attributes of vLLM's DSV4 attention layer the plugin reads, on the CPU."""
    swa = dk.empty_k_cache(64, 64, "cpu")[:, : 64 * 584].view(64, 64, 584)
    comp = None
    if ratio > 1:
        slots = 256 // ratio
        comp = dk.empty_k_cache(64, slots, "cpu")[:, : slots * 584].view(64, slots, 584)
    return types.SimpleNamespace(
        prefix=f"model.layers.{ratio}.attn",
        compress_ratio=ratio,
        n_local_heads=HEADS,
        window_size=128,
        topk_indices_buffer=torch.zeros(256, 512, dtype=torch.int32),
        max_model_len=131072,
        max_num_batched_tokens=8192,
        kv_cache_dtype="fp8_ds_mla",
        scale=512**-0.5,
        attn_sink=torch.zeros(PADDED),
        swa_cache_layer=types.SimpleNamespace(kv_cache=swa),
        comp_cache=comp,
    )


def _metadata(ratio: int, tokens: int, torch: Any) -> tuple[Any, Any]:
    """vLLM's window and compressed decode metadata of ``tokens`` one-token requests."""
    swa = types.SimpleNamespace(
        num_decode_tokens=tokens,
        num_decodes=tokens,
        block_size=64,
        decode_swa_indices=torch.zeros(tokens, 1, 128, dtype=torch.int32),
        decode_swa_lens=torch.full((tokens,), 128, dtype=torch.int32),
        token_to_req_indices=torch.arange(tokens, dtype=torch.int32),
        is_valid_token=torch.ones(tokens, dtype=torch.bool),
    )
    attn = None
    if ratio > 1:
        attn = types.SimpleNamespace(
            block_size=256,
            block_table=torch.zeros(tokens, 512, dtype=torch.int32),
            c128a_global_decode_topk_indices=torch.zeros(tokens, 1, 1024, dtype=torch.int32),
            c128a_decode_topk_lens=torch.full((tokens,), 1024, dtype=torch.int32),
        )
    return swa, attn


def _mapped(topk: tuple[Any, Any], *args: Any) -> tuple[Any, Any]:
    """vLLM's global top-k mapping, stood in by its result."""
    return topk


def measure(calls: int, tokens: int) -> dict[str, float]:
    """Host microseconds per ``runtime.decode`` call of each kind (this process's
    packages): the least of 5 timings of ``calls`` calls."""
    import torch

    import dsv4_kernels as dk
    from dsv4_attention.facts import ServingConfig
    from dsv4_attention.policy import Device, Switches
    from dsv4_attention.runtime import HeadExactRuntime, VllmAccess
    from dsv4_attention.tables import table_for
    from dsv4_kernels import sparse_mla
    from dsv4_kernels.reference import decode as ref_decode

    def no_attention(q: Any, **kw: Any) -> tuple[Any, Any]:
        return kw["out"], kw["lse"]

    ref_decode.sparse_mla_decode = no_attention  # the launch point: nothing computed
    sparse_mla.wgmma_available = lambda: True
    serving = ServingConfig(
        architectures=("DeepseekV4ForCausalLM",),
        max_num_batched_tokens=8192,
        max_model_len=131072,
    )
    device = Device("NVIDIA H200", (9, 0), wgmma=True)
    # the decode alone: the prefill switched off (no prefill scratch, no prefill warm-up)
    runtime = HeadExactRuntime(
        serving, device, table_for(device.name, device.capability),
        Switches(prefill_disable=True),
        VllmAccess(info=lambda _: None, warning=print),
    )  # fmt: skip
    found: dict[str, float] = {}
    for kind, ratio in KINDS.items():
        layer = _layer(ratio, torch, dk)
        swa, attn = _metadata(ratio, tokens, torch)
        q = torch.zeros(tokens, PADDED, 512, dtype=torch.bfloat16)
        out = torch.zeros_like(q)
        topk = (torch.zeros(tokens, 512, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int32))

        call = functools.partial(
            runtime.decode, layer, q, layer.comp_cache, swa, attn, ratio == 1, out,
            functools.partial(_mapped, topk),
        )  # fmt: skip

        if not call():
            raise RuntimeError(f"{kind}: the plugin did not take the decode")
        # timeit: the garbage collector off while timing; the least of 5 timings (the
        # others include the machine's interruptions, not our code)
        found[kind] = min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e6
    return found


def _child(tree: Path, calls: int, tokens: int) -> dict[str, float]:
    paths = [str(tree / "packages" / p / "src") for p in ("dsv4-kernels", "dsv4-attention")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)])}
    env.pop("TRITON_INTERPRET", None)  # CPU tensors take the reference entry (the no-op)
    code = (
        "import json, benchmarks.host_overhead as h; "
        f"print(json.dumps(h.measure({calls}, {tokens})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                    help="a source tree to measure (default: this one, as 'this')")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="A/B/A rounds over the trees")
    ap.add_argument("--calls", type=int, default=2000, help="decode calls per timing")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per step")
    ap.add_argument("--out", type=Path, help="folder for host_overhead.json")
    args = ap.parse_args(argv)
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for r in range(args.rounds):
        order = trees if r % 2 == 0 else trees[::-1]  # A/B, then B/A
        for name, path in order:
            runs[name].append(_child(Path(path).resolve(), args.calls, args.tokens))
    table = {
        name: {k: statistics.median(run[k] for run in got) for k in KINDS}
        for name, got in runs.items()
    }
    first = trees[0][0]
    print(f"host us per layer decode call ({args.tokens} tokens, {HEADS} heads; median over "
          f"{args.rounds} processes of the least of 5 timings of {args.calls} calls)")  # fmt: skip
    print("| tree | " + " | ".join(KINDS) + " |")
    print("| --- |" + " --- |" * len(KINDS))
    for name, row in table.items():
        cells = [f"{row[k]:.1f} ({row[k] / table[first][k]:.2f}x)" for k in KINDS]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"trees": dict(trees), "tokens": args.tokens, "calls": args.calls,
                  "runs": runs, "median_us": table}  # fmt: skip
        (args.out / "host_overhead.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
