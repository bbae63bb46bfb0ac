#!/usr/bin/env bash
# Dual micro-batch overlap on GPUs: NCCL, one rank per GPU (needs >= 2), larger batches than on the CPU.
# Untested so far (no multi-GPU machine was lent): step times of single / sequential / overlap.
set -euo pipefail
cd "$(dirname "$0")/../../.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then echo "overlap_gpu.sh: needs >= 2 GPUs (NCCL: one rank per GPU), found $gpus" >&2; exit 2; fi
python ops/bench/ep/overlap.py --device cuda --ranks "$gpus" --prefill-seqs 16 --prefill-len 512 \
  --decode-seqs 256 --decode-context 512 --kv-blocks 4096 --rounds 4 --prefill-steps 10 --decode-steps 10 \
  --out "ops/bench/ep/reports/overlap-gpu-$(date +%Y%m%d)" "$@"
