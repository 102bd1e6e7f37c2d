#!/usr/bin/env bash
# The GPU check of vectorised client cohorts, in one call of under ten minutes on a machine with one
# GPU and a CUDA build of torch of its own (fedsim pins the CPU wheel): docs/gpu.md says what ran where.
#   1. the vectorised-training equality tests on CUDA (each client's update against the sequential path);
#   2. benchmarks/peers.py on the GPU: pfl-research's benchmark shape (50 clients a round, 5 steps of
#      batch 10, LeNet), plain sequential GPU loop vs fedsim sequential vs fedsim vectorised;
#   3. benchmarks/gpu.py: VGG-9 and ResNet-18 rounds (10 clients a round) against the plain GPU loop,
#      fedsim with federation.vectorize off and on.
# What the machine lacks travels with the call: fedsim's Python dependencies as wheels in .whl/ (for
# the device's Python; see .library's device notes, e.g. flwr, ray, pydantic, rich, scipy, ...), and the
# datasets in shared/data (fashion_mnist.npz or mnist.npz; peers.py's shape takes the first 50,000
# training images: an np.savez_compressed MNIST of 50,000 training and 2,000 test images is 8.5 MB).
# Outputs go to $OUT (default ./gpu-out). Run from a copy without .git (a snapshot of a commit, e.g.
# `git archive`), it reads the commit from a file COMMIT in the repository root ("commit <hash> <subject>").
#   OUT=/somewhere benchmarks/gpu_cohorts.sh
# On one H100 (2026-11-27, docs/gpu.md) step 1 took 42 s and step 2 about 205 s; step 3 reached its
# former 200 s limit after VGG-9's two runs, and ResNet-18's run alone took under two minutes.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FEDSIM_DATA_DIR=${FEDSIM_DATA_DIR:-$PWD/shared/data}
if ls .whl/*.whl > /dev/null 2>&1; then
  SITE=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    && export PYTHONPATH=$SITE:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
PY=${PY:-python3}
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1;
  $PY -c "import torch, flwr, ray; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'flwr', flwr.__version__, 'ray', ray.__version__)";
  if [ "$(git rev-parse --show-toplevel 2>/dev/null)" = "$PWD" ]; then git log -1 --format='commit %h %s'
  elif [ -f COMMIT ]; then cat COMMIT; else echo "commit unknown (no git checkout here, no COMMIT file)"; fi; } \
  | tee "$OUT/machine.txt"

echo "== 1. equality tests on CUDA"
timeout 90 $PY -m pytest -q -p no:cacheprovider tests/test_vectorized_training.py tests/test_cohorts.py 2>&1 \
  | tail -25 | tee "$OUT/tests.txt"

echo "== 2. pfl-research's benchmark shape on the GPU"
timeout 240 $PY benchmarks/peers.py --device cuda --only lenet --rounds 20 --sides plain,fedsim-off,fedsim-on 2>&1 \
  | tee "$OUT/peers.txt"

echo "== 3. VGG-9 and ResNet-18 rounds against the plain GPU loop"
timeout 260 $PY benchmarks/gpu.py --quick --skip-aggregation --repeats 2 --models vgg9 resnet18 --vectorize off on \
  --shares 0.25 2>&1 | tee "$OUT/gpu.txt"
