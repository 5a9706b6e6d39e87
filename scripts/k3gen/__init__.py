"""Synthetic Kimi K3 checkpoint generator (see scripts/make-checkpoint.py)."""
