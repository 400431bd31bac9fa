"""Certified recovery: in-memory snapshots, peer replication, trust states, durable store (paper section 8)."""
