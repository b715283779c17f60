"""Partitioners, experiment configs, the fast engine and run recipes."""
