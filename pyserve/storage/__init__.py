"""Persistent state: uploaded files and batch records."""
