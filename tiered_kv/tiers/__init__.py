"""Storage tiers: L1 host memory, L2 local disk, and (later) L3 remote."""
