#!/usr/bin/env bash
# The notebook, Run all through papermill, on a lent GPU machine that has torch but no TE, no
# papermill and no network: papermill and its kernel come as wheels in .whl (carried), pip's
# network attempts (the TE install cell) fail fast, and the notebook trains its stand-in.
# Writes the executed notebook, its RESULTS_JSON and the GPU's facts to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 PIP_RETRIES=0 PIP_TIMEOUT=5
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.csv"
python3 -c 'import torch, sys; print(sys.version); print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), torch.cuda.get_device_name(), torch.cuda.get_device_capability())' | tee -a "$OUT/gpu.csv"
start=$(date +%s)
timeout 480 python3 -m papermill te_fp8_training.ipynb "$OUT/te_fp8_training.h200.ipynb" \
  -p RESULTS_JSON "$OUT/results_h200.json" --log-output 2>&1 | tail -c 200000 > "$OUT/papermill.log"
rc=${PIPESTATUS[0]}
echo "papermill rc=$rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/papermill.log"
tail -40 "$OUT/papermill.log"
