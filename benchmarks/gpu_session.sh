#!/usr/bin/env bash
# One GPU session in one call, on a CUDA machine (torch, Triton, pytest, hypothesis,
# pyyaml and matplotlib installed; no nox, no network needed):
#   1. builds FlashMLA first when the tree carries it in .fmla (the sparse-MLA
#      benchmark's FlashMLA provider imports it from /tmp/fmla), and says whether
#      vLLM 0.33's bundled FlashMLA loads (the vllm-flashmla-* providers: carry
#      .vllm_flashmla, staged by python3 -m benchmarks.support.fetch_vllm_flashmla,
#      or set DSV4_VLLM_FLASHMLA), running each of its ops once;
#   2. runs the README's GPU test command (log: $OUT/gpu-tests.log);
#   3. runs the full kernel benchmark into $OUT (results.jsonl, table.md,
#      plot.png; log: $OUT/bench.log), then prints the prefill choices the run
#      decides (python3 -m benchmarks.support.prefill_table: the C128A rows read
#      through the block table, prefill.c128a_block_rows; ours above 16 heads in wide
#      head blocks, prefill.wide; written into a table with --table once the GPU
#      tests passed; log: $OUT/prefill_table.log);
#   4. runs the whole-model step benchmark into $OUT/model_step (vLLM's own metadata
#      kernels where the tree carries .vllm_peer, staged by
#      python3 -m benchmarks.support.vllm_peer where vLLM is installed; log:
#      $OUT/model_step.log);
#   5. with MEASURE_TABLE=1, measures this GPU's table into $OUT/table
#      (python3 -m benchmarks.measure_table; log: $OUT/table.log) and checks that the
#      plugin's runtime takes it from DSV4_TABLES_DIR.
# Everything is printed as it runs.  Usage, from anywhere in the checkout:
#   OUT=results/h200 DSV4_GIT_SHA=<sha> bash benchmarks/gpu_session.sh
# ($OUT defaults to results/; set DSV4_GIT_SHA when the tree is a copy without .git.)
# Exits non-zero when the tests or the benchmark fail; the benchmark runs either way.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SRC=packages/dsv4-kernels/src:packages/dsv4-attention/src:packages/dsv4-presets/src

echo "== machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"

build_rc=0
if [ -d .fmla ]; then
    echo "== building FlashMLA from .fmla"
    bash .fmla/build-on-gpu.sh
    build_rc=$?
fi

echo "== vLLM 0.33 bundled FlashMLA: python3 -m benchmarks.flashmla_vllm"
PYTHONPATH="$SRC:." python3 -m benchmarks.flashmla_vllm

echo "== GPU tests: PYTHONPATH=$SRC:. python3 -m pytest -m gpu"
PYTHONPATH="$SRC:." python3 -m pytest -m gpu 2>&1 | tee "$OUT/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark: python3 -m benchmarks.kernels --out $OUT"
PYTHONPATH="$SRC:." python3 -m benchmarks.kernels --out "$OUT" 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
if [ -f "$OUT/results.jsonl" ]; then
    echo "== prefill choices: python3 -m benchmarks.support.prefill_table $OUT/results.jsonl"
    PYTHONPATH="$SRC:." python3 -m benchmarks.support.prefill_table "$OUT/results.jsonl" 2>&1 | tee "$OUT/prefill_table.log"
fi

peer=()
[ -d .vllm_peer ] && peer=(--vllm-peer .vllm_peer)
echo "== model step: python3 -m benchmarks.model_step ${peer[*]} --out $OUT/model_step"
PYTHONPATH="$SRC:." python3 -m benchmarks.model_step "${peer[@]}" --out "$OUT/model_step" 2>&1 | tee "$OUT/model_step.log"
step_rc=${PIPESTATUS[0]}

table_rc=0
if [ "${MEASURE_TABLE:-0}" = "1" ]; then
    echo "== measured table: python3 -m benchmarks.measure_table --out $OUT/table"
    PYTHONPATH="$SRC:." python3 -m benchmarks.measure_table --out "$OUT/table" 2>&1 | tee "$OUT/table.log"
    table_rc=${PIPESTATUS[0]}
    if [ "$table_rc" -eq 0 ]; then
        DSV4_TABLES_DIR="$OUT/table" PYTHONPATH="$SRC:." python3 -c "
import torch
from dsv4_attention import tables
from dsv4_attention.policy import Switches
name = torch.cuda.get_device_name()
table = tables.table_for(name, None, Switches.read().tables_dir)
assert table is not None and table.source.startswith('benchmarks.measure_table'), table
print('the runtime takes the measured table of', name, '; decode rows:', sorted(table.decode.ratios))
" 2>&1 | tee -a "$OUT/table.log"
        table_rc=${PIPESTATUS[0]}
    fi
fi

echo "== exit codes: FlashMLA build $build_rc, GPU tests $tests_rc, benchmark $bench_rc, model step $step_rc, table $table_rc"
ls -l "$OUT"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$step_rc" -eq 0 ] && [ "$table_rc" -eq 0 ]
