"""GDS tier: the disk layout, read through NVIDIA GPUDirect Storage into GPU memory."""
