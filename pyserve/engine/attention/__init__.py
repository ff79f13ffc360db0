"""Attention backends: one interface, several implementations."""
