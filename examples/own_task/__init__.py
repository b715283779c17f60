"""Bring your own task: ``tabular.py`` defines one; ``celgc.toml`` runs it (docs/tutorials/own-task.md)."""
