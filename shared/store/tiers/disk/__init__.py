"""Disk tier: one record file per key under a directory, with an LMDB index for size and LRU order."""
