"""`tiercache bench gpu`: the CUDA paths against what the hardware gives."""
