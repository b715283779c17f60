"""Run records, the same for the ServerApp and the engine (no flwr): results rows, checkpoints,
run folders, central evaluation, and the recorder that ties them together for each round.

Below ``client`` | ``server`` and ``simulations``: the engine writes the same files as the
ServerApp without importing it.
"""
