"""How records reach the slower tiers: the background writer and its queue (`background`), the write-behind
buffer that keeps queued records readable (`behind`), and a batch job's patient writes (`patience`)."""
