"""Examples that use this project from the outside (not part of the installed packages)."""
