"""Mixture-of-experts support: execution paths, the offline shape catalog and its compression."""
