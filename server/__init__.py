"""Server side: the ServerApp (``server.app``), results and checkpoints."""
