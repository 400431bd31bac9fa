"""In-situ replay: capture, RNG alignment, layer and optimizer replay, timing (paper section 6)."""
