"""faultlab pytest plugin (stub; being written)."""
