#!/usr/bin/env bash
# Install a real SGLang engine for kvgate's real-engine tests, bench and demo: SGLang 0.5.23 (CPU path) in a
# virtual environment of its own (its pins - transformers, fastapi, openai, ... - are not kvgate's).
# Usage: scripts/setup-engine.sh [VENV_DIR]   (default .venv-engine). Safe to run again; ~2 min, ~7 GB.
# Skip it with KVGATE_SKIP_ENGINE=1 (the real-engine tests then skip, saying why).
#
# What is left out: sglang's GPU-only dependencies (flashinfer, flash-attn, deep-gemm, sglang-kernel, ...).
# The CPU engine needs two ops from sgl_kernel; kvgate ships a pure-torch stand-in for them
# (kvgate/tools/sglang_cpu/sgl_kernel), put on PYTHONPATH by kvgate's launcher (kvgate/tools/sglang_engine.py).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv-engine}"
PYTHON="${PYTHON:-python3}"
if [ -n "${KVGATE_SKIP_ENGINE:-}" ]; then
  echo "setup-engine: skipped (KVGATE_SKIP_ENGINE is set); the real-engine tests will skip"
  exit 0
fi
if [ -f "$VENV/.installed" ]; then exit 0; fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
# PyPI's torchvision links libtorch_cuda, and sglang imports torchvision unconditionally: a CPU-only torch
# does not work, the PyPI build of torch 2.14.1 does (it runs on the CPU).
"$VENV/bin/python" -m pip install --quiet --no-deps sglang==0.5.23
"$VENV/bin/python" -m pip install --quiet torch==2.14.1 torchvision==0.29.1 triton \
  aiohttp 'anthropic>=0.20.0' apache-tvm-ffi==0.1.11 blobfile==3.0.0 build compressed-tensors==0.18.0 \
  datasets distro easydict einops fastapi gguf interegular IPython 'kernels<0.15,>=0.14.1' \
  'llguidance<2.0.0,>=1.7.6' 'mistral_common>=1.11.5' modelscope msgspec ninja numba==0.65.1 numpy \
  nvidia-ml-py openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser \
  pillow 'prometheus-client>=0.20.0' psutil py-spy pybase64 pydantic 'python-dateutil<3' python-multipart \
  'pyzmq>=25.1.2' regex requests scipy sentencepiece==0.2.1 setproctitle 'smg-grpc-servicer>=0.9.0' \
  soundfile==0.13.1 tiktoken timm==1.0.25 tokenizers==0.23.2 tqdm transformers==5.19.0 'uvicorn>=0.51' \
  uvloop watchfiles xgrammar==0.2.7 xxhash zstandard grpcio grpcio-health-checking pyyaml
touch "$VENV/.installed"
echo "setup-engine: $VENV ready (sglang $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("sglang"))'), $(du -sh "$VENV" | cut -f1))"
