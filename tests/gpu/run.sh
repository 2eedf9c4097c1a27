#!/usr/bin/env bash
# The prepared GPU check: everything in the suite that needs CUDA, in one run, on a
# machine with a GPU and PyTorch already installed (nothing is fetched). From the
# repository root:  bash tests/gpu/run.sh [more pytest arguments]
# Builds shm's compiled core in place, prints what the machine has, then runs every
# test marked `gpu` (NCCL conformance, CUDA tensors through shm and gloo, DDP of a CUDA
# model over nccl/shm/gloo, FSDP's refusal of one). Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
LOG="${OUT:-/tmp}/gpu-check.log"
{
  nvidia-smi -L || true
  python3 -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'devices', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None,
'numpy', numpy.__version__)"
  python3 setup.py -q build_ext --inplace 2>&1 | tail -3
  python3 -c "import collectives; print('backends', collectives.available_backends())"
  python3 -m pytest -m gpu -p no:cacheprovider -o addopts="" -ra --timeout 900 \
      tests/test_gpu.py tests/test_torchdist_backend.py "$@"
} 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
