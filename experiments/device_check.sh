#!/usr/bin/env bash
# Issue 14's accelerator checks, prepared as one call of the device tool (docs/kernels.md).
#
# Here, where PyPI is reachable, once per checkout:
#
#   LLA_DATA_DIR=../shared/data bash experiments/device_check.sh prepare
#
# fills .device/ (git-ignored, about 16 MB): whl/, the pure-Python packages lla imports that
# the accelerator machine's image lacks (ml_collections, rouge-score and its nltk) at the
# versions of requirements-cpu.txt, and data/, a copy of $LLA_DATA_DIR (WikiText-2 and the
# GPT-2 tokenizer; ../shared does not travel). Then, on the accelerator (the device tool's
# `run`, with carry=[".device"] and timeout_s=600):
#
#   bash experiments/device_check.sh run
#
# runs, each step under its own time limit so that one hang keeps the others' results, and
# writes into $OUT (at most 8 files, as the tool brings back):
#   env.txt          the device, driver, python, jax and jaxlib it ran with
#   flops.json       XLA's FLOP counts of a matmul, a scanned loop and a client against
#                    counts by hand (experiments/flops_probe.py: does the FLOP meter's
#                    assumption hold on this backend?)
#   kernels_small.json, kernels.json
#                    lla_kernels.vocab_topk against XLA's materialise-and-top_k at 512 and
#                    8192 rows x 768 x 50257, k = 32 (experiments/bench_kernels.py; each
#                    score kind written as it ends)
#   attacks.json     bench_attacks at GPT-2 124M (random weights), $DOCS documents, lla against
#                    PyTorch on the same GPU, the kernel check at the same shape
#   precision.json   predictions under TF32 and bf16 against float32 at GPT-2 124M shape
#                    (experiments/bench_precision.py, the process-wide precision of lla.runtime)
#   run.log          everything the steps printed, the kernel tests' (tests/test_kernels_vocab_topk.py)
#                    included
#
# A second call, `bash experiments/device_check.sh forms` (timeout_s=600), writes forms.json
# and forms.log: the attacks' model calls with the layers unrolled against scanned
# (Workspace.layer_form, whose "auto" scans on an accelerator without a measurement there
# yet) at GPT-2 124M's and SmolLM2's shapes (FORMS_SHAPES), on FORMS_DOCS documents
# (experiments/bench_compile.py --forms).
# Sizes can be lowered for a dry run on CPU: DOCS, KERNEL_ROWS, TORCH_DOCS, PRECISION_DOCS,
# PRECISIONS (float32 alone on CPU, which has no TF32 or bf16 matmul precision). The step
# limits add up to 570 s: call the tool with timeout_s=600.
set -uo pipefail
cd "$(dirname "$0")/.."

prepare() {
  : "${LLA_DATA_DIR:?set LLA_DATA_DIR to the data directory (../shared/data)}"
  rm -rf .device && mkdir -p .device/whl
  cp -r "$LLA_DATA_DIR" .device/data || return 1
  local spec
  for name in ml-collections nltk rouge-score; do
    spec=$(grep -i -E "^${name}==" requirements-cpu.txt) || {
      echo "requirements-cpu.txt pins no $name" >&2; return 1; }
    if [[ $name == rouge-score ]]; then
      # Published as an sdist only; pure Python, so a wheel built here installs anywhere.
      python -m pip wheel -q --no-deps -w .device/whl "$spec" || return 1
    else
      python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux2014_x86_64 -d .device/whl "$spec" || return 1
    fi
  done
  du -sh .device/*
}

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, logs, never aborts.
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/run.log"
  timeout "$limit" "$@" >>"$OUT/run.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc" | tee -a "$OUT/run.log"
}

site() {  # The packages of .device/whl, lla_kernels and the data, for python3 here.
  if [[ -d .device/whl ]]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/lla_site .device/whl/*.whl || return 1
  fi
  # lla is not pip-installed there, and kernels/ is imported as lla_kernels (setup.py): a link.
  mkdir -p /tmp/lla_site && ln -sfn "$PWD/kernels" /tmp/lla_site/lla_kernels
  export PYTHONPATH=/tmp/lla_site
  if [[ -d .device/data ]]; then export LLA_DATA_DIR="$PWD/.device/data"; fi
  : "${LLA_DATA_DIR:?no .device/data and no LLA_DATA_DIR: run prepare first}"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
}

run() {
  : "${OUT:?set OUT to the folder that receives the results}"
  mkdir -p "$OUT"
  site || return 1
  {
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    python3 -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())'
  } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
  local docs=${DOCS:-256} torch_docs=${TORCH_DOCS:-32} rows=${KERNEL_ROWS:-8192}
  step tests 45 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_vocab_topk.py
  step flops 30 python3 -m experiments.flops_probe --out_json="$OUT/flops.json"
  # 512 rows first: the kernel's compile time and a timing even if the full size runs long.
  step kernels_small 60 python3 -m experiments.bench_kernels --device=auto --rows=512 \
    --out_json="$OUT/kernels_small.json"
  step kernels 120 python3 -m experiments.bench_kernels --device=auto --rows="$rows" \
    --out_json="$OUT/kernels.json"
  step attacks 230 python3 -m experiments.bench_attacks --device=auto --batch="$docs" \
    --torch_batch="$torch_docs" --torch_nocache_batch=0 --cold_start=false \
    --kernel_rows="$rows" --out_json="$OUT/attacks.json"
  step precision 85 python3 -m experiments.bench_precision --model=gpt2_124m \
    --docs="${PRECISION_DOCS:-64}" --mode=runtime --precisions="${PRECISIONS:-float32,tensorfloat32,bfloat16}" \
    --out_json="$OUT/precision.json"
  ls -l "$OUT"
}

forms() {
  : "${OUT:?set OUT to the folder that receives the results}"
  mkdir -p "$OUT"
  site || return 1
  timeout 580 python3 -m experiments.bench_compile --forms \
    --shapes="${FORMS_SHAPES:-gpt2_124m,smollm2}" \
    --docs="${FORMS_DOCS:-64}" --attacks=activation,sipit --warm_repeats=2 \
    --out="$OUT/forms.json" \
    >"$OUT/forms.log" 2>&1
  tail -5 "$OUT/forms.log"
}

case "${1:-}" in
  prepare) prepare ;;
  run) run ;;
  forms) forms ;;
  *) echo "usage: bash experiments/device_check.sh prepare|run|forms" >&2; exit 2 ;;
esac
