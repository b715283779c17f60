"""A plain ClientApp: load the global model, run local SGD steps, reply with the model."""

import json
import os
import time

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .models import batches, build

app = ClientApp()


def stamp(path: str, event: str) -> None:
    """One time stamp of this node's training (the benchmark's clock: training beside the round)."""
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid()}) + "\n")


@app.train()
def train(msg: Message, context: Context) -> Message:
    cfg = context.run_config
    stamp(str(cfg["times-file"]), "train-start")
    name = str(cfg["model"])
    net = build(name)
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    opt = torch.optim.SGD(net.parameters(), lr=float(cfg["lr"]))
    net.train()
    steps, batch = int(cfg["local-steps"]), int(cfg["batch-size"])
    pid, num = int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    for x, y in batches(name, pid, num, steps, batch, int(msg.content["config"]["server-round"])):
        opt.zero_grad()
        out = net(x)
        loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
    stamp(str(cfg["times-file"]), "train-end")
    metrics = MetricRecord({"train-loss": float(loss), "num-examples": steps * batch})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
