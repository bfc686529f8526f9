#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("round_cost.py on a GPU") in one run, for a machine with
# one NVIDIA GPU and PyTorch (no download: the target is a random-weight Llama-3.1-8B shape):
#   1. the CUDA-graph tests (tests/runtime/test_graphs.py; its GPU tests skip on a CPU);
#   2. benchmarks/round_cost.py with that target and a fresh EAGLE-3 drafter of its shape
#      (32000-token head): eager runtime, reference path, and target and drafter on CUDA graphs,
#      at 400 and at 2000 cached tokens;
#      with two more arms on CUDA graphs: without grouped query heads folded into rows (--unfolded)
#      and with the target's norms and MLPs compiled (--compile-blocks);
#   3. chains drafted by sampling (--temperature 1), on CUDA graphs: each sampled chain recorded whole;
#   4. the same with --profile for a one-token step, a chain of 3 and a 6,10,60 tree: where each
#      arm's round goes, host and GPU kernels by kind.
# Logs go to $OUT (default /tmp/gpu-round-cost).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
out="${OUT:-/tmp/gpu-round-cost}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_graphs.py 2>&1 | tail -15 | tee "$out/pytest.txt"
for context in 400 2000; do
  timeout 300 python3 benchmarks/round_cost.py --device cuda --target random:llama-3.1-8b --draft-vocab 32000 \
    --graphs --unfolded --compile-blocks --chains 3,4 --trees 4,4,12 5,6,24 6,10,60 --repeats 30 --context "$context" 2>&1 \
    | tee "$out/round_cost_8b_ctx$context.txt"
done
timeout 200 python3 benchmarks/round_cost.py --device cuda --target random:llama-3.1-8b --draft-vocab 32000 \
  --graphs --arms runtime,graphs --chains 3,4 --trees --temperature 1 --repeats 30 2>&1 | tee "$out/round_cost_8b_t1.txt"
timeout 300 python3 benchmarks/round_cost.py --device cuda --target random:llama-3.1-8b --draft-vocab 32000 \
  --graphs --unfolded --compile-blocks --chains 3 --trees 6,10,60 --repeats 10 --profile 2>&1 | tee "$out/round_cost_8b_profile.txt"
