#!/usr/bin/env bash
# The GPU figures of docs/benchmarks.md ("round_cost.py on a GPU") in one run of under 10 minutes, for
# a machine with one NVIDIA GPU and PyTorch (no download: the target is a random-weight Llama-3.1-8B
# shape, the drafter a fresh EAGLE-3 of that shape with a 32000-token head):
#   1. the GPU tests of tests/runtime/test_graphs.py (they skip on a CPU, where the rest run in make test):
#      the whole draft recorded as one graph (trees and chains), a sampled chain recorded whole;
#   2. round costs on CUDA graphs at 400 cached tokens: target and drafter graphed (graphs), and the same
#      with the target's norms and MLPs compiled (blocks);
#   3. chains drafted by sampling (--temperature 1): eager runtime against CUDA graphs (each sampled
#      chain recorded whole);
#   4. --profile for a one-token step, a chain of 3 and a 6,10,60 tree: where each arm's round goes,
#      host and GPU kernels by kind.
# FULL=1 adds the eager, reference and unfolded arms and 2000 cached tokens, and `generate`'s own rounds
# against the rounds alone (--generate 128, for the 135M and the 8B shape): about 7 more minutes.
# Logs go to $OUT (default /tmp/gpu-round-cost).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$(pwd)"
out="${OUT:-/tmp/gpu-round-cost}"
mkdir -p "$out"
round_cost="python3 benchmarks/round_cost.py --device cuda --target random:llama-3.1-8b --draft-vocab 32000 --graphs"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/nvidia-smi.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/runtime/test_graphs.py -k "cuda or refuses" 2>&1 \
  | tail -15 | tee "$out/pytest.txt"
if [ "${FULL:-0}" = 1 ]; then
  for context in 400 2000; do
    timeout 300 $round_cost --unfolded --compile-blocks --chains 3,4 --trees 4,4,12 5,6,24 6,10,60 --repeats 30 \
      --context "$context" 2>&1 | tee "$out/round_cost_8b_ctx$context.txt"
  done
  for target in "random:smollm2-135m --draft-vocab 8192" "random:llama-3.1-8b --draft-vocab 32000"; do
    timeout 170 python3 benchmarks/round_cost.py --device cuda --graphs --arms graphs --generate 128 --chains 3 \
      --trees 4,4,12 --repeats 10 --profile --target $target 2>&1 | tee "$out/generate_$(echo "$target" | cut -d' ' -f1 | cut -d: -f2).txt"
  done
else
  timeout 200 $round_cost --compile-blocks --arms graphs,blocks --chains 3,4 --trees 4,4,12 5,6,24 6,10,60 --repeats 30 \
    2>&1 | tee "$out/round_cost_8b_ctx400.txt"
fi
timeout 120 $round_cost --arms runtime,graphs --chains 3,4 --trees --temperature 1 --repeats 30 2>&1 | tee "$out/round_cost_8b_t1.txt"
timeout 100 $round_cost --compile-blocks --arms graphs,blocks --chains 3 --trees 6,10,60 --repeats 10 --profile 2>&1 \
  | tee "$out/round_cost_8b_profile.txt"
