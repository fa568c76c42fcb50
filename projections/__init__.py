"""Projections: state derived from the log by replay (SPEC §3, §6)."""
