"""Hang localization: shared-memory progress, collective fingerprints, the out-of-band observer."""
