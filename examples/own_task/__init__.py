"""Bring your own task: ``tabular.py`` defines one; ``celgc.toml`` runs it (README "Bring your own task")."""
