"""Storage tiers: L1 host memory (`l1`), and below it (`base.LowerTier`) L2 local disk
(`l2/`) and L3 remote stores (`l3_remote`, connectors in `remote/`); `factory` builds the
lower tiers a config names, `testing` holds fakes for fault injection."""
