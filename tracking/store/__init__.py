"""Where runs go: the configured store, the offline fallback, server health, the store lock, store errors, the storage guard and redaction."""
