"""Activation capture: what the engines record of each hooked layer's calls."""
