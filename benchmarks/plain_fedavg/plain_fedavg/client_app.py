"""A plain ClientApp: load the global model, run local SGD steps, reply with the model."""

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .digits_cnn import model, partition

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    net = model()
    net.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = partition(int(context.node_config["partition-id"]), int(context.node_config["num-partitions"]))
    cfg = context.run_config
    opt = torch.optim.SGD(net.parameters(), lr=float(cfg["lr"]))
    gen = torch.Generator().manual_seed(int(msg.content["config"]["server-round"]))
    net.train()
    for _ in range(int(cfg["local-steps"])):
        idx = torch.randint(len(x), (int(cfg["batch-size"]),), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
        loss.backward()
        opt.step()
    metrics = MetricRecord({"train-loss": float(loss), "num-examples": int(cfg["local-steps"]) * int(cfg["batch-size"])})
    return Message(RecordDict({"arrays": ArrayRecord(net.state_dict()), "metrics": metrics}), reply_to=msg)
