#!/usr/bin/env bash
# Prints the pip extra that fits this machine: "gpu" where an NVIDIA driver answers, else "cpu".
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo gpu
else
  echo cpu
fi
