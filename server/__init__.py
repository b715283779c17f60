"""Server side: the ServerApp (``server.app``) and what is Flower's own on the server -- the
federation check, the watched grid (``server.faults``), partial participation's node choice
(``server.participation``), resuming under ``Strategy.start`` (``server.resumed``) and the
deployment scripts. Results rows, checkpoints and evaluation are ``tasks.runs``, shared with
the engine."""
