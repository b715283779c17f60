"""ClientApp: local clipped SGD on this node's shard, through the CELGC client API."""

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from strategies.clientapp import local_update, round_settings, train_reply

from task import Net, evaluate, load_data, loss_fn, test_data

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    settings = round_settings(msg)  # local-steps, lr, clip, ... as the strategy sent them
    loader = load_data(context.node_config["partition-id"], context.node_config["num-partitions"], settings.batch_size)
    metrics = local_update(model, loader, loss_fn, settings)  # exactly local-steps clipped steps
    return train_reply(msg, model, metrics)


@app.evaluate()
def evaluate_model(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    loader = test_data()
    loss, accuracy = evaluate(model, loader)
    metrics = MetricRecord({"eval-loss": loss, "eval-accuracy": accuracy, "num-examples": len(loader.dataset)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)
