"""The scratch the plugin reserves per GPU, per serving configuration, as a Markdown table.

The runtime sizes its two scratches from the token budget, the context length and
the widest decode row vLLM can build (``dsv4_attention.policy.reserved_bytes``);
this prints them for V4-Flash and V4-Pro at TP8 on an H200 (132 multiprocessors;
grouped rows of 4 tokens at 8 heads, 2 at 16), the most the runtime reserves
(every layer kind on our path).  Run from the repository root:

    export PYTHONPATH=packages/dsv4-kernels/src:packages/dsv4-attention/src
    python3 -m benchmarks.support.reserved_bytes [--c128a-block-rows]

``--c128a-block-rows``: as where a GPU's table says ``prefill.c128a_block_rows`` (the
C128A rows read through the compressed block table: no row of entries reserved).
"""

from __future__ import annotations

import argparse

from dsv4_attention.facts import ServingConfig
from dsv4_attention.policy import reserved_bytes

MODELS = {"V4-Flash TP8": (8, 512, 4), "V4-Pro TP8": (16, 1024, 2)}
BUDGETS = (512, 2048, 8192, 16384, 65536)
LENGTHS = (4096, 131072, 1048576)
DRAFTERS = {"none / MTP": 128, "DSpark k=15": 192}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.support.reserved_bytes")
    p.add_argument("--c128a-block-rows", action="store_true")
    blocks = p.parse_args(argv).c128a_block_rows
    print(
        "| model | drafter | max_model_len | " + " | ".join(f"budget {b}" for b in BUDGETS) + " |"
    )
    print("| --- | --- | --- | " + " | ".join("---" for _ in BUDGETS) + " |")
    for model, (heads, topk, group) in MODELS.items():
        for drafter, width in DRAFTERS.items():
            for length in LENGTHS:
                cells = []
                for budget in BUDGETS:
                    serving = ServingConfig(
                        max_num_batched_tokens=budget,
                        max_model_len=length,
                        decode_window_width=width,
                    )
                    got = reserved_bytes(
                        serving, heads, topk, max_group=group, sms=132, c128a_blocks=blocks
                    )
                    cells.append(f"{got['prefill'] / 2**20:.0f} + {got['decode'] / 2**20:.1f} MiB")
                print(f"| {model} | {drafter} | {length:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
