"""Storage tiers of the KV store (see `services.kvcache.store.Tier`)."""
