"""kvcache service: the KV store's control plane (lookup, stats, KV events, capacity)."""
