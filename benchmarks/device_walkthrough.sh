#!/usr/bin/env bash
# docs/deployment.md's device walk-through on loopback: a SuperLink from this checkout's venv and two
# SuperNodes from a device install (DEVICE_VENV, default this venv), each training on its own folder
# of 600 MNIST PNGs written from mnist.npz; the quickstart's MLP on MNIST, 5 rounds. Prints the
# ServerApp's per-round lines and the SuperNodes' peak RSS. Needs $FEDSIM_DATA_DIR/mnist.npz and Pillow.
#   FEDSIM_DATA_DIR=../shared/data DEVICE_VENV=/opt/fedsim-node benchmarks/device_walkthrough.sh
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
DEVICE_VENV=${DEVICE_VENV:-$REPO/.venv}
W=$(mktemp -d -t fedsim-walk.XXXX)
export PATH=$REPO/.venv/bin:$PATH FLWR_HOME=$W/flwr_home
"$REPO/.venv/bin/python" - "$W" <<'PY'
import os, sys
from pathlib import Path
import numpy as np
from PIL import Image
a = np.load(Path(os.environ["FEDSIM_DATA_DIR"]) / "mnist.npz")
for node, start in ((0, 0), (1, 600)):
    for i in range(start, start + 600):
        d = Path(sys.argv[1]) / f"node{node}" / str(int(a["y_train"][i]))
        d.mkdir(parents=True, exist_ok=True)
        Image.fromarray(a["x_train"][i].astype("uint8"), mode="L").save(d / f"{i}.png")
PY
fedsim deploy superlink --insecure > "$W/superlink.log" 2>&1 &
sleep 8
for i in 0 1; do
  (PATH=$DEVICE_VENV/bin:$PATH FEDSIM_CACHE_DIR=$W/cache$i /usr/bin/time -v "$DEVICE_VENV/bin/fedsim" deploy supernode --insecure \
     --partition $i --num-partitions 2 --local-data "$W/node$i" > "$W/supernode$i.log" 2>&1 &)
done
sleep 5
start=$(date +%s)
fedsim deploy run scenarios/quickstart.yaml --insecure --output "$W/results" --set data.dataset=mnist --set attack=null \
  --set federation.num_clients=2 --set federation.clients_per_round=2 --set federation.rounds=5 \
  --set evaluation.test_subset=2000 > "$W/run.log" 2>&1
code=$?
echo "fedsim deploy run exit $code after $(( $(date +%s) - start )) s (logs in $W)"
pkill -f "flower-supernode --superlink 127.0.0.1:8000" ; pkill -f "flower-superlink --host 127.0.0.1 --port 8000"; sleep 3
grep "fedsim round" "$W/run.log" | sed 's/.*fedsim round/round/'
grep -h "examples (local data)" "$W"/supernode*.log | head -4
grep -h "Maximum resident" "$W"/supernode*.log
