"""Memory tier: a byte-bounded cache of tensor objects inside this process."""
