"""SCAFFOLD's controls as a run's checkpoint holds them (tests/test_scaffold.py, tests/test_deploy_faults.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from tasks.runs.checkpoint import load_checkpoint


def checkpointed_controls(folder: Path, num_clients: int) -> tuple[dict, dict[int, dict]]:
    """SCAFFOLD's server control c and every client's c_i from the run's checkpoint (a client that never
    trained holds zeros), after checking that c is the mean of the N c_i (to float32 rounding): the
    invariant a lost, failed or rejected reply must not break."""
    state = load_checkpoint(folder).strategy_state
    c = {k.removeprefix("control/"): v for k, v in state.items() if k.startswith("control/")}
    assert c, f"{folder}: the checkpoint holds no server control (not a SCAFFOLD run?)"
    held = {i: {k: state.get(f"client-control/{i}/{k}", torch.zeros_like(v)) for k, v in c.items()}
            for i in range(num_clients)}
    for k, v in c.items():
        torch.testing.assert_close(v.double(), sum(held[i][k].double() for i in held) / num_clients, rtol=0, atol=1e-6)
    return c, held
