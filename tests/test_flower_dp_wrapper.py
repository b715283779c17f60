"""Flower's own DP wrappers around this project's strategy, through our ServerApp (``server.app.run(...,
wrap=...)``): CELGC inside ``DifferentialPrivacyServerSideFixedClipping`` at clipping_norm = I gamma."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

from client.app import app as client_app
from server.app import run
from simulations.loopback import LoopbackGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results

I, GAMMA, M = 3, 0.3, 4  # noqa: E741 -- the paper's I (local steps)
VALUES = {"num-clients": M, "num-rounds": 2, "local-steps": I, "clip": GAMMA, "batch-size": 16, "device": "cpu",
          "node-wait": 2.0}


def wrapped_app(noise_multiplier: float, seen: list[float]) -> ServerApp:
    """Our ServerApp with the strategy inside Flower's server-side fixed clipping at I gamma; ``seen``
    collects every client's update norm over the whole state (what Flower clips)."""

    class Recording(DifferentialPrivacyServerSideFixedClipping):
        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            current = self.current_arrays.to_torch_state_dict()
            for reply in replies:
                for record in reply.content.array_records.values():
                    state = record.to_torch_state_dict()
                    seen.append(float(torch.sqrt(sum(((state[k].double() - current[k].double()) ** 2).sum()
                                                      for k in trainable_keys(state)))))
            return super().aggregate_train(server_round, replies)

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        run(grid, RunConfig.from_mapping(dict(context.run_config)),
            wrap=lambda strategy: Recording(strategy, noise_multiplier=noise_multiplier, clipping_norm=I * GAMMA,
                                            num_sampled_clients=M))

    return app


def trainable_keys(state):
    return [k for k in state if "running" not in k and "num_batches" not in k]


def one_run(tmp_path, name, app=None):
    from server.app import app as server_app

    values = {**RunConfig().to_mapping(), **VALUES, "results-dir": str(tmp_path), "run-name": name}
    run_server_app(app or server_app, LoopbackGrid(client_app, values, M))
    return load_weights(tmp_path / name / "model.pt"), read_results(tmp_path / name / "results.jsonl")


def test_clipping_at_i_gamma_touches_no_trainable_parameter_of_an_honest_client(tmp_path, mlp_digits):
    """A model without buffers: every honest CELGC update lies within I gamma, so Flower's clip is a
    no-op and the wrapped run (noise 0) ends where the plain one does, up to Flower's float64
    round trip of the arrays."""
    seen: list[float] = []
    wrapped, (_, rows) = one_run(tmp_path, "wrapped", wrapped_app(0.0, seen))
    plain, _ = one_run(tmp_path, "plain")
    assert len(seen) == 2 * M and max(seen) <= I * GAMMA * (1 + 1e-5) and min(seen) > 0
    assert [r["round"] for r in rows] == [0, 1, 2] and rows[-1]["replies"] == M
    for key in plain:
        torch.testing.assert_close(wrapped[key], plain[key], rtol=0, atol=1e-6)


def test_flowers_noise_goes_through_our_serverapp(tmp_path, mlp_digits):
    seen: list[float] = []
    noisy, _ = one_run(tmp_path, "noisy", wrapped_app(1.0, seen))
    plain, _ = one_run(tmp_path, "plain")
    deviation = torch.cat([(noisy[k].double() - plain[k].double()).flatten() for k in plain])
    assert float(deviation.abs().max()) > 1e-3  # Flower's N(0, (z C / M)^2) per coordinate reached the model


def test_our_dp_keys_and_a_wrapper_are_refused_together(tmp_path, mlp_digits):
    values = {**RunConfig().to_mapping(), **VALUES, "results-dir": str(tmp_path), "run-name": "both",
              "dp-noise-multiplier": 1.0}
    with pytest.raises(ValueError, match="noise would be added twice"):
        run_server_app(wrapped_app(1.0, []), LoopbackGrid(client_app, values, M))
