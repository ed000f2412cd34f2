"""How much compile time the profile-run warm-up takes out of the first request (GPU).

Each measurement runs in a fresh process with an empty Triton cache (so nothing
compiled earlier is reused): ``cold`` times a first real prefill step of one
layer of each type (8 or 16 heads) with no warm-up; ``warm`` runs
:func:`dsv4_attention.warmup.warm_up_prefill` first (what the plugin does in
vLLM's profile run), then times the same first step.  The difference is the
compile moved out of the first request.  Usage::

    PYTHONPATH=packages/dsv4-kernels/src:packages/dsv4-attention/src:. \\
        python3 -m benchmarks.experiments.exp_warmup --out results/
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = {"swa": 1, "c4a": 4, "c128a": 128}


def _child(heads: int, warm: bool) -> dict[str, float]:
    import torch
    from tests.attention._prefill_scenario import Scenario, StepRequest
    from tests.attention.test_prefill_forward import layer_kwargs

    from dsv4_attention.prefill import PrefillPlan, forward_prefill
    from dsv4_attention.warmup import warm_up_prefill
    from dsv4_kernels.testing.sparse_mla import random_q

    gpu = torch.device("cuda")
    torch.zeros(1, device=gpu)  # CUDA context outside the timings
    sc = Scenario(
        [[StepRequest("a", 9000, 1000), StepRequest("b", 0, 333)]],
        heads=heads,
        topk=512,
        c128a_topk=128,
        seed=1,
        device=gpu,
    )
    inputs = sc.prepare_step(0)
    q = random_q(inputs.num_tokens, heads, generator=sc.g, device="cpu").to(gpu)
    result: dict[str, float] = {}
    if warm:
        began = time.perf_counter()
        for ratio in LAYERS.values():
            warm_up_prefill(gpu, heads, ratio, 512)
        result["warm_up_s"] = time.perf_counter() - began
    plan = PrefillPlan(inputs.query_start_loc, inputs.seq_lens, num_tokens=inputs.num_tokens)
    torch.cuda.synchronize()
    began = time.perf_counter()
    for layer in LAYERS:
        forward_prefill(q, plan, **layer_kwargs(sc, layer, inputs))
    torch.cuda.synchronize()
    result["first_step_s"] = time.perf_counter() - began
    began = time.perf_counter()
    for layer in LAYERS:
        forward_prefill(q, plan, **layer_kwargs(sc, layer, inputs))
    torch.cuda.synchronize()
    result["second_step_s"] = time.perf_counter() - began

    # decode: one call per layer type at 4 tokens (split over keys), same comparison
    from dsv4_attention.decode import forward_decode, make_decode_scratch
    from dsv4_attention.warmup import warm_up_decode

    scratch = make_decode_scratch(512, heads, 128 + 512, gpu)
    if warm:
        began = time.perf_counter()
        for ratio in LAYERS.values():
            warm_up_decode(gpu, heads, ratio, 128 + 512, scratch)
        result["decode_warm_up_s"] = time.perf_counter() - began
    cache = sc.window_cache["swa"]
    idx = torch.arange(128, dtype=torch.int32, device=gpu).repeat(4, 1)
    lens = torch.full((4,), 128, dtype=torch.int32, device=gpu)
    comp = torch.arange(512, dtype=torch.int32, device=gpu).repeat(4, 1)
    sink = torch.zeros(heads, device=gpu)
    for name in ("first_decode_s", "second_decode_s"):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for layer, ratio in LAYERS.items():
            kw = {}
            if ratio > 1:
                kw = dict(
                    comp_cache=sc.comp_cache[layer],
                    comp_indices=comp if ratio == 4 else comp[:, :128],
                    comp_lens=torch.full((4,), 100, dtype=torch.int32, device=gpu),
                )
            out = torch.empty((4, heads, 512), dtype=torch.bfloat16, device=gpu)
            forward_decode(q[:4], cache, idx, lens, sink, 512**-0.5, out, scratch, **kw)
        torch.cuda.synchronize()
        result[name] = time.perf_counter() - began
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--child", nargs=2, metavar=("HEADS", "WARM"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(int(args.child[0]), args.child[1] == "1")))
        return
    rows = []
    for heads in (8, 16):
        for warm in (0, 1):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                done = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "benchmarks.experiments.exp_warmup",
                        "--child",
                        str(heads),
                        str(warm),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                )
            row = {
                "heads": heads,
                "warm": bool(warm),
                **json.loads(done.stdout.strip().splitlines()[-1]),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "warmup.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
