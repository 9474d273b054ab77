"""Model runner: turns a scheduler Plan into a forward pass over the paged/slot caches and samples next tokens."""
