from simulations.loopback import LoopbackGrid, run_in_process, run_server_app  # noqa: F401  (moved)
