"""ServerApp: CELGC over every connected node, central evaluation on held-out digits."""

import json

import torch
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from strategies import CELGC

from task import Net, evaluate, test_data

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    torch.manual_seed(0)
    model = Net()
    strategy = CELGC(local_steps=cfg["local-steps"], lr=cfg["lr"], clip=cfg["clip"], batch_size=cfg["batch-size"],
                     fraction_evaluate=0.0)

    def central_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        loss, accuracy = evaluate(model, test_data())
        return MetricRecord({"test-loss": loss, "test-accuracy": accuracy})

    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()),
                            num_rounds=cfg["num-server-rounds"], evaluate_fn=central_evaluate)
    if cfg["results-file"]:
        with open(cfg["results-file"], "w") as f:
            json.dump({"train": {r: dict(m) for r, m in result.train_metrics_clientapp.items()},
                       "test": {r: dict(m) for r, m in result.evaluate_metrics_serverapp.items()}}, f)
