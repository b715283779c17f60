"""A plain ServerApp: Flower's own FedAvg for num-server-rounds; one time stamp a round."""

import json
import time

from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

from .models import build

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    times = str(cfg["times-file"])

    def stamp(server_round: int, arrays: ArrayRecord):
        if times:
            with open(times, "a") as fh:
                fh.write(json.dumps({"round": server_round, "t": time.time()}) + "\n")
        return None

    n = int(cfg["min-nodes"])
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n, min_available_nodes=n)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(build(str(cfg["model"])).state_dict()),
                   num_rounds=int(cfg["num-server-rounds"]), evaluate_fn=stamp)
